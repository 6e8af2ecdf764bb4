"""The wire protocol between the recovery :mod:`~lightning_oobleck.recovery.coordinator` and the
:mod:`~lightning_oobleck.recovery.agent` that runs in every worker.

Transport: one TCP connection per worker process, opened at start and kept for the whole run (and, under
SLURM, one more opened as the process starts: ``present``). A message
is one JSON object on one line (UTF-8, terminated by ``\\n``) with an ``"op"`` field.

Worker -> coordinator::

    register  {node, device, pid, host, name, secret, [heartbeat_timeout, agreement_timeout], [node_key],
               [can_host_standby]}
                                          first message; answered by welcome, refused or fenced (or
                                          redirect: not the active coordinator, try the next). The
                                          first registration's timeouts become the job's; a later one
                                          asking for others is refused. ``node`` null: a joiner whose
                                          node id the coordinator gives (one per ``node_key``). ``name``:
                                          the node as users name it (SLURM's), for the log
    present   {node, device, name, secret} on a connection of its own, sent by the process that will be this
                                          worker before anything slow runs (imports, data), and nothing
                                          after: if it ends before the worker registered, the process is
                                          gone and the start does not wait for it. Never answered
    heartbeat {}                          every ``heartbeat_interval``; answered by ack
    suspect   {node, device, reason}      hint from a communication error: "this peer looks dead"
    ready     {generation}                agreement barrier: "I stopped generation g-1, I am ready for g"
    leave     {}                          finished normally: not a failure
    admit     {generation, nodes}         a step boundary after generation g's commit that saw pending
                                          joiners: admit up to ``nodes`` whole nodes of them now
                                          (answered by the announcement of g+1, or nothing_to_admit)
    standby_ack {designation}             the standby designation ``designation`` was received
    reattach  {node, device, secret, announced, agreed, epoch}
                                          first message on a connection to the standby, once the active
                                          coordinator was lost: a vote for the standby; answered by
                                          welcome once it took over (then what the worker missed), or
                                          fenced / refused
    exited    {node, device, reason, secret}
                                          from the local launcher, on a connection of its own: a process
                                          ended (it matters for one that never registered)

Coordinator -> worker::

    welcome   {node, epoch, heartbeat_interval, heartbeat_timeout}
                                          ``node``: the worker's node id (given, for a joiner); ``epoch``:
                                          how many times the coordinator failed over
    ack       {}                          reply to a heartbeat (the worker's view of coordinator liveness)
    abort     {generation, suspects, detected_at}
                                          a member of the current generation is dead: stop communicating
    announce  {generation, workers, removed, added, cause, detected_at}
                                          the next generation's membership (sent to its members only)
    go        {generation, workers, agreed_at}
                                          every member of that generation is ready: build its groups
    joiners   {nodes}                     to the members: how many whole nodes wait to join (when it changes)
    nothing_to_admit {generation}         the joiners are gone: generation g goes on
    finished  {reason}                    to a pending joiner: the training ended before it was admitted
    fenced    {reason}                    you were declared dead: exit now (the connection is then closed)
    refused   {reason}                    the registration is invalid (the connection is then closed)
    redirect  {reason}                    this is the standby, not the active coordinator
    standby   {address, designation}      where the standby is: reconnect there if this one is lost
    host_standby {follow, loopback, join_file}
                                          start a standby coordinator on this node, following ``follow``

The coordinators' own link (:mod:`~lightning_oobleck.recovery.replica`): ``follow`` (standby -> active),
``snapshot``, ``replicate``, ``dismissed``, ``finished``, ``deposed`` (active -> standby), ``ack``.

Timestamps (``*_at``) are wall-clock seconds (``time.time()``) of the coordinator's host, so events of
several processes line up on one time axis.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_oobleck.worker import Worker

FENCED_EXIT_CODE = 86
"""Exit status of a worker process that its agent terminated because the coordinator fenced it."""

ADDRESS_ENV = "OOBLECK_COORDINATOR_ADDR"
"""Environment variable holding the coordinator's ``host:port`` for the worker agents."""

SECRET_ENV = "OOBLECK_COORDINATOR_SECRET"
"""Environment variable holding the job's secret, made at launch: the coordinator registers only workers that
present it (never logged)."""

NODE_KEY_ENV = "OOBLECK_NODE_KEY"
"""Environment variable set for a process that joins a running training: a name for its node (the join job
and its node index, a replacement's number); the coordinator gives the node id, so a node that comes back
is a new node whatever its launch position says."""

MAX_LINE_BYTES = 1 << 20


class Timeouts(NamedTuple):
    """The failure detector's timeouts, in seconds, as the workers' configuration sets them."""

    heartbeat_timeout: float
    """Silence after which a worker is declared dead."""
    agreement_timeout: float
    """How long a live member may take to reach a generation's agreement barrier."""


@dataclass(frozen=True)
class Membership:
    """The workers of one generation, in rank order, and how this generation came to be.

    ``workers`` is sorted, so a worker's rank in the generation is its index and the lowest surviving
    ``(node, device)`` is rank 0. ``removed``/``added`` compare with what the workers ran: the newest agreed
    generation (a generation abandoned during its agreement is skipped; generation 0 compares with every
    launched worker);
    ``detected_at`` is when the first failure (or join) that led to this generation was seen, and
    ``agreed_at`` when every member reached the agreement barrier (``None`` until then); ``started_at`` when
    the job's first generation was agreed and ``failures`` how many generations since lost workers, this one
    included: the failure rate every member observes alike (:meth:`observed`).
    """

    generation: int
    workers: tuple[Worker, ...]
    removed: tuple[Worker, ...] = ()
    added: tuple[Worker, ...] = ()
    cause: str = ""
    detected_at: float | None = None
    agreed_at: float | None = None
    started_at: float | None = None
    failures: int = 0

    def observed(self) -> tuple[int, float]:
        """The failures so far (this generation's included) and the time they came in: from the start to
        this generation's detection (0 before the start was agreed)."""
        if self.started_at is None or self.detected_at is None:
            return self.failures, 0.0
        return self.failures, max(0.0, self.detected_at - self.started_at)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({w.node for w in self.workers}))

    def rank(self, worker: Worker) -> int:
        """Rank of ``worker`` in this generation; a clear error if it is not a member."""
        try:
            return self.workers.index(worker)
        except ValueError:
            raise ValueError(
                f"worker {tuple(worker)} is not a member of generation {self.generation}"
            ) from None

    def to_message(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "workers": [list(w) for w in self.workers],
            "removed": [list(w) for w in self.removed],
            "added": [list(w) for w in self.added],
            "cause": self.cause,
            "detected_at": self.detected_at,
            "agreed_at": self.agreed_at,
            "started_at": self.started_at,
            "failures": self.failures,
        }

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> Membership:
        return cls(
            generation=int(msg["generation"]),
            workers=workers_from_json(msg["workers"]),
            removed=workers_from_json(msg.get("removed", ())),
            added=workers_from_json(msg.get("added", ())),
            cause=str(msg.get("cause", "")),
            detected_at=msg.get("detected_at"),
            agreed_at=msg.get("agreed_at"),
            started_at=msg.get("started_at"),
            failures=int(msg.get("failures", 0)),
        )


def workers_from_json(items: Any) -> tuple[Worker, ...]:
    return tuple(Worker(int(n), int(d)) for n, d in items)


def node_name() -> str:
    """This process's node as its user names it: SLURM's node name in a SLURM task (a test cluster runs
    several on one host), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def parse_addresses(value: str) -> list[str]:
    """``"host:port,host:port"`` (the job's coordinators, the active first) -> the addresses, each checked."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"no coordinator address in {value!r} (expected HOST:PORT[,HOST:PORT])")
    for address in addresses:
        parse_address(address)
    return addresses


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, with an error that shows the expected form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not of the form HOST:PORT (e.g. node001:29400)")
    return host, int(port)


def encode(op: str, **fields: Any) -> bytes:
    return (json.dumps({"op": op, **fields}, separators=(",", ":")) + "\n").encode()


class LineReader:
    """Splits a byte stream into protocol messages; keeps an incomplete last line for the next feed; a line
    longer than ``max_line`` bytes is not from the job."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buffer = bytearray()
        self._max_line = max_line

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        if len(rest) > self._max_line:
            raise ValueError(f"protocol line longer than {self._max_line} bytes: not an oobleck peer")
        self._buffer = bytearray(rest)
        return [json.loads(line) for line in lines if line.strip()]


def accept(server: socket.socket) -> tuple[socket.socket, Any] | None:
    """The next connection waiting on the non-blocking listening socket ``server``, made non-blocking and
    without Nagle's delay (messages are single lines, answered at once); ``None`` if none waits."""
    try:
        sock, address = server.accept()
    except BlockingIOError:
        return None
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, address
