"""Local launcher: the calling process becomes a supervisor of N worker processes that may die.

Lightning's launchers make the main process rank 0 (``ddp``) or kill every child when one exits non-zero
(both ``ddp`` and ``ddp_spawn``). Oobleck keeps training when any worker dies, rank 0 included, so here:

* the calling process is a **supervisor**, never a worker: it starts the job's coordinator (its failure
  detector and rendezvous store: :class:`~lightning_oobleck.recovery.service.CoordinatorProcess`, on the
  loopback interface, answering only processes that present the job's secret), which a worker's standby
  replaces if it is lost, and runs the :class:`SupervisorService` objects;
* workers are started with ``forkserver`` (default: forked from a single-threaded server process that
  has imported torch and Lightning once, so starting a worker costs no re-import and never inherits a
  lock held by another thread or an OpenMP pool), ``spawn`` (like ``ddp_spawn``) or ``fork``
  (notebooks; unsafe once the caller has run torch ops or started threads): the caller's
  ``trainer.fit`` returns in the supervisor
  with the survivors' state and weights, which a script re-run (``ddp``) cannot give, and the supervisor
  never runs training code that could crash it;
* workers are started *before* the coordinator and the services, and wait for their environment on a
  pipe: no supervisor thread exists at a fork (a worker forked while a store's server thread ran was seen
  to deadlock in its store client, past the store's own timeout);
* a worker's death is reported to the services at once and otherwise left alone; the run succeeds if any
  worker finished, and the supervisor raises :class:`LaunchError` only when none did;
* with ``replace_failed_after_s``, a dead worker's node is replaced that long after its death: new
  processes (``OOBLECK_NODE_KEY=replacement-K``) that join the running training at a step boundary, as a
  repaired node would (a replacement that finds the training over exits quietly);
* workers die with the supervisor (Linux ``PR_SET_PDEATHSIG``) and every wait is bounded.

Worker ``r`` gets ``OOBLECK_STORE_ADDR``, the job's secret (``OOBLECK_COORDINATOR_SECRET``), ``OOBLECK_RANK``,
``OOBLECK_WORLD_SIZE``, ``OOBLECK_NODE`` (``r // devices_per_node``) and ``OOBLECK_DEVICE`` (``r %
devices_per_node``), read by
:class:`~lightning_oobleck.lightning.environment.LocalOobleckEnvironment`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.trainer.states import TrainerFn

from lightning_oobleck.execution.faults import FAULTS_ENV
from lightning_oobleck.lightning._internals import (
    GlobalStateSnapshot,
    Launcher,
    TunerExit,
    check_bad_cuda_fork,
    check_missing_main_guard,
    disable_module_memory_sharing,
    set_num_threads_if_needed,
)
from lightning_oobleck.lightning.config import START_METHODS, StartMethod
from lightning_oobleck.lightning.console import show_warnings_on_rank_zero
from lightning_oobleck.lightning.environment import DEVICE_VAR, local_worker_env
from lightning_oobleck.lightning.results import (
    collect_layers,
    read_error,
    read_exception,
    read_result,
    restore_in_main_process,
    result_path,
    write_worker_error,
    write_worker_result,
)
from lightning_oobleck.process import die_with_parent
from lightning_oobleck.recovery.agent import TrainingFinished, close_process_agent
from lightning_oobleck.recovery.errors import UnrecoverableFailure
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import ADDRESS_ENV, NODE_KEY_ENV, SECRET_ENV
from lightning_oobleck.recovery.service import CoordinatorProcess
from lightning_oobleck.recovery.startup import StartFailure
from lightning_oobleck.worker import Worker

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_KILL_JOIN_TIMEOUT_S = 10.0
_RELEASE_TIMEOUT_S = 300.0
"""How long a started worker waits for the supervisor's store and services to come up."""
_UNGUARDED_SCRIPT_EXIT = 78
"""A worker's exit status when importing the user's script started a fit
(:func:`_exit_if_importing_script`)."""
_UNGUARDED_SCRIPT = (
    "your script starts training when it is imported: the workers (start_method={method!r}) import it to "
    "find its classes, so put the code that builds the Trainer and calls fit under "
    '`if __name__ == "__main__":` (as in the README\'s example)'
)

FORWARDED_ENV = (FAULTS_ENV,)
"""Variables of the launching process handed to every worker as they are when the fit starts."""
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_oobleck.lightning")
"""Imported once by the fork server, so that forked workers start without importing them again. The fork
server is one per process: whoever starts it first sets what it preloads."""
_MAX_WAIT_S = 1.0
"""Longest single wait on worker sentinels, so that deadlines are checked at least this often."""


class LaunchError(RuntimeError):
    """No worker finished: every one died or raised. The message lists each worker's fate."""


class SupervisorService(Protocol):
    """Something that runs in the supervisor for the whole launch, e.g. the recovery coordinator."""

    def start(self, supervisor: Supervisor) -> None:
        """Called once the store is up and before any worker starts; may add to ``supervisor.worker_env``."""

    def worker_exited(self, rank: int, exitcode: int) -> None:
        """Called as soon as the supervisor sees worker ``rank`` exit (``exitcode < 0``: killed by signal)."""

    def stop(self) -> None:
        """Called after every worker has exited (or been killed); must return promptly."""


class Supervisor:
    """The job's coordinator (its failure detector and rendezvous store, in a process of its own) plus the
    services, started and stopped together, and the job's secret (:attr:`secret`, made here: the
    coordinators serve only processes that present it, and :attr:`worker_env` hands it to the workers
    alone). Used by :class:`OobleckLauncher` on one machine, listening on ``host`` (default: loopback only).
    ``coordinator``: the failure detector's settings; ``workdir``: where the coordinators keep their
    addresses (the launch's folder)."""

    def __init__(
        self,
        world_size: int,
        *,
        devices_per_node: int = 1,
        services: Sequence[SupervisorService] = (),
        host: str = "127.0.0.1",
        coordinator: MembershipSettings | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.world_size = world_size
        self.devices_per_node = devices_per_node
        self.services = list(services)
        self.host = host
        self.secret = secrets.token_hex(16)
        self.coordinator: CoordinatorProcess | None = None
        self._settings = replace(coordinator or MembershipSettings(), devices_per_node=devices_per_node)
        self._workdir = workdir
        self.worker_env: dict[str, str] = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        self.worker_env[SECRET_ENV] = self.secret
        """Variables every worker gets besides its position, e.g. a service's address (and those of
        :data:`FORWARDED_ENV` set now: a worker forked from a server started earlier would miss them)."""
        self._started: list[SupervisorService] = []
        self._own_workdir: Path | None = None
        """A folder :meth:`start` made because none was given, removed by :meth:`stop`."""

    @property
    def store_addr(self) -> str:
        """The job's coordinators as they are now, the active first (``OOBLECK_STORE_ADDR`` and
        ``OOBLECK_COORDINATOR_ADDR`` of a worker started now)."""
        if self.coordinator is None:
            raise RuntimeError("the supervisor is not started")
        return self.coordinator.addresses

    def start(self) -> None:
        workdir = self._workdir
        if workdir is None:
            workdir = self._own_workdir = Path(tempfile.mkdtemp(prefix="oobleck-supervisor-"))
        # every worker runs on this machine: a fenced one is also killed, so that its peers see it gone
        settings = replace(self._settings, kill_fenced=True)
        self.coordinator = CoordinatorProcess(
            self.world_size, self.secret, workdir / "coordinators.json", settings=settings, host=self.host
        )
        self.worker_env[ADDRESS_ENV] = self.coordinator.address
        try:
            for service in self.services:
                service.start(self)
                self._started.append(service)
        except BaseException:
            self.stop()
            raise

    def worker_exited(self, rank: int, exitcode: int) -> None:
        if self.coordinator is not None:  # the launcher numbers ranks node by node
            how = f"killed by signal {-exitcode}" if exitcode < 0 else f"exited with status {exitcode}"
            worker = Worker(*divmod(rank, self.devices_per_node))
            self.coordinator.worker_exited(worker, f"its process ended ({how}) before it registered")
        for service in self._started:
            service.worker_exited(rank, exitcode)

    def stop(self) -> None:
        """Stop the services in reverse order, then the coordinator; one service failing does not stop the
        rest."""
        while self._started:
            service = self._started.pop()
            try:
                service.stop()
            except Exception:
                log.exception("supervisor service %r failed to stop", service)
        if self.coordinator is not None:
            self.coordinator.stop()
        self.coordinator = None
        if self._own_workdir is not None:
            shutil.rmtree(self._own_workdir, ignore_errors=True)
            self._own_workdir = None

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class LaunchReport:
    """How each worker of the last launch ended."""

    exitcodes: dict[int, int]
    finished: tuple[int, ...]
    """Ranks that returned a result, ascending."""
    lost: dict[int, str] = field(default_factory=dict)
    """Rank -> why it did not finish (signal, exit code, exception, killed by the supervisor)."""
    result_rank: int | None = None
    """The finished rank whose result the caller got."""
    user_error: int | None = None
    """A rank whose exception workers of two nodes raised alike: the model's error, not a node failure."""
    errors: tuple[int, ...] = ()
    """The ranks that ended with an ``Exception``, in the order they ended."""


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    workdir: Path
    supervisor_pid: int
    num_processes: int
    spawned: bool


class OobleckLauncher(Launcher):
    """Starts ``num_processes`` workers under a supervisor that survives any of them (see module doc).

    Args:
        num_processes: workers to start.
        devices_per_node: devices per failure domain; worker ``r`` is device ``r % G`` of node ``r // G``.
        start_method: ``"forkserver"`` (default) or ``"spawn"``, both needing the
            ``if __name__ == "__main__"`` guard and picklable arguments, or ``"fork"`` (interactive
            sessions; no CUDA, no torch threads before launching).
        services: started in the supervisor before the workers (append to :attr:`services` until launch).
        host: address the coordinator listens on and workers connect to.
        coordinator: the failure detector's settings (the job's coordinator and its standby).
        timeout_s: bound on the whole launch; ``None`` lets training run as long as it needs.
        finish_grace_s: once one worker finished, how long the others may take before they are killed
            (a hung or stopped worker must not hold the run forever).
        replace_failed_after_s: start a replacement for a dead worker's node this long after its death
            (``None``: never); ``forkserver`` and ``spawn`` only (a fork of the supervisor once its threads
            run could deadlock).
        preflight: ``preflight(trainer, args)`` raises for a call that cannot run (``args`` of
            ``trainer.fit/validate/test/predict``), in this process, before any worker starts.
    """

    def __init__(
        self,
        num_processes: int,
        *,
        devices_per_node: int = 1,
        start_method: StartMethod = "forkserver",
        services: Sequence[SupervisorService] = (),
        host: str = "127.0.0.1",
        coordinator: MembershipSettings | None = None,
        timeout_s: float | None = None,
        finish_grace_s: float = 60.0,
        replace_failed_after_s: float | None = None,
        preflight: Callable[[pl.Trainer, tuple[Any, ...]], None] | None = None,
    ) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        if devices_per_node < 1 or num_processes % devices_per_node:
            raise ValueError(
                f"num_processes={num_processes} is not a whole number of nodes of devices_per_node="
                f"{devices_per_node}: choose devices_per_node dividing the number of processes"
            )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        if replace_failed_after_s is not None and start_method == "fork":
            raise ValueError(
                "replace_failed_after_s needs start_method='forkserver' or 'spawn': a replacement forked "
                "from the supervisor while its store and coordinator threads run could deadlock"
            )
        self.num_processes = num_processes
        self.devices_per_node = devices_per_node
        self.start_method = start_method
        self.services = list(services)
        self.host = host
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.finish_grace_s = finish_grace_s
        self.replace_failed_after_s = replace_failed_after_s
        self.preflight = preflight
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self._node_of: dict[int, int] = {}
        """Launcher rank -> the node (index) it runs on; replacements get new node indices."""
        self._start: Callable[[int, dict[str, str]], None] | None = None
        self.last_report: LaunchReport | None = None
        self._already_fit = False

    @property
    def is_interactive_compatible(self) -> bool:
        return self.start_method == "fork"

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` in every worker; return a finished worker's return value.

        With ``trainer``, the caller's Trainer also gets that worker's state, loop progress, callback
        metrics, callbacks' state and learning-rate finding (:func:`restore_in_main_process`), and (when
        fitting) the model weights merged from the finished workers. Raises :class:`LaunchError` if no worker
        finished, ``TimeoutError`` past ``timeout_s``.
        """
        if self.start_method != "fork":
            _exit_if_importing_script()
        else:
            check_bad_cuda_fork()
        if self.preflight is not None and trainer is not None:
            self.preflight(trainer, args)
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "trainer.fit() twice on one Trainer is not supported with strategy='oobleck': create a new "
                "Trainer and pass fit(ckpt_path=...)"
            )
        workdir = Path(tempfile.mkdtemp(prefix="oobleck-launch-"))
        supervisor = Supervisor(
            self.num_processes,
            devices_per_node=self.devices_per_node,
            services=self.services,
            host=self.host,
            coordinator=self.coordinator,
            workdir=workdir,
        )
        env_pipes: dict[int, Connection] = {}
        try:
            # Workers start before the coordinator and the services: no thread of theirs exists at a fork.
            env_pipes = self._start_workers(workdir, trainer, function, args, kwargs)
            with supervisor:
                try:
                    self._release_workers(supervisor, env_pipes)
                    report = self._supervise(supervisor, workdir)
                finally:
                    self._kill_all(signal.SIGKILL)  # before the services stop, whatever happened
            return self._recover_results(report, workdir, trainer)
        finally:
            self._kill_all(signal.SIGKILL)
            for pipe in env_pipes.values():
                pipe.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def kill(self, signum: int | signal.Signals) -> None:
        """Send ``signum`` to every live worker."""
        for proc in self.procs.values():
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def _start_workers(
        self, workdir: Path, trainer: pl.Trainer | None, function: Callable, args: Any, kwargs: Any
    ) -> dict[int, Connection]:
        """Start every worker, blocked until :meth:`_release_workers` sends its environment."""
        context = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        spawned = self.start_method != "fork"  # arguments travel pickled
        global_states = GlobalStateSnapshot.capture() if spawned else None
        self.procs = {}
        env_pipes: dict[int, Connection] = {}

        def start(rank: int) -> None:
            spec = _WorkerSpec(rank, workdir, os.getpid(), self.num_processes, spawned)
            receiver, env_pipes[rank] = context.Pipe(duplex=False)
            proc = context.Process(
                target=_worker_main,
                args=(spec, receiver, trainer, function, args, kwargs, global_states),
                name=f"oobleck-worker-{rank}",
            )
            proc.start()
            receiver.close()
            self.procs[rank] = proc

        def start_released(rank: int, env: dict[str, str]) -> None:
            start(rank)
            env_pipes[rank].send(env)

        for rank in range(self.num_processes):
            start(rank)
            self._node_of[rank] = rank // self.devices_per_node
        self._start = start_released
        return env_pipes

    def _release_workers(self, supervisor: Supervisor, env_pipes: dict[int, Connection]) -> None:
        """Send each worker its position, the store's address and the services' variables.

        The pipes stay open until the launch ends: a worker takes their end-of-file as its supervisor's death.
        """
        for rank, pipe in env_pipes.items():
            position = local_worker_env(
                rank, self.num_processes, self.devices_per_node, supervisor.store_addr
            )
            with contextlib.suppress(BrokenPipeError):  # a worker already gone: its exit is reported
                pipe.send({**supervisor.worker_env, **position})

    def _supervise(self, supervisor: Supervisor, workdir: Path) -> LaunchReport:
        """Wait for every worker, telling the services of each exit and starting the replacements that are
        due; bounded by the two deadlines."""
        exitcodes: dict[int, int] = {}
        launch_deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        finish_deadline: float | None = None
        replace_at: dict[int, float] = {}
        replaced: set[int] = set()  # a node's other workers may exit after its replacement started
        raised: dict[str, int] = {}  # the last line of an exception's traceback -> the first rank raising it
        errors: list[int] = []
        user_error: int | None = None
        while len(exitcodes) < len(self.procs) and user_error is None:
            deadlines = [d for d in (finish_deadline, launch_deadline) if d is not None]
            now = time.monotonic()
            if deadlines and now >= min(deadlines):
                break
            for node in [n for n, at in replace_at.items() if at <= now and finish_deadline is None]:
                del replace_at[node]
                replaced.add(node)
                self._replace(node, supervisor)
            running = {proc.sentinel: rank for rank, proc in self.procs.items() if rank not in exitcodes}
            waits = [*(d - now for d in deadlines), *(at - now for at in replace_at.values())]
            for sentinel in wait_for_sentinels(list(running), timeout=max(0.0, min([_MAX_WAIT_S, *waits]))):
                rank = running[sentinel]  # type: ignore[index]
                exitcodes[rank] = self._reap(rank)
                if exitcodes[rank] == _UNGUARDED_SCRIPT_EXIT:
                    raise LaunchError(_UNGUARDED_SCRIPT.format(method=self.start_method))
                supervisor.worker_exited(rank, exitcodes[rank])
                finished = result_path(workdir, rank).exists()
                if (error := _training_error(workdir, rank)) is not None:
                    errors.append(rank)
                    first = raised.setdefault(error, rank)
                    if self._node_of[first] != self._node_of[rank]:
                        user_error = first
                if finish_deadline is None and finished:
                    finish_deadline = time.monotonic() + self.finish_grace_s
                node = self._node_of[rank]
                if (
                    self.replace_failed_after_s is not None
                    and not finished
                    and exitcodes[rank] != 0
                    and node not in replaced
                ):
                    replace_at.setdefault(node, time.monotonic() + self.replace_failed_after_s)
        stuck = sorted(self.procs.keys() - exitcodes.keys())
        self._kill_all(signal.SIGKILL)
        for rank in stuck:
            exitcodes[rank] = self._reap(rank)
            supervisor.worker_exited(rank, exitcodes[rank])
        if user_error is not None:
            stuck_reason = "the model raised the same error on two nodes"
        elif finish_deadline is not None:
            stuck_reason = f"still running {self.finish_grace_s} s after a worker finished"
        else:
            stuck_reason = f"still running after timeout_s={self.timeout_s}"
        report = _report(exitcodes, stuck, stuck_reason, workdir)
        self.last_report = replace(report, user_error=user_error, errors=tuple(errors))
        if stuck and finish_deadline is None and user_error is None:
            raise TimeoutError(f"the launch did not finish: {_describe_lost(self.last_report)}")
        return self.last_report

    def _replace(self, node: int, supervisor: Supervisor) -> None:
        """Start a new node of ``devices_per_node`` processes in place of the dead node ``node``: they join
        the running training (a new node: the coordinator gives it an id)."""
        assert self._start is not None
        new_node = max(self._node_of.values()) + 1
        log.warning("starting node %d to replace node %d: it joins at the next step boundary", new_node, node)
        for device in range(self.devices_per_node):
            rank = max(self.procs) + 1
            self._node_of[rank] = new_node
            position = local_worker_env(
                rank, self.num_processes, self.devices_per_node, supervisor.store_addr
            )
            position[DEVICE_VAR] = str(device)
            coordinators = {ADDRESS_ENV: supervisor.store_addr}  # the ones that took over, if any
            self._start(
                rank,
                {
                    **supervisor.worker_env,
                    **position,
                    **coordinators,
                    NODE_KEY_ENV: f"replacement-{new_node}",
                },
            )

    def _recover_results(self, report: LaunchReport, workdir: Path, trainer: pl.Trainer | None) -> Any:
        if report.user_error is not None:
            raise _user_exception(workdir, report)
        result = read_result(workdir, report.result_rank) if report.result_rank is not None else None
        if result is None:
            raise LaunchError(_describe_failure(report, workdir))
        if report.lost:
            log.warning("training finished on the survivors; lost workers: %s", _describe_lost(report))
        if trainer is not None:
            restore_in_main_process(trainer, result, collect_layers(workdir, report.finished))
            # the tuner's run restored the state it started from: the fit it prepares is the first
            self._already_fit |= trainer.state.fn == TrainerFn.FITTING and not result.tuner_exit
        if result.tuner_exit:
            raise TunerExit  # Lightning ends the tuner's run in the caller's Trainer, as on one device
        return result.value

    def _reap(self, rank: int) -> int:
        proc = self.procs[rank]
        proc.join(timeout=_KILL_JOIN_TIMEOUT_S)
        return proc.exitcode if proc.exitcode is not None else -signal.SIGKILL

    def _kill_all(self, signum: int) -> None:
        self.kill(signum)
        for proc in self.procs.values():
            proc.join(timeout=_KILL_JOIN_TIMEOUT_S)

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the launcher inside the pickled strategy; processes and services stay here.
        state = self.__dict__.copy()
        state["procs"] = {}
        state["services"] = []
        state["_start"] = None
        state["preflight"] = None
        return state


def _worker_main(
    spec: _WorkerSpec,
    env_pipe: Connection,
    trainer: pl.Trainer | None,
    function: Callable,
    args: Any,
    kwargs: Any,
    global_states: GlobalStateSnapshot | None,
) -> None:
    _die_with_supervisor(spec.supervisor_pid)
    if not env_pipe.poll(_RELEASE_TIMEOUT_S):
        raise TimeoutError(f"the supervisor did not release worker {spec.rank} within {_RELEASE_TIMEOUT_S} s")
    os.environ.update(env_pipe.recv())
    threading.Thread(
        target=_exit_with_supervisor, args=(env_pipe,), name="oobleck-lifeline", daemon=True
    ).start()
    if global_states is not None:
        global_states.restore()
    if spec.spawned:
        args, kwargs = disable_module_memory_sharing((args, kwargs))
    set_num_threads_if_needed(num_processes=spec.num_processes)
    # Lightning's rank-zero messages before the strategy knows the rank (its tips at the start) print once.
    rank_zero_only.rank = spec.rank
    show_warnings_on_rank_zero()
    tuner_exit = False
    try:
        value = function(*args, **kwargs)
    except TrainingFinished:  # a replacement that found the training over: nothing to do, nothing lost
        close_process_agent()
        return
    except TunerExit:  # Tuner.lr_find's run ended as it should: its result goes back, then the exit
        value, tuner_exit = None, True
    except BaseException as error:
        close_process_agent(finished=False)  # lost, not finished: the peers recover without it
        write_worker_error(spec.workdir, spec.rank, error)
        sys.exit(1)  # the supervisor reports it, once (multiprocessing would print every worker's traceback)
    close_process_agent()  # the process ends here (without atexit handlers)
    write_worker_result(spec.workdir, spec.rank, value, trainer, tuner_exit)


def _exit_if_importing_script() -> None:
    """In a worker importing the user's script (``forkserver``, ``spawn``: to find what the pickled fit
    refers to), a fit started at the script's top level would launch workers of its own. The worker exits at
    once, printing nothing, and its supervisor raises one error saying why (:data:`_UNGUARDED_SCRIPT`),
    instead of every worker printing Lightning's traceback."""
    try:
        check_missing_main_guard()
    except RuntimeError:
        os._exit(_UNGUARDED_SCRIPT_EXIT)


def _exit_with_supervisor(lifeline: Connection) -> None:
    """Exit when the supervisor's end of ``lifeline`` closes (it never writes again).

    ``PR_SET_PDEATHSIG`` fires on the death of the *parent*, which is the fork server, not the supervisor,
    with ``forkserver``; and the fork server can outlive the supervisor.
    """
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os._exit(1)


def _die_with_supervisor(supervisor_pid: int) -> None:
    """Make the kernel SIGKILL this worker when the supervisor dies, so that no worker is orphaned."""
    die_with_parent()
    # The parent is the supervisor (fork, spawn) or the fork server, which exits with the supervisor.
    with contextlib.suppress(ProcessLookupError):
        os.kill(supervisor_pid, 0)
        return
    os._exit(1)  # the supervisor died before the prctl took effect


def _report(exitcodes: dict[int, int], stuck: list[int], stuck_reason: str, workdir: Path) -> LaunchReport:
    """Finished ranks (a result file, not killed by us) and why each other rank was lost."""
    ranks = sorted(exitcodes)
    finished = tuple(r for r in ranks if r not in stuck and result_path(workdir, r).exists())
    lost = {
        r: f"killed by the supervisor: {stuck_reason}"
        if r in stuck
        else _describe_exit(exitcodes[r], read_error(workdir, r))
        for r in ranks
        if r not in finished
    }
    return LaunchReport({r: exitcodes[r] for r in ranks}, finished, lost, finished[0] if finished else None)


_CANNOT_GO_ON = (UnrecoverableFailure, StartFailure)
"""What survivors raise when the workers lost took what they need: a consequence, not a cause."""


def _training_error(workdir: Path, rank: int) -> str | None:
    """What identifies the ``Exception`` that ended ``rank``: the last line of its traceback, or its type when
    survivors could not go on; ``None`` for a stop such as ``SystemExit`` or Lightning's
    ``SIGTERMException``, which every worker raises together by design."""
    text = read_error(workdir, rank)
    if text is None:
        return None
    exception = read_exception(workdir, rank)
    if exception is not None and not isinstance(exception, Exception):
        return None
    if isinstance(exception, _CANNOT_GO_ON):  # its message names the workers each survivor saw lost
        return type(exception).__name__
    return text.strip().splitlines()[-1]


def _user_exception(workdir: Path, report: LaunchReport) -> BaseException:
    """The exception to raise in the caller when workers of two nodes raised alike (``report.user_error``):
    that exception, the user's own, with its worker's traceback attached. When it says that the survivors
    could not go on (too many workers lost), the first error that a worker raised, if any, is the cause and
    is raised instead; a :class:`LaunchError` with the traceback when the exception could not travel."""
    rank = report.user_error
    assert rank is not None
    error = read_exception(workdir, rank)
    if isinstance(error, _CANNOT_GO_ON):
        cause = next(
            (r for r in report.errors if not isinstance(read_exception(workdir, r), _CANNOT_GO_ON)), None
        )
        if cause is None:
            return _earliest_view(workdir, report, error)
        consequence, rank = error, cause
        error = read_exception(workdir, rank)
    else:
        consequence = None
    text = read_error(workdir, rank) or ""
    if error is None:
        return LaunchError(f"the training raised on several nodes; rank {rank}'s traceback:\n{text}")
    note = f"\nraised in the training; rank {rank}'s traceback:\n{text}"
    if consequence is not None:
        note += f"\nthe other workers then could not go on: {consequence}"
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)
    return error


def _earliest_view(workdir: Path, report: LaunchReport, error: BaseException) -> BaseException:
    """Of the :class:`StartFailure` s that survivors raised, the one naming the fewest lost nodes (the others
    saw the first survivor's stop as one more loss); ``error`` when it is of another kind."""
    if not isinstance(error, StartFailure):
        return error
    views = [e for e in (read_exception(workdir, r) for r in report.errors) if isinstance(e, StartFailure)]
    return min([error, *views], key=lambda e: len(e.lost))


def _describe_exit(exitcode: int, error: str | None) -> str:
    if error is not None:
        return f"raised {error.strip().splitlines()[-1]}"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode} without a result"


def _describe_lost(report: LaunchReport) -> str:
    return "; ".join(f"rank {rank}: {why}" for rank, why in report.lost.items())


def _describe_failure(report: LaunchReport, workdir: Path) -> str:
    message = f"no worker finished ({len(report.exitcodes)} started): {_describe_lost(report)}"
    errors = [(rank, read_error(workdir, rank)) for rank in report.lost]
    first = next(((rank, text) for rank, text in errors if text), None)
    if first is not None:
        message += f"\n\ntraceback of rank {first[0]}:\n{first[1]}"
    return message
