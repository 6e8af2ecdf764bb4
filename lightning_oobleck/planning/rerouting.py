"""ReCycle's rerouting (Gandhi et al., SOSP'24): after a failure, a pipeline that lost a node keeps its
surviving stages, and the lost stages' layers run for its micro-batches on replicas in other pipelines.

Pure planning, like the rest of :mod:`lightning_oobleck.planning`. :func:`reroute` turns a plan and the nodes
it lost into a *rerouted plan*: the same pipelines, the lost nodes named (:attr:`Plan.lost`) and, for every
lost stage, the pipelines that run its layers (:class:`~lightning_oobleck.planning.plan.Reroute`). Nothing
moves: every surviving worker keeps its layers and their optimizer state, so the new layout costs no copy.

A micro-batch of a damaged pipeline follows a *route*: its pipeline's own stages where they live, and where a
stage was lost, the stages of a helper pipeline that hold that stage's layers, at layer granularity (a
helper split differently may run a part of a stage's layers, and one lost stage may take two of its stages).
:func:`routes` gives each route as a pipeline of its own (a
:class:`~lightning_oobleck.planning.schedules.PipelineSpec`); the plan's schedule makes each route's lists
and :func:`~lightning_oobleck.planning.schedules.merge` interleaves them on the workers they share, so
rerouted work fills the helpers' bubbles; every route's transfers go on a channel of their own
(:func:`step_actions`). Gradients of rerouted work accumulate in the replica that computed them, and the
gradient sync sums each layer over its live replicas (:meth:`Plan.layer_owners`): each layer's gradient is
still the sum over every micro-batch of the global batch, so the step is single-device training's.

A plan fills its devices with its own micro-batches, so rerouted ones must fit beside them: the merge holds
a helper's rerouted forwards back to the room its own leave (:class:`_StepMemory`), the rerouted step's
memory is counted along its lists (:func:`peak_memory_bytes`), a lost stage's micro-batches go to one
helper where spreading them overfills a device, and a step that still overfills one is not reroutable.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_oobleck.planning.plan import Pipeline, Plan, Reroute
from lightning_oobleck.planning.planner import PlannerInputs, PlanningError
from lightning_oobleck.planning.reconfigure import (
    Reconfiguration,
    ReconfigurationError,
    after_failures,
    copy_time_s,
)
from lightning_oobleck.planning.schedules import (
    COMPUTE,
    Action,
    Op,
    PipelineSpec,
    Schedule,
    in_flight_limit,
    merge,
    pipeline_actions,
    pipeline_times_s,
    reduce_actions,
    simulate,
)
from lightning_oobleck.worker import Worker


class NotReroutable(ValueError):
    """The failure leaves a layer without a live replica, or a route that would visit a worker twice:
    rerouting cannot keep the step exact, and the layout must be re-instantiated."""


def _lost_stages(pipeline: Pipeline, lost: frozenset[int]) -> list[int]:
    return [si for si in range(len(pipeline.stages)) if pipeline.worker_of_stage(si).node in lost]


def _intact_over(pipeline: Pipeline, layers: range, lost: frozenset[int]) -> bool:
    return all(
        pipeline.worker_of_stage(si).node not in lost
        for si, s in enumerate(pipeline.stages)
        if s.first_layer < layers.stop and layers.start < s.end_layer
    )


def reroute(plan: Plan, failed: Iterable[int]) -> Plan:
    """``plan`` after ``failed`` nodes are gone, its damaged pipelines rerouted.

    Each lost stage's micro-batches are spread over the pipelines whose replicas of the stage's layers all
    live, the ones after the damaged pipeline first, at most one per micro-batch (micro-batch ``k`` of the
    damaged pipeline to the ``k``-th of them, round robin): the extra work divides among the helpers. The
    plan's fault tolerance is what it guaranteed before, lowered to the live replicas of its least replicated
    layer minus one where fewer are left (as re-instantiation caps it: a failure never raises it). The
    predicted step (:attr:`Plan.iteration_time_s`) is the plan's own, times the ratio of
    :func:`predict_step_s` after and before: the event simulation's slowdown applied to the planner's step
    (its gradient sync and optimizer included).

    Raises :class:`NotReroutable` when a layer has no live replica left or a route would run on one worker
    twice (its micro-batch would cross the same device at two depths).
    """
    return _reroute(plan, failed)[0]


class _NoRoom(NotReroutable):
    """A worker of the rerouted step would need more memory than its device has; ``narrowable``: a lost
    stage's micro-batches were spread over several helpers."""

    def __init__(self, message: str, narrowable: bool) -> None:
        super().__init__(message)
        self.narrowable = narrowable


def _reroute(plan: Plan, failed: Iterable[int]) -> tuple[Plan, float]:
    """:func:`reroute`'s plan and its :func:`predict_step_s` (the simulation is the cost at scale: once)."""
    failed = tuple(failed)
    try:
        return _reroute_over(plan, failed, spread=True)
    except _NoRoom as e:
        if not e.narrowable:
            raise
        return _reroute_over(plan, failed, spread=False)


def _reroute_over(plan: Plan, failed: tuple[int, ...], spread: bool) -> tuple[Plan, float]:
    """:func:`_reroute` with each lost stage's micro-batches spread over its helpers, or all on the first
    (one route: a damaged pipeline's surviving stages warm up once, not once per helper)."""
    lost = frozenset(plan.lost) | frozenset(failed)
    unknown = sorted(set(failed) - {n for p in plan.pipelines for n in p.nodes})
    if unknown:
        raise ValueError(f"nodes {unknown} are not in the plan")
    reroutes: list[Reroute] = []
    count = len(plan.pipelines)
    for pi, p in enumerate(plan.pipelines):
        for si in _lost_stages(p, lost):
            layers = p.stages[si].layers
            # the pipelines after this one first (damaged pipelines lean on different helpers), at most one
            # per micro-batch: each helper takes at least one
            order = [(pi + k) % count for k in range(1, count)]
            helpers = tuple(q for q in order if _intact_over(plan.pipelines[q], layers, lost))
            helpers = helpers[: p.microbatches if spread else 1]
            if not helpers:
                raise NotReroutable(
                    f"no other pipeline holds layers {layers.start}..{layers.stop - 1} on live nodes after "
                    f"losing nodes {sorted(lost)}: the stage cannot be rerouted"
                )
            reroutes.append(Reroute(pi, si, helpers))
    replicas = [len(plan.pipelines)] * plan.num_layers
    for p in plan.pipelines:
        for si in _lost_stages(p, lost):
            for layer in p.stages[si].layers:
                replicas[layer] -= 1
    fault_tolerance = min(plan.fault_tolerance, min(replicas) - 1)
    warnings: tuple[str, ...] = ()
    if fault_tolerance < plan.fault_tolerance:
        warnings = (
            f"rerouted after losing nodes {sorted(lost)}: fault tolerance {fault_tolerance} "
            f"(was {plan.fault_tolerance}); a layer has {min(replicas)} live replica(s)",
        )
    rerouted = dataclasses.replace(
        plan,
        lost=tuple(sorted(lost)),
        reroutes=tuple(reroutes),
        fault_tolerance=fault_tolerance,
        warnings=warnings,
    )
    # the rerouted step's merge makes its routes, which refuse a route through one worker twice
    before, after = predict_step_s(plan), predict_step_s(rerouted)
    # the merge's own; None for a plan made by hand, without a profile to weigh
    memory = _step_memory(*_cache_key(rerouted))
    if memory is not None:
        worker, most = max(memory.peaks(affected(rerouted)).items(), key=lambda item: item[1])
        if most > memory.device_bytes:
            raise _NoRoom(
                f"worker {worker} would need {most:.4g} bytes of its device's {memory.device_bytes:.4g} "
                "in the rerouted step, even with each lost stage's micro-batches on one helper",
                narrowable=any(len(r.helpers) > 1 for r in reroutes),
            )
    step = plan.iteration_time_s * after / before if plan.iteration_time_s > 0 and before > 0 else after
    return dataclasses.replace(rerouted, iteration_time_s=step), after


def affected(plan: Plan) -> frozenset[int]:
    """The pipelines a rerouted plan changes: the damaged ones and their helpers."""
    return frozenset(p for r in plan.reroutes for p in (r.pipeline, *r.helpers))


def routes(plan: Plan, tensor_rank: int = 0) -> tuple[PipelineSpec, ...]:
    """The paths of the step's micro-batches, each as a pipeline: an intact pipeline's stages with all its
    micro-batches; for a damaged one, a route per combination of helpers, with the micro-batches that take
    it. At tensor parallelism ``t > 1``, the devices of tensor rank ``tensor_rank``. Route ``k``'s transfers
    go on channel ``k``."""
    by_pipeline: dict[int, dict[int, Reroute]] = {}
    for r in plan.reroutes:
        by_pipeline.setdefault(r.pipeline, {})[r.stage] = r
    out: list[PipelineSpec] = []
    for pi, p in enumerate(plan.pipelines):
        lost_here = by_pipeline.get(pi, {})
        combos: dict[tuple[int, ...], list[int]] = {}
        for k, mb in enumerate(plan.microbatch_range(pi)):
            combo = tuple(lost_here[si].helpers[k % len(lost_here[si].helpers)] for si in sorted(lost_here))
            combos.setdefault(combo, []).append(mb)
        for combo, microbatches in combos.items():
            helper_of = dict(zip(sorted(lost_here), combo, strict=True))
            segments: list[tuple[Worker, list[int]]] = []
            for si, s in enumerate(p.stages):
                if si in helper_of:
                    q = plan.pipelines[helper_of[si]]
                    parts = [
                        (q.workers_of_stage(sj)[tensor_rank], [i for i in qs.layers if i in s.layers])
                        for sj, qs in enumerate(q.stages)
                    ]
                else:
                    parts = [(p.workers_of_stage(si)[tensor_rank], list(s.layers))]
                for worker, layers in parts:
                    if not layers:
                        continue
                    if segments and segments[-1][0] == worker:
                        segments[-1][1].extend(layers)
                    else:
                        segments.append((worker, layers))
            workers = [w for w, _ in segments]
            if len(set(workers)) != len(workers):
                twice = next(w for w in workers if workers.count(w) > 1)
                raise NotReroutable(
                    f"pipeline {pi}'s micro-batches would cross worker {twice} twice when rerouted through "
                    f"pipelines {list(combo)}"
                )
            out.append(
                PipelineSpec(tuple(workers), tuple(tuple(ls) for _, ls in segments), tuple(microbatches))
            )
    return tuple(out)


def phase_duration(plan: Plan) -> Callable[[Worker, Action], float]:
    """The cost model's time of one compute action: the worker's stage time per micro-batch
    (:attr:`PipelineTemplate.stage_times_s`) in the share of the stage's layers the action runs, split
    ``F = I = W`` (``B = I + W``)."""
    cache: dict[Worker, tuple[float, int]] = {}
    backward = Op.B  # called for every action of a merge

    def duration(worker: Worker, action: Action) -> float:
        known = cache.get(worker)
        if known is None:
            role = plan.role(worker.node, worker.device)
            template = plan.pipelines[role.pipeline].template
            known = cache[worker] = (template.stage_times_s[role.stage], len(role.layers))
        stage_s, layers = known
        share = stage_s * len(action.layers) / layers
        return share * (2 if action.op is backward else 1) / 3

    return duration


def step_actions(
    plan: Plan,
    tensor_rank: int = 0,
    buckets: Mapping[Worker, Sequence[tuple[int, ...]]] | None = None,
    train: bool = True,
    pipelines: frozenset[int] | None = None,
) -> tuple[Schedule, dict[Worker, int]]:
    """The action lists of every worker (of tensor rank ``tensor_rank``) for one step of a rerouted plan,
    and how many micro-batches each may hold in flight (the sum over the routes it is on); ``pipelines``:
    only the routes of these pipelines' micro-batches (with their channels), e.g. :func:`affected`.

    Each route's lists come from the plan's schedule on channel ``k`` and :func:`merge` interleaves them by
    :func:`phase_duration`; ``buckets[worker]``: its gradient buckets' layers, reduced at the end of its
    list (default: one bucket of its layers, on every worker). The merge is made once per plan in a process
    (:func:`_merge_routes`): a recovery's choice simulates the rerouted step, then the engine runs its
    lists."""
    merged, limits, _ = _merge_routes(plan, tensor_rank, train, pipelines)
    schedule = {worker: list(actions) for worker, actions in merged.items()}
    if train:
        if buckets is None:
            buckets = {w: [tuple(plan.role(w.node, w.device).layers)] for w in limits}
        for worker, layer_sets in buckets.items():
            schedule.setdefault(worker, []).extend(reduce_actions(layer_sets))
    return schedule, dict(limits)


def _merge_routes(
    plan: Plan, tensor_rank: int, train: bool, pipelines: frozenset[int] | None
) -> tuple[Schedule, dict[Worker, int], float]:
    """:func:`step_actions` before the reductions, and the step's length by :func:`phase_duration`: made
    once per plan (the last two kept: a plan's training and evaluation lists), as on 64 nodes x 8 GPUs (16
    pipelines of 32 stages, 64 micro-batches each) the merge of a rerouted step takes 1.2-1.7 s. Callers copy
    the lists they change."""
    return _merged(*_cache_key(plan), tensor_rank, train, pipelines)


def _cache_key(plan: Plan) -> tuple[Plan, int]:
    """How :func:`_merged` and :func:`_step_memory` know a plan: with its predicted step zeroed (the merge
    does not depend on it; a rerouting sets it after simulating the lists) and the identity of its planner
    inputs (``plan.extra``, which the merge weighs memory by and a plan's equality leaves out)."""
    return dataclasses.replace(plan, iteration_time_s=0.0), id(plan.extra)


@functools.lru_cache(maxsize=2)
def _merged(
    plan: Plan, inputs: int, tensor_rank: int, train: bool, pipelines: frozenset[int] | None
) -> tuple[Schedule, dict[Worker, int], float]:
    """:func:`_merge_routes`, cached by :func:`_cache_key`."""
    parts = []
    limits: dict[Worker, int] = {}
    starts = list(itertools.accumulate((p.microbatches for p in plan.pipelines), initial=0))
    memory = _step_memory(plan, inputs) if train and plan.reroutes else None
    room: dict[tuple[int, Worker], float] = {}  # what a helper's device leaves to micro-batches in flight
    with _without_cyclic_gc():
        for channel, spec in enumerate(routes(plan, tensor_rank)):
            owner = bisect.bisect_right(starts, spec.microbatches[0]) - 1  # whose micro-batches go this way
            if pipelines is not None and owner not in pipelines:
                continue
            for s, w in enumerate(spec.workers):
                bound = in_flight_limit(plan.schedule, len(spec.workers), s, len(spec.microbatches))
                limits[w] = limits.get(w, 0) + bound
                if memory is not None and plan.role(w.node, w.device).pipeline != owner:
                    room[(len(parts), w)] = memory.activation_room(w)
            parts.append(pipeline_actions(spec, plan.schedule, None, train, channel))
        schedule, end_s = merge(parts, phase_duration(plan), None, memory and memory.change, room)
    return schedule, limits, end_s


def peak_memory_bytes(plan: Plan, pipelines: frozenset[int] | None = None) -> dict[Worker, float]:
    """The most bytes each worker (of tensor rank 0; on the routes of ``pipelines``' micro-batches only,
    e.g. :func:`affected`) holds in a training step of ``plan``.

    The cost model's terms (:meth:`~lightning_oobleck.planning.cost.CostModel.stage_memory_bytes`), counted
    along the worker's merged action list instead of bounded per stage: its stage's parameters and their
    state, and the most that its in-flight micro-batches keep (each one the saved tensors of the layers it
    ran there, then what its ``I`` keeps for its ``W``) with a backward running, or the optimizer step's
    temporaries where those are more. A helper's rerouted micro-batches keep what the layers it runs for
    them keep, which the per-stage bound of a plan never counted."""
    return _StepMemory(plan).peaks(pipelines)


@functools.lru_cache(maxsize=2)
def _step_memory(plan: Plan, inputs: int) -> _StepMemory | None:
    """The step memory of ``plan`` (cached by :func:`_cache_key`), made once for the merge and the count;
    ``None`` for a plan without its planner inputs (made by hand)."""
    try:
        return _StepMemory(plan)
    except PlanningError:
        return None


class _StepMemory:
    """The cost model's bytes of a plan's step on each worker, action by action (:func:`peak_memory_bytes`;
    :func:`_merged` keeps rerouted work within them)."""

    def __init__(self, plan: Plan) -> None:
        inputs = PlannerInputs.from_plan(plan)
        self.device_bytes = inputs.cluster.device_memory_bytes
        self.cost = inputs.cost()
        self.plan = plan
        self.route_start = {mb: spec.workers[0] for spec in routes(plan) for mb in spec.microbatches}
        self._effects: dict[tuple[Worker, Op, tuple[int, ...], bool], tuple[float, float]] = {}
        self._stage: dict[Worker, tuple[bool, range]] = {}

    def peaks(self, pipelines: frozenset[int] | None) -> dict[Worker, float]:
        """:func:`peak_memory_bytes`."""
        schedule, _, _ = _merge_routes(self.plan, 0, True, pipelines)
        out: dict[Worker, float] = {}
        for worker, actions in schedule.items():
            alive = peak = 0.0
            for a in actions:
                if a.op in COMPUTE:
                    change, rise = self.effect(worker, a)
                    peak = max(peak, alive + rise)
                    alive += change
            state, step = self.state_bytes(worker)
            out[worker] = state + max(peak, step)
        return out

    def _role(self, worker: Worker) -> tuple[bool, range]:
        """Whether the worker's stage recomputes its activations, and its layers."""
        if worker not in self._stage:
            role = self.plan.role(worker.node, worker.device)
            stage = self.plan.pipelines[role.pipeline].stages[role.stage]
            self._stage[worker] = (stage.recompute, role.layers)
        return self._stage[worker]

    def effect(self, worker: Worker, action: Action) -> tuple[float, float]:
        """How many bytes more ``worker`` holds after the compute ``action``, and how far above what it held
        before it the bytes rise while it runs."""
        # a route's first stage and a recomputing one run the whole backward (the first's in its W, with
        # nothing kept between: counted at its I)
        whole = self._role(worker)[0] or self.route_start[action.microbatch] == worker
        key = (worker, action.op, action.layers, whole)
        if key not in self._effects:
            self._effects[key] = self._effect(worker, action.op, action.layers, whole)
        return self._effects[key]

    def _effect(self, worker: Worker, op: Op, layers: tuple[int, ...], whole: bool) -> tuple[float, float]:
        cost, recompute = self.cost, self._role(worker)[0]
        start, end = layers[0], layers[-1] + 1
        held = cost.held_bytes(start, end, recompute)
        kept = cost.weight_kept_bytes(start, end, 1)
        split_peak = cost.backward_peak_bytes(start, end, 1)
        if op is Op.F:
            return held, held
        if op is Op.B or (op is Op.I and whole):
            return -held, cost.backward_peak_bytes(start, end, 0, recompute)
        if op is Op.I:
            return kept - held, split_peak
        return (0.0, 0.0) if whole else (-kept, split_peak)

    def change(self, worker: Worker, action: Action) -> float:
        """:meth:`effect`'s first half: what :func:`~lightning_oobleck.planning.schedules.merge` counts."""
        return self.effect(worker, action)[0]

    def state_bytes(self, worker: Worker) -> tuple[float, float]:
        """The worker's parameters with their gradients and optimizer state, and its optimizer step's
        temporaries."""
        layers = self._role(worker)[1]
        params = self.cost.parameter_bytes(layers.start, layers.stop)
        return params * self.cost.state_factor, float(self.cost.step_bytes(params))

    def activation_room(self, worker: Worker) -> float:
        """The most the worker's in-flight micro-batches may hold, a backward's rise through any of its layers
        beside them, on a device of the plan's cluster."""
        recompute, layers = self._role(worker)
        rise = self.cost.backward_peak_bytes(layers.start, layers.stop, 0, recompute)
        return self.device_bytes - self.state_bytes(worker)[0] - rise


@contextlib.contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: a merge at scale allocates hundreds of thousands of actions,
    none in a cycle (reference counting frees them), and the collector's passes over them took a third of
    the merge (2,048 nodes x 8 GPUs: 1.3 s of 4.3 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def predict_step_s(plan: Plan) -> float:
    """The event simulation of a step (:func:`step_actions` timed by :func:`phase_duration`, transfers
    free; the merge's own): the pipelines rerouting touches simulated together, each other one alone
    (:func:`~lightning_oobleck.planning.schedules.pipeline_times_s`, the same rules); the slowest."""
    touched = affected(plan)
    # pipelines of one template with as many micro-batches take the same time: each simulated once
    alone = {
        (p.template.stage_times_s, p.microbatches)
        for i, p in enumerate(plan.pipelines)
        if i not in touched and p.microbatches > 0
    }
    runs = [([(t / 3, t / 3, t / 3) for t in times], [0.0] * len(times), m) for times, m in alone]
    slowest = float(pipeline_times_s(plan.schedule, runs).max(initial=0.0))
    if not touched:
        return slowest
    return max(slowest, _merge_routes(plan, 0, True, touched)[2])


def predict_staggered_step_s(plan: Plan, steps: int = 6) -> float:
    """The step :func:`predict_step_s` would take if each worker started its next step as soon as every
    replica of its own layers finished this one (its gradients reduced, so it could apply its update: a
    staggered optimizer, ReCycle's), instead of after the step commit that every worker waits for.

    The event simulation of ``steps`` consecutive steps of the whole plan (:func:`step_actions`, timed by
    :func:`phase_duration`, transfers free); the mean period between the ends of the last ``steps - 1``.
    What it takes off :func:`predict_step_s` is what a staggered optimizer would save, besides the commit's
    latency: the skew of the workers' ends (none in a pipeline of 1F1B alone: its first stage starts the next
    step first and finishes this one last)."""
    if steps < 2:
        raise ValueError(f"a period needs at least 2 steps, got {steps}")
    duration = phase_duration(plan)
    schedule, _ = step_actions(plan)
    layers = {w: set(plan.role(w.node, w.device).layers) for w in schedule}
    partners = {w: [v for v in schedule if layers[v] & layers[w]] for w in schedule}
    start = dict.fromkeys(schedule, 0.0)
    ends = []
    for _ in range(steps):
        timings = simulate(schedule, duration, start=start)
        end = {w: t[-1].end if t else start[w] for w, t in timings.items()}
        ends.append(max(end.values()))
        start = {w: max(end[v] for v in partners[w]) for w in schedule}
    return (ends[-1] - ends[0]) / (steps - 1)


# ---------------------------------------------------------------------------------------------- the choice

RECOVERY_POLICIES = ("reinstantiate", "reroute", "auto")
"""How a failure is recovered from: re-instantiate pipelines from the templates (Oobleck; the layers a
worker newly holds are copied), reroute the lost stages' micro-batches (ReCycle; nothing moves, the step is
slower), or ``auto``: whichever the cost model predicts trains more samples before the next failure."""


def expected_failure_interval_s(configured_s: float, failures: int = 0, observed_s: float = 0.0) -> float:
    """The expected time to the next failure, from the configured interval and the run's own record:
    ``failures`` seen in ``observed_s`` seconds of running. The configured interval is one failure's worth of
    prior evidence (the posterior mean under a Gamma(1, ``configured_s``) prior on an exponential failure
    rate): ``(configured_s + observed_s) / (1 + failures)``. With no record it is the configured interval; a
    run that fails often soon weighs its own rate, one that runs long without a failure lengthens it."""
    if configured_s <= 0 or failures < 0 or observed_s < 0:
        raise ValueError(
            f"the failure interval must be positive and the record non-negative, got {configured_s}, "
            f"{failures} failure(s) in {observed_s} s"
        )
    return (configured_s + observed_s) / (1 + failures)


@dataclass(frozen=True)
class Candidate:
    """One way to recover from a failure, as the cost model predicts it."""

    policy: str
    step_s: float = math.nan
    """The predicted step after the switch (:func:`predict_step_s`)."""
    transition_s: float = math.nan
    """The predicted state copy before training resumes (none for rerouting)."""
    samples: float = 0.0
    """Samples trained over the horizon: ``B * max(D - transition, 0) / step``."""
    infeasible: str = ""
    """Why this way is impossible here (empty: it is possible)."""

    def __str__(self) -> str:
        if self.infeasible:
            return f"{self.policy}: impossible ({self.infeasible})"
        return (
            f"{self.policy}: {self.step_s:.3g} s/step after {self.transition_s:.3g} s of copy, "
            f"{self.samples:.4g} samples before the next failure"
        )


@dataclass(frozen=True)
class RecoveryChoice:
    """The reconfiguration a failure leads to and the candidates it was chosen from."""

    reconfiguration: Reconfiguration
    policy: str
    """The way taken: ``reinstantiate`` or ``reroute``."""
    candidates: tuple[Candidate, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "candidates": [dataclasses.asdict(c) for c in self.candidates]}


def choose_recovery(
    plan: Plan,
    failed: Iterable[int],
    policy: str = "auto",
    horizon_s: float = 3600.0,
    link_share: float = 1.0,
    message_tags: bool = True,
) -> RecoveryChoice:
    """How to go on after ``failed`` nodes are gone, under ``policy`` (:data:`RECOVERY_POLICIES`).

    Each way is predicted with the same event simulation of its step (:func:`predict_step_s`: the stages'
    compute; the gradient sync, about the same either way, is left out) and, for
    re-instantiation, the state copy over the nodes' links at ``link_share`` of their bandwidth
    (:func:`~lightning_oobleck.planning.reconfigure.copy_time_s`); ``auto`` takes the one that trains the
    most samples over ``horizon_s``, how long the chosen layout is expected to last: until the next failure,
    or the lost nodes' return, which ends a rerouting (Odyssey's score, ``B / step`` times the share of the
    horizon left after the transition), rerouting on a tie. ``reroute`` falls back to
    re-instantiation where rerouting is impossible (a layer without a live replica, a route through one
    worker twice, or with ``message_tags=False``, as under NCCL, two routes between one pair of workers).
    Raises :class:`~lightning_oobleck.planning.reconfigure.ReconfigurationError` when neither way exists.
    """
    if policy not in RECOVERY_POLICIES:
        raise ValueError(f"recovery_policy must be one of {', '.join(RECOVERY_POLICIES)}, got {policy!r}")
    failed = sorted(set(failed))
    if unknown := sorted(set(failed) - set(plan.nodes)):
        raise ReconfigurationError(
            f"node id(s) {unknown} are not in the plan; its nodes are {list(plan.nodes)}"
        )
    big_b = plan.global_batch_size
    options: dict[str, Reconfiguration] = {}
    candidates: list[Candidate] = []
    error: ReconfigurationError | None = None
    try:
        again = after_failures(plan, failed)
        copy_s = copy_time_s(again.copies, PlannerInputs.from_plan(plan), link_share)
        options["reinstantiate"] = again
        candidates.append(Candidate("reinstantiate", predict_step_s(again.plan), copy_s))
    except ReconfigurationError as e:
        error = e
        candidates.append(Candidate("reinstantiate", infeasible=str(e)))
    if policy != "reinstantiate":
        try:
            rerouted, step_s = _reroute(plan, failed)
            if not message_tags and (shared := shared_pairs(rerouted)):
                raise NotReroutable(
                    f"workers {list(shared[0])} would carry two routes' micro-batches, which a backend "
                    "without message tags (NCCL) cannot keep apart"
                )
            options["reroute"] = Reconfiguration(rerouted, ())
            candidates.append(Candidate("reroute", step_s, 0.0))
        except NotReroutable as e:
            candidates.append(Candidate("reroute", infeasible=str(e)))
    scored = tuple(
        c
        if c.infeasible
        else dataclasses.replace(c, samples=big_b * max(horizon_s - c.transition_s, 0.0) / c.step_s)
        for c in candidates
    )
    feasible = [c for c in scored if not c.infeasible]
    if not feasible:
        assert error is not None
        raise error
    if policy == "auto":
        chosen = max(feasible, key=lambda c: (c.samples, c.policy == "reroute")).policy
    else:
        chosen = policy if policy in options else feasible[0].policy
    return RecoveryChoice(options[chosen], chosen, scored)


def shared_pairs(plan: Plan) -> list[tuple[Worker, Worker]]:
    """The pairs of workers between which two routes of a rerouted plan send (tensor rank 0's)."""
    channels: dict[tuple[Worker, Worker], set[int]] = {}
    for channel, spec in enumerate(routes(plan)):
        for a, b in itertools.pairwise(spec.workers):
            channels.setdefault((min(a, b), max(a, b)), set()).add(channel)
    return sorted(pair for pair, used in channels.items() if len(used) > 1)
