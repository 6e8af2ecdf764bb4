"""The worker side of recovery: one :class:`WorkerAgent` per worker process.

The agent connects to the :mod:`~lightning_oobleck.recovery.coordinator` (protocol there), registers
its ``(node, device)``, and runs one daemon thread that sends heartbeats and receives notices. The
training code sees:

* ``abort``: a :class:`threading.Event` set as soon as the coordinator reports a failure or announces a
  new generation. Every blocking communication of the worker waits through an abortable wait that
  polls it, so a rank blocked on a live-but-silent peer (which gloo would wait on for the whole
  process-group timeout) is released within the coordinator's detection time.
* ``agree(after, timeout)``: after an abort, wait for the next generation and pass its barrier;
  returns the agreed :class:`~lightning_oobleck.recovery.protocol.Membership` (rank = index). If yet
  another failure happens meanwhile, it starts over with the newer generation by itself. On return
  ``abort`` is clear again (unless a newer failure already arrived).
* joiners: ``joiners`` is how many whole nodes wait to join (the coordinator tells the members);
  :meth:`WorkerAgent.request_admission` asks for them at a step boundary. A joiner's own agent registers
  without a node id (``node_key``) and learns it from the coordinator; it waits in ``agree`` until admitted,
  or gets :class:`TrainingFinished` if the training ends first.
* fencing: if the coordinator declares this worker dead (it was stopped, hung or cut off), the agent
  exits the process at once with status ``FENCED_EXIT_CODE``, without running any more training code.
  It also fences itself when its own thread was frozen longer than the heartbeat timeout (SIGSTOP
  then SIGCONT): by then the coordinator has declared it dead, whatever message may have been lost.

The coordinator is a single point of failure (like SLURM's batch host): if it cannot be reached at
start, :meth:`WorkerAgent.start` retries for ``connect_timeout`` and raises
:class:`CoordinatorUnreachable`; if it is lost later, ``abort`` is set and every later call raises
:class:`CoordinatorLost`: without a failure detector the worker cannot continue safely.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import select
import socket
import sys
import threading
import time
import weakref
from typing import Any

from lightning_oobleck.recovery.protocol import (
    ADDRESS_ENV,
    FENCED_EXIT_CODE,
    SECRET_ENV,
    LineReader,
    Membership,
    Timeouts,
    encode,
    node_name,
    parse_address,
)
from lightning_oobleck.worker import Worker


class RecoveryError(RuntimeError):
    """Base class of the agent's errors."""


class CoordinatorUnreachable(RecoveryError):
    """The coordinator could not be reached at start."""


class CoordinatorLost(RecoveryError):
    """The connection to the coordinator was lost during the run."""


class RegistrationRefused(RecoveryError):
    """The coordinator refused this worker (duplicate (node, device), or a node declared dead)."""


class AgreementTimeout(RecoveryError, TimeoutError):
    """No agreement was reached within the caller's timeout."""


class TrainingFinished(RecoveryError):
    """The training ended while this worker waited to be admitted (a joiner): nothing is left to do."""


class GenerationChanged(RecoveryError):
    """A newer generation was announced while waiting for an older one's agreement."""

    def __init__(self, membership: Membership) -> None:
        super().__init__(f"generation {membership.generation} was announced: {membership.cause}")
        self.membership = membership


class WorkerAgent:
    """Failure notices, agreement and fencing for one worker process (see the module docstring).

    ``address`` is the coordinator's ``host:port``; by default it comes from ``OOBLECK_COORDINATOR_ADDR``, and
    ``secret`` (the job's, made at launch) from ``OOBLECK_COORDINATOR_SECRET``.
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        worker: tuple[int | None, int],
        address: str | None = None,
        *,
        connect_timeout: float = 30.0,
        secret: str | None = None,
        timeouts: Timeouts | None = None,
        node_key: str | None = None,
    ) -> None:
        address = address or os.environ.get(ADDRESS_ENV)
        if not address:
            raise ValueError(
                f"no coordinator address: pass address='HOST:PORT' or set {ADDRESS_ENV} "
                "(the launcher or the SLURM batch script sets it)"
            )
        self._host, self._port = parse_address(address)
        self.address = address
        self._secret = secret if secret is not None else os.environ.get(SECRET_ENV)
        node, device = worker
        if node is None and not node_key:
            raise ValueError("a worker without a node id (a joiner) needs node_key: a name for its node")
        self.worker = Worker(-1 if node is None else node, device)
        """This worker's ``(node, device)``; a joiner's node id is known once :meth:`start` returned."""
        self.node_key = node_key if node is None else None
        self.joiners = 0
        """How many whole nodes wait to join, as the coordinator last said (members only)."""
        self.registered_at: float | None = None
        """Wall-clock time the coordinator welcomed this worker (for a joiner: when it began to wait)."""
        self.connect_timeout = connect_timeout
        self.timeouts = timeouts
        """The failure detector's timeouts this worker's configuration asks for (``None``: the
        coordinator's); every worker of a job must ask for the same."""
        self.abort = threading.Event()
        """Set when the current generation must stop communicating (a failure or a new generation)."""
        self.aborted_at: float | None = None
        """Wall-clock time ``abort`` was last set (for detection-latency measurements)."""
        self.heartbeat_interval = 0.5
        self.heartbeat_timeout = 2.0
        self._cond = threading.Condition()
        self._nothing_to_admit = -1
        self._announced: Membership | None = None
        self._agreed: Membership | None = None
        self._error: RecoveryError | None = None
        self._sock: socket.socket | None = None
        self._reader = LineReader()
        self._send_lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> WorkerAgent:
        """Connect (retrying for ``connect_timeout``), register, and start the heartbeat thread."""
        if self._sock is not None:
            raise RuntimeError("this agent was already started: use one WorkerAgent per start")
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                self._sock = socket.create_connection((self._host, self._port), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise CoordinatorUnreachable(
                        f"cannot reach the oobleck coordinator at {self.address} after "
                        f"{self.connect_timeout:g} s ({e}). It runs in the launcher's supervisor process, "
                        "or on the SLURM batch host: check that it started and that this address is right"
                    ) from e
                time.sleep(0.2)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        agent = weakref.ref(self)
        os.register_at_fork(
            after_in_child=lambda: (a := agent()) is not None and a._drop_inherited_connection()
        )
        try:
            self._send(
                "register",
                node=None if self.node_key else self.worker.node,
                **({"node_key": self.node_key} if self.node_key else {}),
                device=self.worker.device,
                pid=os.getpid(),
                host=socket.gethostname(),
                name=node_name(),
                **({"secret": self._secret} if self._secret is not None else {}),
                **(self.timeouts._asdict() if self.timeouts is not None else {}),
            )
            pending = self._await_welcome(deadline=time.monotonic() + self.connect_timeout)
        except OSError as e:
            self._sock.close()
            raise CoordinatorUnreachable(
                f"registration with the coordinator at {self.address} failed: {e}"
            ) from e
        except RecoveryError:
            self._sock.close()
            raise
        for msg in pending:
            self._handle(msg)
        self._thread = threading.Thread(target=self._run, name="oobleck-agent", daemon=True)
        self._thread.start()
        return self

    def _await_welcome(self, deadline: float) -> list[dict[str, Any]]:
        assert self._sock is not None
        messages: list[dict[str, Any]] = []
        while not messages:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorUnreachable(
                    f"the coordinator at {self.address} did not answer the registration"
                )
            self._sock.settimeout(remaining)
            data = self._sock.recv(65536)
            if not data:
                raise CoordinatorUnreachable(f"the coordinator at {self.address} closed the connection")
            messages = self._reader.feed(data)
        first, rest = messages[0], messages[1:]
        if first["op"] in ("refused", "fenced"):
            raise RegistrationRefused(
                f"the coordinator refused worker {tuple(self.worker)}: {first['reason']}"
            )
        self.worker = Worker(int(first["node"]), self.worker.device)
        self.registered_at = time.time()
        self.heartbeat_interval = float(first["heartbeat_interval"])
        self.heartbeat_timeout = float(first["heartbeat_timeout"])
        self._sock.settimeout(max(1.0, self.heartbeat_timeout))
        return rest

    def close(self, finished: bool = True) -> None:
        """Stop the agent. ``finished=True`` tells the coordinator this worker ended normally; otherwise
        the coordinator sees a dead worker (which is what a worker that failed is)."""
        if self._closing.is_set() or self._sock is None:
            return
        self._closing.set()  # first: the coordinator may close the connection as soon as it reads LEAVE
        if finished:
            with contextlib.suppress(OSError):
                self._send("leave")
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_interval + 1.0)
        self._sock.close()

    def __enter__(self) -> WorkerAgent:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(finished=exc_type is None)

    # ------------------------------------------------------------------ state

    @property
    def generation(self) -> int:
        """The newest announced generation (-1 before the first)."""
        with self._cond:
            return self._announced.generation if self._announced else -1

    @property
    def announced(self) -> Membership | None:
        """The newest announced membership, agreed or not."""
        with self._cond:
            return self._announced

    @property
    def members(self) -> Membership | None:
        """The newest agreed membership (None before generation 0 is agreed)."""
        with self._cond:
            return self._agreed

    # ------------------------------------------------------------------ agreement

    def wait_announced(self, after: int, timeout: float | None) -> Membership:
        """Wait for a generation newer than ``after`` to be announced (``timeout=None``: as long as the
        coordinator runs); return the newest."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._error or (self._announced and self._announced.generation > after), timeout
            )
            self._raise_error()
            if self._announced is None or self._announced.generation <= after:
                raise AgreementTimeout(
                    f"no generation newer than {after} was announced within {timeout} s "
                    f"(are all {'workers started' if after < 0 else 'survivors connected'}?)"
                )
            return self._announced

    def ready_for(self, generation: int, timeout: float) -> Membership:
        """The agreement barrier: tell the coordinator this worker is ready for ``generation`` and wait
        until every member is. Raises :class:`GenerationChanged` if a newer one is announced first."""
        with self._cond:
            self._raise_error()
            announced = self._announced
            if announced is None or announced.generation < generation:
                raise ValueError(f"generation {generation} has not been announced yet: use wait_announced")
            if announced.generation > generation:
                raise GenerationChanged(announced)
        self._send_or_lose("ready", generation=generation)

        def settled() -> bool:
            agreed, newest = self._agreed, self._announced
            return bool(
                self._error
                or (agreed and agreed.generation >= generation)
                or (newest and newest.generation > generation)
            )

        with self._cond:
            self._cond.wait_for(settled, timeout)
            if self._agreed is not None and self._agreed.generation == generation:
                return self._agreed
            self._raise_error()
            assert self._announced is not None
            if self._announced.generation > generation:
                raise GenerationChanged(self._announced)
            raise AgreementTimeout(f"generation {generation} was not agreed within {timeout:g} s")

    def agree(self, after: int, timeout: float) -> Membership:
        """Wait for the first generation newer than ``after`` that every member agrees on; return it.

        At start ``after=-1``; after an abort, ``after`` is the generation that was running.
        """
        deadline = time.monotonic() + timeout
        while True:
            announced = self.wait_announced(after, max(0.0, deadline - time.monotonic()))
            try:
                return self.ready_for(announced.generation, max(0.0, deadline - time.monotonic()))
            except GenerationChanged:
                after = announced.generation

    def request_admission(self, generation: int, nodes: int, timeout: float) -> bool:
        """At a step boundary of ``generation``: ask the coordinator to admit up to ``nodes`` whole pending
        nodes now.

        Returns ``True`` once a newer generation is announced (``abort`` is then set: recover into it),
        ``False`` if nobody is left to admit (generation ``generation`` goes on)."""
        self._send_or_lose("admit", generation=generation, nodes=nodes)

        def answered() -> bool:
            newest = self._announced
            return bool(
                self._error
                or (newest is not None and newest.generation > generation)
                or self._nothing_to_admit >= generation
            )

        with self._cond:
            if not self._cond.wait_for(answered, timeout):
                raise AgreementTimeout(f"the coordinator did not answer an admission within {timeout:g} s")
            self._raise_error()
            assert self._announced is not None
            return self._announced.generation > generation

    # ------------------------------------------------------------------ internals

    def _drop_inherited_connection(self) -> None:
        """In a forked child (e.g. a DataLoader worker), close the inherited copy of the connection:
        otherwise the child keeps it open and the worker's death would not close it for the coordinator."""
        if self._sock is not None:
            self._sock.close()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _send(self, op: str, **fields: Any) -> None:
        assert self._sock is not None
        with self._send_lock:
            self._sock.sendall(encode(op, **fields))

    def _send_or_lose(self, op: str, **fields: Any) -> None:
        try:
            self._send(op, **fields)
        except OSError as e:
            self._lose(f"sending to it failed ({e})")
            self._raise_error()

    def _run(self) -> None:
        assert self._sock is not None
        now = time.monotonic()
        last_tick = last_heard = next_heartbeat = now
        while not self._closing.is_set():
            now = time.monotonic()
            if now - last_tick > self.heartbeat_timeout:
                self._fence(
                    f"this process was frozen for {now - last_tick:.1f} s, longer than the heartbeat timeout "
                    f"({self.heartbeat_timeout:g} s): the coordinator has declared it dead"
                )
            last_tick = now
            if now - last_heard > 2 * self.heartbeat_timeout:
                self._lose(f"it sent nothing for {now - last_heard:.1f} s")
                return
            try:
                if now >= next_heartbeat:
                    self._send("heartbeat")
                    next_heartbeat = now + self.heartbeat_interval
                readable, _, _ = select.select([self._sock], [], [], max(0.0, next_heartbeat - now))
                if not readable:
                    continue
                data = self._sock.recv(65536)
            except OSError as e:
                self._lose(f"the connection failed ({e})")
                return
            if not data:
                self._lose("it closed the connection")
                return
            last_heard = time.monotonic()
            for msg in self._reader.feed(data):
                self._handle(msg)

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "fenced":
            self._fence(msg["reason"])
        elif op == "abort":
            self._set_abort()
        elif op == "announce":
            membership = Membership.from_message(msg)
            with self._cond:
                self._announced = membership
                self._set_abort()
                self._cond.notify_all()
        elif op == "joiners":
            self.joiners = int(msg["nodes"])
        elif op == "finished":
            with self._cond:
                self._error = TrainingFinished(
                    f"worker {tuple(self.worker)} was not admitted: {msg['reason']}"
                )
                self._cond.notify_all()
        elif op == "nothing_to_admit":
            with self._cond:
                self._nothing_to_admit = int(msg["generation"])
                self.joiners = 0
                self._cond.notify_all()
        elif op == "go":
            with self._cond:
                if self._announced is not None and self._announced.generation == msg["generation"]:
                    self._agreed = dataclasses.replace(self._announced, agreed_at=msg["agreed_at"])
                    self.abort.clear()
                    self._cond.notify_all()

    def _set_abort(self) -> None:
        if not self.abort.is_set():
            self.aborted_at = time.time()
            self.abort.set()

    def _lose(self, reason: str) -> None:
        global _lost_coordinator
        if self._closing.is_set() or isinstance(self._error, TrainingFinished):
            return  # closed by this worker, or by the coordinator after it said why
        with self._cond:
            self._error = _lost_coordinator = CoordinatorLost(
                f"lost the oobleck coordinator at {self.address}: {reason}. Its host is a single point of "
                "failure (like SLURM's batch host): without it failures can be neither detected nor agreed "
                "on, so this worker must stop; resume from the last checkpoint (ckpt_path=)"
            )
            self._set_abort()
            self._cond.notify_all()

    def _fence(self, reason: str) -> None:
        node, device = self.worker
        sys.stderr.write(
            f"oobleck: worker (node {node}, device {device}, pid {os.getpid()}) fenced: {reason}; "
            f"exiting with status {FENCED_EXIT_CODE}\n"
        )
        sys.stderr.flush()
        os._exit(FENCED_EXIT_CODE)


_process_agent: WorkerAgent | None = None
_lost_coordinator: CoordinatorLost | None = None


def lost_coordinator() -> CoordinatorLost | None:
    """The loss of its coordinator that an agent of this process saw, if one did: for what must happen after
    the training whatever it raised, and once its agent is closed (a SLURM task ends the job)."""
    return _lost_coordinator


def process_agent(worker: Worker, **kwargs: Any) -> WorkerAgent:
    """This process's agent: started (``WorkerAgent(worker, **kwargs).start()``) on first use and kept for
    every later run of the process (``fit``, then ``validate``...): a worker registers once, and its
    membership carries over from one run to the next. It leaves (``close_process_agent``) when the process
    ends normally; a process that fails closes it unfinished, so the peers see it lost at once."""
    global _process_agent
    if _process_agent is not None and _process_agent.worker == Worker(*worker):
        wanted = kwargs.get("timeouts")
        if wanted is not None and wanted != _process_agent.timeouts:
            raise ValueError(
                f"this process registered with {_process_agent.timeouts} and a later run asks for {wanted}: "
                "the failure detector's timeouts are the job's; give every run of the process the same "
                "heartbeat_timeout_s and hang_timeout_s"
            )
        return _process_agent
    close_process_agent(finished=False)
    _process_agent = WorkerAgent(worker, **kwargs).start()
    atexit.register(close_process_agent)
    # A worker with a stuck abandoned wait ends without finalisation: it still says goodbye first (torch and
    # the execution package are loaded by now: the caller is a worker).
    from lightning_oobleck.execution.exit_guard import before_exit

    before_exit(_close_at_exit)
    return _process_agent


def _close_at_exit(failed: bool) -> None:
    close_process_agent(finished=not failed)


def close_process_agent(finished: bool = True) -> None:
    """Close this process's agent, if one runs: ``finished`` says LEAVE (ended normally); otherwise the
    coordinator declares the worker dead as soon as its connection closes."""
    global _process_agent
    agent, _process_agent = _process_agent, None
    if agent is not None:
        agent.close(finished=finished)


_presence: socket.socket | None = None


def announce_presence(worker: Worker, address: str | None = None, secret: str | None = None) -> bool:
    """Tell the coordinator, before anything slow runs (imports, loading data), that this process is
    ``worker``, on a connection kept open for the process's life: if the process ends before its agent
    registers, the coordinator sees that connection end and starts without it instead of waiting for it.

    For launchers that cannot report a process's end themselves (``srun``); best effort: returns whether
    the coordinator (``address``, default ``$OOBLECK_COORDINATOR_ADDR``) took the message. Forked children
    (loader workers) close their copy, so that only this process's end closes the connection."""
    global _presence
    address = address or os.environ.get(ADDRESS_ENV)
    secret = secret if secret is not None else os.environ.get(SECRET_ENV)
    if _presence is not None or not address:
        return False
    try:
        sock = socket.create_connection(parse_address(address), timeout=5.0)
        node, device = worker
        fields = {"secret": secret} if secret else {}
        sock.sendall(encode("present", node=node, device=device, name=node_name(), **fields))
    except OSError:
        return False
    _presence = sock
    os.register_at_fork(after_in_child=sock.close)
    return True
