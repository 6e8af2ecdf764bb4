"""The recovery coordinator: the single authority on who is alive and which generation is current.

It runs in a process that is not a worker (the local launcher's supervisor, or the SLURM batch host),
so the loss of any worker, global rank 0 included, is survived. Every worker's
:class:`~lightning_oobleck.recovery.agent.WorkerAgent` keeps one TCP connection to it (wire format in
:mod:`~lightning_oobleck.recovery.protocol`). One thread serves all connections with ``selectors``.

The protocol, step by step::

    start      workers register (node, device, pid). When every one of the ``world_size`` workers has
               registered or was lost, generation 0 is announced to those alive (same barrier as after a
               failure, below). A worker that dies before it registers is reported by whoever saw its
               process end (the local launcher's supervisor: :meth:`Coordinator.worker_exited`): its node
               is out, and generation 0 starts without it at once instead of waiting for it.

    detect     a worker is declared dead when
                 (a) its connection ends (EOF/reset): its process died; a SIGKILL closes its sockets
                     at once, so this takes milliseconds;
                 (b) nothing came from it for ``heartbeat_timeout`` (SIGSTOP, hung process, crashed
                     or partitioned host);
                 (c) it did not reach the agreement barrier within ``agreement_timeout``.
               A worker's hint "peer P looks dead" (a communication error) shortens P's deadline to
               two heartbeat intervals: a live P answers with its next heartbeat, a dead one is
               declared dead by (b) at once.

    fence      the failure domain is the node: every other worker of that node is declared dead too.
               A worker declared dead gets FENCED and its connection is closed; its agent exits the
               process (a stopped one when it wakes up: it also fences itself after a freeze longer
               than the heartbeat timeout). It can never come back: registrations from a dead node are
               answered FENCED, and its messages are never read again, so it cannot take part in any
               later generation. With ``kill_fenced`` (one machine: the local launcher), a fenced
               process on this host is also SIGKILLed, so that its open gloo connections close and its
               peers' pending operations fail at once instead of at the process-group timeout.

    abort      on the first detection, every member of the current generation gets ABORT at once:
               their agents set ``abort`` and every abortable wait in the worker stops.

    settle     detections within ``settle_s`` of the first are folded into one change, so f
               simultaneous failures (which are seen a few ms apart) make one new generation.

    announce   the generation number goes up by one; its membership is every live registered worker
               (survivors and nodes that joined), sorted, so the lowest (node, device) is rank 0.
               ANNOUNCE goes to each member. The coordinator is the only writer of this state:
               there is one membership per generation and no split brain.

    agree      each member answers READY(g) once it has stopped the old generation. When every member
               of g is ready, all get GO(g) and build the process groups of g together. A failure
               before GO (during recovery) goes back to "abort": g is abandoned, g+1 is announced, and
               members waiting for g are told so and start over with g+1. Members that are alive but
               not ready within ``agreement_timeout`` are declared dead (c).

    join       a worker that registers after generation 0 (a new or replacement node with a fresh
               node id) is added to the next generation: it triggers an announcement like a failure.

    leave      a worker that finished training says LEAVE: not a failure. When no worker is left the
               coordinator is done.

The coordinator's host is a single point of failure, like SLURM's batch host: if it dies, the workers
lose their failure detector and stop (see ``WorkerAgent``); the run resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hmac
import logging
import os
import selectors
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_oobleck.recovery.protocol import LineReader, Membership, Timeouts, Worker, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Death:
    """Why and when (wall clock) the coordinator declared a worker dead."""

    worker: Worker
    reason: str
    at: float
    generation: int
    """The generation that was current when it was declared dead."""


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    deadline: float
    reader: LineReader = field(default_factory=LineReader)
    outbox: bytearray = field(default_factory=bytearray)
    worker: Worker | None = None
    pid: int | None = None
    host: str | None = None
    last_heard: float = 0.0
    suspicion: str | None = None
    closed: bool = False
    ended_by_peer: bool = False
    """Its end closed or reset: the process is gone, so its pid may already belong to another one."""
    writing: bool = False


class Coordinator:
    """Failure detector, membership authority and fence for one training run (protocol above).

    ``Coordinator(world_size).start()`` serves in a daemon thread; ``stop()`` ends it. All public
    attributes may be read from any thread.
    """

    def __init__(
        self,
        world_size: int,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        heartbeat_timeout: float = 2.0,
        settle_s: float = 0.1,
        agreement_timeout: float = 30.0,
        advertise_host: str | None = None,
        kill_fenced: bool = False,
        secret: str | None = None,
        allow_joins: bool = True,
        devices_per_node: int = 1,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1 (the number of worker processes), got {world_size}")
        if heartbeat_timeout <= 0 or settle_s < 0 or agreement_timeout <= 0:
            raise ValueError("heartbeat_timeout and agreement_timeout must be > 0 and settle_s >= 0")
        self.world_size = world_size
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_timeout / 4
        self.settle_s = settle_s
        self.agreement_timeout = agreement_timeout
        self.kill_fenced = kill_fenced
        self.secret = secret
        """Workers must present it to register (``None``: no secret, for trusted test setups only)."""
        self.allow_joins = allow_joins
        """Whether a worker may register after generation 0 (and join at the next generation)."""
        self.devices_per_node = devices_per_node
        """Workers per node: a node lost before it registered takes that many workers out of the start."""
        self._registration_timeout = max(10.0, 5 * heartbeat_timeout)

        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        bound_host, bound_port = self._server.getsockname()[:2]
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else bound_host
        self.address = f"{advertise_host}:{bound_port}"
        """``host:port`` for the workers (``OOBLECK_COORDINATOR_ADDR``)."""

        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._done = threading.Event()

        # Protocol state, owned by the service thread.
        self._connections: set[_Connection] = set()
        self._alive: dict[Worker, _Connection] = {}
        self._finished: set[Worker] = set()
        self._dead_nodes: dict[int, str] = {}
        self._lost_before_start: set[Worker] = set()
        self._timeouts_from: Worker | None = None
        self._exits: list[tuple[Worker, str]] = []
        """Process ends reported by :meth:`worker_exited`, for the service thread."""
        self._current: Membership | None = None
        self._ready: set[Worker] = set()
        self._agree_deadline: float | None = None
        self._change_at: float | None = None
        self._change_detected_at: float | None = None
        self._broken: list[tuple[_Connection, str]] = []

        # Published records, read from other threads.
        self._lock = threading.Lock()
        self._history: list[Membership] = []
        self._deaths: list[Death] = []

    # ------------------------------------------------------------------ public API

    def start(self) -> Coordinator:
        """Serve in a daemon thread (for the local launcher's supervisor)."""
        if self._thread is not None:
            raise RuntimeError("the coordinator is already running")
        self._thread = threading.Thread(target=self.serve_forever, name="oobleck-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection (workers still connected see the coordinator lost)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the coordinator thread did not stop within {timeout} s")

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def worker_exited(self, worker: Worker, reason: str) -> None:
        """Report that ``worker``'s process ended (from any thread).

        A registered worker's end is seen on its connection; this is for a worker that died before it
        registered, which would otherwise hold back generation 0: its node is declared dead.
        """
        with self._lock:
            self._exits.append((worker, reason))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def wait_done(self, timeout: float) -> bool:
        """Wait until no worker is left (all finished or dead); False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    @property
    def history(self) -> tuple[Membership, ...]:
        """Every announced generation, oldest first; ``agreed_at`` is set on those that were agreed."""
        with self._lock:
            return tuple(self._history)

    @property
    def deaths(self) -> tuple[Death, ...]:
        """Every worker declared dead, in order."""
        with self._lock:
            return tuple(self._deaths)

    @property
    def agreed(self) -> Membership | None:
        """The newest agreed generation, or None before generation 0 is agreed."""
        return next((m for m in reversed(self.history) if m.agreed_at is not None), None)

    @property
    def finished(self) -> bool:
        """True once every worker left normally or died, and at least one left normally."""
        with self._lock:
            return self._done.is_set() and bool(self._finished)

    # ------------------------------------------------------------------ service loop

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (the calling thread becomes the service thread)."""
        try:
            while not self._stopping.is_set():
                timeout = max(0.0, min(self._next_deadline() - time.monotonic(), 1.0))
                for key, events in self._selector.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        key.fileobj.recv(64)  # type: ignore[union-attr]
                        self._take_exits()
                    else:
                        self._service(key.data, events)
                    self._drop_broken()
                self._fire_timers(time.monotonic())
                self._drop_broken()
                if self._current is not None and not self._alive and self._change_at is None:
                    self._done.set()
        except Exception:
            log.exception("the coordinator failed; every worker will see it lost")
            raise
        finally:
            for conn in list(self._connections):
                self._close(conn)
            self._selector.close()
            self._server.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_deadline(self) -> float:
        deadlines = [c.deadline for c in self._connections]
        deadlines += [t for t in (self._change_at, self._agree_deadline) if t is not None]
        return min(deadlines, default=time.monotonic() + 1.0)

    def _accept(self) -> None:
        try:
            sock, addr = self._server.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(
            sock, f"{addr[0]}:{addr[1]}", deadline=time.monotonic() + self._registration_timeout
        )
        self._connections.add(conn)
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _service(self, conn: _Connection, events: int) -> None:
        if conn.closed:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if not events & selectors.EVENT_READ:
            return
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            conn.ended_by_peer = True
            self._drop(conn, f"its connection failed ({e.strerror or e}): the process died")
            return
        if not data:
            conn.ended_by_peer = True
            self._drop(conn, "its connection closed: the process died")
            return
        conn.last_heard = time.monotonic()
        conn.suspicion = None
        conn.deadline = conn.last_heard + (
            self.heartbeat_timeout if conn.worker else self._registration_timeout
        )
        try:
            messages = conn.reader.feed(data)
        except ValueError as e:
            self._drop(conn, f"it sent garbage ({e})")
            return
        for msg in messages:
            if conn.closed:
                return
            try:
                self._handle(conn, msg)
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                self._drop(conn, f"it broke the protocol ({type(e).__name__}: {e} in {msg})")

    def _handle(self, conn: _Connection, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if conn.worker is None:
            if op == "register":
                self._register(conn, msg)
            else:
                self._refuse(conn, f"the first message must be 'register', got {op!r}")
        elif op == "heartbeat":
            self._send(conn, "ack")
        elif op == "ready":
            self._ready_for(conn.worker, int(msg["generation"]))
        elif op == "suspect":
            self._suspect(Worker(int(msg["node"]), int(msg["device"])), str(msg.get("reason", "")))
        elif op == "leave":
            self._leave(conn)
        else:
            log.warning("ignoring unknown message %r from worker %s", op, tuple(conn.worker))

    # ------------------------------------------------------------------ membership changes

    def _register(self, conn: _Connection, msg: dict[str, Any]) -> None:
        if self.secret is not None and not hmac.compare_digest(str(msg.get("secret", "")), self.secret):
            self._refuse(conn, "the job's secret is missing or wrong: only this job's workers may register")
            return
        worker = Worker(int(msg["node"]), int(msg["device"]))
        if self._current is not None and not self.allow_joins:
            self._refuse(
                conn,
                f"worker {tuple(worker)} registered after the training started: this run does not admit new "
                "workers (training goes on without it)",
            )
            return
        if (refusal := self._adopt_timeouts(worker, msg)) is not None:
            self._refuse(conn, refusal)
            return
        if worker.node in self._dead_nodes:
            self._send(
                conn,
                "fenced",
                reason=f"node {worker.node} was declared dead ({self._dead_nodes[worker.node]}); a dead "
                "node never rejoins: start a replacement with a new node id",
            )
            self._close(conn)
            return
        if worker in self._alive:
            holder = self._alive[worker]
            self._refuse(
                conn,
                f"worker (node {worker.node}, device {worker.device}) is already registered by pid "
                f"{holder.pid} from {holder.peer}: give each process its own (node, device)",
            )
            return
        conn.worker, conn.pid, conn.host = worker, msg.get("pid"), msg.get("host")
        conn.deadline = time.monotonic() + self.heartbeat_timeout
        self._alive[worker] = conn
        self._send(
            conn,
            "welcome",
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
        )
        log.info("worker %s registered (pid %s, %s)", tuple(worker), conn.pid, conn.peer)
        if self._current is None:
            self._maybe_start(time.time())
        else:
            self._schedule_change()

    def _adopt_timeouts(self, worker: Worker, msg: dict[str, Any]) -> str | None:
        """Take the first registration's timeouts as the job's; the reason to refuse one that differs."""
        if "heartbeat_timeout" not in msg:
            return None
        wanted = Timeouts(float(msg["heartbeat_timeout"]), float(msg["agreement_timeout"]))
        if self._timeouts_from is None:
            self._timeouts_from = worker
            self.heartbeat_timeout, self.agreement_timeout = wanted
            self.heartbeat_interval = wanted.heartbeat_timeout / 4
            return None
        current = Timeouts(self.heartbeat_timeout, self.agreement_timeout)
        if wanted == current:
            return None
        return (
            f"worker {tuple(worker)} is configured with {wanted} but worker {tuple(self._timeouts_from)} "
            f"with {current}: give every worker of the job the same strategy configuration"
        )

    def _maybe_start(self, now: float) -> None:
        """Announce generation 0 once every expected worker registered or was lost."""
        if self._alive and len(self._alive) + len(self._lost_before_start) >= self.world_size:
            self._change_detected_at = now
            self._announce()

    def _take_exits(self) -> None:
        with self._lock:
            exits, self._exits = self._exits, []
        for worker, reason in exits:
            # A registered worker's end is seen on its connection, after whatever it sent last (a LEAVE).
            if self._current is None and worker not in self._alive and worker.node not in self._dead_nodes:
                self._declare_dead(worker, reason, registered=False)

    def _declare_dead(self, worker: Worker, reason: str, registered: bool = True) -> None:
        """Take ``worker``'s whole node out, fence its processes, abort the current generation.

        ``registered=False``: ``worker`` died before it registered (only before generation 0)."""
        if registered and worker not in self._alive:
            return
        node = worker.node
        self._dead_nodes[node] = f"worker {tuple(worker)}: {reason}"
        now = time.time()
        generation = self._current.generation if self._current else -1
        victims = sorted(w for w in self._alive if w.node == node)
        if not registered:
            log.warning("worker %s declared dead before it registered: %s", tuple(worker), reason)
            with self._lock:
                self._deaths.append(Death(worker, reason, now, generation))
        for w in victims:
            why = reason if w == worker else f"node {node} is out because worker {tuple(worker)}: {reason}"
            log.warning("worker %s declared dead: %s", tuple(w), why)
            conn = self._alive.pop(w)
            with self._lock:
                self._deaths.append(Death(w, why, now, generation))
            self._send(conn, "fenced", reason=why)
            if not (conn.closed or conn.ended_by_peer):
                self._kill_if_local(conn)
            self._close(conn)
        if self._current is None:
            self._lost_before_start |= {Worker(node, d) for d in range(self.devices_per_node)}
            self._lost_before_start |= {worker, *victims}
            self._maybe_start(now)
            return
        self._schedule_change()
        if not set(victims) & set(self._current.workers):
            return  # a worker that had not joined yet: nobody to abort
        for member in self._current.workers:
            if member in self._alive:
                self._send(
                    self._alive[member],
                    "abort",
                    generation=self._current.generation,
                    suspects=[list(w) for w in victims],
                    detected_at=self._change_detected_at,
                )

    def _schedule_change(self) -> None:
        if self._change_at is None:
            self._change_at = time.monotonic() + self.settle_s
            self._change_detected_at = time.time()

    def _announce(self) -> None:
        """Publish the next generation: every live registered worker, in rank order."""
        self._change_at = None
        workers = tuple(sorted(self._alive))
        if self._current is None:  # the start: "removed" are the workers lost before it
            removed, added = tuple(sorted(self._lost_before_start)), ()
        else:
            previous = set(self._current.workers)
            removed = tuple(sorted(previous - set(workers)))
            added = tuple(sorted(set(workers) - previous))
            if not workers or not (removed or added):
                self._maybe_go()
                return
        with self._lock:
            causes = [f"{tuple(d.worker)} {d.reason}" for d in self._deaths if d.worker in removed]
        causes += [f"{tuple(w)} left (finished)" for w in removed if w in self._finished]
        causes += [f"{tuple(w)} joined" for w in added] if self._current else ["start"]
        generation = self._current.generation + 1 if self._current else 0
        self._current = Membership(
            generation, workers, removed, added, "; ".join(causes), detected_at=self._change_detected_at
        )
        with self._lock:
            self._history.append(self._current)
        self._ready = set()
        self._agree_deadline = time.monotonic() + self.agreement_timeout
        log.info(
            "generation %d announced: %s (%s)", generation, [tuple(w) for w in workers], self._current.cause
        )
        for w in workers:
            self._send(self._alive[w], "announce", **self._current.to_message())

    def _ready_for(self, worker: Worker, generation: int) -> None:
        current = self._current
        if current is None or generation != current.generation or worker not in current.workers:
            return  # stale: that worker has been or is being told about a newer generation
        self._ready.add(worker)
        self._maybe_go()

    def _maybe_go(self) -> None:
        current = self._current
        if current is None or current.agreed_at is not None or self._change_at is not None:
            return  # nothing to agree, or a newer generation is about to be announced
        if not set(current.workers) <= self._ready | self._finished:
            return
        self._current = dataclasses.replace(current, agreed_at=time.time())
        with self._lock:
            self._history[-1] = self._current
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

    def _suspect(self, worker: Worker, reason: str) -> None:
        conn = self._alive.get(worker)
        if conn is not None:
            log.info("worker %s suspected by a peer (%s): checking its liveness", tuple(worker), reason)
            conn.suspicion = reason or "communication error"
            conn.deadline = min(conn.deadline, time.monotonic() + 2 * self.heartbeat_interval)

    def _leave(self, conn: _Connection) -> None:
        worker = conn.worker
        assert worker is not None
        log.info("worker %s finished", tuple(worker))
        del self._alive[worker]
        with self._lock:
            self._finished.add(worker)
        self._close(conn)
        self._maybe_go()

    def _fire_timers(self, now: float) -> None:
        for conn in list(self._connections):
            if conn.closed or conn.deadline > now:
                continue
            if conn.worker is None:
                log.warning(
                    "closing %s: it did not register within %.0f s", conn.peer, self._registration_timeout
                )
                self._close(conn)
            elif conn.suspicion is not None:
                silent = now - conn.last_heard
                self._declare_dead(
                    conn.worker, f"suspected by a peer ({conn.suspicion}), silent for {silent:.1f} s"
                )
            else:
                self._declare_dead(
                    conn.worker, f"sent nothing for {self.heartbeat_timeout:g} s (hung or stopped)"
                )
        if self._change_at is not None and now >= self._change_at:
            self._announce()
        if self._agree_deadline is not None and now >= self._agree_deadline and self._current is not None:
            self._agree_deadline = None
            stragglers = [w for w in self._current.workers if w in self._alive and w not in self._ready]
            for w in stragglers:
                self._declare_dead(
                    w,
                    f"did not reach the agreement barrier of generation {self._current.generation} "
                    f"within {self.agreement_timeout:g} s",
                )

    def _kill_if_local(self, conn: _Connection) -> None:
        """Fencing with certainty on one machine: SIGKILL a fenced worker whose process may still exist.

        A stopped or hung process keeps its gloo connections open, so its peers' pending operations (and
        a ``destroy_process_group``) wait for the whole process-group timeout; once it is killed they
        fail within milliseconds. Only a process on this host that holds this very connection (checked in
        ``/proc``: the pid a client reports is not trusted), while the connection is open.
        """
        if not (self.kill_fenced and conn.pid and conn.host == socket.gethostname()):
            return
        pid = int(conn.pid)
        if not holds_connection(pid, conn.sock):
            log.warning(
                "not killing pid %d reported by fenced worker %s: that process does not hold its connection",
                pid,
                tuple(conn.worker or ()),
            )
            return
        log.warning("killing fenced worker %s (pid %d)", tuple(conn.worker or ()), pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ connections

    def _refuse(self, conn: _Connection, reason: str) -> None:
        log.warning("refusing %s: %s", conn.peer, reason)
        self._send(conn, "refused", reason=reason)
        self._close(conn)

    def _drop(self, conn: _Connection, reason: str) -> None:
        # Declared dead (and recorded) before its connection closes: whoever sees the close sees the death.
        if conn.worker is not None and self._alive.get(conn.worker) is conn:
            self._declare_dead(conn.worker, reason)
        self._close(conn)

    def _drop_broken(self) -> None:
        while self._broken:
            conn, reason = self._broken.pop()
            self._drop(conn, reason)

    def _send(self, conn: _Connection, op: str, **fields: Any) -> None:
        if not conn.closed:
            conn.outbox += encode(op, **fields)
            self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._broken.append((conn, f"sending to it failed ({e.strerror or e}): the process died"))
            return
        del conn.outbox[:sent]
        if bool(conn.outbox) != conn.writing and not conn.closed:
            conn.writing = bool(conn.outbox)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self._selector.modify(conn.sock, events, conn)

    def _close(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._connections.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.send(conn.outbox)  # best effort: a fenced worker also fences itself
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()


def holds_connection(pid: int, sock: socket.socket) -> bool:
    """Whether process ``pid`` (on this host) has the other end of TCP connection ``sock`` open.

    The peer's socket is found in the kernel's table by its address (``/proc/net/tcp``, ``tcp6``), and
    the process by the socket's inode among its file descriptors: the same proof ``SO_PEERCRED`` gives for
    a Unix socket. A forked child that inherited the connection also holds it."""
    try:
        peer_port, local_port = sock.getpeername()[1], sock.getsockname()[1]
    except OSError:
        return False
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                ports = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
                if ports == (peer_port, local_port):
                    inodes.add(f"socket:[{inode}]")
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Run a coordinator until every worker finished or died (the SLURM batch host runs this).

    Exit status 0 if at least one worker finished normally, 1 otherwise.
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_oobleck.recovery",
        description="Failure detector and membership authority for an oobleck training run.",
    )
    parser.add_argument("--world-size", type=int, required=True, help="number of worker processes at start")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--advertise-host", help="host name the workers use to reach this one")
    parser.add_argument("--address-file", type=Path, help="write HOST:PORT here once listening")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence = dead")
    parser.add_argument("--settle", type=float, default=0.1, help="seconds to fold concurrent failures")
    parser.add_argument("--agreement-timeout", type=float, default=30.0, help="seconds to reach agreement")
    parser.add_argument(
        "--kill-fenced", action="store_true", help="also SIGKILL fenced workers that run on this host"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s oobleck-coordinator %(message)s")
    with Coordinator(
        args.world_size,
        args.host,
        args.port,
        heartbeat_timeout=args.heartbeat_timeout,
        settle_s=args.settle,
        agreement_timeout=args.agreement_timeout,
        advertise_host=args.advertise_host,
        kill_fenced=args.kill_fenced,
    ) as coordinator:
        log.info("listening on %s for %d workers", coordinator.address, args.world_size)
        if args.address_file:
            tmp = args.address_file.with_suffix(".tmp")
            tmp.write_text(coordinator.address + "\n")
            os.replace(tmp, args.address_file)
        while not coordinator.wait_done(1.0):
            pass
    return 0 if coordinator.finished else 1
