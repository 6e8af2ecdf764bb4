"""The coordinator serves only its job: a client without the job's secret is refused and changes nothing; a
late registration of a run that admits no joins is refused without disturbing the workers. The launchers
(the local supervisor, the SLURM rendezvous) always make a secret and hand it to the workers only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightning_oobleck.recovery import Coordinator, RegistrationRefused, WorkerAgent
from lightning_oobleck.recovery.coordinator import holds_connection
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import SECRET_ENV, encode, parse_address

SECRET = "a1b2c3"


def _stray(address: str, silent_s: float, **fields: object) -> dict:
    """A raw TCP client that registers with ``fields`` and then stays connected and silent for
    ``silent_s`` (a registered worker that does so is declared dead and its pid killed); returns the
    coordinator's answer."""
    with socket.create_connection(parse_address(address), timeout=5) as sock:
        sock.sendall(encode("register", **fields))
        answer = json.loads(sock.makefile().readline())
        time.sleep(silent_s)
        return answer


def _start_two(coordinator: Coordinator) -> list[WorkerAgent]:
    agents = [WorkerAgent((n, 0), coordinator.address, secret=SECRET).start() for n in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: a.agree(after=-1, timeout=10), agents))
    return agents


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_client_without_the_secret_is_refused_and_changes_nothing() -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with Coordinator(
        2, "127.0.0.1", settings=MembershipSettings(kill_fenced=True, heartbeat_timeout=2.0), secret=SECRET
    ) as c:
        agents = _start_two(c)
        try:
            for fields in ({}, {"secret": "wrong"}):
                # a new worker id, another process's pid, then silence past the heartbeat timeout
                answer = _stray(
                    c.address, 1.5 * c.heartbeat_timeout, node=9, device=0, pid=victim.pid,
                    host=socket.gethostname(), **fields,
                )  # fmt: skip
                assert answer["op"] == "refused" and "secret is missing or wrong" in answer["reason"]
            assert victim.poll() is None, "the coordinator killed a process a stray client named"
            assert [m.generation for m in c.history] == [0] and not c.deaths
            assert not any(a.abort.is_set() for a in agents)
        finally:
            for agent in agents:
                agent.close()
            victim.kill()
            victim.wait()


@pytest.mark.timeout(60)
def test_a_fenced_client_is_killed_only_if_its_process_holds_the_connection() -> None:
    """The pid a client reports is checked against the kernel's socket table before it is killed: a client
    that names another process (here, with no secret configured) is fenced, and that process lives."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Coordinator(
            1, "127.0.0.1", settings=MembershipSettings(kill_fenced=True, heartbeat_timeout=1.0)
        ) as c:
            fields = {"node": 0, "device": 0, "pid": victim.pid, "host": socket.gethostname()}
            answer = _stray(c.address, 2.5 * c.heartbeat_timeout, **fields)
            assert answer["op"] == "welcome"
            assert [d.worker for d in c.deaths] == [(0, 0)]
            assert victim.poll() is None, "the coordinator killed a process the fenced client named"
    finally:
        victim.kill()
        victim.wait()


def test_holds_connection_finds_the_process_at_the_other_end() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert holds_connection(os.getpid(), conn)
            assert not holds_connection(other.pid, conn)
            client.close()
            time.sleep(0.1)
            assert not holds_connection(os.getpid(), conn)
        finally:
            conn.close()
            other.kill()
            other.wait()


@pytest.mark.timeout(60)
def test_a_late_registration_is_refused_without_disturbing_training() -> None:
    with Coordinator(2, "127.0.0.1", settings=MembershipSettings(allow_joins=False), secret=SECRET) as c:
        agents = _start_two(c)
        try:
            with pytest.raises(RegistrationRefused, match="registered after the training started"):
                WorkerAgent((9, 0), c.address, secret=SECRET, connect_timeout=5).start()
            time.sleep(0.5)
            assert [m.generation for m in c.history] == [0] and not c.deaths
            assert not any(a.abort.is_set() for a in agents)
        finally:
            for agent in agents:
                agent.close()


@pytest.mark.timeout(60)
def test_a_joiner_without_the_secret_cannot_join_a_running_training() -> None:
    with Coordinator(2, "127.0.0.1", secret=SECRET) as c:
        agents = _start_two(c)
        try:
            for secret in ("", "wrong"):
                with pytest.raises(RegistrationRefused, match="secret is missing or wrong"):
                    WorkerAgent(
                        (None, 0), c.address, secret=secret, node_key="intruder", connect_timeout=5
                    ).start()
            time.sleep(0.5)
            assert [m.generation for m in c.history] == [0] and not c.deaths
            assert not any(a.abort.is_set() or a.joiners for a in agents)  # nobody waits to join
            assert c.machine.pending == ()
        finally:
            for agent in agents:
                agent.close()


def test_the_local_supervisor_hands_the_secret_to_its_workers_only() -> None:
    from lightning_oobleck.lightning.launcher import Supervisor

    with Supervisor(1) as supervisor:
        secret = supervisor.worker_env[SECRET_ENV]
        assert len(secret) >= 32
        assert SECRET_ENV not in os.environ  # the supervisor's own environment does not carry it
        address = supervisor.worker_env["OOBLECK_COORDINATOR_ADDR"]
        assert address.startswith("127.0.0.1:")  # a local run: loopback only
        with pytest.raises(RegistrationRefused, match="secret is missing or wrong"):
            WorkerAgent((0, 0), address, secret="guess", connect_timeout=5).start()
        agent = WorkerAgent((0, 0), address, secret=secret).start()
        agent.agree(after=-1, timeout=10)
        agent.close()
        assert supervisor.coordinator is not None and supervisor.coordinator.process.wait(timeout=10) == 0
