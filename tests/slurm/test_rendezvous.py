"""The batch host's supervisor (``python -m lightning_oobleck.slurm.rendezvous``) as a batch script uses it,
without SLURM: a shell evals its line, a task reaches the store (with the job's secret; a guess is refused)
and the coordinator, and both go away with the shell."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_oobleck.slurm.rendezvous import MODULE

TASK = """
import datetime, json, os
from lightning_oobleck.recovery import WorkerAgent
from lightning_oobleck.recovery.keystore import KeyStoreClient, KeyStoreError
address = os.environ["OOBLECK_STORE_ADDR"]
timeout = datetime.timedelta(seconds=20)
store = KeyStoreClient(address, os.environ["OOBLECK_COORDINATOR_SECRET"], timeout)
store.set("k", "v")
try:
    KeyStoreClient(address, "guessed", timeout)
    stranger = "served"
except KeyStoreError as e:
    stranger = str(e)
with WorkerAgent((0, 0), connect_timeout=20) as agent:
    membership = agent.agree(-1, timeout=20)
print(json.dumps({
    "store": os.environ["OOBLECK_STORE_ADDR"], "coordinator": os.environ["OOBLECK_COORDINATOR_ADDR"],
    "value": store.get("k").decode(), "generation": membership.generation,
    "members": [list(w) for w in membership.workers], "stranger": stranger, "keys": store.num_keys(),
}))
"""


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_batch_script_lines_export_a_store_and_a_coordinator_that_end_with_the_shell(tmp_path: Path) -> None:
    log = tmp_path / "rendezvous.log"
    start = f"{sys.executable} -m {MODULE} --detach --watch-pid $$ --world-size 1 --log {log}"
    script = f"exports=$({start}) || exit 1\neval \"$exports\"\n{sys.executable} -c '{TASK}'\n"
    script += "cat /proc/net/tcp > listeners.txt\n"
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    task = json.loads(done.stdout.strip().splitlines()[-1])
    listeners = {  # port -> address of the sockets listening (state 0A) while the shell ran
        int(local.split(":")[1], 16): socket.inet_ntoa(bytes.fromhex(local.split(":")[0])[::-1])
        for local, state in (
            (f[1], f[3])
            for f in (line.split() for line in (tmp_path / "listeners.txt").read_text().splitlines()[1:])
        )
        if state == "0A"
    }
    assert task["value"] == "v" and task["keys"] == 2  # "k", and the count of the job's workers that finished
    assert "refused this process: refused: the job's secret is missing or wrong" in task["stranger"]
    assert (task["generation"], task["members"]) == (0, [[0, 0]])
    assert f"worker (0, 0) on {socket.gethostname()} registered" in log.read_text()  # its node, named
    # Store and coordinator listened only on the interface the host name resolves to, not on every interface.
    for service in ("store", "coordinator"):
        assert listeners[int(task[service].rsplit(":", 1)[1])] == socket.gethostbyname(socket.gethostname())
    deadline = time.monotonic() + 10
    while any(_listening(task[k]) for k in ("store", "coordinator")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listening(task["store"]) and not _listening(task["coordinator"]), "outlived the batch shell"


def test_without_a_world_size_it_says_how_to_give_one() -> None:
    done = subprocess.run(
        [sys.executable, "-m", MODULE, "--detach"],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "no world size: pass --world-size N" in done.stderr
