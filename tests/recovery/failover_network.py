"""A simulated job for the coordinator replicas' protocol, without sockets: real
:class:`~lightning_oobleck.recovery.replica.Replica` objects, model workers that behave as
:class:`~lightning_oobleck.recovery.agent.WorkerAgent` does (register, answer every announcement, heartbeat,
acknowledge designations, vote for the designated standby once the active is lost), and a network of
connections between hosts whose links a test can cut (messages wait, as TCP retransmits them, until the link
heals) and whose processes it can kill (their connections end, after what they sent).

Every GO a replica sends is recorded with the time it left: the invariants of the tests are read off
:attr:`Network.decisions` and the workers' :attr:`ModelWorker.accepted`.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lightning_oobleck.recovery.membership import MembershipMachine, MembershipSettings
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.replica import (
    Answer,
    Close,
    Exit,
    Kill,
    Replica,
    Replicas,
    ReplicaSettings,
    Role,
    Send,
)
from lightning_oobleck.worker import Worker

SECRET = "s"
HEARTBEAT = 1.0


@dataclass
class Connection:
    """Two ends, each (owner, local id); messages in flight per direction, in order."""

    ends: tuple[Any, Any]
    ids: tuple[int, int]
    queues: tuple[deque, deque] = field(default_factory=lambda: (deque(), deque()))
    """queues[i]: what end i sent, for the other end."""
    closed: list[bool] = field(default_factory=lambda: [False, False])
    """closed[i]: end i closed it (its FIN follows what it sent)."""
    delivered_end: list[bool] = field(default_factory=lambda: [False, False])


@dataclass
class ModelWorker:
    worker: Worker
    host: str
    alive: bool = True
    conn: Connection | None = None
    attached: bool = False
    epoch: int = 0
    standby: str | None = None
    announced: Membership | None = None
    agreed: int = -1
    last_heard: float = 0.0
    next_heartbeat: float = 0.0
    voting: Connection | None = None
    lost: str | None = None
    fenced: str | None = None
    accepted: list[tuple[int, tuple[Worker, ...]]] = field(default_factory=list)
    responsive: bool = True


class Network:
    """The job: replicas ``R0`` (active) and ``R1`` (its standby), and ``nodes`` x ``devices`` workers."""

    def __init__(
        self,
        nodes: int,
        devices: int = 1,
        *,
        active_node: int | None = None,
        standby_node: int = 1,
        more_standbys: bool = True,
    ) -> None:
        self.now = 0.0
        self.settings = MembershipSettings(
            heartbeat_timeout=HEARTBEAT, settle_s=0.1, agreement_timeout=30.0, devices_per_node=devices
        )
        self.ids = itertools.count(1)
        self.connections: list[Connection] = []
        self.replicas: dict[str, Replica] = {}
        self.hosts: dict[str, str] = {}
        """Replica name -> its host."""
        self.dead: set[str] = set()
        """Dead processes: replica names and worker reprs."""
        self.cut: set[frozenset[str]] = set()
        self.decisions: list[tuple[float, str, int, tuple[Worker, ...]]] = []
        """Every GO sent: (time, replica, generation, members)."""
        self.exits: dict[str, str] = {}
        self.writes: dict[int, str] = {}
        """A store connection's replica-side id -> the key it writes."""
        self.acknowledged: list[tuple[str, str, int, bool]] = []
        """Every store write answered: (key, replica, its epoch, whether it was isolated)."""
        self.more_standbys = more_standbys
        self.workers = {
            Worker(n, d): ModelWorker(Worker(n, d), f"node{n}") for n in range(nodes) for d in range(devices)
        }
        self._start_replica("R0", None if active_node is None else f"node{active_node}", active_node, None)
        self._start_replica("R1", f"node{standby_node}", standby_node, "R0")
        for model in self.workers.values():
            model.conn = self._connect(model, "R0")
            self._send_from(model, model.conn, "register", node=model.worker.node, device=model.worker.device,
                            pid=0, host=model.host, secret=SECRET, can_host_standby=True)  # fmt: skip

    # ------------------------------------------------------------------ processes

    def _start_replica(self, name: str, host: str | None, node: int | None, follow: str | None) -> None:
        machine = MembershipMachine(len(self.workers), self.settings, secret=SECRET, host="nowhere")
        role = Role.STANDBY if follow else Role.ACTIVE
        settings = ReplicaSettings(standby=self.more_standbys)
        self.replicas[name] = Replica(
            machine, secret=SECRET, address=name, node=node, role=role, settings=settings
        )
        self.hosts[name] = host or f"host-{name}"
        if follow is not None:
            conn = self._connect(name, follow)
            self.replicas[name].follow(self._id(conn, name), self.now)
            self._flush(name)

    def _host(self, end: Any) -> str:
        return end.host if isinstance(end, ModelWorker) else self.hosts[end]

    def _alive(self, end: Any) -> bool:
        return end.alive if isinstance(end, ModelWorker) else end not in self.dead

    def _connect(self, client: Any, replica: str) -> Connection:
        conn = Connection((client, replica), (next(self.ids), next(self.ids)))
        self.connections.append(conn)
        if replica in self.dead:
            conn.closed[1] = True
        else:
            self.replicas[replica].connected(conn.ids[1], self.now)
            self._flush(replica)
        return conn

    def _id(self, conn: Connection, end: Any) -> int:
        return conn.ids[0] if conn.ends[0] is end else conn.ids[1]

    def _conn_of(self, replica: str, local: int) -> Connection | None:
        for conn in self.connections:
            for i in (0, 1):
                if conn.ends[i] == replica and conn.ids[i] == local:
                    return conn
        return None

    def _send_from(self, end: Any, conn: Connection, op: str, **fields: Any) -> None:
        i = 0 if conn.ends[0] is end else 1
        if not conn.closed[i]:
            conn.queues[i].append({"op": op, **fields})

    def _close_from(self, end: Any, conn: Connection) -> None:
        conn.closed[0 if conn.ends[0] is end else 1] = True

    def _flush(self, name: str) -> None:
        if name in self.dead:
            return
        replica = self.replicas[name]
        for effect in replica.flush(self.now):
            conn = self._conn_of(name, effect.conn) if not isinstance(effect, Replicas | Exit) else None
            if isinstance(effect, Send):
                if effect.op == "go":
                    fields = effect.fields
                    members = tuple(Worker(*w) for w in fields["workers"])
                    self.decisions.append((self.now, name, fields["generation"], members))
                if effect.op == "host_standby" and self.more_standbys and conn is not None:
                    host = conn.ends[0]
                    self._host_standby(host, name)
                if conn is not None:
                    self._send_from(name, conn, effect.op, **effect.fields)
            elif isinstance(effect, Answer) and conn is not None:
                conn.queues[1].append(effect.fields)
                if (key := self.writes.get(id(conn))) is not None and effect.fields == {}:
                    self.acknowledged.append((key, name, replica.machine.epoch, replica.machine.isolated))
            elif isinstance(effect, Close) and conn is not None:
                self._close_from(name, conn)
            elif isinstance(effect, Exit):
                self.exits[name] = effect.reason
                self.kill_replica(name)
            elif isinstance(effect, Kill):
                pass  # no process behind a model worker's pid

    def _host_standby(self, host: ModelWorker, follow: str) -> None:
        name = f"R{len(self.replicas)}"
        if len(self.replicas) < 5 and host.alive:
            self._start_replica(name, host.host, host.worker.node, follow)

    def kill_replica(self, name: str) -> None:
        """Its process ends: every connection of its ends (after what it sent)."""
        if name in self.dead:
            return
        self.dead.add(name)
        for conn in self.connections:
            for i in (0, 1):
                if conn.ends[i] == name:
                    conn.closed[i] = True

    def kill_node(self, node: int) -> None:
        """``node`` crashes: every process of it ends (its workers and a replica it hosts), and what they
        had not sent yet is lost with the machine."""
        host = f"node{node}"
        for conn in self.connections:
            for i in (0, 1):
                if self._host(conn.ends[i]) == host:
                    conn.queues[i].clear()
        for model in self.workers.values():
            if model.worker.node == node:
                self._kill_worker(model)
        for name, where in self.hosts.items():
            if where == host:
                self.kill_replica(name)

    def write(self, worker: Worker, key: str) -> None:
        """``worker`` sets ``key`` in the job's store, on a connection of its own to its coordinator."""
        model = self.workers[worker]
        if not model.alive or model.conn is None or not model.attached:
            return
        conn = self._connect(model, model.conn.ends[1])
        self.writes[id(conn)] = key
        self._send_from(model, conn, "hello", secret=SECRET)
        self._send_from(model, conn, "set", key=key, value="MQ==", cid=f"{worker}", seq=len(self.writes))

    def split(self, rng: random.Random) -> None:
        """Cut the hosts into two random sides."""
        hosts = sorted({*self.hosts.values(), *(m.host for m in self.workers.values())})
        side = {h for h in hosts if rng.random() < 0.5}
        for a in side:
            for b in set(hosts) - side:
                self.partition(a, b)

    def _kill_worker(self, model: ModelWorker) -> None:
        if not model.alive:
            return
        model.alive = False
        for conn in self.connections:
            if model in conn.ends:
                self._close_from(model, conn)

    def partition(self, a: str, b: str) -> None:
        self.cut.add(frozenset((a, b)))

    def heal(self) -> None:
        self.cut.clear()

    def isolate_host(self, host: str) -> None:
        """Cut ``host`` from every other host."""
        for other in {*self.hosts.values(), *(m.host for m in self.workers.values())} - {host}:
            self.partition(host, other)

    # ------------------------------------------------------------------ moving messages

    def _link_up(self, conn: Connection) -> bool:
        return frozenset((self._host(conn.ends[0]), self._host(conn.ends[1]))) not in self.cut or (
            self._host(conn.ends[0]) == self._host(conn.ends[1])
        )

    def deliverable(self) -> list[tuple[Connection, int]]:
        """(connection, sending end) pairs with something to deliver now."""
        ready = []
        for conn in self.connections:
            if not self._link_up(conn):
                continue
            for i in (0, 1):
                if conn.queues[i] or (conn.closed[i] and not conn.delivered_end[i]):
                    ready.append((conn, i))
        return ready

    def deliver(self, conn: Connection, i: int) -> None:
        """Deliver end ``i``'s next message (or its close) to the other end."""
        receiver, local = conn.ends[1 - i], conn.ids[1 - i]
        if conn.queues[i]:
            msg = conn.queues[i].popleft()
            if not self._alive(receiver) or conn.closed[1 - i]:
                return
            if isinstance(receiver, ModelWorker):
                self._worker_receives(receiver, conn, msg)
            else:
                self.replicas[receiver].received(local, msg, self.now)
                self._flush(receiver)
            return
        conn.delivered_end[i] = True
        if not self._alive(receiver) or conn.closed[1 - i]:
            return
        if isinstance(receiver, ModelWorker):
            if id(conn) not in self.writes:
                self._worker_loses(receiver, conn, "the connection closed")
        else:
            self.replicas[receiver].ended(local, "closed", self.now)
            self._flush(receiver)

    def settle(self, rng: random.Random | None = None, limit: int = 10_000) -> None:
        """Deliver everything deliverable: in a fixed order, or in ``rng``'s."""
        for _ in range(limit):
            ready = self.deliverable()
            if not ready:
                return
            self.deliver(*(rng.choice(ready) if rng is not None else ready[0]))
        raise AssertionError("the network did not settle")

    def advance(self, dt: float) -> None:
        """Time passes: the replicas' timers, the workers' heartbeats and silence checks."""
        self.now += dt
        for name in list(self.replicas):
            if name not in self.dead:
                self.replicas[name].tick(self.now)
                self._flush(name)
        for model in self.workers.values():
            if not model.alive or model.lost or model.conn is None or not model.attached:
                continue
            if self.now - model.last_heard > 2 * HEARTBEAT:
                self._worker_loses(model, model.conn, "silence")
            elif self.now >= model.next_heartbeat:
                self._send_from(model, model.conn, "heartbeat")
                model.next_heartbeat = self.now + HEARTBEAT / 4

    def run(self, seconds: float, step: float = 0.05, rng: random.Random | None = None) -> None:
        """Advance ``seconds`` in steps, delivering everything after each (in ``rng``'s order if given)."""
        for _ in range(round(seconds / step)):
            self.advance(step)
            self.settle(rng)

    # ------------------------------------------------------------------ the model worker

    def _worker_receives(self, model: ModelWorker, conn: Connection, msg: dict[str, Any]) -> None:
        if id(conn) in self.writes:
            return  # a store connection's answers: read off the replica's side (Network.acknowledged)
        model.last_heard = self.now
        op = msg["op"]
        if conn is model.voting:
            if op == "welcome":
                model.conn, model.voting, model.attached = conn, None, True
                model.epoch = msg["epoch"]
                model.next_heartbeat = self.now
            elif op in ("refused", "redirect"):
                model.lost = f"the standby refused: {msg.get('reason')}"
                return
            elif op == "fenced":
                model.fenced = msg["reason"]
                self._kill_worker(model)
                return
            else:
                return
            return
        if conn is not model.conn:
            return  # a stale connection
        if op == "welcome":
            model.attached, model.epoch, model.next_heartbeat = True, msg["epoch"], self.now
        elif op == "announce":
            model.announced = Membership.from_message(msg)
            if model.responsive:
                self._send_from(model, conn, "ready", generation=model.announced.generation)
        elif op == "go":
            if model.announced is not None and model.announced.generation == msg["generation"]:
                assert msg["generation"] > model.agreed, "a GO older than one accepted"
                model.agreed = msg["generation"]
                model.accepted.append((msg["generation"], tuple(Worker(*w) for w in msg["workers"])))
        elif op == "standby":
            model.standby = msg["address"]
            self._send_from(model, conn, "standby_ack", designation=msg["designation"])
        elif op == "fenced":
            model.fenced = msg["reason"]
            self._kill_worker(model)
        elif op in ("refused", "redirect"):
            model.lost = f"refused: {msg.get('reason')}"

    def _worker_loses(self, model: ModelWorker, conn: Connection, why: str) -> None:
        if conn is model.voting:
            model.lost = f"the standby's connection {why}"
            return
        if conn is not model.conn or model.lost:
            return
        self._close_from(model, conn)
        model.conn, model.attached = None, False
        if model.standby is None:
            model.lost = f"the coordinator's connection {why}, no standby known"
            return
        model.voting = self._connect(model, model.standby)
        self._send_from(
            model, model.voting, "reattach", secret=SECRET, node=model.worker.node,
            device=model.worker.device, announced=model.announced.generation if model.announced else -1,
            agreed=model.agreed, epoch=model.epoch,
        )  # fmt: skip

    # ------------------------------------------------------------------ reading the outcome

    def active(self) -> list[str]:
        return [n for n, r in self.replicas.items() if n not in self.dead and r.role is Role.ACTIVE]

    def check_invariants(self) -> None:
        """One membership per generation number, whoever sent its GO; a generation first decided is
        numbered past every one decided before (no coordinator decides behind another); every worker
        accepted GOs in increasing order."""
        members: dict[int, tuple[Worker, ...]] = {}
        newest = -1
        for _, name, generation, workers in self.decisions:
            if generation in members:
                assert members[generation] == workers, f"two memberships for generation {generation}"
                continue
            assert generation > newest, f"{name} decided generation {generation} after {newest}"
            members[generation], newest = workers, generation
        for key, name, epoch, isolated in self.acknowledged:
            if isolated:
                continue  # an isolated coordinator's writes are not replicated (docs/recovery.md)
            for other, replica in self.replicas.items():
                if other not in self.dead and replica.machine.epoch > epoch and replica.role is Role.ACTIVE:
                    assert key in replica.table.data, f"{other} lost {key}, which {name} acknowledged"
        for model in self.workers.values():
            numbers = [g for g, _ in model.accepted]
            assert numbers == sorted(set(numbers)), f"worker {model.worker} accepted {numbers}"
            for g, workers in model.accepted:
                assert members[g] == workers
