"""A coordinator replica: the job's membership machine and store table, as the *active* coordinator or as the
*standby* that takes over when the active one is lost, so that no node's loss ends the run.

No sockets, threads or clocks here, as in :mod:`~lightning_oobleck.recovery.membership`: :class:`Replica`
takes what happens on its connections with the time it happens and returns the effects to carry out; the
:class:`~lightning_oobleck.recovery.coordinator.Coordinator` moves the bytes, and the property tests drive
two replicas, their workers and a network that can cut any link
(``tests/recovery/test_failover_machine.py``).

**Replication.** The standby connects to the active (``follow``) and receives a snapshot of its state, then
every input the active applies to its membership machine and every write to its store table, in batches
(``replicate``, one per round of the active's service loop, an empty one at least every heartbeat interval),
and applies them to its own copies: both machines are pure, so the copies are equal. The standby
acknowledges each batch (``ack``). What the active's inputs caused (an announcement, a GO, a store answer) is
held until the batch that caused it is acknowledged: whatever a worker or a store client was told, the
standby knows. The active then tells every worker where the standby is (a *designation*, acknowledged by each
worker): a worker that loses the active reconnects to that standby only.

**Failover.** The standby takes over (*promotes*, epoch + 1) when its link to the active

* ends without a word (closed or reset by the other host: the active's process is gone) while the standby
  is in step with it: at once, unless the active was isolated (below) and no quorum had yet acknowledged
  this standby: its predecessor may still be elected, so this one collects votes like a candidate;
* falls silent for a heartbeat timeout: it becomes a *candidate* and takes over once the workers of more than
  half of the newest generation it knows voted for it (also if the link then ends: the active may have
  decided alone meanwhile, and only the votes tell what). A worker votes by reconnecting (``reattach``),
  which it does only once it lost the active itself, and it never speaks to the lost one again.

On promotion every live worker gets a heartbeat timeout to reconnect, those of the lost coordinator's node
(most likely lost with it) two heartbeat intervals; a worker that does not is declared dead
(:meth:`~lightning_oobleck.recovery.membership.MembershipMachine.take_over`). A new standby is then asked of a
worker on another node (``host_standby``), which starts one.

**No split brain.** The active that loses its standby to silence cannot tell a crash from a partition, so it
is *isolated* (:meth:`~lightning_oobleck.recovery.membership.MembershipMachine.isolate`): a GO then needs at
least half of each generation the standby may know as its newest to be ready. Two sets of more than half and
at least half of one set intersect in a worker, which either voted first (and is never ready here again) or
was ready first (and its vote tells the candidate the generation, which it numbers past). So at most one of
them decides, and generation numbers only grow. Isolation ends once at least half of each of these sets
acknowledged a new standby: the old one can no longer collect more than half. A standby dismissed
(``dismissed``), deposed (``deposed``) or told the job finished (``finished``) exits: an active never closes
its link without one of these, so a link that ends without one is the other process's death.

Roles and what moves them:

============  ==========================  ==========================  ==========================
event         ACTIVE                      STANDBY                     CANDIDATE
============  ==========================  ==========================  ==========================
follow        attach (snapshot); one at   -                           -
              a time
ack           release held effects; the   -                           -
              first: designate it
link silent   dismiss it, isolate,        CANDIDATE                   -
              release held effects
link ends     release held effects        promote at once (a          keep counting votes
                                          CANDIDATE if the active
                                          was isolated)
reattach      the machine's               hold the vote (fenced if    count the vote; promote on
                                          the active declared it      more than half of the
                                          dead)                       newest generation
register,     the machine's               redirect: not the active    redirect
hello
dismissed,    -                           ENDED (exit)                ENDED
finished
============  ==========================  ==========================  ==========================
"""

from __future__ import annotations

import base64
import enum
import hmac
import logging
import pickle
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lightning_oobleck.recovery.keytable import WRITES, KeyTable
from lightning_oobleck.recovery.membership import Close, Effect, Kill, MembershipMachine, Send
from lightning_oobleck.worker import Worker

log = logging.getLogger(__name__)


class Role(enum.Enum):
    ACTIVE = "active"
    """Serves the workers and the store; replicates to its standby."""
    STANDBY = "standby"
    """Follows an active replica; holds the votes of workers that lost it."""
    CANDIDATE = "candidate"
    """Lost its active to silence: promotes once more than half of the newest generation voted for it."""
    ENDED = "ended"
    """Dismissed, deposed or done: its process exits."""


@dataclass(frozen=True)
class Answer:
    """Send the store's answer ``fields`` (one JSON object) on connection ``conn``."""

    conn: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class Replicas:
    """The job's replicas changed: ``addresses``, the active first (for the join file)."""

    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Exit:
    """This replica's part is over (``reason``): its process ends."""

    reason: str


ReplicaEffect = Effect | Answer | Replicas | Exit


class _Kind(enum.Enum):
    NEW = "new"
    WORKER = "worker"
    STORE = "store"
    LAUNCHER = "launcher"
    FOLLOWER = "follower"
    LEADER = "leader"
    VOTER = "voter"


@dataclass(frozen=True)
class ReplicaSettings:
    """How a replica finds and keeps its partner."""

    standby: bool = True
    """Whether the active asks a worker of another node to host a standby."""
    loopback: bool = False
    """Standbys listen on the loopback interface only (every process of a local run is on one machine)."""
    host_timeout_s: float = 30.0
    """How long a worker asked to host the standby may take before another is asked."""
    candidate_timeout_s: float = 120.0
    """How long a candidate waits for votes before it gives up (the workers have then given up too)."""
    join_file: str | None = None
    """The file that tells joiners where the replicas are (kept current by the active)."""


@dataclass
class _Held:
    seq: int
    generation: int
    """The newest generation when the batch was sent (what the standby knows once it acknowledges it)."""
    effects: list[ReplicaEffect] = field(default_factory=list)


class Replica:
    """One replica's logic (module docstring); each event method queues effects, :meth:`flush` returns them.

    ``machine``: the membership machine (a standby's is replaced by the active's snapshot); ``address``: where
    this replica's workers and store clients reach it; ``node``: the job's node it runs on (``None``: a
    machine that is no worker node, e.g. a local launcher's), declared lost with it; ``wall_offset``: this
    host's wall clock minus its monotonic clock."""

    def __init__(
        self,
        machine: MembershipMachine,
        *,
        secret: str | None,
        address: str,
        node: int | None = None,
        role: Role = Role.ACTIVE,
        settings: ReplicaSettings | None = None,
        wall_offset: float = 0.0,
        host: str = "",
        pid: int | None = None,
    ) -> None:
        if role not in (Role.ACTIVE, Role.STANDBY):
            raise ValueError(f"a replica starts active or standby, not {role.value}")
        self.machine = machine
        self.table = KeyTable()
        self.secret = secret
        self.address = address
        self.node = node
        self.role = role
        self.settings = settings or ReplicaSettings()
        self.wall_offset = wall_offset
        self.host, self.pid = host, pid
        self.promoted_at: float | None = None
        """When (this host's monotonic clock) this replica took over, if it did."""
        self._kinds: dict[int, _Kind] = {}
        self._new: dict[int, float] = {}
        self._out: list[ReplicaEffect] = []
        """Effects of this round's inputs: held until the standby has the inputs."""
        self._now: list[ReplicaEffect] = []
        """Effects that need no replication (the link's own messages, refusals)."""
        self._log: list[list[Any]] = []
        # active: the standby following it
        self._follower: int | None = None
        self._follower_address: str | None = None
        self._seq = 0
        self._held: deque[_Held] = deque()
        self._acked_generation = -1
        self._designated = False
        self._link_heard = 0.0
        self._link_sent = 0.0
        self._host_request: tuple[Worker, float] | None = None
        self._asked: set[Worker] = set()
        # standby: the active it follows, the votes
        self._leader: int | None = None
        self._leader_node: int | None = None
        self._votes: dict[Worker, tuple[int, dict[str, Any]]] = {}
        self._quorum: frozenset[Worker] = frozenset()
        self._candidate_until = 0.0
        self._synced = False
        """Whether the active's snapshot came: before it, this standby knows nothing to take over with."""

    # ------------------------------------------------------------------ state

    @property
    def replicas(self) -> tuple[str, ...]:
        """Where the job's replicas are, this one first: an active's standby follows it."""
        return (self.address,) + ((self._follower_address,) if self._follower_address else ())

    @property
    def following(self) -> bool:
        """Whether a standby follows this (active) replica."""
        return self._follower is not None

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must run next."""
        deadlines = list(self._new.values())
        if self.role is Role.ACTIVE:
            deadlines += [
                t for t in (self.machine.next_deadline(), self.table.next_deadline) if t is not None
            ]
            if self._follower is not None:
                deadlines += [self._link_sent + self._interval, self._link_heard + self._timeout]
            if self._host_request is not None:
                deadlines.append(self._host_request[1])
        elif self.role is Role.STANDBY:
            deadlines.append(self._link_heard + self._timeout)
        elif self.role is Role.CANDIDATE:
            deadlines.append(self._candidate_until)
        return min(deadlines, default=None)

    @property
    def _timeout(self) -> float:
        return self.machine.settings.heartbeat_timeout

    @property
    def _interval(self) -> float:
        return self.machine.settings.heartbeat_interval

    # ------------------------------------------------------------------ events

    def connected(self, conn: int, now: float) -> None:
        """A client connected: it says what it is in its first message."""
        self._kinds[conn] = _Kind.NEW
        self._new[conn] = now + self.machine.settings.registration_timeout

    def follow(self, conn: int, now: float) -> None:
        """(Standby) the connection ``conn`` to the active replica is open: ask it for the stream."""
        self._kinds[conn] = _Kind.LEADER
        self._leader, self._link_heard = conn, now
        self._now.append(
            Send(conn, "follow", {"secret": self.secret, "address": self.address, "node": self.node})
        )

    def received(self, conn: int, msg: dict[str, Any], now: float) -> None:
        """A message arrived on ``conn``."""
        kind = self._kinds.get(conn)
        if kind is _Kind.NEW:
            del self._new[conn]
            self._first(conn, msg, now)
        elif kind is _Kind.WORKER:
            self._apply("received", conn, msg, now)
        elif kind is _Kind.STORE:
            self._store(conn, msg, now)
        elif kind is _Kind.FOLLOWER:
            self._from_follower(msg, now)
        elif kind is _Kind.LEADER:
            self._from_leader(msg, now)
        elif kind is _Kind.LAUNCHER:
            self.exited(Worker(int(msg["node"]), int(msg["device"])), str(msg["reason"]), now)

    def exited(self, worker: Worker, reason: str, now: float) -> None:
        """(Active) the launcher saw ``worker``'s process end (it matters before it registered)."""
        if self.role is Role.ACTIVE:
            self._apply("exited", list(worker), reason, now)

    def ended(self, conn: int, reason: str, now: float, by_peer: bool = True) -> None:
        """``conn`` ended: closed or reset by the other side (``by_peer``), or unusable."""
        kind = self._kinds.pop(conn, None)
        self._new.pop(conn, None)
        if kind is _Kind.WORKER:
            self._apply("ended", conn, reason, now, by_peer)
        elif kind is _Kind.STORE:
            self.table.forget(conn)
        elif kind is _Kind.FOLLOWER and conn == self._follower:
            self._lose_follower(now, f"its link ended ({reason})", silent=False)
        elif kind is _Kind.LEADER and conn == self._leader:
            self._leader = None
            if not self._synced:
                self._end(f"the active coordinator's link ended ({reason}) before its state came")
            elif self.role is Role.STANDBY and self.machine.isolated:
                # designated by an active cut off from its previous standby, and not yet acknowledged by the
                # quorum that ends that: the previous standby may still be elected, so only votes tell
                log.warning(
                    "the active coordinator's link ended (%s) before a quorum acknowledged this standby: "
                    "collecting votes",
                    reason,
                )
                self._stand(now)
            elif self.role is Role.STANDBY:
                log.warning("the active coordinator's link ended (%s): its process is gone", reason)
                self._promote(now)
            # a candidate's active fell silent first: it may have decided alone since; only votes tell
        elif kind is _Kind.VOTER:
            self._votes = {w: v for w, v in self._votes.items() if v[0] != conn}

    def tick(self, now: float) -> None:
        """Fire every timer due at ``now``."""
        for conn in [c for c, deadline in self._new.items() if deadline <= now]:
            del self._new[conn]
            self._kinds.pop(conn, None)
            self._now.append(Close(conn))
        if self.role is Role.ACTIVE:
            due = self.machine.next_deadline()
            if due is not None and due <= now:
                self._apply("tick", now)
                if self.machine.abandoned:
                    self._end("cut off from more than half of the job's workers: gave up")
                    return
            self._out += [Answer(c, a) for c, a in self.table.expire(now)]
            if self._follower is not None and now - self._link_heard > self._timeout:
                self._lose_follower(now, f"it sent nothing for {now - self._link_heard:.1f} s", silent=True)
            self._ask_for_standby(now)
        elif self.role is Role.STANDBY and not self._synced and now - self._link_heard > self._timeout:
            self._end("the active coordinator sent no state")
        elif self.role is Role.STANDBY and now - self._link_heard > self._timeout:
            log.warning(
                "the active coordinator sent nothing for %.1f s: collecting votes", now - self._link_heard
            )
            self._stand(now)
        elif self.role is Role.CANDIDATE and now >= self._candidate_until:
            self._end(f"no quorum voted for this standby within {self.settings.candidate_timeout_s:g} s")

    def flush(self, now: float) -> list[ReplicaEffect]:
        """The effects to carry out now: this round's inputs go to the standby, and what they caused waits
        for its acknowledgement (an empty batch at least every heartbeat interval keeps the link alive)."""
        out, self._now = self._now, []
        if self.role is Role.ACTIVE and self._follower is not None:
            if self._log or now - self._link_sent >= self._interval:
                self._seq += 1
                out.append(Send(self._follower, "replicate", {"seq": self._seq, "events": self._log}))
                current = self.machine.current
                self._held.append(_Held(self._seq, current.generation if current else -1, self._out))
                self._link_sent = now
            elif self._held:
                self._held[-1].effects += self._out
            else:
                out += self._out
        else:
            out += self._out
        self._out, self._log = [], []
        return out

    # ------------------------------------------------------------------ first messages

    def _first(self, conn: int, msg: dict[str, Any], now: float) -> None:
        op = msg.get("op")
        active = self.role is Role.ACTIVE
        if op not in ("register", "present", "reattach", "hello", "exited", "follow"):
            self._refuse(conn, f"the first message must name what the client is, got {op!r}")
        elif not self._authentic(conn, msg, store=op == "hello"):
            return  # nothing else is said to a stranger, not even what this replica is
        elif op in ("register", "present") or (op == "reattach" and active):
            if not active:
                self._redirect(conn, "this replica is the standby coordinator, not the active one")
                return
            self._kinds[conn] = _Kind.WORKER
            self._apply("connected", conn, now)
            self._apply("received", conn, msg, now)
        elif op == "reattach":
            self._vote(conn, msg, now)
        elif op == "hello":
            if not active:
                self._now += [
                    Answer(conn, {"error": "not the active coordinator", "redirect": True}),
                    Close(conn),
                ]
                return
            self._kinds[conn] = _Kind.STORE
            self._now.append(
                Answer(conn, {"ok": True, "epoch": self.machine.epoch, "replicas": self.replicas})
            )
        elif not active:
            self._refuse(conn, f"{op!r} is for the active coordinator; this replica is {self.role.value}")
        elif op == "exited":
            self._kinds[conn] = _Kind.LAUNCHER
            self.received(conn, msg, now)
        else:
            self._attach(conn, msg, now)

    def _authentic(self, conn: int, msg: dict[str, Any], store: bool = False) -> bool:
        if self.secret is None or hmac.compare_digest(str(msg.get("secret", "")), self.secret):
            return True
        reason = "the job's secret is missing or wrong: this coordinator serves one job only"
        if store:
            self._now += [Answer(conn, {"error": f"refused: {reason}"}), Close(conn)]
        else:
            self._refuse(conn, reason)
        return False

    def _refuse(self, conn: int, reason: str) -> None:
        """Refuse a client that said nothing valid yet: in words both a worker and a store client read."""
        log.warning("refusing a client: %s", reason)
        self._kinds.pop(conn, None)
        self._new.pop(conn, None)
        self._now += [Send(conn, "refused", {"reason": reason, "error": f"refused: {reason}"}), Close(conn)]

    def garbage(self, conn: int, why: str, now: float) -> None:
        """``conn`` sent what no client of the job sends (not a JSON object, an endless line)."""
        if self._kinds.get(conn) is _Kind.NEW:
            self._refuse(conn, f"not a message of this job ({why})")
        else:
            self.ended(conn, f"it sent garbage ({why})", now, by_peer=False)
            self._now.append(Close(conn))

    def _redirect(self, conn: int, reason: str) -> None:
        self._kinds.pop(conn, None)
        self._now += [Send(conn, "redirect", {"reason": reason}), Close(conn)]

    # ------------------------------------------------------------------ active

    def _apply(self, name: str, *args: Any) -> None:
        """Apply an input to the membership machine and log it for the standby (``args`` are JSON values)."""
        self._log.append([name, *args])
        self._out += _call(self.machine, name, args)

    def _store(self, conn: int, msg: dict[str, Any], now: float) -> None:
        answers = self.table.request(conn, msg, now)
        if msg.get("op") in WRITES and answers and "error" not in answers[0][1]:
            self._log.append(["store", msg, now])
        self._out += [Answer(c, a) for c, a in answers]

    def _attach(self, conn: int, msg: dict[str, Any], now: float) -> None:
        if self._follower is not None:
            self._refuse(conn, "a standby follows this coordinator already")
            return
        self._kinds[conn] = _Kind.FOLLOWER
        self._follower, self._follower_address = conn, str(msg["address"])
        self._link_heard = self._link_sent = now
        self._host_request = None
        # the snapshot holds every input so far: the log starts after it, and nothing before it is held
        self._now += self._out
        self._out, self._log = [], []
        self._seq += 1
        state = base64.b64encode(pickle.dumps((self.machine, self.table))).decode()
        self._now.append(Send(conn, "snapshot", {"seq": self._seq, "state": state, "node": self.node}))
        current = self.machine.current
        self._held.append(_Held(self._seq, current.generation if current else -1))
        self._designated = False
        log.info("standby %s follows (node %s)", self._follower_address, msg.get("node"))

    def _from_follower(self, msg: dict[str, Any], now: float) -> None:
        self._link_heard = now
        if msg.get("op") == "deposed":  # this one was silent (stopped, cut off) and its standby took over
            self._end(f"deposed: {msg.get('reason')}")
            return
        if msg.get("op") != "ack":
            return
        seq = int(msg["seq"])
        while self._held and self._held[0].seq <= seq:
            held = self._held.popleft()
            self._acked_generation = held.generation
            self._now += held.effects
        if not self._designated and self._follower_address is not None:
            self._designated = True
            self._apply("designate", self._follower_address, now)
            self._now.append(Replicas(self.replicas))

    def _lose_follower(self, now: float, reason: str, silent: bool) -> None:
        """The standby is lost: ``silent`` (it may be alive, cut off) isolates this coordinator; an ended
        link means its process is gone. What its acknowledgement held is released, except a GO the quorum
        rule withdraws."""
        conn, self._follower, self._follower_address = self._follower, None, None
        assert conn is not None
        self._kinds.pop(conn, None)
        held = [effect for batch in self._held for effect in batch.effects]
        self._held.clear()
        # at the end of the training the workers (and the standby one of them started) leave: expected
        (log.info if self.machine.finished else log.warning)("lost the standby coordinator: %s", reason)
        if silent:
            self._now += [
                Send(conn, "dismissed", {"reason": f"the active coordinator lost it: {reason}"}),
                Close(conn),
            ]
            since = self._acked_generation
            quorums = [sorted(m.workers) for m in self.machine.history if m.generation >= since]
            current = self.machine.current
            generation = current.generation if current is not None else -1
            revoke = any(_is_go(e, generation) for e in held)
            self._apply("isolate", [[list(w) for w in q] for q in quorums], revoke, now)
            agreed = (
                current is not None and self.machine.current is not None and self.machine.current.agreed_at
            )
            held = [e for e in held if not (_is_go(e) and (_go_of(e) < generation or not agreed))]
        else:
            self._now.append(Close(conn))
        self._now += held
        self._now.append(Replicas(self.replicas))
        self._host_request = None

    def _ask_for_standby(self, now: float) -> None:
        """Ask a worker of another node to start a standby, when none follows (and none was just asked)."""
        machine = self.machine
        if not self.settings.standby or self._follower is not None or machine.current is None:
            return
        if (
            machine.finished
            or machine.done
            or (self._host_request is not None and now < self._host_request[1])
        ):
            return
        hosts = {}
        for worker in machine.alive:
            other_node = worker.node != self.node and worker.node not in hosts
            if other_node and worker in machine.current.workers and machine.can_host_standby(worker):
                hosts[worker.node] = worker
        choices = [w for w in hosts.values() if w not in self._asked] or list(hosts.values())
        if not choices:
            return
        worker = choices[0]
        conn = machine.connection_of(worker)
        if conn is None:
            return
        self._asked.add(worker)
        self._host_request = (worker, now + self.settings.host_timeout_s)
        fields = {
            "follow": self.address,
            "loopback": self.settings.loopback,
            "join_file": self.settings.join_file,
        }
        self._out.append(Send(conn, "host_standby", fields))
        log.info("asked worker %s to host a standby coordinator", tuple(worker))

    # ------------------------------------------------------------------ standby

    def _from_leader(self, msg: dict[str, Any], now: float) -> None:
        self._link_heard = now
        op = msg.get("op")
        if op == "snapshot":
            self.machine, self.table = pickle.loads(base64.b64decode(msg["state"]))
            self.table.waiters = []  # the active's clients' waits: they ask again if it is lost
            self._leader_node = msg.get("node")
            self._synced = True
        elif op == "replicate":
            for event in msg["events"]:
                if event[0] == "store":
                    self.table.request(-1, event[1], event[2])
                else:
                    _call(self.machine, event[0], event[1:])
        elif op in ("dismissed", "finished", "deposed"):
            why = msg.get("reason", "the training ended")
            self._end(f"{op} by the active coordinator: {why}", expected=op == "finished")
            return
        else:
            return
        assert self._leader is not None
        self._now.append(Send(self._leader, "ack", {"seq": msg["seq"]}))
        for worker, (conn, _) in list(self._votes.items()):
            if (why := self.machine.dead_node_reason(worker.node)) is not None:
                del self._votes[worker]
                self._now += [
                    Send(conn, "fenced", {"reason": f"node {worker.node} was declared dead ({why})"}),
                    Close(conn),
                ]

    def _vote(self, conn: int, msg: dict[str, Any], now: float) -> None:
        worker = Worker(int(msg["node"]), int(msg["device"]))
        self._kinds[conn] = _Kind.VOTER
        if (old := self._votes.get(worker)) is not None:
            self._now.append(Close(old[0]))
        self._votes[worker] = (conn, msg)
        log.info("worker %s lost the active coordinator and voted for this standby", tuple(worker))
        if self.role is Role.CANDIDATE:
            self._count_votes(now)

    def _stand(self, now: float) -> None:
        """Become a candidate: take over once the workers of more than half of the newest generation this
        standby knows voted for it."""
        self.role = Role.CANDIDATE
        current = self.machine.current
        self._quorum = frozenset(current.workers) if current is not None else frozenset()
        self._candidate_until = now + self.settings.candidate_timeout_s
        self._count_votes(now)

    def _count_votes(self, now: float) -> None:
        if 2 * len(self._quorum & self._votes.keys()) > len(self._quorum):
            log.warning(
                "%d of %d workers voted for this standby: taking over", len(self._votes), len(self._quorum)
            )
            self._promote(now)

    def _promote(self, now: float) -> None:
        """Take over as the active coordinator (epoch + 1): the votes become the first reconnections."""
        self.role, self.promoted_at = Role.ACTIVE, now
        window = self.machine.settings.heartbeat_timeout
        self._out += self.machine.take_over(
            now,
            wall_offset=self.wall_offset,
            window=window,
            lost_node=self._leader_node,
            host=self.host,
            pid=self.pid,
        )
        if self._leader is not None:  # a silent active: should it wake up, it learns it was deposed
            self._now += [
                Send(self._leader, "deposed", {"reason": "a standby took over"}),
                Close(self._leader),
            ]
            self._kinds.pop(self._leader, None)
            self._leader = None
        for _, (conn, msg) in sorted(self._votes.items()):
            self._kinds[conn] = _Kind.WORKER
            self._apply("connected", conn, now)
            self._apply("received", conn, msg, now)
        self._votes.clear()
        self._log.clear()  # no standby has seen the state before: a new one gets a snapshot
        self._now.append(Replicas(self.replicas))

    def _end(self, reason: str, expected: bool = False) -> None:
        (log.info if expected else log.warning)("coordinator replica ends: %s", reason)
        self.role = Role.ENDED
        for conn, _ in self._votes.values():
            self._now += [
                Send(conn, "refused", {"reason": f"the standby coordinator ended: {reason}"}),
                Close(conn),
            ]
        self._votes.clear()
        self._now.append(Exit(reason))

    # ------------------------------------------------------------------ the end

    def training_done(self, now: float) -> list[ReplicaEffect]:
        """(Active) no worker is left: the store records how many of the job's workers finished
        (:data:`FINISHED_KEY`), for its tasks' last words, and a standby following it ends."""
        count = str(self.machine.finished_launched).encode()
        self._store(-1, {"op": "set", "key": FINISHED_KEY, "value": base64.b64encode(count).decode()}, now)
        return self.finish()

    @property
    def tasks_ended(self) -> bool:
        """Whether every worker the job launched that finished said it is done with the store."""
        data = self.table.data
        return FINISHED_KEY in data and int(data.get(ENDED_KEY, b"0")) >= int(data[FINISHED_KEY])

    def finish(self) -> list[ReplicaEffect]:
        """The training ended (or this replica is stopped): a standby following it must end, not take over."""
        if self._follower is not None:
            held = [effect for batch in self._held for effect in batch.effects]
            self._held.clear()
            self._now += [*held, Send(self._follower, "finished", {}), Close(self._follower)]
            self._follower = None
        return self.flush(float("inf"))


FINISHED_KEY = "oobleck/job/finished"
"""Written by the active coordinator once no worker is left: how many of the workers the job launched
finished (the job's tasks count themselves against it at their end, :mod:`lightning_oobleck.slurm.task`)."""
ENDED_KEY = "oobleck/job/ended"
"""Each of the job's tasks adds 1 once it is done with the store (its result written)."""


def _call(machine: MembershipMachine, name: str, args: list[Any] | tuple[Any, ...]) -> list[Effect]:
    """Apply the logged input ``[name, *args]`` (JSON values) to ``machine``; its effects."""
    if name == "exited":
        return machine.exited(Worker(*args[0]), args[1], args[2])
    if name == "isolate":
        quorums = [frozenset(Worker(*w) for w in q) for q in args[0]]
        return machine.isolate(quorums, args[1], args[2])
    if name in ("connected", "received", "ended", "tick", "designate"):
        return getattr(machine, name)(*args)
    raise ValueError(f"not a replicated input: {name!r}")


def _is_go(effect: ReplicaEffect, generation: int | None = None) -> bool:
    return (
        isinstance(effect, Send)
        and effect.op == "go"
        and (generation is None or effect.fields["generation"] == generation)
    )


def _go_of(effect: ReplicaEffect) -> int:
    assert isinstance(effect, Send)
    return int(effect.fields["generation"])


__all__ = [
    "Answer",
    "Close",
    "Exit",
    "Kill",
    "Replica",
    "ReplicaEffect",
    "ReplicaSettings",
    "Replicas",
    "Role",
    "Send",
]
