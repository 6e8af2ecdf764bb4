"""Process-level details of detection and fencing on one machine, with agent-only worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from recovery_cluster import wait_until

from lightning_oobleck.recovery import Coordinator, Worker, WorkerAgent
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.replica import ReplicaSettings

SCRIPT = Path(__file__).with_name("agent_only_worker.py")


@contextlib.contextmanager
def agent_workers(
    coordinator: Coordinator, extra: dict[int, list[str]]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), coordinator.address, str(node), *extra.get(node, [])])
        for node in range(coordinator.world_size)
    ]
    try:
        wait_until(lambda: coordinator.agreed, 30.0, "generation 0")
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_forked_child_holding_the_connection_does_not_delay_the_detection_of_its_parents_death(
    tmp_path: Path,
) -> None:
    child_pid_file = tmp_path / "child.pid"
    with (
        Coordinator(2, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=5.0)) as coordinator,
        agent_workers(coordinator, {1: [str(child_pid_file)]}) as procs,
    ):
        child = int(
            wait_until(lambda: child_pid_file.exists() and child_pid_file.read_text(), 10.0, "the fork")
        )
        try:
            killed_at = time.time()
            os.kill(procs[1].pid, signal.SIGKILL)
            (death,) = wait_until(lambda: coordinator.deaths, 5.0, "the parent's death")
            assert death.worker == Worker(1, 0) and "connection" in death.reason
            assert (
                death.at - killed_at < 0.5
            )  # seen by its connection closing, not after the 5 s heartbeat timeout
        finally:
            os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_kill_fenced_kills_a_stopped_worker_on_this_host_so_its_connections_close() -> None:
    with (
        Coordinator(
            2, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=1.0, kill_fenced=True)
        ) as coordinator,
        agent_workers(coordinator, {}) as procs,
    ):
        stopped_at = time.time()
        os.kill(procs[1].pid, signal.SIGSTOP)
        assert procs[1].wait(timeout=5.0) == -signal.SIGKILL  # never woken up: killed
        (death,) = coordinator.deaths
        assert death.worker == Worker(1, 0) and death.at - stopped_at < 1.0 + 0.5
        assert procs[0].poll() is None


@pytest.mark.timeout(60)
def test_a_standby_started_while_the_training_thread_forks_does_not_silence_the_heartbeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker asked to host the standby coordinator starts it with ``Popen``, which returns once the child
    has exec'd: it reads a pipe until every holder of the pipe's write end has closed it, and a process that
    another thread forks meanwhile (a ``DataLoader`` starting its workers) holds it as long as it lives. Here
    one is forked in that window (around CPython's ``fork_exec``, the pipe already open) and lives three
    heartbeat timeouts: the worker's heartbeats go on, nobody is declared dead, and the standby follows.
    (Before, the agent's own thread started it and fell silent: the node was declared dead.)"""
    timeout, forked = 2.0, []
    fork_exec = subprocess._fork_exec  # type: ignore[attr-defined]

    def forking_meanwhile(*args: Any) -> int:
        pid = os.fork()
        if pid == 0:  # as a DataLoader's worker: every descriptor inherited, the pipe's write end included
            time.sleep(3 * timeout)
            os._exit(0)
        forked.append(pid)
        return fork_exec(*args)

    monkeypatch.setattr(subprocess, "_fork_exec", forking_meanwhile)
    settings = MembershipSettings(heartbeat_timeout=timeout)
    secret = "s3cret"
    with Coordinator(
        2, "127.0.0.1", settings=settings, secret=secret, replica_settings=ReplicaSettings(loopback=True)
    ) as coordinator:
        agents = [WorkerAgent((n, 0), coordinator.address, secret=secret).start() for n in (0, 1)]
        try:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda a: a.agree(after=-1, timeout=10), agents))
            wait_until(lambda: forked, 10.0, "the standby's start")
            wait_until(lambda: coordinator.replica.following, 10.0, "the standby following")
            os.waitpid(forked[0], 0)  # three heartbeat timeouts after the standby's start
            assert not coordinator.deaths
            assert [a.members for a in agents] == [coordinator.agreed] * 2
        finally:
            for agent in agents:
                agent.close()
