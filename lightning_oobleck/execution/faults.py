"""Named fault points: where a drill (or a test) makes a worker fail, at a moment it names.

The training code *reaches* a :class:`FaultPoint` at fixed moments (a layer's forward, a split backward's
``I`` and ``W``, a gradient all-reduce issued, a step's commit, the state copy of a recovery (before it,
each round of its chunks, after it), a checkpoint
shard written, a joiner's admission) by calling :func:`reach`. A :class:`Fault` armed in the process
(:func:`arm`, or the ``OOBLECK_FAULTS`` environment variable: a JSON list of faults, for a job submitted
as it is) acts there once: it kills the process (SIGKILL, a crash), stops it (SIGSTOP, a hang), raises
a ``RuntimeError`` (an error in the training code) or sleeps (a slow worker); ``after_s`` makes a kill
or a stop come that many seconds later from a timer, wherever the worker is then. A kill or a stop may
target the job's coordinator instead (``target="coordinator"``): a drill of its failover. With nothing
armed, :func:`reach` is one attribute test. Public through :mod:`lightning_oobleck.testing`.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from lightning_oobleck.worker import Worker

log = logging.getLogger(__name__)

FAULTS_ENV = "OOBLECK_FAULTS"
"""A JSON list of :class:`Fault` fields (``[{"point": "forward", "node": 1, "step": 3}]``), armed in every
worker of a job at its first step."""


class FaultPoint(str, enum.Enum):
    """The moments a fault can be attached to; each is reached on the worker that runs it."""

    STEP = "step"
    """A training step starts (before its schedule)."""
    FORWARD = "forward"
    """A forward action of the step's schedule (before it runs)."""
    BACKWARD = "backward"
    """A full backward action ``B`` (before it runs)."""
    INPUT_GRAD = "input_grad"
    """A split backward's input-gradient action ``I`` (before it runs)."""
    WEIGHT_GRAD = "weight_grad"
    """A split backward's weight-gradient action ``W`` (before it runs)."""
    REDUCE = "reduce"
    """A gradient bucket's all-reduce was issued to the layer's replicas."""
    COMMIT = "commit"
    """The step's commit completed here: before the optimizer update."""
    STATE_COPY = "state_copy"
    """A recovery built the next generation's process groups here: before the state copy into them."""
    COPY_CHUNK = "copy_chunk"
    """A round of a state copy's chunks was issued here, data in flight, before it is waited for."""
    SWITCH = "switch"
    """A recovery's (or an admission's) state copy finished here: before the barrier that commits it."""
    CHECKPOINT = "checkpoint"
    """This worker's checkpoint shard is written, before the save is confirmed with its peers."""
    ADMISSION = "admission"
    """A joiner was admitted: its generation's groups are built, before it receives its layers."""


class FaultTarget(str, enum.Enum):
    """Which process a kill or a stop hits."""

    WORKER = "worker"
    """The worker that reached the point."""
    COORDINATOR = "coordinator"
    """The job's active coordinator (when it runs on the worker's host): its failover is drilled."""


class FaultAction(str, enum.Enum):
    """What a fault does when its point is reached."""

    KILL = "kill"
    """SIGKILL: the process crashes (its node is lost)."""
    STALL = "stall"
    """SIGSTOP: the process hangs, silent (its heartbeats stop: it is declared dead)."""
    RAISE = "raise"
    """Raise a ``RuntimeError``: an error in the training code, which ends the job as the user's own."""
    DELAY = "delay"
    """Sleep ``delay_s``: a slow worker, waited for and not failed."""


@dataclass(frozen=True)
class Fault:
    """Act (``action``) when this process reaches ``point`` for the ``occurrence``-th time in training
    step ``step`` (``None``: in any step), if it runs worker ``(node, device)`` (``None``: any).
    Fires once."""

    point: FaultPoint
    action: FaultAction = FaultAction.KILL
    node: int | None = None
    device: int | None = None
    step: int | None = None
    occurrence: int = 1
    after_s: float = 0.0
    """Kill or stop that many seconds after the point is reached, from a timer."""
    delay_s: float = 1.0
    """How long a :attr:`FaultAction.DELAY` sleeps."""
    message: str = ""
    """What a :attr:`FaultAction.RAISE` says (default: the fault itself)."""
    target: FaultTarget = FaultTarget.WORKER
    """Whom a kill or a stop hits: this worker, or the job's coordinator."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "point", FaultPoint(self.point))
        object.__setattr__(self, "action", FaultAction(self.action))
        object.__setattr__(self, "target", FaultTarget(self.target))
        if self.target is FaultTarget.COORDINATOR and self.action not in (
            FaultAction.KILL,
            FaultAction.STALL,
        ):
            raise ValueError(
                f"Fault(target='coordinator', action={self.action.value!r}): the coordinator can be killed "
                "or stopped; an error or a delay happens in the worker's own training code"
            )
        if self.occurrence < 1:
            raise ValueError(f"Fault(occurrence={self.occurrence}): count the point's occurrences from 1")
        if self.after_s < 0 or (
            self.after_s > 0 and self.action not in (FaultAction.KILL, FaultAction.STALL)
        ):
            raise ValueError(
                f"Fault(after_s={self.after_s}, action={self.action.value!r}): a delay must be >= 0, and "
                "only a kill or a stop can come later (an exception raised by a timer would not reach the "
                "training)"
            )

    def matches(self, point: FaultPoint, worker: Worker | None, step: int | None, count: int) -> bool:
        """Whether this fault acts at the ``count``-th reach of ``point`` by ``worker`` in ``step``."""
        if point is not self.point or count != self.occurrence:
            return False
        if self.step is not None and step != self.step:
            return False
        if worker is None:
            return self.node is None and self.device is None
        return self.node in (None, worker.node) and self.device in (None, worker.device)

    def to_json(self) -> dict[str, object]:
        """The fault's fields as :data:`FAULTS_ENV` takes them."""
        return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(self).items()}


Report = Callable[[Fault], None]
"""Called with a fault as it acts (e.g. a test's record of which fault fired)."""


class _Faults:
    """The faults armed in this process and where it stands (its worker, its step, the counts)."""

    def __init__(self) -> None:
        self.armed: list[tuple[Fault, Report | None]] = []
        self.from_environment = False
        self.worker: Worker | None = None
        self.step: int | None = None
        self.counts: dict[FaultPoint, int] = {}
        self.coordinator: Callable[[], int | None] = lambda: None
        """The pid of the job's active coordinator, when it runs on this host."""


_state = _Faults()


def locate_coordinator(pid: Callable[[], int | None]) -> None:
    """Tell the faults where the job's active coordinator runs: ``pid()`` is its process id, or ``None``
    when it is not on this host (a fault that targets it then does nothing, and says so)."""
    _state.coordinator = pid


def arm(*faults: Fault, report: Report | None = None) -> None:
    """Arm ``faults`` in this process (each fires once); ``report(fault)`` is called as one of them acts,
    just before (for a kill or a stop that comes ``after_s`` later: then)."""
    _state.armed.extend((fault, report) for fault in faults)


def disarm() -> None:
    """Remove every fault armed in this process."""
    _state.armed.clear()


def armed() -> tuple[Fault, ...]:
    """The faults armed in this process that have not fired."""
    return tuple(fault for fault, _ in _state.armed)


def from_environment() -> list[Fault]:
    """The faults :data:`FAULTS_ENV` names (none when it is unset). A value that is not a list of faults is
    one ``ValueError`` that says how to write it: the strategy checks it before any worker starts."""
    text = os.environ.get(FAULTS_ENV)
    if not text:
        return []
    try:
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise TypeError("not a JSON list of objects")
        return [Fault(**fields) for fields in items]
    except (ValueError, TypeError) as e:
        points = ", ".join(p.value for p in FaultPoint)
        actions = ", ".join(a.value for a in FaultAction)
        raise ValueError(
            f"{FAULTS_ENV}={text!r} is not a list of faults ({e}): write e.g. "
            f'\'[{{"point": "backward", "node": 1, "step": 30}}]\' (points: {points}; actions: '
            f"{actions}), or unset it"
        ) from None


def step_starts(worker: Worker, step: int) -> None:
    """The training loop is at the start of step ``step`` on ``worker`` (the points' counts restart; a step
    redone after a recovery keeps them). Reaches :attr:`FaultPoint.STEP`."""
    if not _state.from_environment:
        _state.from_environment = True
        arm(*from_environment())
    if (_state.worker, _state.step) == (worker, step):
        return
    _state.worker, _state.step, _state.counts = Worker(*worker), step, {}
    reach(FaultPoint.STEP)


def reach(point: FaultPoint, worker: Worker | None = None) -> None:
    """This worker reached ``point``: the armed fault that matches acts. ``worker``: which worker this
    process runs, where no step has started yet (a joiner's admission)."""
    if not _state.armed:
        return
    if worker is not None and _state.worker is None:
        _state.worker = Worker(*worker)
    count = _state.counts[point] = _state.counts.get(point, 0) + 1
    for fault, report in _state.armed:
        if fault.matches(point, _state.worker, _state.step, count):
            _state.armed.remove((fault, report))
            _act(fault, report)
            return


def _act(fault: Fault, report: Report | None) -> None:
    where = f"worker {_state.worker} at {fault.point.value} (step {_state.step})"
    log.warning("injected fault: %s %s", fault.action.value, where)
    if fault.action in (FaultAction.RAISE, FaultAction.DELAY) and report is not None:
        report(fault)
    if fault.action is FaultAction.RAISE:
        raise RuntimeError(fault.message or f"an injected error in {where}")
    if fault.action is FaultAction.DELAY:
        time.sleep(fault.delay_s)
        return
    signum = signal.SIGKILL if fault.action is FaultAction.KILL else signal.SIGSTOP
    if fault.after_s > 0:
        timer = threading.Timer(fault.after_s, _signal, (fault, report, signum))
        timer.daemon = True  # a fault due after the training ended never comes
        timer.start()
    else:
        _signal(fault, report, signum)


def _signal(fault: Fault, report: Report | None, signum: int) -> None:
    pid = os.getpid() if fault.target is FaultTarget.WORKER else _state.coordinator()
    if pid is None:
        log.warning("injected fault %s: the coordinator does not run on this host: nothing done", fault)
        return
    if report is not None:
        report(fault)
    os.kill(pid, signum)
