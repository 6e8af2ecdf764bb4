"""The membership protocol's state machine without sockets: the table of its docstring, event by event, and
property tests over random interleavings of registrations, heartbeats, readies, kills, silences, launcher
exit reports, suspect hints, leaves, stray clients, joining nodes and admission requests.

Invariants (after every event): one membership per generation, generations numbered 0, 1, 2, ...; GO(g)
only once every member of g was ready or had left; a joiner becomes a member only through an admission
request at a step boundary, with every process of its node; a worker that keeps sending heartbeats and
answers every announcement is never fenced unless a process of its node died. At the end, once every live
worker answers, a member asks to admit the joiners and time passes: every live worker is a member of the
newest generation (but the processes of a node not all of which registered) and it is agreed, and every
worker or client that is not was told why (``fenced`` or ``refused``, with a reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_oobleck.recovery.membership import (
    Close,
    Effect,
    Kill,
    MembershipMachine,
    MembershipSettings,
    Phase,
    Send,
)
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.worker import Worker

SECRET = "s3cret"
HEARTBEAT = 1.0
SETTLE = 0.1
AGREEMENT = 5.0


@dataclass
class Client:
    """One connection as the machine sees it, and what the harness lets it do."""

    conn: int
    worker: Worker | None = None
    responsive: bool = True
    """Answers every announcement at once (else only when an action says so)."""
    silent: bool = False
    gone: bool = False
    """Its process ended (killed, exited)."""
    inbox: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    closed: bool = False
    readied: set[int] = field(default_factory=set)
    joining_device: int | None = None
    """A joiner's device: it registers without a node id and learns it from the welcome."""
    after_start: bool = False
    """It registered once generation 0 was announced: it must wait for an admission."""

    def last(self, op: str) -> dict[str, Any] | None:
        return next((f for o, f in reversed(self.inbox) if o == op), None)


class Harness:
    def __init__(self, nodes: int, devices: int, allow_joins: bool = True) -> None:
        self.machine = MembershipMachine(
            nodes * devices,
            MembershipSettings(
                heartbeat_timeout=HEARTBEAT,
                settle_s=SETTLE,
                agreement_timeout=AGREEMENT,
                allow_joins=allow_joins,
                devices_per_node=devices,
                kill_fenced=True,
            ),
            secret=SECRET,
            host="here",
        )
        self.now = 0.0
        self.clients: dict[int, Client] = {}
        self.workers = [Worker(n, d) for n in range(nodes) for d in range(devices)]
        self.by_worker: dict[Worker, Client] = {}
        self.announced: dict[int, tuple[Worker, ...]] = {}
        self.killed: set[int] = set()
        self.exited: set[Worker] = set()
        self.strays: list[Client] = []
        self.devices = devices
        self.joiners: set[Worker] = set()
        self.admit_asked = False
        self.workers_by_conn: dict[int, Worker] = {}

    # ------------------------------------------------------------------ plumbing
    def apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            client = self.clients[effect.conn]
            if isinstance(effect, Send):
                assert not client.closed, f"{effect.op} sent on a closed connection"
                client.inbox.append((effect.op, effect.fields))
                if effect.op == "welcome" and client.joining_device is not None:
                    self.welcome_joiner(client, Worker(effect.fields["node"], client.joining_device))
                self.check_send(client, effect)
            elif isinstance(effect, Kill):
                assert client.worker is not None and effect.pid == 1000 + effect.conn
                self.killed.add(effect.conn)
                client.gone = True
            elif isinstance(effect, Close):
                client.closed = True
        for client in list(self.clients.values()):
            self.respond(client)

    def respond(self, client: Client) -> None:
        """A responsive live worker answers its newest announcement at once."""
        announce = client.last("announce")
        if (
            announce is not None
            and client.responsive
            and not (client.silent or client.gone or client.closed)
            and announce["generation"] not in client.readied
        ):
            self.ready(client, announce["generation"])

    def ready(self, client: Client, generation: int) -> None:
        client.readied.add(generation)
        self.apply(self.machine.received(client.conn, {"op": "ready", "generation": generation}, self.now))

    def check_send(self, client: Client, effect: Send) -> None:
        if effect.op == "announce":
            g, workers = effect.fields["generation"], tuple(Worker(*w) for w in effect.fields["workers"])
            if g not in self.announced:
                admitted = {w for members in self.announced.values() for w in members}
                if new_joiners := (set(workers) & self.joiners) - admitted:
                    assert self.admit_asked, f"joiners {new_joiners} admitted without an admission request"
                    nodes = {w.node for w in new_joiners}
                    assert {w for w in self.joiners if w.node in nodes} <= set(workers), (
                        "half a node admitted"
                    )
                self.admit_asked = False
            assert self.announced.setdefault(g, workers) == workers, "two memberships for one generation"
            assert client.worker in workers
            self.check_record(Membership.from_message(effect.fields))
        elif effect.op == "go":
            g = effect.fields["generation"]
            members = self.announced[g]
            for w in members:
                c = self.by_worker[w]
                assert g in c.readied or w in self.machine.finished, f"GO({g}) before {w} was ready"
        elif effect.op == "fenced" and client.joining_device is not None and client.worker is None:
            assert "never rejoins" in effect.fields["reason"]  # its node key names a node that died
        elif effect.op == "fenced":
            assert client.worker is not None
            assert effect.fields["reason"]
            node = client.worker.node
            node_clients = [
                c for c in self.by_worker.values() if c.worker is not None and c.worker.node == node
            ]
            # the node is the failure domain: a node-mate that died, or that never answered an announcement
            # (declared dead after the agreement timeout), takes this worker out with it
            explained = any(
                c.silent or c.gone or c.conn in self.killed or not c.responsive for c in node_clients
            )
            explained |= any(w.node == node for w in self.exited)
            registered_dead_node = (
                client.worker in self.by_worker and self.by_worker[client.worker] is not client
            )
            assert explained or registered_dead_node or not client.responsive, (
                f"healthy, responsive worker {client.worker} fenced: {effect.fields['reason']}"
            )

    def check_record(self, announced: Membership) -> None:
        """The failure record every member reads alike: counted from the start's agreement, one more for
        each agreed generation that lost a worker (not one that left), never fewer than before."""
        agreed = [
            m for m in self.machine.history if m.agreed_at is not None and m.generation < announced.generation
        ]
        if not agreed:
            assert (announced.started_at, announced.failures) == (None, 0)
            return
        assert announced.started_at == agreed[0].agreed_at
        lost = any(w not in self.machine.finished for w in announced.removed)
        assert announced.failures == agreed[-1].failures + lost
        failures, time_s = announced.observed()
        assert failures == announced.failures and time_s >= 0

    # ------------------------------------------------------------------ actions
    def register(self, i: int, responsive: bool) -> None:
        if i >= len(self.workers):
            return
        worker = self.workers[i]
        if worker in self.by_worker or worker in self.exited:
            return
        conn = len(self.clients) + 1
        self.clients[conn] = self.by_worker[worker] = Client(conn, worker, responsive)
        if self.machine.current is not None:
            self.joiners.add(worker)
        self.apply(self.machine.connected(conn, self.now))
        message = {"op": "register", "node": worker.node, "device": worker.device, "pid": 1000 + conn}
        self.apply(self.machine.received(conn, {**message, "host": "here", "secret": SECRET}, self.now))

    def join(self, key: int, processes: int) -> None:
        """``processes`` processes of a new node (named ``key``) register without a node id."""
        for device in range(min(processes, self.devices)):
            conn = len(self.clients) + 1
            self.clients[conn] = Client(
                conn, joining_device=device, after_start=self.machine.current is not None
            )
            self.apply(self.machine.connected(conn, self.now))
            message = {"op": "register", "node": None, "node_key": f"new{key}", "device": device}
            self.apply(
                self.machine.received(conn, {**message, "pid": 1000 + conn, "secret": SECRET}, self.now)
            )

    def welcome_joiner(self, client: Client, worker: Worker) -> None:
        assert worker.node not in {w.node for w in self.workers}, "a joiner got a node id the job used"
        assert worker not in self.by_worker, "two processes registered as one worker"
        client.worker = self.workers_by_conn[client.conn] = worker
        self.by_worker[worker] = client
        if client.after_start:  # else it is one of the workers that start the job
            self.joiners.add(worker)
            assert self.machine.current is not None
            assert worker not in self.machine.current.workers, "a joiner disturbed the running step"

    def admit(self, i: int) -> None:
        """Member ``i`` reached a step boundary after a commit that saw pending joiners."""
        members = sorted(self.by_worker)
        if i >= len(members) or (go := (client := self.by_worker[members[i]]).last("go")) is None:
            return
        if self.live(client):
            self.admit_asked = True
            self.apply(
                self.machine.received(client.conn, {"op": "admit", "generation": go["generation"]}, self.now)
            )

    def told(self, client: Client) -> bool:
        """Whether the newest notice ``client`` got says that whole nodes are pending."""
        notice = client.last("joiners")
        return self.live(client) and notice is not None and notice["nodes"] > 0

    def live(self, client: Client) -> bool:
        return not (client.silent or client.gone or client.closed)

    def advance(self, seconds: float) -> None:
        """Time passes in small steps; live workers heartbeat every quarter of the timeout."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + HEARTBEAT / 4)
            self.beat()

    def beat(self) -> None:
        """Every live worker heartbeats now, then the timers due fire."""
        for client in list(self.by_worker.values()):
            if self.live(client):
                self.apply(self.machine.received(client.conn, {"op": "heartbeat"}, self.now))
        self.apply(self.machine.tick(self.now))

    def kill(self, i: int) -> None:
        client = self._client(i)
        if client is not None and not client.gone:
            client.gone = True
            self.apply(self.machine.ended(client.conn, "its connection closed", self.now))

    def silence(self, i: int) -> None:
        client = self._client(i)
        if client is not None:
            client.silent = True

    def _client(self, i: int) -> Client | None:
        """The ``i``-th registered worker's connection, in (node, device) order (joiners included)."""
        members = sorted(self.by_worker)
        return self.by_worker[members[i]] if i < len(members) else None

    def exit_unregistered(self, i: int) -> None:
        if i >= len(self.workers):
            return
        worker = self.workers[i]
        if worker not in self.by_worker and worker not in self.exited:
            self.exited.add(worker)
            self.apply(self.machine.exited(worker, "its process ended", self.now))

    def presence_ends(self, i: int) -> None:
        """Worker ``i``'s process announces itself on a presence connection, which then ends: its process
        is gone, registered or not."""
        if i >= len(self.workers):
            return
        worker = self.workers[i]
        conn = len(self.clients) + 1
        client = self.clients[conn] = Client(conn)
        self.apply(self.machine.connected(conn, self.now))
        message = {"op": "present", "node": worker.node, "device": worker.device, "secret": SECRET}
        self.apply(self.machine.received(conn, message, self.now))
        assert not client.inbox, "a presence connection is never answered"
        if worker not in self.by_worker:
            self.exited.add(worker)
        self.apply(self.machine.ended(conn, "its connection closed", self.now))
        registered = self.by_worker.get(worker)
        if registered is not None and not registered.gone:
            registered.gone = True
            self.apply(self.machine.ended(registered.conn, "its connection closed", self.now))

    def answer(self, i: int) -> None:
        client = self._client(i)
        if client is not None and self.live(client) and (a := client.last("announce")) is not None:
            self.ready(client, a["generation"])

    def suspect(self, i: int, j: int) -> None:
        client, target = self._client(i), self._client(j)
        if client is not None and target is not None and target.worker is not None and self.live(client):
            target = target.worker
            msg = {"op": "suspect", "node": target.node, "device": target.device, "reason": "test"}
            self.apply(self.machine.received(client.conn, msg, self.now))

    def leave(self, i: int) -> None:
        client = self._client(i)
        if client is not None and self.live(client) and client.last("go") is not None:
            self.apply(self.machine.received(client.conn, {"op": "leave"}, self.now))
            client.gone = True

    def stray(self, kind: int) -> None:
        """A client that is not one of the job's workers: no secret (0), a wrong one (1), a taken
        (node, device) with the secret (2), a first message that is not a registration (3), a presence
        without the secret (4)."""
        message = [
            {"op": "register", "node": 99, "device": 0, "pid": 1, "host": "here"},
            {"op": "register", "node": 99, "device": 0, "pid": 1, "host": "here", "secret": "wrong"},
            None,
            {"op": "heartbeat"},
            {"op": "present", "node": 0, "device": 0, "secret": "wrong"},
        ][kind]
        if message is None:
            taken = next((w for w, c in self.by_worker.items() if self.live(c)), None)
            if taken is None:
                return
            message = {
                "op": "register",
                "node": taken.node,
                "device": taken.device,
                "pid": 1,
                "secret": SECRET,
            }
        conn = len(self.clients) + 1
        client = self.clients[conn] = Client(conn)
        self.strays.append(client)
        self.apply(self.machine.connected(conn, self.now))
        self.apply(self.machine.received(conn, message, self.now))

    # ------------------------------------------------------------------ the end
    def settle_everything(self) -> None:
        for i, worker in enumerate(self.workers):
            if worker not in self.by_worker:
                self.exit_unregistered(i)
        for client in self.by_worker.values():
            client.responsive = True
            self.respond(client)
        self.advance(SETTLE + AGREEMENT + 2 * HEARTBEAT)
        # the next step boundary: a member told of pending joiners asks to admit them
        told = [i for i, c in enumerate(self.by_worker[w] for w in sorted(self.by_worker)) if self.told(c)]
        if told:
            self.admit(told[0])
        self.advance(SETTLE + AGREEMENT + 2 * HEARTBEAT)

    def check_end(self) -> None:
        m = self.machine
        live = sorted(w for w, c in self.by_worker.items() if self.live(c))
        assert list(m.alive) == live
        if live and m.history and not set(live) & set(m.history[-1].workers):
            assert set(live) <= self.joiners  # every member is gone: nobody is left to admit the joiners
        elif live and m.history:
            newest = m.history[-1]
            # every live worker is a member, but the processes of a node not every one of which registered;
            # the others left normally (a leave makes no new generation)
            partial = {w for w in set(live) - set(newest.workers) if w in self.joiners}
            assert all(sum(x.node == w.node for x in live) < self.devices for w in partial), partial
            assert set(live) - partial <= set(newest.workers) <= set(live) | m.finished
            assert newest.agreed_at is not None
            assert m.phase is Phase.RUNNING
        for w, c in self.by_worker.items():
            if not self.live(c) and c.conn not in self.killed and not c.gone:
                told = [c.last(op) for op in ("fenced", "refused", "finished")]
                assert any(m is not None for m in told), f"{w} not told why"
        for c in self.strays:
            assert (
                c.closed and c.inbox and c.inbox[-1][0] in ("refused", "fenced") and c.inbox[-1][1]["reason"]
            )
        assert [g.generation for g in m.history] == list(range(len(m.history)))


ACTIONS = st.one_of(
    st.tuples(st.just("register"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("advance"), st.floats(0.05, 1.5 * AGREEMENT)),
    st.tuples(st.just("kill"), st.integers(0, 8)),
    st.tuples(st.just("silence"), st.integers(0, 8)),
    st.tuples(st.just("exit_unregistered"), st.integers(0, 5)),
    st.tuples(st.just("presence_ends"), st.integers(0, 5)),
    st.tuples(st.just("answer"), st.integers(0, 8)),
    st.tuples(st.just("suspect"), st.integers(0, 8), st.integers(0, 8)),
    st.tuples(st.just("leave"), st.integers(0, 8)),
    st.tuples(st.just("stray"), st.integers(0, 4)),
    st.tuples(st.just("join"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("admit"), st.integers(0, 8)),
)


@settings(max_examples=300, deadline=None)
@given(devices=st.sampled_from([1, 2, 3]), allow_joins=st.booleans(), actions=st.lists(ACTIONS, max_size=40))
@example(  # a joiner that left during the start, then a process of its node key: refused, not re-admitted
    devices=2,
    allow_joins=True,
    actions=[
        ("register", 0, False),
        ("exit_unregistered", 1),
        ("exit_unregistered", 2),
        ("join", 2, 2),
        ("leave", 1),
        ("join", 2, 1),
    ],
)
@example(  # a pending joiner let go when the training ended, then a process of its node key: refused
    devices=3,
    allow_joins=True,
    actions=[
        ("exit_unregistered", 0),
        ("exit_unregistered", 3),
        ("join", 0, 2),
        ("leave", 0),
        ("join", 0, 2),
    ],
)
def test_random_interleavings_keep_the_invariants(devices: int, allow_joins: bool, actions: list) -> None:
    h = Harness(6 // devices, devices, allow_joins)
    for name, *args in actions:
        getattr(h, name)(*args)
    h.settle_everything()
    h.check_end()


# ---------------------------------------------------------------------- the table, row by row


def started(nodes: int = 3, devices: int = 1) -> Harness:
    h = Harness(nodes, devices)
    for i in range(nodes * devices):
        h.register(i, responsive=True)
    assert h.machine.phase is Phase.RUNNING and h.machine.current.generation == 0
    return h


def test_starting_register_announces_generation_0_once_every_worker_registered_or_was_lost() -> None:
    h = Harness(3, 1)
    h.register(0, True)
    h.register(1, True)
    assert h.machine.phase is Phase.STARTING and not h.machine.history
    h.exit_unregistered(2)
    (g0,) = h.machine.history
    assert g0.workers == (Worker(0, 0), Worker(1, 0)) and g0.removed == (Worker(2, 0),)
    assert h.machine.phase is Phase.RUNNING


def test_starting_a_presence_connection_ends_the_wait_for_a_process_that_never_registers() -> None:
    h = Harness(3, 1)
    h.register(0, True)
    h.register(1, True)
    h.advance(3 * h.machine.settings.registration_timeout)  # the presence connection has no timer of its own
    assert h.machine.phase is Phase.STARTING and not h.machine.history
    h.presence_ends(2)
    (g0,) = h.machine.history
    assert g0.workers == (Worker(0, 0), Worker(1, 0)) and g0.removed == (Worker(2, 0),)
    assert h.machine.deaths[0].reason == "its process ended (its connection closed)"


def test_the_end_of_a_registered_workers_presence_is_its_death_seen_once() -> None:
    h = started()
    h.presence_ends(1)
    assert [d.worker for d in h.machine.deaths] == [Worker(1, 0)]
    assert h.machine.deaths[0].reason == "its connection closed"
    h.advance(SETTLE + HEARTBEAT)
    assert h.machine.history[-1].workers == (Worker(0, 0), Worker(2, 0))


def test_starting_death_of_a_registered_worker_takes_its_node_out_of_generation_0() -> None:
    h = Harness(2, 2)
    h.register(0, True)
    h.register(1, True)
    h.kill(0)  # node 0: both processes out
    assert h.by_worker[Worker(0, 1)].last("fenced") is not None
    h.register(2, True)
    h.register(3, True)
    (g0,) = h.machine.history
    assert g0.workers == (Worker(1, 0), Worker(1, 1))
    assert set(g0.removed) == {Worker(0, 0), Worker(0, 1)}


def test_running_death_aborts_the_members_and_a_closed_connection_is_announced_at_once() -> None:
    h = started()
    h.kill(1)
    assert h.machine.phase is Phase.SETTLING
    assert h.by_worker[Worker(0, 0)].last("abort")["suspects"] == [[1, 0]]
    h.kill(2)  # before the next timer check: the same change
    h.apply(h.machine.tick(h.now))  # no settle window: the processes are known to be gone
    assert [m.workers for m in h.machine.history] == [tuple(h.workers), (Worker(0, 0),)]
    assert h.machine.phase is Phase.RUNNING


def test_every_generation_carries_the_failures_since_the_start_and_when_they_came() -> None:
    """What a recovery's horizon is learnt from, the same on every member: failures count, joins and leaves
    do not, and the time runs from the start's agreement to the failure's detection."""
    h = started(4)
    start = h.machine.history[0]
    assert (start.started_at, start.failures) == (None, 0)
    h.advance(10.0)
    h.kill(3)
    h.apply(h.machine.tick(h.now))
    first = h.machine.history[-1]
    assert first.observed() == (1, pytest.approx(10.0, abs=0.3))
    assert first.started_at == start.agreed_at
    h.join(0, processes=1)
    h.admit(0)
    joined = h.machine.history[-1]
    assert joined.added and joined.failures == 1
    h.advance(5.0)
    h.kill(1)
    h.apply(h.machine.tick(h.now))
    second = h.machine.history[-1]
    assert second.observed() == (2, pytest.approx(15.0, abs=0.6))
    assert Membership.from_message(second.to_message()) == second


def test_a_silence_waits_the_settle_window_and_a_closed_connection_ends_it() -> None:
    h = started(4)
    h.silence(1)
    h.silence(2)
    h.now += HEARTBEAT + 0.01
    h.beat()  # both silent past the timeout: one change, after the settle window
    assert h.machine.phase is Phase.SETTLING and len(h.machine.deaths) == 2
    h.now += SETTLE / 2
    h.beat()
    assert h.machine.phase is Phase.SETTLING
    h.kill(3)  # a closed connection ends the window at once, with everything seen so far
    h.beat()
    assert [m.workers for m in h.machine.history][-1] == (Worker(0, 0),)
    assert len(h.machine.history) == 2


def test_agreeing_ready_of_every_member_sends_go_and_a_stale_ready_is_ignored() -> None:
    h = started()
    slow = h.by_worker[Worker(2, 0)]
    slow.responsive = False
    h.kill(1)
    h.advance(SETTLE)
    assert h.machine.phase is Phase.AGREEING
    h.ready(slow, 0)  # stale
    assert h.machine.phase is Phase.AGREEING
    h.answer(2)
    assert h.machine.phase is Phase.RUNNING and slow.last("go")["generation"] == 1


def test_agreeing_timer_declares_live_members_that_never_got_ready_dead() -> None:
    h = started()
    h.by_worker[Worker(2, 0)].responsive = False
    h.kill(1)
    h.advance(SETTLE + AGREEMENT + 0.5)
    assert "agreement barrier" in h.by_worker[Worker(2, 0)].last("fenced")["reason"]
    assert h.machine.current.workers == (Worker(0, 0),) and h.machine.phase is Phase.RUNNING


@pytest.mark.parametrize("kind", [0, 1, 2, 3, 4])
def test_stray_clients_are_refused_and_change_nothing_in_every_phase(kind: int) -> None:
    h = started()
    before = (list(h.machine.history), list(h.machine.deaths), h.machine.phase)
    h.stray(kind)
    assert h.strays
    assert h.strays[-1].inbox[-1][0] == "refused" and h.strays[-1].closed
    assert (list(h.machine.history), list(h.machine.deaths), h.machine.phase) == before
    assert not h.killed


def test_a_silent_worker_is_declared_dead_a_suspected_one_sooner_and_a_live_suspect_is_spared() -> None:
    h = started()
    h.suspect(0, 2)  # alive: it heartbeats
    h.advance(3 * HEARTBEAT)
    assert not h.machine.deaths
    h.silence(1)
    h.suspect(0, 1)
    h.advance(HEARTBEAT / 2 + 0.3)
    (death,) = h.machine.deaths
    assert death.worker == Worker(1, 0) and "suspected" in death.reason
    assert h.killed == {h.by_worker[Worker(1, 0)].conn}  # a fenced process on this host is killed


def test_leave_is_not_a_failure_and_the_machine_is_done_when_no_worker_is_left() -> None:
    h = started()
    for i in range(3):
        h.leave(i)
    assert not h.machine.deaths and len(h.machine.history) == 1
    assert h.machine.phase is Phase.DONE


# ---------------------------------------------------------------------- joiners


def test_running_a_joiner_is_pending_until_a_member_asks_at_a_step_boundary() -> None:
    h = started(devices=2)
    h.join(0, processes=1)
    (half,) = h.joiners
    assert half.node == 3  # a node id no worker of the job had
    assert h.machine.phase is Phase.RUNNING and len(h.machine.history) == 1  # the step goes on
    assert h.machine.pending == ()  # half a node is not admitted
    h.join(0, processes=2)  # the node's second process (the same key: the same node id)
    assert {w.node for w in h.joiners} == {3} and len(h.joiners) == 2
    member = h.by_worker[Worker(0, 0)]
    assert member.last("joiners") == {"nodes": 1}
    h.admit(0)
    g1 = h.machine.history[-1]
    assert g1.generation == 1 and g1.added == (Worker(3, 0), Worker(3, 1)) and "joined" in g1.cause
    assert h.machine.phase is Phase.RUNNING  # every member answered
    assert member.last("joiners") == {"nodes": 0}


def test_running_an_admission_request_with_nobody_pending_is_answered_and_changes_nothing() -> None:
    h = started()
    h.admit(0)
    assert h.by_worker[Worker(0, 0)].last("nothing_to_admit") == {"generation": 0}
    assert len(h.machine.history) == 1 and h.machine.phase is Phase.RUNNING


def test_running_a_joiner_dying_while_pending_is_dropped_without_a_new_generation() -> None:
    h = started()
    h.join(0, processes=1)
    (joiner,) = h.joiners
    h.by_worker[joiner].gone = True
    h.apply(h.machine.ended(h.by_worker[joiner].conn, "its connection closed", h.now))
    assert [d.worker for d in h.machine.deaths] == [joiner]
    assert h.machine.phase is Phase.RUNNING and len(h.machine.history) == 1
    assert h.by_worker[Worker(0, 0)].last("abort") is None
    assert h.by_worker[Worker(0, 0)].last("joiners") == {"nodes": 0}
    h.admit(0)
    assert h.by_worker[Worker(0, 0)].last("nothing_to_admit") is not None


def test_settling_an_admission_during_a_failure_is_one_generation() -> None:
    h = started()
    h.join(0, processes=1)
    h.silence(1)
    h.now += HEARTBEAT + 0.01
    h.beat()
    assert h.machine.phase is Phase.SETTLING
    h.admit(0)  # the step boundary while the silence settles
    h.advance(SETTLE)
    (_g0, g1) = h.machine.history
    assert g1.workers == (Worker(0, 0), Worker(2, 0), Worker(3, 0))
    assert (g1.removed, g1.added) == ((Worker(1, 0),), (Worker(3, 0),))


def test_a_failure_without_an_admission_request_leaves_the_joiner_pending() -> None:
    h = started()
    h.join(0, processes=1)
    h.kill(1)
    h.advance(SETTLE)
    assert h.machine.history[-1].workers == (Worker(0, 0), Worker(2, 0))
    assert h.machine.pending == (Worker(3, 0),)
    assert h.by_worker[Worker(0, 0)].last("joiners") == {"nodes": 1}  # told again in the new generation


def test_a_returning_node_gets_a_new_id_and_its_old_id_is_fenced() -> None:
    h = started()
    h.kill(1)
    h.advance(SETTLE)
    h.join(7, processes=1)
    (joiner,) = h.joiners
    assert joiner.node == 3 and joiner.node not in (0, 1, 2)


def test_recovering_an_admission_asked_while_agreeing_on_a_failure_is_folded_into_one_recovery() -> None:
    h = started()
    h.join(0, processes=1)
    for i in (0, 2):
        h.by_worker[Worker(i, 0)].responsive = False
    h.kill(1)
    h.apply(h.machine.tick(h.now))  # a closed connection: announced at once, generation 1, being agreed
    assert h.machine.phase is Phase.AGREEING and h.machine.current.generation == 1
    h.admit(0)  # a member that recovers asks for the joiner (its go is generation 0's)
    g2 = h.machine.current
    assert g2.generation == 2 and g2.workers == (Worker(0, 0), Worker(2, 0), Worker(3, 0))
    assert (g2.removed, g2.added) == ((Worker(1, 0),), (Worker(3, 0),))


def test_the_end_of_the_training_lets_the_pending_joiners_go() -> None:
    h = started(2)
    h.join(0, processes=1)
    for i in (0, 1):
        h.leave(i)
    (joiner,) = h.joiners
    assert h.by_worker[joiner].last("finished")["reason"].startswith("the training ended")
    assert h.by_worker[joiner].closed and h.machine.phase is Phase.DONE


def test_the_dispatch_follows_the_documented_table() -> None:
    """The messages each phase handles are those the module's dispatch table says, and only those."""
    from lightning_oobleck.recovery import membership

    doc = membership.__doc__ or ""
    table = doc[doc.index("message      STARTING") :]
    phases = [Phase[name] for name in table.splitlines()[0].split()[1:]]
    rows = table.splitlines()[2:]
    rows = rows[: next(i for i, row in enumerate(rows) if row.startswith("="))]
    documented = {
        (phase, row.split()[0])
        for row in rows
        for phase, cell in zip(phases, row.split()[1:], strict=True)
        if cell == "yes"
    }
    assert len(rows) == 9 and documented == set(membership.DISPATCH)
    assert {op for _, op in documented} == membership.MESSAGES
