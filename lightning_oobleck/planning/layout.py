"""A plan from hand-written stage boundaries (a ``layout``), checked like any plan.

``layout[p]`` lists pipeline ``p``'s stage boundaries, 0 to L: stage ``s`` runs on device ``s % G`` of the
pipeline's ``s // G``-th node, and pipelines take nodes in order. At tensor parallelism ``t`` a node holds
``G / t`` stages, stage ``s`` on ``t`` devices from ``(s mod G / t) * t``. Such a plan has no planner
inputs; the planner adds its templates for other node counts
(:func:`~lightning_oobleck.planning.planner.with_templates`) so that it recovers in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan, Stage


def layout_plan(
    layout: Sequence[Sequence[int]],
    num_layers: int,
    *,
    gpus_per_node: int,
    fault_tolerance: int,
    global_batch_size: int,
    microbatch_size: int,
    microbatches: Sequence[int] | None = None,
    schedule: str = "1f1b",
    recompute: bool = False,
    tensor_parallel: int = 1,
) -> Plan:
    """The plan of ``layout`` (module docstring). Micro-batches default to an even split (the first pipelines
    get one more when it is uneven)."""
    gpus = gpus_per_node
    if gpus % tensor_parallel:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} does not divide devices_per_node={gpus}: a stage's devices "
            "are on one node"
        )
    per_node = gpus // tensor_parallel
    layout = [list(bounds) for bounds in layout]
    for p, bounds in enumerate(layout):
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_layers or bounds != sorted(set(bounds)):
            raise ValueError(
                f"layout[{p}]={bounds} must rise strictly from 0 to the number of layers ({num_layers}), "
                f"e.g. [0, {num_layers // 2}, {num_layers}] for two stages"
            )
        if (len(bounds) - 1) % per_node:
            raise ValueError(
                f"layout[{p}] has {len(bounds) - 1} stages, not a whole number of nodes of {per_node} "
                f"stage(s) (devices_per_node={gpus}, tensor_parallel={tensor_parallel})"
            )
    splits: dict[int, list[int]] = {}
    for bounds in layout:
        if splits.setdefault(len(bounds) - 1, bounds) != bounds:
            raise ValueError(
                f"layout has two different {len(bounds) - 1}-stage pipelines ({splits[len(bounds) - 1]} and "
                f"{bounds}): a plan has one template per node count; use the same boundaries for both"
            )
    if len(layout) < fault_tolerance + 1:
        raise ValueError(
            f"layout has {len(layout)} pipeline(s), but fault_tolerance={fault_tolerance} needs at least "
            f"{fault_tolerance + 1}: add pipelines or lower fault_tolerance"
        )
    total = global_batch_size // microbatch_size
    microbatches = list(microbatches or _even_split(total, len(layout)))
    if len(microbatches) != len(layout) or sum(microbatches) != total or min(microbatches) < 1:
        raise ValueError(
            f"microbatches={microbatches} must give each of the {len(layout)} pipelines at least one "
            f"micro-batch and sum to global_batch_size / microbatch_size = {total}"
        )
    pipelines, first_node = [], 0
    for bounds, count in zip(layout, microbatches, strict=True):
        template = _template(bounds, gpus, recompute, tensor_parallel)
        pipelines.append(Pipeline(template, tuple(range(first_node, first_node + template.num_nodes)), count))
        first_node += template.num_nodes
    return Plan(
        num_layers=num_layers,
        gpus_per_node=gpus,
        fault_tolerance=fault_tolerance,
        n0=min(p.template.num_nodes for p in pipelines),
        microbatch_size=microbatch_size,
        global_batch_size=global_batch_size,
        templates=tuple({p.template.num_nodes: p.template for p in pipelines}.values()),
        pipelines=tuple(pipelines),
        schedule=schedule,
    )


def _template(bounds: Sequence[int], gpus: int, recompute: bool, tensor_parallel: int) -> PipelineTemplate:
    per_node = gpus // tensor_parallel
    stages = tuple(
        Stage(first, end, node=s // per_node, device=(s % per_node) * tensor_parallel, recompute=recompute)
        for s, (first, end) in enumerate(itertools.pairwise(bounds))
    )
    return PipelineTemplate(
        num_nodes=len(stages) // per_node,
        gpus_per_node=gpus,
        stages=stages,
        stage_times_s=tuple(0.0 for _ in stages),
        tensor_parallel=tensor_parallel,
    )


def _even_split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]
