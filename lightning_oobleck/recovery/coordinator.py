"""The recovery coordinator: the authority on who is alive and which generation is current, and the job's
rendezvous store, served by one process, with a standby in another that takes over when it is lost.

:class:`Coordinator` serves one :class:`~lightning_oobleck.recovery.replica.Replica` (the protocol, failover
included, is there; the membership machine it runs is
:class:`~lightning_oobleck.recovery.membership.MembershipMachine`) on one TCP port: one thread, ``selectors``,
every connection's messages fed to the replica and its effects carried out: messages, store answers, closed
connections, killed processes, the join file kept current. Every worker's
:class:`~lightning_oobleck.recovery.agent.WorkerAgent` keeps one connection to the active coordinator (wire
format in :mod:`~lightning_oobleck.recovery.protocol`); store clients
(:class:`~lightning_oobleck.recovery.keystore.KeyStoreClient`) one per thread; a standby one link.

It runs in a process that is not a worker (the local launcher starts one; the SLURM batch host runs
:mod:`lightning_oobleck.slurm.rendezvous`); the standby is a process a worker of another node starts when the
active asks (``python -m lightning_oobleck.recovery --follow ADDRESS``). So the loss of any node,
the coordinator's included, is survived.

How deaths are seen: a SIGKILLed worker's connection ends at once (milliseconds); a stopped, hung or
cut-off one stops sending heartbeats; a worker's hint "peer P looks dead" shortens P's deadline to two
heartbeat intervals; the launcher reports a process that ended before it registered. A fenced worker's
agent exits its process (a stopped one when it wakes up); with ``kill_fenced`` (one machine: the local
launcher), a fenced process on this host that provably holds its connection is also SIGKILLed, so that
its open gloo connections close and its peers' pending operations fail at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lightning_oobleck.process import process_alive
from lightning_oobleck.recovery.keytable import MAX_MESSAGE_BYTES
from lightning_oobleck.recovery.membership import Death, MembershipMachine, MembershipSettings
from lightning_oobleck.recovery.protocol import (
    SECRET_ENV,
    LineReader,
    Membership,
    accept,
    encode,
    parse_address,
)
from lightning_oobleck.recovery.replica import (
    Answer,
    Close,
    Exit,
    Kill,
    Replica,
    ReplicaEffect,
    Replicas,
    ReplicaSettings,
    Role,
    Send,
)
from lightning_oobleck.worker import Worker

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "Death", "holds_connection", "main", "update_join_file"]

FOLLOW_TIMEOUT_S = 30.0
"""How long a standby tries to reach the active coordinator it is to follow."""


@dataclass(eq=False)
class _Connection:
    id: int
    sock: socket.socket
    peer: str
    reader: LineReader = field(default_factory=lambda: LineReader(MAX_MESSAGE_BYTES))
    outbox: bytearray = field(default_factory=bytearray)
    writing: bool = False
    closing: bool = False
    """Close once the outbox is sent."""


class Coordinator:
    """Failure detector, membership authority, fence and rendezvous store for one training run: one replica.

    ``Coordinator(world_size).start()`` serves in a daemon thread; ``stop()`` ends it (a standby that follows
    it is told the job ended). ``follow``: start as the standby of the active coordinator at that address.
    ``node``: the job's node this process runs on (``None``: none, e.g. the local launcher's), lost with
    it. All public attributes may be read from any thread. ``settings``: the failure detector's timeouts,
    joins, the processes of a node; ``secret``: every client must present it (``None``: no secret, for
    trusted test setups only).
    """

    def __init__(
        self,
        world_size: int,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        settings: MembershipSettings | None = None,
        advertise_host: str | None = None,
        secret: str | None = None,
        follow: str | None = None,
        node: int | None = None,
        replica_settings: ReplicaSettings | None = None,
    ) -> None:
        self.world_size = world_size
        self.secret = secret
        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        bound_host, bound_port = self._server.getsockname()[:2]
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else bound_host
        self.address = f"{advertise_host}:{bound_port}"
        """``host:port`` for the workers and store clients (``OOBLECK_COORDINATOR_ADDR``)."""
        machine = MembershipMachine(world_size, settings, secret=secret, host=socket.gethostname())
        machine.wall_offset = time.time() - time.monotonic()
        machine.coordinator_pid = os.getpid()
        self.replica = Replica(
            machine,
            secret=secret,
            address=self.address,
            node=node,
            role=Role.STANDBY if follow else Role.ACTIVE,
            settings=replica_settings,
            wall_offset=machine.wall_offset,
            host=machine.host,
            pid=machine.coordinator_pid,
        )
        self.follow = follow
        self.replicas: tuple[str, ...] = (self.address,)
        """Where the job's coordinators are, the active first, as this one last knew."""
        self.exit_reason: str | None = None
        """Why this replica's part ended (dismissed, deposed, the job done), once it did."""

        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        """Held while the replica changes, so that other threads read consistent records."""
        self._connections: dict[int, _Connection] = {}
        self._broken: dict[int, str] = {}
        """Connections a send failed on (id: why), ended by :meth:`_end_broken` after what they still hold."""
        self._next_id = 0
        self._exits: list[tuple[Worker, str]] = []
        self._crash = False

    # ------------------------------------------------------------------ public API

    @property
    def machine(self) -> MembershipMachine:
        """The membership machine (a standby's is the active's copy)."""
        return self.replica.machine

    @property
    def role(self) -> Role:
        return self.replica.role

    @property
    def heartbeat_timeout(self) -> float:
        return self.machine.settings.heartbeat_timeout

    @property
    def allow_joins(self) -> bool:
        return self.machine.settings.allow_joins

    @property
    def settle_s(self) -> float:
        return self.machine.settings.settle_s

    @property
    def heartbeat_interval(self) -> float:
        return self.machine.settings.heartbeat_interval

    @property
    def agreement_timeout(self) -> float:
        return self.machine.settings.agreement_timeout

    def start(self) -> Coordinator:
        """Serve in a daemon thread (a standby first connects to its active coordinator)."""
        if self._thread is not None:
            raise RuntimeError("the coordinator is already running")
        if self.follow is not None:
            self._connect_leader(self.follow)
        self._thread = threading.Thread(target=self.serve_forever, name="oobleck-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection (workers still connected see the coordinator lost; a
        standby that follows is told the job ended, so that it does not take over)."""
        self._stopping.set()
        self._wake()
        self._join(timeout)

    def crash(self, timeout: float = 5.0) -> None:
        """End as a killed process would: every connection closes and nobody is told anything (for tests)."""
        self._crash = True
        self.stop(timeout)

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def worker_exited(self, worker: Worker, reason: str) -> None:
        """Report that ``worker``'s process ended (from any thread); see ``MembershipMachine.exited``."""
        with self._lock:
            self._exits.append((worker, reason))
        self._wake()

    def wait_done(self, timeout: float) -> bool:
        """Wait until no worker is left (all finished or dead); False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def wait_ended(self, timeout: float) -> bool:
        """Wait until this replica's part is over (stopped, dismissed, deposed, done); False on timeout."""
        return self._ended.wait(timeout)

    @property
    def history(self) -> tuple[Membership, ...]:
        """Every announced generation, oldest first; ``agreed_at`` is set on those that were agreed."""
        with self._lock:
            return tuple(self.machine.history)

    @property
    def deaths(self) -> tuple[Death, ...]:
        """Every worker declared dead, in order."""
        with self._lock:
            return tuple(self.machine.deaths)

    @property
    def agreed(self) -> Membership | None:
        """The newest agreed generation, or None before generation 0 is agreed."""
        return next((m for m in reversed(self.history) if m.agreed_at is not None), None)

    @property
    def finished(self) -> bool:
        """True once every worker left normally or died, and at least one left normally."""
        with self._lock:
            return self._done.is_set() and bool(self.machine.finished)

    # ------------------------------------------------------------------ service loop

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` or the replica's end (the calling thread becomes the service thread)."""
        try:
            while not self._stopping.is_set() and self.exit_reason is None:
                deadline = self.replica.next_deadline()
                timeout = 1.0 if deadline is None else max(0.0, min(deadline - time.monotonic(), 1.0))
                for key, events in self._selector.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        key.fileobj.recv(64)  # type: ignore[union-attr]
                        with self._lock:
                            exits, self._exits = self._exits, []
                        for worker, reason in exits:
                            self._apply(
                                lambda w=worker, r=reason: self.replica.exited(w, r, time.monotonic())
                            )
                    else:
                        self._service(key.data, events)
                self._end_broken()
                self._apply(lambda: self.replica.tick(time.monotonic()))
                self._end_broken()
                if self.machine.done and self.role is Role.ACTIVE and not self._done.is_set():
                    with self._lock:
                        effects = self.replica.training_done(time.monotonic())
                    self._carry_out(effects)
                    self._done.set()
            if not self._crash:
                self._carry_out(self.replica.finish())
        except Exception:
            log.exception("the coordinator failed; every worker will see it lost")
            raise
        finally:
            for conn in list(self._connections.values()):
                self._close(conn, flush=not self._crash)
            self._selector.close()
            self._server.close()
            self._wake_r.close()
            self._wake_w.close()
            self._ended.set()

    def _apply(self, event: Callable[[], None]) -> None:
        """Run one replica event under the lock, then carry out what it is due to send now."""
        with self._lock:
            event()
            effects = self.replica.flush(time.monotonic())
        self._carry_out(effects)

    def _carry_out(self, effects: list[ReplicaEffect]) -> None:
        for effect in effects:
            if isinstance(effect, Replicas):
                self._replicas_changed(effect.addresses)
                continue
            if isinstance(effect, Exit):
                self.exit_reason = effect.reason
                continue
            conn = self._connections.get(effect.conn)
            if conn is None:
                continue
            if isinstance(effect, Send):
                self._queue(conn, encode(effect.op, **effect.fields))
            elif isinstance(effect, Answer):
                self._queue(conn, (json.dumps(effect.fields, separators=(",", ":")) + "\n").encode())
            elif isinstance(effect, Kill):
                self._kill(conn, effect.pid)
            elif isinstance(effect, Close):
                conn.closing = True
                if not conn.outbox:
                    self._close(conn)

    def _queue(self, conn: _Connection, data: bytes) -> None:
        conn.outbox += data
        if (error := self._flush(conn)) is not None:
            self._broken.setdefault(conn.id, f"sending to it failed ({error}): the process died")

    def _replicas_changed(self, addresses: tuple[str, ...]) -> None:
        self.replicas = addresses
        join_file = self.replica.settings.join_file
        if join_file and self.role is Role.ACTIVE:
            try:
                update_join_file(Path(join_file), addresses)
            except OSError as e:
                log.warning("could not write the coordinators' addresses to %s: %s", join_file, e)

    def _connect_leader(self, address: str) -> None:
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection(parse_address(address), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cannot reach the active coordinator at {address}: {e}") from e
                time.sleep(0.1)
        conn = self._register(sock, address)
        with self._lock:
            self.replica.follow(conn.id, time.monotonic())
            effects = self.replica.flush(time.monotonic())
        self._carry_out(effects)

    def _register(self, sock: socket.socket, peer: str) -> _Connection:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next_id += 1
        conn = _Connection(self._next_id, sock, peer)
        self._connections[conn.id] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        return conn

    def _accept(self) -> None:
        if (accepted := accept(self._server)) is None:
            return
        sock, addr = accepted
        conn = self._register(sock, f"{addr[0]}:{addr[1]}")
        self._apply(lambda: self.replica.connected(conn.id, time.monotonic()))

    def _service(self, conn: _Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE and (error := self._flush(conn)) is not None:
            self._broken.setdefault(conn.id, f"sending to it failed ({error}): the process died")
            return
        if conn.closing and not conn.outbox:
            self._close(conn)
            return
        if not events & selectors.EVENT_READ or conn.id not in self._connections:
            return
        try:
            data = conn.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as e:
            reason = f"its connection failed ({e.strerror or e}): the process died"
            self._apply(lambda: self.replica.ended(conn.id, reason, time.monotonic()))
            self._close(conn)
            return
        if not data:
            why = "its connection closed: the process died"
            self._apply(lambda: self.replica.ended(conn.id, why, time.monotonic()))
            self._close(conn)
            return
        try:
            messages = conn.reader.feed(data)
        except ValueError as e:
            why = str(e)
            self._apply(lambda: self.replica.garbage(conn.id, why, time.monotonic()))
            return
        for msg in messages:
            if not isinstance(msg, dict):
                self._apply(lambda: self.replica.garbage(conn.id, "not a JSON object", time.monotonic()))
                return
            self._apply(lambda m=msg: self.replica.received(conn.id, m, time.monotonic()))

    def _end_broken(self) -> None:
        """End the connections a send failed on, each after the messages it still holds: a worker that
        sent LEAVE and closed its end before a reply to its last heartbeat left normally; it did not die."""
        while self._broken:
            conn_id, why = self._broken.popitem()
            conn, messages = self._connections.get(conn_id), []
            if conn is None:
                continue
            with contextlib.suppress(OSError, ValueError):  # no more data (BlockingIOError), reset, garbage
                while data := conn.sock.recv(65536):
                    messages += conn.reader.feed(data)
            for msg in messages:
                if isinstance(msg, dict):
                    self._apply(lambda c=conn_id, m=msg: self.replica.received(c, m, time.monotonic()))
            if conn_id in self._connections:
                self._apply(lambda c=conn_id, r=why: self.replica.ended(c, r, time.monotonic()))
                self._close(conn)

    def _kill(self, conn: _Connection, pid: int) -> None:
        """Fencing with certainty on one machine: SIGKILL a fenced worker whose process may still exist.

        A stopped or hung process keeps its gloo connections open, so its peers' pending operations (and
        a ``destroy_process_group``) wait for the whole process-group timeout; once it is killed they
        fail within milliseconds. Only a process that holds this very connection (checked in ``/proc``).
        """
        if not holds_connection(pid, conn.sock):
            log.warning(
                "not killing pid %d a fenced client reported: that process does not hold its connection", pid
            )
            return
        log.warning("killing fenced worker process %d", pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def _flush(self, conn: _Connection) -> str | None:
        """Send what is queued; the error if the connection is broken."""
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            return str(e.strerror or e)
        del conn.outbox[:sent]
        if bool(conn.outbox) != conn.writing:
            conn.writing = bool(conn.outbox)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self._selector.modify(conn.sock, events, conn)
        if conn.closing and not conn.outbox:
            self._close(conn)
        return None

    def _close(self, conn: _Connection, flush: bool = True) -> None:
        if self._connections.pop(conn.id, None) is None:
            return
        if flush:
            with contextlib.suppress(OSError):
                conn.sock.send(conn.outbox)  # best effort: a fenced worker also fences itself
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        if (
            not flush
        ):  # a crash: reset rather than close politely, as the kernel of a killed process would not
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the coordinator thread did not stop within {timeout} s")


def update_join_file(path: Path, addresses: tuple[str, ...]) -> None:
    """Write the coordinators' ``addresses`` (the active first) into the job's join file (the ``coordinator``
    and ``store`` fields, which joiners and replacements read), atomically, readable by this user only. A
    file that is not there (the job's launcher removed it: the job ended) is left so."""
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        return
    fields["coordinator"] = fields["store"] = ",".join(addresses)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, path)


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


def interface_of(host: str) -> str:
    """The address ``host`` resolves to here: the clients resolve the same name to reach this host, so the
    coordinator need not listen on any other interface. ``0.0.0.0`` (every interface) if it does not
    resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "0.0.0.0"


def main(argv: list[str] | None = None) -> int:
    """Run a coordinator replica until its part is over: the active one until every worker finished or died
    (the local launcher starts one; the SLURM batch host runs :mod:`lightning_oobleck.slurm.rendezvous`,
    which adds the join file), or a standby (``--follow``), which a worker starts when the active asks.
    The job's secret comes from ``$OOBLECK_COORDINATOR_SECRET`` (not on the command line, where every user
    of the host could read it). Prints ``HOST:PORT`` on its first line of output once it listens.

    Exit status 0 if the replica's part ended as it should, 1 if an active one saw no worker finish."""
    coordinator = run(argv)
    failed = coordinator.role is Role.ACTIVE and coordinator.wait_done(0) and not coordinator.finished
    return 1 if failed else 0


def run(argv: list[str] | None = None, tasks_report_end: bool = False) -> Coordinator:
    """:func:`main`'s work: serve as its command line says, then return the stopped coordinator.
    ``tasks_report_end``: the job's tasks report their end in the store (``replica.ENDED_KEY``), so that an
    active coordinator serves them until the last one did (at most :data:`END_GRACE_S` once no worker is
    left)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_oobleck.recovery",
        description="Failure detector, membership authority and rendezvous store of an oobleck training.",
    )
    parser.add_argument("--world-size", type=int, default=1, help="number of worker processes at start")
    parser.add_argument("--host", default=socket.gethostname(), help="the name clients reach this host by")
    parser.add_argument("--bind", help="interface to listen on (default: the address --host resolves to)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence = dead")
    parser.add_argument("--settle", type=float, default=0.1, help="seconds to fold concurrent failures")
    parser.add_argument("--agreement-timeout", type=float, default=30.0, help="seconds to reach agreement")
    parser.add_argument("--devices-per-node", type=int, default=1, help="processes of a node (fail together)")
    parser.add_argument(
        "--kill-fenced", action="store_true", help="also SIGKILL fenced workers that run on this host"
    )
    parser.add_argument("--follow", metavar="ADDRESS", help="start as the standby of this active coordinator")
    parser.add_argument("--node", type=int, help="the job's node this process runs on (lost with it)")
    parser.add_argument("--join-file", help="keep the coordinators' addresses in this file (the job's)")
    parser.add_argument("--no-standby", action="store_true", help="never ask a worker to host a standby")
    parser.add_argument(
        "--loopback", action="store_true", help="standbys listen on 127.0.0.1 too (a job on one machine)"
    )
    parser.add_argument(
        "--no-joins", action="store_true", help="refuse workers that register once it started"
    )
    parser.add_argument(
        "--watch-pid", type=int, help="end when this process is gone, as a killed process would (no goodbye)"
    )
    parser.add_argument("--log", help="append the log here (default: warnings on stderr)")
    parser.add_argument("--address-file", type=Path, help="also write HOST:PORT here once listening")
    args = parser.parse_args(argv)
    if not os.environ.get(SECRET_ENV):
        parser.error(
            f"{SECRET_ENV} is not set: the coordinator serves the job's processes only, which present this "
            "secret (the launcher, or the SLURM batch script's rendezvous, makes it and hands it to them)"
        )
    if args.log:
        logging.basicConfig(filename=args.log, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    else:
        logging.basicConfig(level=logging.WARNING, format="oobleck-coordinator: %(message)s")
    bind = args.bind or ("127.0.0.1" if args.host in ("127.0.0.1", "localhost") else interface_of(args.host))
    settings = MembershipSettings(
        heartbeat_timeout=args.heartbeat_timeout,
        settle_s=args.settle,
        agreement_timeout=args.agreement_timeout,
        kill_fenced=args.kill_fenced,
        devices_per_node=args.devices_per_node,
        allow_joins=not args.no_joins,
    )
    coordinator = Coordinator(
        args.world_size,
        bind,
        args.port,
        settings=settings,
        advertise_host=args.host,
        secret=os.environ[SECRET_ENV],
        follow=args.follow,
        node=args.node,
        replica_settings=ReplicaSettings(
            standby=not args.no_standby, loopback=args.loopback, join_file=args.join_file
        ),
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with coordinator:
        print(coordinator.address, flush=True)
        if args.address_file:
            tmp = args.address_file.with_suffix(".tmp")
            tmp.write_text(coordinator.address + "\n")
            os.replace(tmp, args.address_file)
        log.info("%s listening on %s", coordinator.role.value, coordinator.address)
        done_at: float | None = None
        while not stop.is_set() and not coordinator.wait_ended(0.5):
            if args.watch_pid is not None and not process_alive(args.watch_pid):
                log.warning("the process that started this coordinator (%d) is gone", args.watch_pid)
                coordinator.crash()  # as its node would: a standby that follows it takes over
                break
            if coordinator.role is Role.ACTIVE and coordinator.wait_done(0):
                done_at = done_at or time.monotonic()
                waited = time.monotonic() - done_at
                if not tasks_report_end or coordinator.replica.tasks_ended or waited > END_GRACE_S:
                    break
    if coordinator.exit_reason:
        log.info("ended: %s", coordinator.exit_reason)
    return coordinator


END_GRACE_S = 60.0
"""How long a coordinator serves the tasks' reports of their end once no worker is left."""
