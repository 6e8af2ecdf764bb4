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

* failover: the active coordinator tells every worker where its standby is (``standby``, acknowledged). When
  the connection to the active one ends or falls silent for two heartbeat timeouts, the agent reconnects
  to that standby (``reattach``, its vote) and never speaks to the lost one again; the training goes on
  meanwhile, and what the training thread asks (``ready``, ``admit``) is sent again once the standby took
  over. A worker asked to (``host_standby``) starts a standby coordinator process, which dies with it.

If no coordinator can be reached at start, :meth:`WorkerAgent.start` retries for ``connect_timeout`` and
raises :class:`CoordinatorUnreachable`; if the active one is lost and no standby takes over within
:attr:`WorkerAgent.failover_timeout`, ``abort`` is set and every later call raises
:class:`CoordinatorLost`: without a failure detector the worker cannot continue safely.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from lightning_oobleck.recovery.events import Failover
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
    parse_addresses,
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

    ``address`` is the coordinators' ``host:port`` (several, comma-separated: the first that answers as the
    active one is used); by default it comes from ``OOBLECK_COORDINATOR_ADDR``, and ``secret`` (the job's,
    made at launch) from ``OOBLECK_COORDINATOR_SECRET``.
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
        self._addresses = parse_addresses(address)
        self.address = self._addresses[0]
        """The active coordinator's address (the one this agent is connected to once started)."""
        self.standby: str | None = None
        """The standby coordinator's address, as the active one last said: where to go if it is lost."""
        self.epoch = 0
        """How many times the job's coordinator failed over, as this agent knows."""
        self.coordinator: dict[str, Any] = {}
        """Where the active coordinator runs, as it said (``host``, ``pid``): for drills that kill it."""
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
        self.failovers: list[Failover] = []
        """Every time the coordinator was lost and its standby took over, in order."""
        self._cond = threading.Condition()
        self._attached = threading.Event()
        """Connected to the active coordinator (clear while failing over)."""
        self._outstanding: dict[str, dict[str, Any]] = {}
        """What the training thread asked and was not answered yet: sent again after a failover."""
        self._hosted: subprocess.Popen | None = None
        self._hosting: threading.Thread | None = None
        """The thread starting the hosted standby (:meth:`_host_standby`)."""
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
        agent = weakref.ref(self)
        os.register_at_fork(
            after_in_child=lambda: (a := agent()) is not None and a._drop_inherited_connection()
        )
        register = {
            "node": None if self.node_key else self.worker.node,
            **({"node_key": self.node_key} if self.node_key else {}),
            "device": self.worker.device,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "name": node_name(),
            "can_host_standby": self._secret is not None,  # a standby serves only holders of the secret
            **({"secret": self._secret} if self._secret is not None else {}),
            **(self.timeouts._asdict() if self.timeouts is not None else {}),
        }
        deadline = time.monotonic() + self.connect_timeout
        errors: dict[str, str] = {}
        while True:
            for address in self._addresses:
                try:
                    sock, messages = self._open(address, "register", register, deadline)
                except OSError as e:
                    errors[address] = str(e)
                    continue
                first = messages[0]
                if first["op"] == "redirect":
                    errors[address] = first["reason"]
                    sock.close()
                    continue
                if first["op"] in ("refused", "fenced"):
                    sock.close()
                    raise RegistrationRefused(
                        f"the coordinator refused worker {tuple(self.worker)}: {first['reason']}"
                    )
                if first["op"] == "finished":
                    sock.close()
                    raise self._not_admitted(first["reason"])
                self._sock, self.address = sock, address
                self.worker = Worker(int(first["node"]), self.worker.device)
                self.registered_at = time.time()
                self._welcomed(first)
                for msg in messages[1:]:
                    self._handle(msg)
                self._thread = threading.Thread(target=self._run, name="oobleck-agent", daemon=True)
                self._thread.start()
                return self
            if time.monotonic() >= deadline:
                tried = "; ".join(f"{a}: {why}" for a, why in errors.items())
                raise CoordinatorUnreachable(
                    f"cannot reach the oobleck coordinator after {self.connect_timeout:g} s ({tried}). It "
                    "runs in a process the launcher starts, or on the SLURM batch host: check that it "
                    "started and that this address is right"
                )
            time.sleep(0.2)

    def _open(
        self, address: str, op: str, fields: dict[str, Any], deadline: float
    ) -> tuple[socket.socket, list[dict[str, Any]]]:
        """Connect to the coordinator at ``address``, send ``op``, and return the socket with the first
        messages of the answer (``OSError`` if none comes by ``deadline``)."""
        sock = socket.create_connection(
            parse_address(address), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
        )
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(encode(op, **fields))
            reader, messages = LineReader(), []
            while not messages:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the coordinator at {address} did not answer {op!r}")
                sock.settimeout(remaining)
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError(f"the coordinator at {address} closed the connection")
                messages = reader.feed(data)
        except (OSError, ValueError) as e:
            sock.close()
            raise OSError(str(e)) from e
        self._reader = reader
        return sock, messages

    def _welcomed(self, welcome: dict[str, Any]) -> None:
        assert self._sock is not None
        self.epoch = int(welcome.get("epoch", 0))
        self.coordinator = welcome.get("coordinator") or {}
        self.heartbeat_interval = float(welcome["heartbeat_interval"])
        self.heartbeat_timeout = float(welcome["heartbeat_timeout"])
        self._sock.settimeout(max(1.0, self.heartbeat_timeout))
        self._attached.set()

    def coordinator_pid_here(self) -> int | None:
        """The active coordinator's process id, if it runs on this host (``None`` otherwise)."""
        here = self.coordinator.get("host") == socket.gethostname()
        return int(self.coordinator["pid"]) if here and self.coordinator.get("pid") else None

    @property
    def failover_timeout(self) -> float:
        """How long a worker that lost the active coordinator waits for its standby to take over: the
        standby waits for the votes of more than half of the workers, who notice a silent coordinator
        within two heartbeat timeouts of each other."""
        return max(10.0, 4 * self.heartbeat_timeout)

    @property
    def replicas(self) -> list[str]:
        """The coordinators this agent knows of, the active one first."""
        return [self.address, *([self.standby] if self.standby and self.standby != self.address else [])]

    def close(self, finished: bool = True) -> None:
        """Stop the agent. ``finished=True`` tells the coordinator this worker ended normally; otherwise
        the coordinator sees a dead worker (which is what a worker that failed is)."""
        if self._closing.is_set() or self._sock is None:
            return
        if finished:  # a coordinator that is failing over learns of the leave once it took over
            self._attached.wait(self.failover_timeout)
        self._closing.set()  # first: the coordinator may close the connection as soon as it reads LEAVE
        if finished:
            with contextlib.suppress(OSError):
                self._send("leave")
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_interval + 1.0)
        self._sock.close()
        ends_by = time.monotonic() + HOSTED_END_TIMEOUT_S
        if finished and self._hosting is not None:  # the hosted process may be the active coordinator now
            self._hosting.join(HOSTED_END_TIMEOUT_S)
        hosted = self._hosted
        if finished and hosted is not None and hosted.pid == self.coordinator_pid_here():
            # the active coordinator, which this process started as a standby: it serves the others until
            # the training is over everywhere (a standby only waits to take over: it ends with this process)
            try:
                hosted.wait(max(0.0, ends_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                hosted.kill()

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
        """Send a request of the training thread; while failing over (or if the send fails, which the agent's
        thread then notices), it is sent again once a standby took over."""
        with self._send_lock:
            self._outstanding[op] = fields
        if self._attached.is_set():
            with contextlib.suppress(OSError):
                self._send(op, **fields)
        self._raise_error()

    def _run(self) -> None:
        while not self._closing.is_set():
            reason = self._serve()
            if reason is None or self._closing.is_set() or not self._failover(reason):
                return

    def _serve(self) -> str | None:
        """Heartbeats and notices on the connection to the active coordinator, until closed (``None``) or the
        connection is lost (why)."""
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
                return f"it sent nothing for {now - last_heard:.1f} s"
            try:
                if now >= next_heartbeat:
                    self._send("heartbeat")
                    next_heartbeat = now + self.heartbeat_interval
                readable, _, _ = select.select([self._sock], [], [], max(0.0, next_heartbeat - now))
                if not readable:
                    continue
                data = self._sock.recv(65536)
            except OSError as e:
                return f"the connection failed ({e})"
            if not data:
                return "it closed the connection"
            last_heard = time.monotonic()
            for msg in self._reader.feed(data):
                self._handle(msg)
        return None

    def _failover(self, reason: str) -> bool:
        """The active coordinator is lost (``reason``): reconnect to its standby (a vote for it) until it took
        over, then send again what the training thread asked; ``False`` (and :class:`CoordinatorLost`) if
        there is no standby or it did not take over within :attr:`failover_timeout`. Training goes on
        meanwhile: a failure of the coordinator alone changes no generation."""
        standby, lost, lost_at = self.standby, self.address, time.time()
        if self._closing.is_set() or isinstance(self._error, TrainingFinished):
            return False
        if standby is None or standby == lost:
            self._lose(f"{reason}; no standby coordinator was started yet")
            return False
        self._attached.clear()
        assert self._sock is not None
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._cond:
            announced, agreed = self._announced, self._agreed
        vote = {
            **({"secret": self._secret} if self._secret is not None else {}),
            "node": self.worker.node,
            "device": self.worker.device,
            "announced": announced.generation if announced else -1,
            "agreed": agreed.generation if agreed else -1,
            "epoch": self.epoch,
        }
        deadline = time.monotonic() + self.failover_timeout
        while True:
            try:
                sock, messages = self._open(standby, "reattach", vote, deadline)
                break
            except OSError as e:
                if time.monotonic() >= deadline or self._closing.is_set():
                    self._lose(f"{reason}, and its standby at {standby} did not take over ({e})")
                    return False
                time.sleep(0.05)
        first = messages[0]
        if first["op"] == "fenced":
            self._fence(first["reason"])
        if first["op"] != "welcome":
            sock.close()
            self._lose(f"{reason}, and its standby at {standby} refused this worker: {first.get('reason')}")
            return False
        self._sock, self.address, self.standby = sock, standby, None
        self._welcomed(first)
        self.failovers.append(Failover(lost, standby, self.epoch, reason, lost_at, time.time()))
        for msg in messages[1:]:
            self._handle(msg)
        with self._send_lock:
            outstanding = list(self._outstanding.items())
        for op, fields in outstanding:
            with contextlib.suppress(OSError):
                self._send(op, **fields)
        return True

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
            with self._send_lock:
                self._outstanding.clear()  # a newer generation answers every older request
        elif op == "standby":
            self.standby = msg["address"]
            with contextlib.suppress(OSError):
                self._send("standby_ack", designation=msg["designation"])
        elif op == "host_standby":
            self._host_standby(msg)
        elif op == "joiners":
            self.joiners = int(msg["nodes"])
        elif op == "finished":
            with self._cond:
                self._error = self._not_admitted(msg["reason"])
                self._cond.notify_all()
        elif op == "nothing_to_admit":
            with self._cond:
                self._nothing_to_admit = int(msg["generation"])
                self.joiners = 0
                self._cond.notify_all()
            with self._send_lock:
                self._outstanding.pop("admit", None)
        elif op == "go":
            with self._cond:
                if self._announced is not None and self._announced.generation == msg["generation"]:
                    self._agreed = dataclasses.replace(self._announced, agreed_at=msg["agreed_at"])
                    self.abort.clear()
                    self._cond.notify_all()
            with self._send_lock:
                self._outstanding.pop("ready", None)

    def _not_admitted(self, reason: str) -> TrainingFinished:
        """The error of a joiner that the training ended without: at its registration or while pending."""
        return TrainingFinished(f"worker {tuple(self.worker)} was not admitted: {reason}")

    def _host_standby(self, msg: dict[str, Any]) -> None:
        """Start a standby coordinator on this node, following the active one: a process of its own that ends
        with this process, as it would with the node (it watches this process).

        It is started from a thread of its own, never from this one, which must keep the heartbeats:
        ``Popen`` returns once the child has exec'd, which it learns by reading a pipe to its end, and a
        process the training thread forks meanwhile (a ``DataLoader`` starting its workers) holds that pipe
        open for as long as it lives (a whole epoch); the node would be declared dead meanwhile."""
        if (self._hosting is not None and self._hosting.is_alive()) or (
            self._hosted is not None and self._hosted.poll() is None
        ):
            return
        host = "127.0.0.1" if msg.get("loopback") else socket.gethostname()
        module = os.environ.get(STANDBY_MODULE_ENV, STANDBY_MODULE)
        command = [sys.executable, "-m", module, "--follow", str(msg["follow"]), "--host", host]
        if msg.get("loopback"):  # once it takes over, its own standbys listen there too
            command.append("--loopback")
        command += ["--node", str(self.worker.node), "--watch-pid", str(os.getpid())]
        command += ["--heartbeat-timeout", str(self.heartbeat_timeout)]
        if msg.get("join_file"):
            command += ["--join-file", str(msg["join_file"])]
        if log_pattern := os.environ.get(COORDINATOR_LOG_ENV):
            command += ["--log", log_pattern.replace("%n", str(self.worker.node))]
        env = {**os.environ, **({SECRET_ENV: self._secret} if self._secret is not None else {})}
        self._hosting = threading.Thread(
            target=self._start_standby, args=(command, env), name="oobleck-host-standby", daemon=True
        )
        self._hosting.start()

    def _start_standby(self, command: list[str], env: dict[str, str]) -> None:
        try:
            self._hosted = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env
            )
        except OSError as e:
            sys.stderr.write(
                f"oobleck: worker {tuple(self.worker)} could not start a standby coordinator: {e}\n"
            )

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
                f"lost the oobleck coordinator at {self.address}: {reason}. Without a coordinator failures "
                "can be neither detected nor agreed on, so this worker must stop; resume from the last "
                "checkpoint (ckpt_path=)"
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


HOSTED_END_TIMEOUT_S = 90.0
"""How long a worker that finished waits for the coordinator it hosts to end (the training ends everywhere;
the job's tasks may still report their end to it)."""
STANDBY_MODULE = "lightning_oobleck.recovery"
"""What a worker runs to host a standby coordinator (``python -m``)."""
STANDBY_MODULE_ENV = "OOBLECK_STANDBY_MODULE"
"""Another module to run for it, with the same command line (a SLURM task's: it also ends the job when the
batch host is lost, :mod:`lightning_oobleck.slurm.coordinator`)."""
COORDINATOR_LOG_ENV = "OOBLECK_COORDINATOR_LOG"
"""A log file for the standby coordinators the workers start (``%n``: the node id); default: warnings on the
worker's stderr."""

_process_agent: WorkerAgent | None = None
_lost_coordinator: CoordinatorLost | None = None


def known_coordinators() -> list[str]:
    """The coordinators this process's agent knows of (the active one first), for the store's clients: after
    a failover the store is served by the coordinator that took over. Empty without an agent."""
    agent = _process_agent
    return agent.replicas if agent is not None else []


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
        sock = socket.create_connection(parse_address(parse_addresses(address)[0]), timeout=5.0)
        node, device = worker
        fields = {"secret": secret} if secret else {}
        sock.sendall(encode("present", node=node, device=device, name=node_name(), **fields))
    except OSError:
        return False
    _presence = sock
    os.register_at_fork(after_in_child=sock.close)
    return True
