"""The planner's entry point: profile + cluster + fault tolerance + batch -> :class:`Plan`.

``make_plan`` runs the whole method once: ``n0`` and the template sizes (node specification), one
template per size, the instantiation that uses every node in at least ``f + 1`` pipelines, and the
batch distribution. Everything :mod:`lightning_oobleck.planning.reconfigure` needs later (profile,
cluster, options) travels in ``Plan.extra``, so ``oobleck replan`` works from the plan's JSON alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from lightning_oobleck.planning.batch import distribute_microbatches, num_microbatches
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import ActivationCheckpointing, CostModel
from lightning_oobleck.planning.instantiation import InstantiationError, instantiate
from lightning_oobleck.planning.node_spec import min_nodes, template_sizes
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES, check_schedule_name
from lightning_oobleck.planning.templates import InfeasibleTemplateError, generate_templates, with_fits


class PlanningError(ValueError):
    """The request cannot be planned; the message says what to change."""


TensorParallel = int | Literal["auto"]
"""A tensor-parallel degree ``t`` (1, 2, 4, 8: a divisor of the GPUs per node) or ``"auto"``."""


def tensor_parallel_degrees(
    requested: TensorParallel, profile: ModelProfile, gpus_per_node: int
) -> tuple[int, ...]:
    """The degrees ``requested`` lets the planner try: itself, or for ``"auto"`` every one the profile
    describes that divides ``gpus_per_node``."""
    known = profile.tensor_parallel_degrees
    if requested == "auto":
        return tuple(t for t in known if gpus_per_node % t == 0)
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise PlanningError(f"tensor_parallel must be 'auto' or a positive integer, got {requested!r}")
    if gpus_per_node % requested:
        raise PlanningError(
            f"tensor_parallel={requested} does not divide the {gpus_per_node} GPUs of a node: a stage's "
            f"devices are on one node and every device is used; use one of "
            f"{[t for t in known if gpus_per_node % t == 0]} or 'auto'"
        )
    try:
        profile.at(requested)
    except ValueError as err:
        raise PlanningError(str(err)) from err
    return (requested,)


@dataclass(frozen=True)
class PlannerInputs:
    """What a plan is made from, beside the batch: kept in ``Plan.extra`` for replanning."""

    profile: ModelProfile
    cluster: ClusterSpec
    fault_tolerance: int
    """The requested ``f`` (a plan may tolerate fewer failures after losing nodes)."""
    state_factor: float | None = None
    exact_limit: int = 20_000
    activation_checkpointing: ActivationCheckpointing = False
    schedule: str = "1f1b"
    """The pipeline schedule (:data:`~lightning_oobleck.planning.schedules.SCHEDULE_NAMES`) or ``"auto"``: the
    faster predicted. A plan's inputs hold the schedule it chose, which replanning keeps."""
    tensor_parallel: TensorParallel = 1
    """``t``, the devices of a node each stage runs on, or ``"auto"``: the fastest the profile allows. A
    plan's inputs hold the degree it chose, which replanning keeps."""

    def cost(self) -> CostModel:
        if not isinstance(self.tensor_parallel, int):
            raise PlanningError(
                f"a cost model needs one tensor-parallel degree, not {self.tensor_parallel!r}"
            )
        return CostModel(
            self.profile.at(self.tensor_parallel),
            self.cluster,
            self.state_factor,
            self.activation_checkpointing,
            self.schedule,
        )

    def make_plan(self, global_batch_size: int, microbatch_size: int | None = None) -> Plan:
        """:func:`make_plan` from these inputs."""
        return make_plan(
            self.profile,
            self.cluster,
            fault_tolerance=self.fault_tolerance,
            global_batch_size=global_batch_size,
            microbatch_size=microbatch_size,
            state_factor=self.state_factor,
            exact_limit=self.exact_limit,
            activation_checkpointing=self.activation_checkpointing,
            schedule=self.schedule,
            tensor_parallel=self.tensor_parallel,
        )

    def to_extra(self, next_node_id: int) -> dict[str, Any]:
        return {
            "profile": self.profile.to_dict(),
            "cluster": asdict(self.cluster),
            "requested_fault_tolerance": self.fault_tolerance,
            "state_factor": self.state_factor,
            "exact_limit": self.exact_limit,
            "activation_checkpointing": self.activation_checkpointing,
            "schedule": self.schedule,
            "tensor_parallel": self.tensor_parallel,
            "next_node_id": next_node_id,
        }

    @classmethod
    def from_plan(cls, plan: Plan) -> PlannerInputs:
        try:
            e = plan.extra
            return cls(
                profile=ModelProfile.from_dict(e["profile"]),
                cluster=ClusterSpec(**e["cluster"]),
                fault_tolerance=int(e["requested_fault_tolerance"]),
                state_factor=e.get("state_factor"),
                exact_limit=int(e.get("exact_limit", 20_000)),
                activation_checkpointing=e.get("activation_checkpointing", False),
                schedule=str(e.get("schedule", "1f1b")),
                tensor_parallel=e.get("tensor_parallel", 1),
            )
        except (KeyError, TypeError) as err:
            raise PlanningError(
                f"the plan has no planner inputs ({err} missing from 'extra'): replan needs a plan written "
                "by `oobleck plan --json` or make_plan"
            ) from err


def make_plan(
    profile: ModelProfile,
    cluster: ClusterSpec | None = None,
    *,
    fault_tolerance: int,
    global_batch_size: int,
    microbatch_size: int | None = None,
    num_nodes: int | None = None,
    gpus_per_node: int | None = None,
    state_factor: float | None = None,
    exact_limit: int = 20_000,
    activation_checkpointing: ActivationCheckpointing = False,
    schedule: str = "1f1b",
    tensor_parallel: TensorParallel = 1,
) -> Plan:
    """The fastest plan that uses every node of the cluster in at least ``f + 1`` pipelines.

    ``cluster`` describes the nodes; ``num_nodes`` / ``gpus_per_node`` override its counts (or build a
    default :class:`ClusterSpec` when ``cluster`` is None). ``microbatch_size`` defaults to the one
    the profile was measured for and must match it. ``schedule``: the pipeline schedule the plan runs
    (``"1f1b"`` or ``"zb-h1"``); templates, instantiation and batch distribution are chosen for it. ``"auto"``
    plans under each schedule the profile can time and keeps the faster predicted plan
    (``Plan.extra["schedule_choices"]``): ZB-H1 fills the bubble with weight gradients but holds ``min(S, m)``
    micro-batches on every stage, so which wins depends on the depth of the pipelines and the memory.
    ``tensor_parallel``: the devices of a node each stage runs on (:data:`TensorParallel`); ``"auto"`` plans
    at every degree the profile describes and keeps the fastest plan, one degree for all its templates (a
    layer's gradient is summed shard by shard across pipelines, and a recovery copies shards: both need
    the same split everywhere). ``Plan.extra["tensor_parallel_choices"]`` says what each degree gave.
    """
    started = time.perf_counter()
    cluster = cluster or ClusterSpec()
    counts = {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node}
    cluster = replace(cluster, **{k: v for k, v in counts.items() if v is not None})
    cluster.validate()
    microbatch = profile.microbatch_size if microbatch_size is None else microbatch_size
    global_batch = global_batch_size
    total = num_microbatches(global_batch, microbatch)
    if profile.microbatch_size != microbatch:
        raise PlanningError(
            f"the profile was measured for micro-batch {profile.microbatch_size}, the plan asks for "
            f"{microbatch}: profile again with micro-batch {microbatch} or plan with micro-batch "
            f"{profile.microbatch_size}"
        )
    if fault_tolerance < 0:
        raise PlanningError(f"the fault tolerance must be >= 0, got {fault_tolerance}")
    if total < fault_tolerance + 1:
        raise PlanningError(
            f"{total} micro-batches cannot feed the {fault_tolerance + 1} pipelines that f={fault_tolerance} "
            f"needs: raise the global batch to at least {(fault_tolerance + 1) * microbatch}"
        )
    degrees = tensor_parallel_degrees(tensor_parallel, profile, cluster.gpus_per_node)
    schedules = schedule_choices(schedule, profile)
    plans: dict[tuple[str, int], Plan] = {}
    reasons: dict[tuple[str, int], str] = {}
    for name in schedules:
        for t in degrees:
            inputs = PlannerInputs(
                profile,
                cluster,
                fault_tolerance,
                state_factor,
                exact_limit,
                activation_checkpointing,
                name,
                t,
            )
            try:
                plans[name, t] = _plan_at(inputs, global_batch, microbatch, started)
            except (PlanningError, InfeasibleTemplateError, InstantiationError) as err:
                if len(degrees) == 1 and len(schedules) == 1:
                    raise
                reasons[name, t] = str(err)
    if not plans:
        raise PlanningError(
            ("no schedule and tensor-parallel degree" if len(schedules) > 1 else "no tensor-parallel degree")
            + " gives a plan: "
            + "; ".join(
                f"{name} t={t}: {r}" if len(schedules) > 1 else f"t={t}: {r}"
                for (name, t), r in reasons.items()
            )
        )
    best = min(plans, key=lambda k: (plans[k].iteration_time_s, k[1], schedules.index(k[0])))
    plan = plans[best]
    if tensor_parallel != "auto" and schedule != "auto":
        return plan
    extra = dict(plan.extra)
    if tensor_parallel == "auto":
        extra["tensor_parallel_choices"] = [
            {"tensor_parallel": t, "iteration_time_s": plans[best[0], t].iteration_time_s}
            if (best[0], t) in plans
            else {"tensor_parallel": t, "infeasible": reasons[best[0], t]}
            for t in degrees
        ]
    if schedule == "auto":
        extra["schedule_choices"] = [
            {"schedule": name, "iteration_time_s": plans[name, best[1]].iteration_time_s}
            if (name, best[1]) in plans
            else {"schedule": name, "infeasible": reasons[name, best[1]]}
            for name in schedules
        ]
    warnings = plan.warnings
    if tensor_parallel == "auto" and degrees == (1,):
        warnings += (
            "tensor_parallel='auto' planned every stage on one device: the model's layers declare no "
            "tensor-parallel plan (PipelineModule.tensor_parallel_plan)",
        )
    if schedule == "auto" and schedules == ("1f1b",):
        warnings += (
            "schedule='auto' planned 1F1B only: the profile has no weight-gradient times, which ZB-H1's "
            "split backward needs (profile the model again)",
        )
    return replace(plan, extra=extra, planning_s=time.perf_counter() - started, warnings=warnings)


def schedule_choices(requested: str, profile: ModelProfile) -> tuple[str, ...]:
    """The schedules ``requested`` lets the planner try: itself, or for ``"auto"`` every one the profile can
    time (ZB-H1 needs each layer's weight-gradient time)."""
    if requested != "auto":
        check_schedule_name(requested)
        return (requested,)
    if any(layer.weight_grad_s is None for layer in profile.layers):
        return ("1f1b",)
    return SCHEDULE_NAMES


def _plan_at(inputs: PlannerInputs, global_batch: int, microbatch: int, started: float) -> Plan:
    """:func:`make_plan` at the one tensor-parallel degree of ``inputs``."""
    fault_tolerance, cluster = inputs.fault_tolerance, inputs.cluster
    total = num_microbatches(global_batch, microbatch)
    try:
        cost = inputs.cost()
    except ValueError as err:
        raise PlanningError(str(err)) from err
    n0 = min_nodes(cost)
    nodes = cluster.num_nodes
    if nodes < (fault_tolerance + 1) * n0:
        most = nodes // n0 - 1
        fix = (
            f"lower the fault tolerance to {most} (OobleckStrategy(fault_tolerance={most}), oobleck plan "
            f"--fault-tolerance {most}) or use"
            if most >= 0
            else "use"
        )
        raise PlanningError(
            f"f={fault_tolerance} needs {fault_tolerance + 1} pipelines of at least n0={n0} node(s), i.e. "
            f"{(fault_tolerance + 1) * n0} nodes, but the cluster has {nodes}: {fix} at least "
            f"{(fault_tolerance + 1) * n0} nodes"
        )
    sizes = template_sizes(cost, n0, nodes, fault_tolerance)
    templates = generate_templates(cost, sizes, {n: max(1, round(total * n / nodes)) for n in sizes})
    chosen = instantiate(templates, cost, nodes, fault_tolerance, total, inputs.exact_limit)
    warnings = []
    profile = inputs.profile
    if profile.device != "synthetic" and any(la.backward_peak_bytes is None for la in profile.layers):
        warnings.append(
            "the profile has no backward peaks (it was measured before the profiler measured them): each "
            "stage's memory is counted without its backward's own allocations, low by up to a third on a "
            "stage holding a model's head alone; profile the model again"
        )
    if missing := sorted(set(range(n0, 2 * n0)) - set(sizes)):
        warnings.append(
            f"no template fits {missing} nodes (at most one GPU per layer, or the activations of a longer "
            "pipeline exceed memory), so not every survivor count down to "
            f"(f+1)*n0={(fault_tolerance + 1) * n0} is covered: use devices with more memory or a smaller "
            "micro-batch"
        )
    layouts, next_node = [], 0
    for t in chosen.pipeline_templates():
        layouts.append((t, tuple(range(next_node, next_node + t.num_nodes))))
        next_node += t.num_nodes
    return assemble_plan(
        inputs, templates, n0, layouts, global_batch, microbatch, fault_tolerance, started, nodes, warnings
    )


def with_templates(layout: Plan, inputs: PlannerInputs) -> Plan:
    """A hand-written ``layout`` (its pipelines, stage boundaries and micro-batches, unchanged) given the
    planner's templates for every other node count, so that it recovers in place like a planned run.

    The planner plans the same job from ``inputs`` (its cluster has the layout's node count); its templates
    join the layout's own, which are kept for their node counts and costed by the same model. While every
    node lives the layout runs as written; after a failure, damaged pipelines are rebuilt from the templates.
    """
    started = time.perf_counter()
    cost = inputs.cost()
    planned = inputs.make_plan(layout.global_batch_size, layout.microbatch_size)
    own = {t.num_nodes: t for t in with_fits(cost, [_costed(cost, t) for t in layout.templates])}
    templates = {**{t.num_nodes: t for t in planned.templates}, **own}
    layouts = [(own[p.template.num_nodes], p.nodes) for p in layout.pipelines]
    plan = assemble_plan(
        inputs,
        [templates[n] for n in sorted(templates)],
        min(planned.n0, *own),
        layouts,
        layout.global_batch_size,
        layout.microbatch_size,
        layout.fault_tolerance,
        started,
        max(layout.nodes) + 1,
    )
    pipelines = tuple(
        replace(p, microbatches=q.microbatches) for p, q in zip(plan.pipelines, layout.pipelines, strict=True)
    )
    return replace(plan, pipelines=pipelines, tied_layers=layout.tied_layers)


def _costed(cost: CostModel, template: PipelineTemplate) -> PipelineTemplate:
    """``template``'s split with the cost model's stage times and memory (without its schedule's fit)."""
    stages = list(enumerate(template.stages))
    return replace(
        template,
        stage_times_s=tuple(cost.stage_time_s(s.first_layer, s.end_layer, i, len(stages)) for i, s in stages),
        stage_memory_bytes=tuple(
            cost.stage_memory_bytes(s.first_layer, s.end_layer, i, len(stages)) for i, s in stages
        ),
    )


def assemble_plan(
    inputs: PlannerInputs,
    templates: Sequence[PipelineTemplate],
    n0: int,
    layouts: Sequence[tuple[PipelineTemplate, tuple[int, ...]]],
    global_batch: int,
    microbatch: int,
    fault_tolerance: int,
    started: float,
    next_node_id: int,
    warnings: Sequence[str] = (),
) -> Plan:
    """A plan of the given pipelines (template, cluster node ids) with the batch distributed over them.

    The predicted iteration time is the slowest pipeline plus the slowest device's gradient sync across
    ``len(layouts)`` replicas and optimizer step (see :mod:`lightning_oobleck.planning.instantiation`).
    """
    total = num_microbatches(global_batch, microbatch)
    counts = distribute_microbatches([t for t, _ in layouts], total)
    pipelines = tuple(Pipeline(t, nodes, m) for (t, nodes), m in zip(layouts, counts, strict=True))
    cost = inputs.cost()
    tail = max(float(cost.template_tails_s(t, [len(pipelines)])[0]) for t in {p.template for p in pipelines})
    return Plan(
        num_layers=inputs.profile.num_layers,
        gpus_per_node=inputs.cluster.gpus_per_node,
        fault_tolerance=fault_tolerance,
        n0=n0,
        microbatch_size=microbatch,
        global_batch_size=global_batch,
        templates=tuple(templates),
        pipelines=pipelines,
        iteration_time_s=max(p.iteration_time_s() for p in pipelines) + tail,
        planning_s=time.perf_counter() - started,
        warnings=tuple(warnings),
        extra=inputs.to_extra(next_node_id),
        schedule=inputs.schedule,
    )
