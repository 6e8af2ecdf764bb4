"""The plan a configuration fixes: ``plan_path`` (a saved plan) or ``layout`` (explicit stage boundaries,
mostly for tests and benchmarks); otherwise the planner chooses from a layer profile. One worker makes the
plan and hands it to the others (:mod:`~lightning_oobleck.recovery.startup`): profiles differ from worker
to worker, so the others never plan themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan, Stage


def configured_plan(config: OobleckConfig, num_layers: int, num_workers: int) -> Plan | None:
    """The plan fixed by ``plan_path`` or ``layout``, or ``None`` when the planner must choose."""
    if config.plan_path is not None:
        plan = Plan.load(config.plan_path)
        if plan.schedule != config.schedule:
            raise ValueError(
                f"the plan {config.plan_path} was made for the {plan.schedule!r} schedule but the strategy "
                f"asks for schedule={config.schedule!r}: set schedule={plan.schedule!r}, or make the plan "
                f"with `oobleck plan --schedule {config.schedule}`"
            )
        return plan
    if config.layout is not None:
        return layout_plan(config, num_layers, num_workers)
    return None


def layout_plan(config: OobleckConfig, num_layers: int, num_workers: int) -> Plan:
    """A plan from explicit stage boundaries: ``layout[p]`` lists pipeline ``p``'s boundaries, 0 to L.

    Stage ``s`` of a pipeline runs on device ``s % G`` of its ``s // G``-th node; pipelines take nodes in
    order. Micro-batches default to an even split (the first pipelines get one more when it is uneven).
    """
    assert config.layout is not None
    gpus = config.devices_per_node
    assert gpus is not None, "devices_per_node is resolved from the cluster environment before planning"
    layout = [list(bounds) for bounds in config.layout]
    for p, bounds in enumerate(layout):
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_layers or bounds != sorted(set(bounds)):
            raise ValueError(
                f"layout[{p}]={bounds} must rise strictly from 0 to the number of layers ({num_layers}), "
                f"e.g. [0, {num_layers // 2}, {num_layers}] for two stages"
            )
        if (len(bounds) - 1) % gpus:
            raise ValueError(
                f"layout[{p}] has {len(bounds) - 1} stages, not a whole number of nodes of "
                f"devices_per_node={gpus}"
            )
    splits: dict[int, list[int]] = {}
    for bounds in layout:
        if splits.setdefault(len(bounds) - 1, bounds) != bounds:
            raise ValueError(
                f"layout has two different {len(bounds) - 1}-stage pipelines ({splits[len(bounds) - 1]} and "
                f"{bounds}): a plan has one template per node count; use the same boundaries for both"
            )
    check_layout_size(config, num_workers)
    if len(layout) < config.fault_tolerance + 1:
        raise ValueError(
            f"layout has {len(layout)} pipeline(s), but fault_tolerance={config.fault_tolerance} needs at "
            "least "
            f"{config.fault_tolerance + 1}: add pipelines or lower fault_tolerance"
        )
    microbatches = config.microbatches or _even_split(config.num_microbatches, len(layout))
    if (
        len(microbatches) != len(layout)
        or sum(microbatches) != config.num_microbatches
        or min(microbatches) < 1
    ):
        raise ValueError(
            f"microbatches={list(microbatches)} must give each of the {len(layout)} pipelines at least one "
            f"micro-batch and sum to global_batch_size / microbatch_size = {config.num_microbatches}"
        )
    pipelines, first_node = [], 0
    for bounds, count in zip(layout, microbatches, strict=True):
        template = _template(bounds, gpus, recompute=config.activation_checkpointing is True)
        pipelines.append(Pipeline(template, tuple(range(first_node, first_node + template.num_nodes)), count))
        first_node += template.num_nodes
    assert config.global_batch_size is not None
    return Plan(
        num_layers=num_layers,
        gpus_per_node=gpus,
        fault_tolerance=config.fault_tolerance,
        n0=min(p.template.num_nodes for p in pipelines),
        microbatch_size=config.microbatch_size,
        global_batch_size=config.global_batch_size,
        templates=tuple({p.template.num_nodes: p.template for p in pipelines}.values()),
        pipelines=tuple(pipelines),
        schedule=config.schedule,
    )


def check_layout_size(config: OobleckConfig, num_workers: int) -> None:
    """Refuse a layout whose stage count is not the number of processes (one stage per process)."""
    assert config.layout is not None
    stages = sum(len(bounds) - 1 for bounds in config.layout)
    if stages != num_workers:
        raise ValueError(
            f"the layout has {stages} stages in all but Trainer(devices=..., num_nodes=...) gives "
            f"{num_workers} processes: one stage runs per process, so set devices={stages} (on one node) "
            "or change the layout"
        )


def _template(bounds: Sequence[int], gpus: int, recompute: bool) -> PipelineTemplate:
    stages = tuple(
        Stage(first, end, node=s // gpus, device=s % gpus, recompute=recompute)
        for s, (first, end) in enumerate(itertools.pairwise(bounds))
    )
    return PipelineTemplate(
        num_nodes=len(stages) // gpus,
        gpus_per_node=gpus,
        stages=stages,
        stage_times_s=tuple(0.0 for _ in stages),
    )


def _even_split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]
