"""The membership protocol as a pure state machine: who is alive and which generation is current.

No sockets, threads or clocks here. :class:`MembershipMachine` takes events with the (monotonic) time they
happen — a connection opened, a message received, a connection ended, a process end reported by the
launcher or seen on a presence connection, time passing — and returns *effects*: send a message on a
connection, close it, kill the process behind it. The
:class:`~lightning_oobleck.recovery.coordinator.Coordinator` runs it behind a socket loop; tests drive it
directly with any interleaving of events (``tests/recovery/test_membership_machine.py``).
Wire messages are those of :mod:`~lightning_oobleck.recovery.protocol`.

The job is in one *phase* at a time (:class:`Phase`); each event does this in each phase (a dash: cannot
happen or is ignored; "death" is a connection that ended, ``heartbeat_timeout`` of silence, two heartbeat
intervals of silence after a peer's ``suspect`` hint, a process end reported before it registered, or a
member not ready within ``agreement_timeout``):

==============  ======================  ======================  ====================  =====================
event           STARTING                AGREEING(g)             RUNNING(g)            SETTLING
==============  ======================  ======================  ====================  =====================
register        pending; once every     joins off: refused;     joins off: refused;   joins off: refused;
                worker registered or    else *pending*: not a   else pending; the     else pending
                was lost: announce      member, the members     members are told how
                generation 0 to the     told how many whole     many whole nodes
                live ones (AGREEING)    nodes are pending       are pending
admit(g)        -                       g-1 (a member that      whole pending nodes:  the coming
(a member, at                           recovers from a         announce g+1 with     generation admits
a step                                  failure): announce      them (AGREEING);      the whole pending
boundary)                               g+1 with them           none: nothing_to_     nodes
                                                                admit(g)
bad client:     refused; nothing        refused; nothing        refused; nothing      refused; nothing
no secret, a    else changes (no        else changes            else changes          else changes
taken (node,    state, no kill)
device), not
a register
register        fenced: a dead node     fenced                  fenced                fenced
from a dead     never comes back
node
present, then   the worker is lost      -                       -                     -
its end         before the start
                (unless registered)
death           its node fenced;        node fenced; ABORT      node fenced; ABORT    node fenced; folded
                lost before the         to the members of       to the members of     into the coming
                start: maybe            g; SETTLING (a          g; SETTLING (a        change
                announce gen 0          pending joiner: just    pending joiner: just
                                        dropped)                dropped)
ready(g)        -                       recorded; all           stale: ignored        recorded; GO waits
                                        members ready:                                for the next
                                        GO(g), RUNNING                                announcement
leave           -                       finished (counts        finished; no          finished
                                        as ready)               generation change;
                                                                the last member:
                                                                FINISHED to the
                                                                pending joiners, and
                                                                to a later register
settle          -                       -                       -                     announce g+1: the
timer                                                                                 live members (and
                                                                                      the admitted
                                                                                      joiners; AGREEING)
agreement       -                       live members not        -                     -
timer                                   ready are deaths
==============  ======================  ======================  ====================  =====================

The messages a phase handles (:data:`DISPATCH`, checked against this table by the tests); a message not
listed in a phase is ignored, and an unknown one logged:

===========  ========  ========  =======  ========
message      STARTING  AGREEING  RUNNING  SETTLING
===========  ========  ========  =======  ========
register     yes       yes       yes      yes
present      yes       yes       yes      yes
reattach     yes       yes       yes      yes
heartbeat    yes       yes       yes      yes
suspect      yes       yes       yes      yes
standby_ack  yes       yes       yes      yes
ready        -         yes       yes      yes
admit        -         yes       yes      yes
leave        -         yes       yes      yes
===========  ========  ========  =======  ========

**Failover** (:mod:`~lightning_oobleck.recovery.replica` runs two machines, the active one and its standby's
copy): the standby's copy takes over (:meth:`~MembershipMachine.take_over`, epoch + 1) when the active
coordinator is lost: every live worker gets a heartbeat timeout to reconnect (``reattach``: bound to its new
connection and told what it missed), after which it is declared dead; the workers of the lost coordinator's
node get two heartbeat intervals, or, once every other worker reconnected, as long again as those took. A
reconnecting worker that saw a newer generation than this copy (an isolated predecessor's) makes the next
one be numbered past it. An active machine cut off from its standby is isolated
(:meth:`~MembershipMachine.isolate`): a GO then needs at least half of each given set ready, until a new
standby's designation (:meth:`~MembershipMachine.designate`) is acknowledged (``standby_ack``) by at least
half of each; isolated past ``agreement_timeout`` without such a quorum, it fences its workers and gives up.

A joiner is admitted only at a step boundary, when a member asks (``admit``), so that it never disturbs a
step in progress; a node is admitted once all its ``devices_per_node`` processes are pending. A joiner may
register without a node id (``node_key``: a name for its node, e.g. the host and the job): the
machine then gives it a node id no worker of the job ever had, the same for every process of that key.

A death takes the whole node out (the node is the failure domain): every process of that node is fenced,
the ones that are alive are sent FENCED and, with ``kill_fenced`` on this host, killed. A death whose
connection ended (the process is gone) is announced at once, with its whole node; after a silence, the
next generation waits ``settle_s``, so that the silences of one partition fold into it. A death that comes
while a generation is being agreed moves everyone to the next one (workers fold both into one recovery).

Invariants (property-tested): one membership per generation; a worker whose heartbeats arrive is never
fenced unless its node is out or it did not reach an agreement barrier within ``agreement_timeout``; GO(g)
only once every member of g is ready; every live worker ends in the newest generation or was told why not
(``fenced`` or ``refused``, with the reason).
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_oobleck.recovery.protocol import Membership, Timeouts
from lightning_oobleck.worker import Worker

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"
    """Before generation 0: workers register."""
    AGREEING = "agreeing"
    """A generation was announced; its members answer READY."""
    RUNNING = "running"
    """The newest generation was agreed (GO sent)."""
    SETTLING = "settling"
    """A change (death, join) was seen: the next generation is announced when the settle window ends."""
    DONE = "done"
    """No worker is left."""


@dataclass(frozen=True)
class MembershipSettings:
    """The coordinator's settings, one object from the command line or the launcher to the machine.

    The first worker to register brings the job's ``heartbeat_timeout`` and ``agreement_timeout`` (its
    strategy's); they replace these, and a worker configured otherwise is refused."""

    heartbeat_timeout: float = 2.0
    """Silence after which a registered worker is declared dead."""
    settle_s: float = 0.1
    """How long the next generation waits after a silence, to fold concurrent failures into it."""
    agreement_timeout: float = 30.0
    """How long a live member may take to reach a generation's agreement barrier."""
    allow_joins: bool = True
    """Whether a worker may register after generation 0 (a joiner)."""
    devices_per_node: int = 1
    """The processes of a node, which fail together."""
    kill_fenced: bool = False
    """Also kill fenced workers that registered from this host (one machine: the local launcher)."""

    def __post_init__(self) -> None:
        if self.heartbeat_timeout <= 0 or self.settle_s < 0 or self.agreement_timeout <= 0:
            raise ValueError("heartbeat_timeout and agreement_timeout must be > 0 and settle_s >= 0")
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")

    @property
    def heartbeat_interval(self) -> float:
        """How often a worker sends a heartbeat: four within the timeout."""
        return self.heartbeat_timeout / 4

    @property
    def registration_timeout(self) -> float:
        """How long a new connection may take to register."""
        return max(10.0, 5 * self.heartbeat_timeout)


@dataclass(frozen=True)
class Send:
    """Send message ``op`` with ``fields`` on connection ``conn``."""

    conn: int
    op: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Close:
    """Close connection ``conn`` (after sending what was queued)."""

    conn: int


@dataclass(frozen=True)
class Kill:
    """Kill process ``pid``, which registered on connection ``conn`` from this host, if it holds that
    connection (the socket layer checks: a pid a client reports is not trusted)."""

    conn: int
    pid: int


Effect = Send | Close | Kill


@dataclass(frozen=True)
class Death:
    """Why and when (wall clock) the coordinator declared a worker dead."""

    worker: Worker
    reason: str
    at: float
    generation: int
    """The generation that was current when it was declared dead."""


@dataclass(eq=False)
class _Peer:
    conn: int
    deadline: float
    worker: Worker | None = None
    pid: int | None = None
    host: str | None = None
    last_heard: float = 0.0
    suspicion: str | None = None
    present: Worker | None = None
    """The worker a presence connection stands for (it never registers; it only ends with its process)."""
    closed: bool = False
    ended_by_peer: bool = False
    """Its end closed or reset: the process is gone, so its pid may already belong to another one."""
    detached: bool = False
    """A worker of the coordinator this one took over from, not reconnected yet: no connection behind it."""


class MembershipMachine:
    """The coordinator's logic (see the module docstring); every method returns the effects to apply.

    ``now`` is a monotonic time in seconds; ``wall_offset`` turns it into the wall clock of the records
    (``Death.at``, ``Membership.detected_at``/``agreed_at``). ``host`` is this machine's name: only
    workers that registered from it can be killed.
    """

    def __init__(
        self,
        world_size: int,
        settings: MembershipSettings | None = None,
        *,
        secret: str | None = None,
        host: str = "",
        wall_offset: float = 0.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1 (the number of worker processes), got {world_size}")
        self.world_size = world_size
        self.settings = settings or MembershipSettings()
        self.secret = secret
        self.host = host
        self.wall_offset = wall_offset

        self.history: list[Membership] = []
        """Every announced generation, oldest first (``agreed_at`` set on those agreed)."""
        self.deaths: list[Death] = []
        self.finished: set[Worker] = set()
        """Workers that left normally."""

        self._peers: dict[int, _Peer] = {}
        self._alive: dict[Worker, _Peer] = {}
        self._dead_nodes: dict[int, str] = {}
        self._names: dict[Worker, str] = {}
        """The node each worker runs on, as its user names it (SLURM's node name): for the log."""
        self._lost_before_start: set[Worker] = set()
        self._timeouts_from: Worker | None = None
        self._current: Membership | None = None
        self._ready: set[Worker] = set()
        self._agree_deadline: float | None = None
        self._change_at: float | None = None
        self._change_detected_at: float | None = None
        self._admitted: set[Worker] = set()
        """Every worker that was a member of an announced generation (the others alive are pending)."""
        self._admitting = 0
        """How many whole pending nodes a member asked to admit: the next announcement does."""
        self._node_ids: dict[str, int] = {}
        self._told_pending = 0
        self._out: list[Effect] = []
        self._phase = Phase.STARTING

        self.epoch = 0
        """How many times the job's coordinator failed over (:meth:`take_over`)."""
        self.standby: str | None = None
        """The address of the standby replica the workers were last told of (:meth:`designate`)."""
        self.designation = 0
        """How many standbys were designated: the number the workers acknowledge a designation with."""
        self._designation_acks: set[Worker] = set()
        self._quorums: tuple[frozenset[Worker], ...] = ()
        """While cut off from a standby that may still be alive: a GO needs at least half of each of these
        sets ready (:meth:`isolate`)."""
        self._floor = -1
        """The newest generation a reconnecting worker reported: the next one is numbered above it."""
        self._placeholders = 0
        self.coordinator_pid: int | None = None
        """The process this machine runs in, which the workers are told (a drill may kill it)."""
        self._took_over: tuple[float, int | None] | None = None
        """When this machine took over, and the node of the coordinator it replaced (until every other
        worker reconnected)."""
        self._standby_hosts: set[Worker] = set()
        """Workers that said they can start a standby coordinator when asked (a worker agent can)."""
        self.abandoned = False
        """Isolated without a quorum for ``agreement_timeout``: this coordinator gave up (``_abandon``)."""

    # ------------------------------------------------------------------ state

    @property
    def phase(self) -> Phase:
        """The phase the job is in (stored at each transition; ``DONE`` once no worker is left)."""
        return Phase.DONE if self.done else self._phase

    @property
    def current(self) -> Membership | None:
        """The newest announced generation."""
        return self._current

    @property
    def done(self) -> bool:
        """No worker is left (all finished or dead) once training started."""
        return self._current is not None and not self._alive and self._change_at is None

    @property
    def finished_launched(self) -> int:
        """How many of the workers the job launched (not joiners, which another job may have started) left
        normally."""
        joined = set(self._node_ids.values())
        return sum(w.node not in joined for w in self.finished)

    @property
    def alive(self) -> tuple[Worker, ...]:
        """Registered workers not declared dead and not finished."""
        return tuple(sorted(self._alive))

    @property
    def pending(self) -> tuple[Worker, ...]:
        """Joiners registered and alive, not yet admitted, of nodes whose every process registered."""
        waiting = [w for w in self._alive if w not in self._admitted]
        nodes = {w.node for w in waiting}
        whole = {n for n in nodes if sum(w.node == n for w in self._alive) >= self.settings.devices_per_node}
        return tuple(sorted(w for w in waiting if w.node in whole))

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must run next (``None``: no timer is pending)."""
        deadlines = [p.deadline for p in self._peers.values() if p.present is None]
        deadlines += [t for t in (self._change_at, self._agree_deadline) if t is not None]
        return min(deadlines, default=None)

    # ------------------------------------------------------------------ events

    def connected(self, conn: int, now: float) -> list[Effect]:
        """A client connected; it must register within ``registration_timeout``."""
        self._peers[conn] = _Peer(conn, deadline=now + self.settings.registration_timeout)
        return self._effects()

    def received(self, conn: int, msg: dict[str, Any], now: float) -> list[Effect]:
        """A message arrived on ``conn``."""
        peer = self._peers.get(conn)
        if peer is None or peer.closed:
            return self._effects()
        peer.last_heard = now
        peer.suspicion = None
        if peer.present is None:
            settings = self.settings
            peer.deadline = now + (
                settings.heartbeat_timeout if peer.worker else settings.registration_timeout
            )
        try:
            self._handle(peer, msg, now)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            self._drop(peer, f"it broke the protocol ({type(e).__name__}: {e} in {msg})", now)
        return self._effects()

    def ended(self, conn: int, reason: str, now: float, by_peer: bool = True) -> list[Effect]:
        """``conn`` ended: closed or reset by its process (``by_peer``: the process is gone), or unusable
        (garbage on the wire, a failed send)."""
        peer = self._peers.get(conn)
        if peer is not None and not peer.closed and peer.present is not None and by_peer:
            self._exited(peer.present, f"its process ended ({reason})", now)
        if peer is not None and not peer.closed:
            peer.ended_by_peer = by_peer
            self._drop(peer, reason, now, explained=by_peer)
        return self._effects()

    def exited(self, worker: Worker, reason: str, now: float) -> list[Effect]:
        """The launcher saw ``worker``'s process end. A registered worker's end is seen on its connection,
        after whatever it sent last (a LEAVE); this counts only for one that never registered, before the
        start: its node is out, so that generation 0 does not wait for it."""
        self._exited(worker, reason, now)
        return self._effects()

    def _exited(self, worker: Worker, reason: str, now: float) -> None:
        if self._current is None and worker not in self._alive and worker.node not in self._dead_nodes:
            self._declare_dead(worker, reason, now, registered=False)

    def tick(self, now: float) -> list[Effect]:
        """Fire every timer due at ``now``."""
        for peer in list(self._peers.values()):
            if peer.closed or peer.present is not None or peer.deadline > now:
                continue
            if peer.worker is None:
                timeout = self.settings.registration_timeout
                log.warning("closing a connection: it did not register within %.0f s", timeout)
                self._close(peer)
            elif peer.suspicion is not None:
                silent = now - peer.last_heard
                reason = f"suspected by a peer ({peer.suspicion}), silent for {silent:.1f} s"
                self._declare_dead(peer.worker, reason, now)
            elif peer.detached:
                window = peer.deadline - peer.last_heard
                reason = f"did not reconnect within {window:g} s after the coordinator failed over"
                self._declare_dead(peer.worker, reason, now)
            else:
                silence = f"sent nothing for {self.settings.heartbeat_timeout:g} s (hung or stopped)"
                self._declare_dead(peer.worker, silence, now)
        if self._change_at is not None and now >= self._change_at:
            self._announce(now)
        if self._agree_deadline is not None and now >= self._agree_deadline and self._current is not None:
            self._agree_deadline = None
            current = self._current
            for w in [w for w in current.workers if w in self._alive and w not in self._ready]:
                reason = (
                    f"did not reach the agreement barrier of generation {current.generation} "
                    f"within {self.settings.agreement_timeout:g} s"
                )
                self._declare_dead(w, reason, now)
            if current.agreed_at is None and self._change_at is None and not self._quorate():
                self._abandon(now)
        return self._effects()

    # ------------------------------------------------------------------ failover

    def take_over(
        self,
        now: float,
        *,
        wall_offset: float,
        window: float,
        lost_node: int | None = None,
        host: str | None = None,
        pid: int | None = None,
    ) -> list[Effect]:
        """Become the job's coordinator: this machine is the replica of one that was lost (epoch + 1).

        Its connections were the lost coordinator's: every live worker gets ``window`` seconds to reconnect
        (``reattach``), after which it is declared dead like a silent one; the workers of ``lost_node`` (the
        node the lost coordinator ran on, if a worker node: most likely lost with it) two heartbeat intervals
        at most, and once every other worker reconnected, as long again as those took (a live worker
        reconnects within milliseconds of seeing its coordinator lost, as the others do). Timers restart on
        this
        host's clock (``now``, ``wall_offset``); ``host`` and ``pid`` are this host's and process's (the
        workers are told, and fenced workers are killed on this host only)."""
        self.epoch += 1
        self.wall_offset = wall_offset
        self.host = host if host is not None else self.host
        self.coordinator_pid = pid
        self._peers = {}
        for worker, old in sorted(self._alive.items()):
            self._placeholders += 1
            peer = _Peer(-self._placeholders, now + window, worker, old.pid, old.host, last_heard=now)
            peer.detached = True
            self._peers[peer.conn] = self._alive[worker] = peer
        if self._change_at is not None:
            self._change_at = now
        if self._agree_deadline is not None:
            self._agree_deadline = now + self.settings.agreement_timeout
        self._quorums, self._designation_acks, self.standby = (), set(), None
        log.warning(
            "coordinator epoch %d: took over; %d worker(s) to reconnect", self.epoch, len(self._alive)
        )
        for peer in self._peers.values():
            if peer.worker is not None and peer.worker.node == lost_node:
                peer.deadline = now + min(window, 2 * self.settings.heartbeat_interval)
        self._took_over = (now, lost_node)
        return self._effects()

    def _hurry_the_lost_node(self, now: float) -> None:
        """Every worker but those of the lost coordinator's node reconnected after a take-over: they saw the
        coordinator lost as those would have, so those that have not reconnected within as long again (0.1 s
        at least) are taken for lost with their node."""
        if self._took_over is None:
            return
        since, lost_node = self._took_over
        waiting = [p for p in self._peers.values() if p.detached and p.worker is not None]
        if lost_node is None or any(p.worker.node != lost_node for p in waiting):  # type: ignore[union-attr]
            return
        self._took_over = None
        for peer in waiting:
            peer.deadline = min(peer.deadline, now + max(0.1, now - since))

    def isolate(self, quorums: list[frozenset[Worker]], revoke: bool, now: float) -> list[Effect]:
        """Cut off from a standby that may be alive (silent, not closed): from now on a GO needs at least half
        of each set in ``quorums`` ready, so that the standby, which promotes itself only on more than half
        of one of them, and this coordinator can never both decide. ``revoke``: the current generation's GO
        was decided but not sent (its replication was not acknowledged): it is decided again under the
        rule. Ends once a new standby's designation is acknowledged by at least half of each set."""
        self._quorums = tuple(q for q in quorums if q)
        current = self._current
        if revoke and current is not None and current.agreed_at is not None and not self._quorate():
            log.warning(
                "generation %d: its agreement is withheld until a quorum is ready", current.generation
            )
            self._current = dataclasses.replace(current, agreed_at=None)
            self.history[-1] = self._current
            self._phase = Phase.AGREEING if self._change_at is None else Phase.SETTLING
            self._agree_deadline = now + self.settings.agreement_timeout
        return self._effects()

    def _abandon(self, now: float) -> None:
        """Isolated, and no quorum was ready within ``agreement_timeout``: this coordinator is cut off with
        less than half of the job, which another coordinator may be running. Every worker still here is
        fenced (it cannot train safely), and nothing more is decided."""
        reason = (
            "the coordinator is cut off from more than half of the job's workers (a standby may have taken "
            f"over): no quorum was ready within {self.settings.agreement_timeout:g} s"
        )
        log.error("giving up: %s", reason)
        self.abandoned = True
        for worker in sorted(self._alive):
            peer = self._alive.pop(worker)
            self._send(peer, "fenced", reason=reason)
            self._close(peer)
        self._agree_deadline = None

    @property
    def isolated(self) -> bool:
        """Whether a GO needs a quorum (:meth:`isolate`)."""
        return bool(self._quorums)

    def designate(self, standby: str | None, now: float) -> list[Effect]:
        """Tell every live worker that ``standby`` (an address) takes over if this coordinator is lost; they
        acknowledge it (``standby_ack``) and from then on reconnect to it only."""
        self.standby = standby
        self.designation += 1
        self._designation_acks = set()
        for peer in self._alive.values():
            self._send(peer, "standby", address=standby, designation=self.designation)
        return self._effects()

    def connection_of(self, worker: Worker) -> int | None:
        """The connection ``worker`` is registered on, if it is alive and connected."""
        peer = self._alive.get(worker)
        return None if peer is None or peer.detached else peer.conn

    def can_host_standby(self, worker: Worker) -> bool:
        """Whether ``worker`` said it can start a standby coordinator when asked."""
        return worker in self._standby_hosts

    def dead_node_reason(self, node: int) -> str | None:
        """Why node ``node`` was declared dead, if it was."""
        return self._dead_nodes.get(node)

    def node_name(self, worker: Worker) -> str | None:
        """The node ``worker`` runs on, as its user names it (what it said when it registered)."""
        return self._names.get(worker)

    # ------------------------------------------------------------------ messages

    def _handle(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        op = str(msg.get("op"))
        first = op in ("register", "present", "reattach")
        if peer.worker is None and (not first or peer.present is not None):
            self._refuse(
                peer, f"the first and only message must be 'register', 'present' or 'reattach', got {op!r}"
            )
            return
        handler = DISPATCH.get((self._phase, op))
        if peer.worker is not None and (first or op not in MESSAGES):
            log.warning("ignoring unknown message %r from worker %s", op, tuple(peer.worker))
        elif handler is not None:
            handler(self, peer, msg, now)

    def _on_heartbeat(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        self._send(peer, "ack")

    def _on_ready(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        assert peer.worker is not None
        self._ready_for(peer.worker, int(msg["generation"]), now)

    def _on_suspect(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        self._suspect(Worker(int(msg["node"]), int(msg["device"])), str(msg.get("reason", "")), now)

    def _on_leave(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        self._leave(peer, now)

    def _on_admit(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        self._admit(peer, int(msg["generation"]), int(msg.get("nodes") or 1 << 30), now)

    def _on_present(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        self._present(peer, msg)

    def _on_standby_ack(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        if int(msg["designation"]) != self.designation or peer.worker is None:
            return
        self._designation_acks.add(peer.worker)
        if self._quorums and all(2 * len(q & self._designation_acks) >= len(q) for q in self._quorums):
            log.info("the standby's designation is acknowledged by a quorum: no quorum needed any more")
            self._quorums = ()
            self._maybe_go(now)

    def _on_reattach(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        """A worker of the coordinator this one took over from reconnects: it is bound to this connection and
        told what it missed (the newest announcement, its agreement, a change under way, the joiners)."""
        if not self._authentic(peer, msg):
            return
        worker = Worker(int(msg["node"]), int(msg["device"]))
        announced, agreed = int(msg.get("announced", -1)), int(msg.get("agreed", -1))
        current = self._current
        if announced > (current.generation if current else -1):
            # an isolated predecessor announced generations this replica never saw: number past them (what
            # a worker of a dead node saw counts too)
            self._floor = max(self._floor, announced)
            self._schedule_change(now, 0.0)
        holder = self._alive.get(worker)
        if worker.node in self._dead_nodes:
            self._send(
                peer,
                "fenced",
                reason=f"node {worker.node} was declared dead ({self._dead_nodes[worker.node]})",
            )
            self._close(peer)
            return
        if holder is None or not holder.detached:
            why = (
                "already left the training"
                if worker in self.finished
                else "is not a worker this coordinator waits for"
            )
            if holder is not None:
                why = "is connected already"
            self._refuse(peer, f"worker {tuple(worker)} {why}")
            return
        del self._peers[holder.conn]
        peer.worker, peer.pid, peer.host = worker, holder.pid, holder.host
        peer.deadline = now + self.settings.heartbeat_timeout
        self._alive[worker] = peer
        log.info("%s reconnected (epoch %d)", self._who(worker), self.epoch)
        self._hurry_the_lost_node(now)
        self._welcome(peer)
        if current is None or worker not in current.workers:
            return
        if current.generation > announced:
            self._send(peer, "announce", **current.to_message())
        elif self._change_at is not None:
            self._send(
                peer,
                "abort",
                generation=current.generation,
                suspects=[],
                detected_at=self._change_detected_at,
            )
        if current.agreed_at is not None and agreed < current.generation and self._change_at is None:
            self._send(
                peer,
                "go",
                generation=current.generation,
                workers=[list(m) for m in current.workers],
                agreed_at=current.agreed_at,
            )
        if self.pending:
            self._send(peer, "joiners", nodes=len({w.node for w in self.pending}))

    def _authentic(self, peer: _Peer, msg: dict[str, Any]) -> bool:
        if self.secret is not None and not hmac.compare_digest(str(msg.get("secret", "")), self.secret):
            self._refuse(peer, "the job's secret is missing or wrong: only this job's workers may register")
            return False
        return True

    def _present(self, peer: _Peer, msg: dict[str, Any]) -> None:
        if self._authentic(peer, msg):
            peer.present = Worker(int(msg["node"]), int(msg["device"]))
            if msg.get("name"):
                self._names[peer.present] = str(msg["name"])

    def _who(self, worker: Worker) -> str:
        """``worker (2, 1) on node3``: the worker and, when it said, its node's name."""
        name = self._names.get(worker)
        return f"worker {tuple(worker)}{f' on {name}' if name else ''}"

    def _register(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        if not self._authentic(peer, msg):
            return
        node = msg.get("node")
        if node is None:
            node = self._node_ids.setdefault(str(msg["node_key"]), self._fresh_node_id())
        worker = Worker(int(node), int(msg["device"]))
        if self._current is not None and not self.settings.allow_joins:
            self._refuse(
                peer,
                f"worker {tuple(worker)} registered after the training started: this run does not admit new "
                "workers (training goes on without it)",
            )
            return
        if (refusal := self._adopt_timeouts(worker, msg)) is not None:
            self._refuse(peer, refusal)
            return
        if worker.node in self._dead_nodes:
            reason = (
                f"node {worker.node} was declared dead ({self._dead_nodes[worker.node]}); a dead node never "
                "rejoins: start a replacement with a new node id"
            )
            self._send(peer, "fenced", reason=reason)
            self._close(peer)
            return
        if worker in self.finished:
            self._refuse(
                peer,
                f"worker (node {worker.node}, device {worker.device}) already ran and left the training: a "
                "process that comes back is a new node (a new node key)",
            )
            return
        if self._over():
            log.info("%s registered after the training ended", self._who(worker))
            self._let_go(peer)
            return
        if worker in self._alive:
            holder = self._alive[worker]
            self._refuse(
                peer,
                f"worker (node {worker.node}, device {worker.device}) is already registered by pid "
                f"{holder.pid}: give each process its own (node, device)",
            )
            return
        peer.worker, peer.pid, peer.host = worker, msg.get("pid"), msg.get("host")
        if msg.get("name"):
            self._names[worker] = str(msg["name"])
        if msg.get("can_host_standby"):
            self._standby_hosts.add(worker)
        peer.deadline = now + self.settings.heartbeat_timeout
        self._alive[worker] = peer
        self._welcome(peer)
        log.info("%s registered (pid %s)", self._who(worker), peer.pid)
        if self._current is None:
            self._maybe_start(now)
        else:
            log.info("%s is pending: it joins at the next step boundary", self._who(worker))
            self._tell_pending()
            self._release_joiners_if_over()

    def _welcome(self, peer: _Peer) -> None:
        """Welcome a registered or reconnected worker: its node id, the epoch, the detector's timeouts, and
        the standby to reconnect to should this coordinator be lost."""
        assert peer.worker is not None
        self._send(
            peer,
            "welcome",
            node=peer.worker.node,
            epoch=self.epoch,
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_timeout=self.settings.heartbeat_timeout,
            coordinator={"host": self.host, "pid": self.coordinator_pid},
        )
        if self.standby is not None:
            self._send(peer, "standby", address=self.standby, designation=self.designation)

    def _fresh_node_id(self) -> int:
        """A node id that no worker of the job ever had (a node that comes back is a new node)."""
        used = {w.node for w in self._alive} | set(self._dead_nodes) | {w.node for w in self._admitted}
        used |= {w.node for w in self._lost_before_start} | set(self._node_ids.values())
        used |= set(range(self.world_size // self.settings.devices_per_node))
        return max(used, default=-1) + 1

    def _admit(self, peer: _Peer, generation: int, nodes: int, now: float) -> None:
        """A member reached the step boundary after generation ``generation``'s commit that saw joiners:
        admit up to ``nodes`` whole pending nodes (the lowest ids first)."""
        current = self._current
        if current is None or peer.worker not in current.workers:
            return
        recovering = current.agreed_at is None and generation == current.generation - 1
        if generation != current.generation and not recovering:
            return  # it was or is being told about the newer generation
        if not self.pending:
            self._send(peer, "nothing_to_admit", generation=generation)
            return
        self._admitting = max(1, nodes)
        if self._change_at is None:  # else a change settles: its generation admits them
            self._schedule_change(now, 0.0)
            self._announce(now)

    def _tell_pending(self) -> None:
        """Tell the members how many whole nodes are pending, when that changes."""
        nodes = len({w.node for w in self.pending})
        if nodes == self._told_pending or self._current is None:
            return
        self._told_pending = nodes
        for w in self._current.workers:
            if w in self._alive:
                self._send(self._alive[w], "joiners", nodes=nodes)

    def _adopt_timeouts(self, worker: Worker, msg: dict[str, Any]) -> str | None:
        """Take the first registration's timeouts as the job's; the reason to refuse one that differs."""
        if "heartbeat_timeout" not in msg:
            return None
        wanted = Timeouts(float(msg["heartbeat_timeout"]), float(msg["agreement_timeout"]))
        if self._timeouts_from is None:
            self._timeouts_from = worker
            heartbeat, agreement = wanted
            self.settings = dataclasses.replace(
                self.settings, heartbeat_timeout=heartbeat, agreement_timeout=agreement
            )
            return None
        current = Timeouts(self.settings.heartbeat_timeout, self.settings.agreement_timeout)
        if wanted == current:
            return None
        return (
            f"worker {tuple(worker)} is configured with {wanted} but worker {tuple(self._timeouts_from)} "
            f"with {current}: give every worker of the job the same strategy configuration"
        )

    def _ready_for(self, worker: Worker, generation: int, now: float) -> None:
        current = self._current
        if current is None or generation != current.generation or worker not in current.workers:
            return  # stale: that worker has been or is being told about a newer generation
        self._ready.add(worker)
        self._maybe_go(now)

    def _suspect(self, worker: Worker, reason: str, now: float) -> None:
        peer = self._alive.get(worker)
        if peer is not None:
            log.info("%s suspected by a peer (%s): checking its liveness", self._who(worker), reason)
            peer.suspicion = reason or "communication error"
            peer.deadline = min(peer.deadline, now + 2 * self.settings.heartbeat_interval)

    def _leave(self, peer: _Peer, now: float) -> None:
        worker = peer.worker
        assert worker is not None
        log.info("%s finished", self._who(worker))
        del self._alive[worker]
        self.finished.add(worker)
        self._close(peer)
        self._maybe_go(now)
        self._release_joiners_if_over()

    def _over(self) -> bool:
        """The training is over: it started, and every member left, the last ones finished."""
        return (
            self._current is not None
            and bool(self.finished)
            and not any(w in self._admitted for w in self._alive)
        )

    def _release_joiners_if_over(self) -> None:
        """Once the last member left (finished), the training is over: the pending joiners are told so and
        let go."""
        if not self._over():
            return
        for w in [w for w in self._alive if w not in self._admitted]:
            log.info("%s was pending when the training ended", self._who(w))
            self._let_go(self._alive.pop(w))

    def _let_go(self, peer: _Peer) -> None:
        """Tell a joiner the training ended before it was admitted (pending then, or registering after)."""
        self._send(peer, "finished", reason="the training ended before this worker was admitted")
        self._close(peer)

    # ------------------------------------------------------------------ membership changes

    def _maybe_start(self, now: float) -> None:
        """Announce generation 0 once every expected worker registered or was lost."""
        if self._alive and len(self._alive) + len(self._lost_before_start) >= self.world_size:
            self._change_detected_at = now + self.wall_offset
            self._announce(now)

    def _declare_dead(
        self, worker: Worker, reason: str, now: float, registered: bool = True, explained: bool = False
    ) -> None:
        """Take ``worker``'s whole node out, fence its processes, abort the current generation.

        ``registered=False``: ``worker`` died before it registered (only before generation 0).
        ``explained``: its process is known to be gone (its connection ended), so the change is announced
        at once: its node's other processes are fenced with it, and no window is needed to see them. A
        silence waits ``settle_s``, in which the silences of a partitioned switch or rack are folded."""
        if registered and worker not in self._alive:
            return
        node = worker.node
        self._dead_nodes[node] = f"worker {tuple(worker)}: {reason}"
        at = now + self.wall_offset
        generation = self._current.generation if self._current else -1
        victims = sorted(w for w in self._alive if w.node == node)
        if not registered:
            log.warning("%s declared dead before it registered: %s", self._who(worker), reason)
            self.deaths.append(Death(worker, reason, at, generation))
        for w in victims:
            why = reason if w == worker else f"node {node} is out because worker {tuple(worker)}: {reason}"
            log.info("%s declared dead: %s", self._who(w), why)
            peer = self._alive.pop(w)
            self.deaths.append(Death(w, why, at, generation))
            self._send(peer, "fenced", reason=why)
            if (
                self.settings.kill_fenced
                and peer.pid
                and peer.host == self.host
                and not (peer.closed or peer.ended_by_peer)
            ):
                self._out.append(Kill(peer.conn, int(peer.pid)))
            self._close(peer)
        self._tell_pending()
        if self._current is None:
            self._lost_before_start |= {Worker(node, d) for d in range(self.settings.devices_per_node)}
            self._lost_before_start |= {worker, *victims}
            self._maybe_start(now)
            return
        if not set(victims) & set(self._current.workers):
            return  # a pending joiner: nothing to change, nobody to abort
        self._schedule_change(now, 0.0 if explained else self.settings.settle_s)
        for member in self._current.workers:
            if member in self._alive:
                self._send(
                    self._alive[member],
                    "abort",
                    generation=self._current.generation,
                    suspects=[list(w) for w in victims],
                    detected_at=self._change_detected_at,
                )

    def _schedule_change(self, now: float, settle_s: float) -> None:
        if self._change_at is None:
            self._change_detected_at = now + self.wall_offset
        self._change_at = min(now + settle_s, self._change_at or float("inf"))
        self._phase = Phase.SETTLING

    def _announce(self, now: float) -> None:
        """Publish the next generation: every live member, and the pending joiners when admitting, in rank
        order."""
        self._change_at = None
        nodes = sorted({w.node for w in self.pending})[: self._admitting]
        joining = {w for w in self.pending if w.node in nodes}
        self._admitting = 0
        workers = tuple(sorted(w for w in self._alive if w in self._admitted or w in joining))
        if self._current is None:  # the start: every registered worker; "removed": those lost before it
            workers = tuple(sorted(self._alive))
            removed, added = tuple(sorted(self._lost_before_start)), ()
        else:
            if not workers or (workers == self._current.workers and self._floor < self._current.generation):
                self._phase = Phase.RUNNING if self._current.agreed_at is not None else Phase.AGREEING
                self._maybe_go(now)
                return
            # Compared with what the workers run: the newest agreed generation (or everyone, at the start).
            agreed = next((m for m in reversed(self.history) if m.agreed_at is not None), None)
            previous = set(agreed.workers if agreed else self.history[0].workers + self.history[0].removed)
            removed = tuple(sorted(previous - set(workers)))
            added = tuple(sorted(set(workers) - previous))
        causes = [f"{tuple(d.worker)} {d.reason}" for d in self.deaths if d.worker in removed]
        causes += [f"{tuple(w)} left (finished)" for w in removed if w in self.finished]
        causes += [f"{tuple(w)} joined" for w in added] if self._current else ["start"]
        generation = max(self._current.generation + 1 if self._current else 0, self._floor + 1)
        settled = [m for m in self.history if m.agreed_at is not None]
        started, failures = (settled[0].agreed_at, settled[-1].failures) if settled else (None, 0)
        if settled and any(w not in self.finished for w in removed):  # start-up failures are not counted
            failures += 1
        self._current = Membership(
            generation,
            workers,
            removed,
            added,
            "; ".join(causes),
            detected_at=self._change_detected_at,
            started_at=started,
            failures=failures,
        )
        self.history.append(self._current)
        self._phase = Phase.AGREEING
        self._admitted |= set(workers)
        self._told_pending = -1
        self._ready = set()
        self._agree_deadline = now + self.settings.agreement_timeout
        log.info(
            "generation %d announced: %s (%s)", generation, [tuple(w) for w in workers], self._current.cause
        )
        for w in workers:
            self._send(self._alive[w], "announce", **self._current.to_message())
        self._tell_pending()

    def _quorate(self) -> bool:
        """At least half of each quorum set is ready (or left): always, when not isolated."""
        ready = self._ready | self.finished
        return all(2 * len(q & ready) >= len(q) for q in self._quorums)

    def _maybe_go(self, now: float) -> None:
        current = self._current
        if current is None or current.agreed_at is not None or self._change_at is not None:
            return  # nothing to agree, or a newer generation is about to be announced
        if not set(current.workers) <= self._ready | self.finished:
            return
        if not self._quorate():
            return
        self._current = dataclasses.replace(current, agreed_at=now + self.wall_offset)
        self.history[-1] = self._current
        self._phase = Phase.RUNNING
        self._agree_deadline = None
        log.info("generation %d agreed", current.generation)
        for w in current.workers:
            if w in self._alive:
                self._send(
                    self._alive[w],
                    "go",
                    generation=current.generation,
                    workers=[list(m) for m in current.workers],
                    agreed_at=self._current.agreed_at,
                )

    # ------------------------------------------------------------------ connections

    def _refuse(self, peer: _Peer, reason: str) -> None:
        log.warning("refusing a client: %s", reason)
        self._send(peer, "refused", reason=reason)
        self._close(peer)

    def _drop(self, peer: _Peer, reason: str, now: float, explained: bool = False) -> None:
        # Declared dead (and recorded) before its connection closes: whoever sees the close sees the death.
        if peer.worker is not None and self._alive.get(peer.worker) is peer:
            self._declare_dead(peer.worker, reason, now, explained=explained)
        self._close(peer)

    def _send(self, peer: _Peer, op: str, **fields: Any) -> None:
        if not peer.closed and not peer.detached:
            self._out.append(Send(peer.conn, op, fields))

    def _close(self, peer: _Peer) -> None:
        if not peer.closed:
            peer.closed = True
            del self._peers[peer.conn]
            self._out.append(Close(peer.conn))

    def _effects(self) -> list[Effect]:
        out, self._out = self._out, []
        return out


Handler = Callable[[MembershipMachine, _Peer, dict[str, Any], float], None]
_STARTED = (Phase.AGREEING, Phase.RUNNING, Phase.SETTLING)
_ALWAYS = (Phase.STARTING, *_STARTED)
_HANDLERS: dict[str, tuple[Handler, tuple[Phase, ...]]] = {
    "register": (MembershipMachine._register, _ALWAYS),
    "present": (MembershipMachine._on_present, _ALWAYS),
    "heartbeat": (MembershipMachine._on_heartbeat, _ALWAYS),
    "suspect": (MembershipMachine._on_suspect, _ALWAYS),
    "ready": (MembershipMachine._on_ready, _STARTED),  # in RUNNING: stale, ignored once its fields parse
    "admit": (MembershipMachine._on_admit, _STARTED),
    "leave": (MembershipMachine._on_leave, _STARTED),
    "reattach": (MembershipMachine._on_reattach, _ALWAYS),
    "standby_ack": (MembershipMachine._on_standby_ack, _ALWAYS),
}
MESSAGES = frozenset(_HANDLERS)
"""The messages a worker or a client may send (anything else is logged and ignored)."""
DISPATCH: dict[tuple[Phase, str], Handler] = {
    (phase, op): handler for op, (handler, phases) in _HANDLERS.items() for phase in phases
}
"""``(phase, message) -> handler``: the module's table of the messages each phase handles."""
