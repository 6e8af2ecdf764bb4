"""The recovery coordinator: the single authority on who is alive and which generation is current.

It runs in a process that is not a worker (the local launcher's supervisor, or the SLURM batch host),
so the loss of any worker, global rank 0 included, is survived. Every worker's
:class:`~lightning_oobleck.recovery.agent.WorkerAgent` keeps one TCP connection to it (wire format in
:mod:`~lightning_oobleck.recovery.protocol`). One thread serves all connections with ``selectors`` and
feeds what happens on them to the protocol's state machine,
:class:`~lightning_oobleck.recovery.membership.MembershipMachine` (the protocol, phase by phase, is
there), then carries out its effects: messages, closed connections, killed processes.

How deaths are seen: a SIGKILLed worker's connection ends at once (milliseconds); a stopped, hung or
cut-off one stops sending heartbeats; a worker's hint "peer P looks dead" shortens P's deadline to two
heartbeat intervals; the launcher reports a process that ended before it registered. A fenced worker's
agent exits its process (a stopped one when it wakes up); with ``kill_fenced`` (one machine: the local
launcher), a fenced process on this host that provably holds its connection is also SIGKILLed, so that
its open gloo connections close and its peers' pending operations fail at once.

The coordinator's host is a single point of failure, like SLURM's batch host: if it dies, the workers
lose their failure detector and stop (see ``WorkerAgent``); the run resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
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

from lightning_oobleck.recovery.membership import (
    Close,
    Death,
    Effect,
    Kill,
    MembershipMachine,
    MembershipSettings,
    Send,
)
from lightning_oobleck.recovery.protocol import SECRET_ENV, LineReader, Membership, accept, encode
from lightning_oobleck.worker import Worker

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "Death", "holds_connection", "main"]


@dataclass(eq=False)
class _Connection:
    id: int
    sock: socket.socket
    peer: str
    reader: LineReader = field(default_factory=LineReader)
    outbox: bytearray = field(default_factory=bytearray)
    writing: bool = False


class Coordinator:
    """Failure detector, membership authority and fence for one training run.

    ``Coordinator(world_size).start()`` serves in a daemon thread; ``stop()`` ends it. All public
    attributes may be read from any thread. ``settings``: the failure detector's timeouts, joins, the
    processes of a node (:class:`~lightning_oobleck.recovery.membership.MembershipSettings`); ``secret``:
    workers must present it to register (``None``: no secret, for trusted test setups only).
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
    ) -> None:
        self.machine = MembershipMachine(
            world_size,
            settings,
            secret=secret,
            host=socket.gethostname(),
            wall_offset=time.time() - time.monotonic(),
        )
        self.world_size = world_size
        self.secret = secret
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
        self._lock = threading.Lock()
        """Held while the machine changes, so that other threads read consistent records."""
        self._connections: dict[int, _Connection] = {}
        self._broken: dict[int, str] = {}
        """Connections a send failed on (id: why), ended by :meth:`_end_broken` after what they still hold."""
        self._next_id = 0
        self._exits: list[tuple[Worker, str]] = []

    # ------------------------------------------------------------------ public API

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
        """Report that ``worker``'s process ended (from any thread); see ``MembershipMachine.exited``."""
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
        """Serve until :meth:`stop` (the calling thread becomes the service thread)."""
        try:
            while not self._stopping.is_set():
                deadline = self.machine.next_deadline()
                now = time.monotonic()
                timeout = 1.0 if deadline is None else max(0.0, min(deadline - now, 1.0))
                for key, events in self._selector.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        key.fileobj.recv(64)  # type: ignore[union-attr]
                        with self._lock:
                            exits, self._exits = self._exits, []
                        for worker, reason in exits:
                            self._apply(
                                lambda w=worker, r=reason: self.machine.exited(w, r, time.monotonic())
                            )
                    else:
                        self._service(key.data, events)
                self._end_broken()
                self._apply(lambda: self.machine.tick(time.monotonic()))
                self._end_broken()
                if self.machine.done:
                    self._done.set()
        except Exception:
            log.exception("the coordinator failed; every worker will see it lost")
            raise
        finally:
            for conn in list(self._connections.values()):
                self._close(conn)
            self._selector.close()
            self._server.close()
            self._wake_r.close()
            self._wake_w.close()

    def _apply(self, event: Callable[[], list[Effect]]) -> None:
        """Run one machine event under the lock, then carry out its effects; a connection a send fails on is
        ended by :meth:`_end_broken`."""
        with self._lock:
            effects = event()
        for effect in effects:
            conn = self._connections.get(effect.conn)
            if conn is None:
                continue
            if isinstance(effect, Send):
                conn.outbox += encode(effect.op, **effect.fields)
                if (error := self._flush(conn)) is not None:
                    self._broken.setdefault(conn.id, f"sending to it failed ({error}): the process died")
            elif isinstance(effect, Kill):
                self._kill(conn, effect.pid)
            elif isinstance(effect, Close):
                self._close(conn)

    def _accept(self) -> None:
        if (accepted := accept(self._server)) is None:
            return
        sock, addr = accepted
        self._next_id += 1
        conn = _Connection(self._next_id, sock, f"{addr[0]}:{addr[1]}")
        self._connections[conn.id] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._apply(lambda: self.machine.connected(conn.id, time.monotonic()))

    def _service(self, conn: _Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE and (error := self._flush(conn)) is not None:
            self._broken.setdefault(conn.id, f"sending to it failed ({error}): the process died")
            return
        if not events & selectors.EVENT_READ or conn.id not in self._connections:
            return
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            reason = f"its connection failed ({e.strerror or e}): the process died"
            self._apply(lambda: self.machine.ended(conn.id, reason, time.monotonic()))
            return
        if not data:
            self._apply(
                lambda: self.machine.ended(
                    conn.id, "its connection closed: the process died", time.monotonic()
                )
            )
            return
        try:
            messages = conn.reader.feed(data)
        except ValueError as e:
            why = f"it sent garbage ({e})"
            self._apply(lambda: self.machine.ended(conn.id, why, time.monotonic(), by_peer=False))
            return
        for msg in messages:
            self._apply(lambda m=msg: self.machine.received(conn.id, m, time.monotonic()))

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
                self._apply(lambda c=conn_id, m=msg: self.machine.received(c, m, time.monotonic()))
            if conn_id in self._connections:
                self._apply(lambda c=conn_id, r=why: self.machine.ended(c, r, time.monotonic()))
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
        return None

    def _close(self, conn: _Connection) -> None:
        if self._connections.pop(conn.id, None) is None:
            return
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
    """Run a coordinator until every worker finished or died: for a launcher of your own (the local
    launcher hosts one in its supervisor; the SLURM batch host runs
    :mod:`lightning_oobleck.slurm.rendezvous`, which adds the rendezvous store and the join file). The job's
    secret comes from ``$OOBLECK_COORDINATOR_SECRET`` (give the workers the same; not on the command line,
    where every user of the host could read it).

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
    settings = MembershipSettings(
        heartbeat_timeout=args.heartbeat_timeout,
        settle_s=args.settle,
        agreement_timeout=args.agreement_timeout,
        kill_fenced=args.kill_fenced,
    )
    with Coordinator(
        args.world_size,
        args.host,
        args.port,
        settings=settings,
        advertise_host=args.advertise_host,
        secret=os.environ.get(SECRET_ENV) or None,
    ) as coordinator:
        log.info("listening on %s for %d workers", coordinator.address, args.world_size)
        if args.address_file:
            tmp = args.address_file.with_suffix(".tmp")
            tmp.write_text(coordinator.address + "\n")
            os.replace(tmp, args.address_file)
        while not coordinator.wait_done(1.0):
            pass
    return 0 if coordinator.finished else 1
