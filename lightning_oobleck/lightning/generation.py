"""How a process of the fit gets its first generation: the job's plan, made by one worker, then generation 0
(with or without the coordinator), or, for a process that joins a running training, its admission.

The plan is the configured one (``plan_path``, ``layout``: :mod:`~lightning_oobleck.lightning.plan_agreement`)
or the planner's, from the layers' profile (measured on this worker, cached, or loaded) and the cluster of
this launch. With a coordinator, the first generation is agreed with it (workers lost before the first
step are left out, :func:`~lightning_oobleck.recovery.startup.start`); without one (a bare
``torch.distributed`` launch), the lowest rank publishes the plan and every worker reads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from lightning.pytorch.plugins.precision import Precision

from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import build_stage
from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.lightning.module import PipelineModule, example_forward_args, layer_source
from lightning_oobleck.lightning.plan_agreement import configured_plan
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.recovery.agent import WorkerAgent
from lightning_oobleck.recovery.joiner import Admission, join_training
from lightning_oobleck.recovery.startup import publish_plan, read_plan, start
from lightning_oobleck.worker import Worker

if TYPE_CHECKING:
    from lightning_oobleck.planning import planner


@dataclass(frozen=True)
class GenerationOptions:
    """How a generation's process groups are built: the backend and the bounds of every wait."""

    backend: str
    group_timeout: timedelta
    """The hang limit of every wait (``hang_timeout_s``)."""
    slow_after: timedelta
    """A wait on live peers warns after this and goes on (``collective_timeout_s``)."""

    @classmethod
    def of(cls, config: OobleckConfig, backend: str) -> GenerationOptions:
        return cls(
            backend, timedelta(seconds=config.hang_timeout_s), timedelta(seconds=config.collective_timeout_s)
        )


@dataclass(frozen=True)
class JobPlanner:
    """Makes the plan of this job on the worker that plans it (the others read it)."""

    config: OobleckConfig
    module: PipelineModule
    device: torch.device
    precision: Precision
    profile_cache: Path

    def plan(self, num_layers: int, num_workers: int) -> Plan:
        """``plan_path``, the planner's plan, or a hand-written ``layout`` with the planner's templates for
        other node counts (so that it recovers in place)."""
        from lightning_oobleck.planning.planner import PlanningError, with_templates

        cfg = self.config
        plan = configured_plan(cfg, num_layers, num_workers)
        if plan is None:
            return self.inputs(num_workers).make_plan(cfg.global_batch_size, cfg.microbatch_size)
        if cfg.layout is None or cfg.fault_tolerance == 0:
            return plan
        if cfg.profile_path is None and getattr(self.module, "example_input_array", None) is None:
            reason = "set example_input_array in your module's __init__ so that the strategy can profile it"
        else:
            try:
                return with_templates(plan, self.inputs(num_workers))
            except PlanningError as e:
                reason = f"the planner cannot plan this job ({e})"
        warnings.warn(
            f"the layout cannot recover in place after a failure (fault_tolerance={cfg.fault_tolerance}): "
            f"it has no pipeline templates for other node counts; {reason}",
            stacklevel=1,
        )
        return plan

    def inputs(self, num_workers: int) -> planner.PlannerInputs:
        """What the planner plans this job from: the layers' profile (measured, cached or loaded), the cluster
        (``planner.cluster``, a dict of :class:`ClusterSpec` fields, with this run's nodes) and options."""
        from lightning_oobleck.execution import profile_layers
        from lightning_oobleck.planning import ClusterSpec
        from lightning_oobleck.planning.planner import PlannerInputs
        from lightning_oobleck.planning.profile import ModelProfile

        cfg, module = self.config, self.module
        if cfg.profile_path is not None:
            profile = ModelProfile.load(cfg.profile_path)
        else:
            inputs, context = example_forward_args(module)
            # Profiles depend on shapes only: one sample, repeated to a micro-batch, in the dtype the layers
            # will see (the precision converts float inputs, e.g. float32 data under "64-true").
            b = cfg.microbatch_size
            inputs, context = self.precision.convert_input(
                pytree.tree_map(lambda t: t[:1].expand(b, *t.shape[1:]).clone(), (inputs, context))
            )
            # layers built as the run builds them, run as its steps run them (autocast under "bf16-mixed")
            with self.precision.tensor_init_context(), self.precision.forward_context():
                profile = profile_layers(
                    layer_source(module),
                    inputs,
                    self.device,
                    seed=module.init_seed,
                    cache_dir=self.profile_cache,
                    init=module.init_layer,
                    example_context=context,
                    tensor_parallel=profiled_degrees(cfg.tensor_parallel, cfg.devices_per_node),
                    tensor_parallel_plan=module.tensor_parallel_plan,
                )
        options = dict(cfg.planner)
        cluster = ClusterSpec(**options.pop("cluster", {}))
        cluster = replace(
            cluster, num_nodes=num_workers // cfg.devices_per_node, gpus_per_node=cfg.devices_per_node
        )
        return PlannerInputs(
            profile,
            cluster,
            cfg.fault_tolerance,
            activation_checkpointing=cfg.activation_checkpointing,
            schedule=cfg.schedule,
            tensor_parallel=cfg.tensor_parallel,
            **options,
        )


def profiled_degrees(tensor_parallel: int | str, devices_per_node: int | None) -> tuple[int, ...]:
    """The tensor-parallel degrees above 1 a run profiles its layers at: its own, or for ``"auto"`` every one
    of 2, 4, 8 that divides the devices of a node."""
    if tensor_parallel == "auto":
        return tuple(t for t in (2, 4, 8) if devices_per_node and devices_per_node % t == 0)
    return (tensor_parallel,) if isinstance(tensor_parallel, int) and tensor_parallel > 1 else ()


def first_generation(
    worker: Worker,
    store: dist.Store,
    make_plan: Callable[[], Plan],
    plan_timeout_s: float,
    options: GenerationOptions,
    agent: WorkerAgent | None,
    plans: bool,
) -> ProcessGroups:
    """Generation 0 of this launch. With the coordinator's ``agent``: agreed with it, the plan made by the
    lowest live worker, workers lost before the first step left out. Without: the plan made by the worker
    that ``plans`` (the lowest rank) and read by the others, over every launched worker."""
    if agent is not None:
        _, _, groups = start(agent, store, make_plan, plan_timeout_s, **asdict(options))
        return groups
    plan = publish_plan(store, make_plan) if plans else read_plan(store, plan_timeout_s)
    assert plan is not None  # no abort event: the read waits or raises
    # Without a failure detector a wait cannot tell slow from dead: it ends after collective_timeout_s.
    return ProcessGroups(plan, worker, store, 0, options.backend, options.slow_after)


def join_running_training(
    agent: WorkerAgent,
    store: dist.Store,
    module: PipelineModule,
    device: torch.device,
    precision: Precision,
    options: GenerationOptions,
    agreement_timeout_s: float,
) -> Admission:
    """This process joins a running training: wait to be admitted at a step boundary, then take its role in
    the new plan with the layers and optimizer state copied from live replicas."""
    build_layers = partial(build_stage, layer_source(module), device=device, init=None)
    with precision.tensor_init_context():
        return join_training(
            agent,
            store,
            build_layers,
            device,
            agreement_timeout=agreement_timeout_s,
            tensor_parallel_plan=module.tensor_parallel_plan,
            **asdict(options),
        )
