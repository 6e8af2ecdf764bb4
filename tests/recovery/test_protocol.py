"""The coordinator's protocol over real sockets: joins, fencing of a dead node, suspect hints, the
agreement deadline; and the worker agent's errors when the coordinator is missing or lost.

Workers are played here by raw protocol clients (they may misbehave on purpose: stay silent, never
reach the barrier), and by real ``WorkerAgent``\\ s where fencing cannot happen (an agent that is
fenced ends its process, so fenced agents only run in worker processes: see test_failures.py)."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from recovery_cluster import wait_until

from lightning_oobleck.recovery import (
    ADDRESS_ENV,
    Coordinator,
    CoordinatorLost,
    CoordinatorUnreachable,
    RegistrationRefused,
    Worker,
    WorkerAgent,
)
from lightning_oobleck.recovery.agent import TrainingFinished
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import SECRET_ENV, LineReader, Timeouts, encode, parse_address

W = Worker


class RawClient:
    """A worker speaking the wire protocol directly, so that a test decides every message it sends."""

    def __init__(self, coordinator: Coordinator, worker: Worker) -> None:
        self.worker = worker
        self.sock = socket.create_connection(parse_address(coordinator.address), timeout=5.0)
        self.reader = LineReader()
        self.pending: list[dict[str, Any]] = []
        self.received: list[str] = []  # every op received, in order
        self.send("register", node=worker.node, device=worker.device, pid=0, host="test")

    def send(self, op: str, **fields: Any) -> None:
        self.sock.sendall(encode(op, **fields))

    def expect(self, op: str, timeout: float = 5.0) -> dict[str, Any]:
        """The next message with ``op``, skipping welcomes, heartbeat acks and aborts."""
        deadline = time.monotonic() + timeout
        while True:
            while self.pending:
                msg = self.pending.pop(0)
                if msg["op"] == op:
                    return msg
                assert msg["op"] in ("welcome", "ack", "abort", "joiners"), (
                    f"{tuple(self.worker)} expected {op!r}, got {msg}"
                )
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{tuple(self.worker)} got no {op!r} within {timeout} s"
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            assert data, f"{tuple(self.worker)}: connection closed while waiting for {op!r}"
            self._receive(data)

    def _receive(self, data: bytes) -> None:
        messages = self.reader.feed(data)
        self.pending += messages
        self.received += [m["op"] for m in messages]

    def is_closed_by_peer(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False
            if not data:
                return True
            self._receive(data)
        return False


def agree(clients: list[RawClient], generation: int) -> list[Worker]:
    """Every client receives ``generation``'s announcement, answers READY and gets GO; returns its workers."""
    announced = [c.expect("announce") for c in clients]
    assert {a["generation"] for a in announced} == {generation}
    for c in clients:
        c.send("ready", generation=generation)
    (workers,) = {json.dumps(c.expect("go")["workers"]) for c in clients}  # the same for every client
    return [W(*w) for w in json.loads(workers)]


@pytest.fixture
def coordinator(request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    options = {"heartbeat_timeout": 5.0, **getattr(request, "param", {})}
    world_size = options.pop("world_size", 2)
    with Coordinator(world_size, "127.0.0.1", settings=MembershipSettings(**options)) as c:
        yield c


def test_a_worker_registering_after_the_start_joins_when_a_member_admits_it(coordinator: Coordinator) -> None:
    a, b = RawClient(coordinator, W(0, 0)), RawClient(coordinator, W(1, 0))
    assert agree([a, b], 0) == [W(0, 0), W(1, 0)]
    c = RawClient(coordinator, W(2, 0))
    c.expect("welcome")
    assert a.expect("joiners") == {"op": "joiners", "nodes": 1}  # pending: the step goes on
    a.send("admit", generation=0, nodes=1)  # the step boundary
    assert agree([a, b, c], 1) == [W(0, 0), W(1, 0), W(2, 0)]
    joined = coordinator.history[1]
    assert (joined.added, joined.removed, joined.agreed_at is not None) == ((W(2, 0),), (), True)


def test_a_joiner_the_training_ended_without_is_told_so_alike_pending_or_registering_after() -> None:
    """A joiner pending when the last member finishes, and one that registers afterwards (a replacement
    started late), both end with :class:`TrainingFinished` (nothing to do: the launcher and the SLURM task
    exit cleanly), not one of them with a refusal (an error exit)."""
    with Coordinator(1, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=5.0)) as c:
        member = WorkerAgent((0, 0), c.address).start()
        member.agree(after=-1, timeout=5.0)
        pending = WorkerAgent((1, 0), c.address).start()
        try:
            wait_until(lambda: member.joiners == 1, 5.0, "the joiner to be pending")
            member.close(finished=True)
            with pytest.raises(TrainingFinished, match=r"\(1, 0\) was not admitted: the training ended"):
                pending.agree(after=-1, timeout=5.0)
            with pytest.raises(TrainingFinished, match=r"\(2, 0\) was not admitted: the training ended"):
                WorkerAgent((2, 0), c.address, connect_timeout=5.0).start()
        finally:
            pending.close()


@pytest.mark.parametrize("coordinator", [{"world_size": 3}], indirect=True)
def test_a_dead_workers_node_is_fenced_and_never_registers_again(coordinator: Coordinator) -> None:
    a, sibling, c = (
        RawClient(coordinator, W(0, 0)),
        RawClient(coordinator, W(0, 1)),
        RawClient(coordinator, W(1, 0)),
    )
    agree([a, sibling, c], 0)
    a.sock.close()  # the process died
    assert "node 0 is out" in sibling.expect("fenced")["reason"]
    assert sibling.is_closed_by_peer()
    assert agree([c], 1) == [W(1, 0)]

    late = RawClient(coordinator, W(0, 2))
    assert "never rejoins" in late.expect("fenced")["reason"] and late.is_closed_by_peer()
    duplicate = RawClient(coordinator, W(1, 0))
    assert "already registered" in duplicate.expect("refused")["reason"] and duplicate.is_closed_by_peer()
    assert [m.workers for m in coordinator.history] == [(W(0, 0), W(0, 1), W(1, 0)), (W(1, 0),)]


@pytest.mark.parametrize("coordinator", [{"world_size": 3, "heartbeat_timeout": 4.0}], indirect=True)
def test_a_suspect_hint_confirms_a_silent_worker_early_and_spares_a_live_one(
    coordinator: Coordinator,
) -> None:
    live, reporter, silent = (RawClient(coordinator, W(n, 0)) for n in range(3))
    agree([live, reporter, silent], 0)
    reported_at = time.time()
    reporter.send("suspect", node=0, device=0, reason="connection reset")
    reporter.send("suspect", node=2, device=0, reason="connection reset")
    deadline = time.monotonic() + 3.0  # less than the heartbeat timeout
    while time.monotonic() < deadline and not coordinator.deaths:
        live.send("heartbeat")
        reporter.send("heartbeat")
        time.sleep(0.2)
    (death,) = coordinator.deaths
    assert death.worker == W(2, 0) and "suspected by a peer" in death.reason
    assert death.at - reported_at < 2 * coordinator.heartbeat_interval + 0.5 < coordinator.heartbeat_timeout
    assert agree([live, reporter], 1) == [W(0, 0), W(1, 0)]


@pytest.mark.parametrize("coordinator", [{"agreement_timeout": 0.5}], indirect=True)
def test_a_member_that_never_reaches_the_barrier_is_declared_dead(coordinator: Coordinator) -> None:
    ready, straggler = RawClient(coordinator, W(0, 0)), RawClient(coordinator, W(1, 0))
    ready.expect("announce")
    straggler.expect("announce")
    ready.send("ready", generation=0)
    assert "agreement barrier" in straggler.expect("fenced", timeout=3.0)["reason"]
    assert agree([ready], 1) == [W(0, 0)]
    assert coordinator.history[0].agreed_at is None


def test_agent_agrees_and_loses_the_coordinator_with_a_clear_error() -> None:
    coordinator = Coordinator(1, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=5.0)).start()
    agent = WorkerAgent((0, 0), coordinator.address).start()
    try:
        membership = agent.agree(after=-1, timeout=5.0)
        assert (membership.generation, membership.workers, agent.abort.is_set()) == (0, (W(0, 0),), False)
        coordinator.stop()
        wait_until(agent.abort.is_set, 2.0, "the agent to notice the coordinator's loss")
        with pytest.raises(CoordinatorLost, match="no standby coordinator was started yet"):
            agent.agree(after=0, timeout=2.0)
    finally:
        agent.close()
        coordinator.stop()


def test_agent_reports_an_unreachable_coordinator_after_a_bounded_retry() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here
    started = time.monotonic()
    with pytest.raises(CoordinatorUnreachable, match=address):
        WorkerAgent((0, 0), address, connect_timeout=0.6).start()
    assert time.monotonic() - started < 3.0


def test_a_worker_that_leaves_never_takes_the_coordinators_close_for_its_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The coordinator closes a worker's connection as soon as it reads LEAVE. The leaving worker must not
    take that close for the coordinator's loss (``CoordinatorLost``, which aborts the worker's collectives
    while it still ends its run). Here the thread that leaves is held for a moment after the send, as a
    pre-empted thread may be."""
    coordinator = Coordinator(1, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=5.0)).start()
    agent = WorkerAgent((0, 0), coordinator.address).start()
    try:
        agent.agree(after=-1, timeout=5.0)
        send = agent._send

        def send_then_stall(op: str, **fields: Any) -> None:
            send(op, **fields)
            if op == "leave":
                wait_until(lambda: (0, 0) in coordinator.machine.finished, 2.0, "LEAVE to be read")
                time.sleep(0.2)  # the agent's thread reads the close meanwhile

        monkeypatch.setattr(agent, "_send", send_then_stall)
        agent.close(finished=True)
        assert not agent.abort.is_set()
    finally:
        agent.close()
        coordinator.stop()


def test_agent_errors_name_the_fix(coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    with pytest.raises(ValueError, match=ADDRESS_ENV):
        WorkerAgent((0, 0))
    with pytest.raises(ValueError, match="HOST:PORT"):
        WorkerAgent((0, 0), "no-port")
    holder = RawClient(coordinator, W(0, 0))
    holder.expect("welcome")
    monkeypatch.setenv(ADDRESS_ENV, coordinator.address)
    with pytest.raises(RegistrationRefused, match="own \\(node, device\\)"):
        WorkerAgent((0, 0)).start()


def test_a_joiner_dying_before_admission_leaves_the_running_generation_alone(
    coordinator: Coordinator,
) -> None:
    a, b = RawClient(coordinator, W(0, 0)), RawClient(coordinator, W(1, 0))
    agree([a, b], 0)
    joiner = RawClient(coordinator, W(2, 0))
    joiner.expect("welcome")
    joiner.sock.close()  # dies within the settle window, before generation 1 is announced
    wait_until(lambda: coordinator.deaths, 2.0, "the joiner to be declared dead")
    time.sleep(3 * coordinator.settle_s)
    a.send("heartbeat")
    a.expect("ack")
    assert [op for op in a.received if op in ("abort", "announce")] == ["announce"]  # generation 0's only
    assert [m.generation for m in coordinator.history] == [0]


def test_a_worker_breaking_the_protocol_is_dropped_and_the_coordinator_keeps_serving(
    coordinator: Coordinator,
) -> None:
    a, b = RawClient(coordinator, W(0, 0)), RawClient(coordinator, W(1, 0))
    agree([a, b], 0)
    b.send("ready")  # no generation
    assert b.is_closed_by_peer()
    (death,) = coordinator.deaths
    assert death.worker == W(1, 0) and "broke the protocol" in death.reason
    assert agree([a], 1) == [W(0, 0)]


def test_the_launchers_supervisor_starts_the_coordinator_and_exports_its_address() -> None:
    from lightning_oobleck.lightning.launcher import Supervisor

    with Supervisor(2, coordinator=MembershipSettings(heartbeat_timeout=5.0)) as supervisor:
        address, secret = supervisor.worker_env[ADDRESS_ENV], supervisor.worker_env[SECRET_ENV]
        assert address == supervisor.store_addr  # one process serves the store and the coordinator
        agents = [WorkerAgent((node, 0), address, secret=secret).start() for node in (0, 1)]
        try:
            with ThreadPoolExecutor(len(agents)) as pool:  # the barrier needs both at once
                agreed = list(pool.map(lambda agent: agent.agree(after=-1, timeout=5.0), agents))
            assert {m.workers for m in agreed} == {(W(0, 0), W(1, 0))}
        finally:
            for agent in agents:
                agent.close()
        # the workers left: the coordinator's process ends by itself, having seen every one finish
        assert supervisor.coordinator is not None
        assert supervisor.coordinator.process.wait(timeout=10) == 0


def test_the_coordinator_entry_point_serves_until_the_workers_finished(tmp_path: Path) -> None:
    """With the job's secret from the environment: a client without it is refused, the worker is served."""
    address_file = tmp_path / "coordinator.addr"
    command = [
        sys.executable,
        "-m",
        "lightning_oobleck.recovery",
        "--world-size=1",
        "--host=127.0.0.1",
    ]
    log = tmp_path / "coordinator.log"
    with subprocess.Popen(
        [*command, f"--address-file={address_file}", f"--log={log}"],
        stdout=subprocess.DEVNULL,
        env={**os.environ, SECRET_ENV: "s3cret"},
    ) as proc:
        try:
            address = wait_until(
                lambda: address_file.exists() and address_file.read_text().strip(), 20.0, "address"
            )
            with pytest.raises(RegistrationRefused, match="secret is missing or wrong"):
                WorkerAgent((0, 0), address, connect_timeout=5.0, secret="wrong").start()
            with WorkerAgent((0, 0), address, connect_timeout=5.0, secret="s3cret") as agent:
                assert agent.agree(after=-1, timeout=5.0).workers == (W(0, 0),)
            assert proc.wait(timeout=5.0) == 0
            assert "generation 0 agreed" in log.read_text()
        finally:
            proc.kill()


@pytest.mark.timeout(30)
def test_the_first_registration_sets_the_jobs_timeouts_and_a_different_one_is_refused() -> None:
    """Under SLURM the coordinator starts before any worker's configuration is known: the workers bring
    their ``heartbeat_timeout_s`` and ``hang_timeout_s``; one configured differently is refused by name."""
    with Coordinator(3, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=2.0)) as c:
        first = WorkerAgent((0, 0), c.address, timeouts=Timeouts(3.0, 90.0)).start()
        try:
            assert (first.heartbeat_timeout, c.heartbeat_timeout, c.agreement_timeout) == (3.0, 3.0, 90.0)
            with pytest.raises(
                RegistrationRefused, match=r"worker \(1, 0\) is configured with .*same strategy"
            ):
                WorkerAgent((1, 0), c.address, timeouts=Timeouts(9.0, 90.0), connect_timeout=5).start()
            same = WorkerAgent((1, 0), c.address, timeouts=Timeouts(3.0, 90.0)).start()
            same.close()
        finally:
            first.close()


@pytest.mark.timeout(30)
def test_a_process_keeps_one_agent_for_its_runs_and_refuses_other_timeouts_in_a_later_run() -> None:
    from lightning_oobleck.recovery.agent import close_process_agent, process_agent

    with Coordinator(1, "127.0.0.1") as c:
        try:
            first = process_agent((0, 0), address=c.address, timeouts=Timeouts(3.0, 90.0))
            assert process_agent((0, 0), address=c.address, timeouts=Timeouts(3.0, 90.0)) is first
            with pytest.raises(
                ValueError, match="give every run of the process the same heartbeat_timeout_s"
            ):
                process_agent((0, 0), address=c.address, timeouts=Timeouts(6.0, 90.0))
        finally:
            close_process_agent()
        wait_until(lambda: c.wait_done(0), 5.0, "the agent's leave")
        assert c.finished and not c.deaths


def test_a_leave_whose_connection_is_reset_at_once_is_a_leave_not_a_death() -> None:
    """The worker sends a heartbeat and LEAVE and resets its connection (SO_LINGER 0) before the reply to
    the heartbeat can be sent: the failed send must not make the coordinator miss the LEAVE behind it."""
    for _ in range(5):  # the reset may or may not beat the reply's send: try a few times
        with Coordinator(1, "127.0.0.1") as c:
            client = RawClient(c, W(0, 0))
            client.expect("announce")
            client.send("ready", generation=0)
            client.expect("go")
            client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.sock.sendall(encode("heartbeat") + encode("leave"))
            client.sock.close()
            wait_until(lambda c=c: c.wait_done(0), 5.0, "the worker's leave")
            assert c.finished and not c.deaths, c.deaths
