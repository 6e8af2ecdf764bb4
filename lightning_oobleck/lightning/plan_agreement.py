"""The plan a configuration fixes: ``plan_path`` (a saved plan) or ``layout`` (explicit stage boundaries,
mostly for tests and benchmarks); otherwise the planner chooses from a layer profile. One worker makes the
plan and hands it to the others (:mod:`~lightning_oobleck.recovery.startup`): profiles differ from worker
to worker, so the others never plan themselves.
"""

from __future__ import annotations

from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.planning.layout import layout_plan as plan_of_layout
from lightning_oobleck.planning.plan import Plan


def configured_plan(config: OobleckConfig, num_layers: int, num_workers: int) -> Plan | None:
    """The plan fixed by ``plan_path`` or ``layout``, or ``None`` when the planner must choose."""
    if config.plan_path is not None:
        plan = Plan.load(config.plan_path)
        if config.schedule != "auto" and plan.schedule != config.schedule:
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
    """The plan of the configuration's ``layout`` (:func:`lightning_oobleck.planning.layout.layout_plan`)."""
    assert config.layout is not None
    assert config.devices_per_node is not None, "devices_per_node is resolved before planning"
    assert config.global_batch_size is not None and config.microbatch_size is not None
    check_layout_size(config, num_workers)
    return plan_of_layout(
        config.layout,
        num_layers,
        gpus_per_node=config.devices_per_node,
        fault_tolerance=config.fault_tolerance,
        global_batch_size=config.global_batch_size,
        microbatch_size=config.microbatch_size,
        microbatches=config.microbatches,
        schedule=config.schedule,
        recompute=config.activation_checkpointing is True,
        tensor_parallel=config.tensor_parallel,
    )


def check_layout_size(config: OobleckConfig, num_workers: int) -> None:
    """Refuse a layout whose stages do not take the processes exactly (``tensor_parallel`` per stage)."""
    assert config.layout is not None
    t = config.tensor_parallel
    stages = sum(len(bounds) - 1 for bounds in config.layout)
    if stages * t != num_workers:
        per = "one stage runs per process" if t == 1 else f"each stage runs on {t} processes"
        raise ValueError(
            f"the layout has {stages} stages in all but Trainer(devices=..., num_nodes=...) gives "
            f"{num_workers} processes: {per}, so set devices={stages * t} (on one node) or change the layout"
        )
