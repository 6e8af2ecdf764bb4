"""Run one worker's stage of a plan: training and evaluation steps equal to single-device training.

Each pipeline gets ``m_p`` consecutive micro-batches of the global batch (``Plan.microbatch_range``);
the first stage of a pipeline feeds its share in, the last stage computes the loss of each micro-batch
scaled by ``b / B`` and back-propagates it, in the order of the plan's schedule (an action list per
worker, :mod:`lightning_oobleck.planning.schedules`); the gradient sync sums each layer over its
replicas. The gradients left in ``.grad`` are then exactly those of single-device training on the whole
global batch with a mean loss.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.grad_sync import DEFAULT_BUCKET_CAP_BYTES, GradientSync
from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.schedule import Context, LossFn, Microbatch, StageContext, run_actions
from lightning_oobleck.execution.stage import (
    LayerInit,
    LayerSource,
    StageModule,
    build_stage,
    find_ties,
    reset_parameters,
    resolve_layers,
)
from lightning_oobleck.execution.tensor_parallel import (
    LayerPlans,
    check_split_for,
    declared_plan,
    is_split,
    local_grad,
    parallelize_stage,
)
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.rerouting import affected, shared_pairs, step_actions
from lightning_oobleck.planning.schedules import (
    Action,
    Op,
    PipelineSpec,
    Timing,
    in_flight_limit,
    pipeline_actions,
    validate,
)


def pipeline_batch_slice(plan: Plan, pipeline: int) -> slice:
    """The samples of the global batch that pipeline ``pipeline`` trains on in every step
    (:meth:`Plan.samples`), as a slice."""
    samples = plan.samples(pipeline)
    return slice(samples.start, samples.stop)


def _consecutive_runs(values: tuple[int, ...]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][-1] == v - 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return runs


def check_plan(plan: Plan, num_layers: int, tied_layers: tuple[tuple[int, ...], ...] = ()) -> None:
    """Refuse a plan the model cannot run with, naming what to change."""
    if plan.tied_layers != tied_layers:
        raise ValueError(
            f"the model ties parameters across layers {list(map(list, tied_layers))} but the plan was made "
            f"for ties {list(map(list, plan.tied_layers))}: give the plan the model's ties "
            "(dataclasses.replace(plan, tied_layers=...), as the strategy does)"
        )
    b, big_b = plan.microbatch_size, plan.global_batch_size
    if b <= 0 or big_b % b != 0:
        raise ValueError(
            f"the micro-batch size {b} does not divide the global batch size {big_b}; "
            "choose a micro-batch size that divides it"
        )
    if plan.num_layers != num_layers:
        raise ValueError(
            f"the plan is for a model of {plan.num_layers} layers but the model has {num_layers}; "
            "make the plan from this model's profile"
        )
    given = sum(p.microbatches for p in plan.pipelines)
    if given != plan.num_microbatches:
        raise ValueError(
            f"the plan's pipelines take {given} micro-batches per step, but the global batch has "
            f"{plan.num_microbatches}; the plan is inconsistent, re-run the planner"
        )
    for p in plan.pipelines:
        owned = [layer for s in p.stages for layer in s.layers]
        if owned != list(range(num_layers)) or any(s.first_layer >= s.end_layer for s in p.stages):
            bounds = [(s.first_layer, s.end_layer) for s in p.stages]
            raise ValueError(
                f"a {p.template.num_nodes}-node template's stages {bounds} do not split layers "
                f"0..{num_layers - 1} into contiguous non-empty ranges"
            )


@dataclass(frozen=True)
class StepResult:
    """What a training step's commit (:meth:`PipelineEngine.commit`) all-reduced over every worker."""

    grad_norm_sq: float
    """The whole model's squared gradient norm (NaN when the step did not compute it)."""
    loss: float
    """The global mean loss of the step."""
    sums: dict[str, float] = field(default_factory=dict)
    """The sums of the numbers the layers above shared, by name."""


class PipelineEngine:
    """One worker's stage of a plan: builds its layers and runs training/evaluation steps.

    ``layers_or_factory``: the model as an ordered sequence of layers or a factory returning one (called
    on the meta device, so only owned layers are materialised). ``loss_fn(output, targets)`` returns the
    mean loss of one micro-batch. ``abort``: set it (e.g. from a heartbeat thread) to make a blocked
    step raise :class:`~lightning_oobleck.execution.errors.PeerFailure` promptly.
    ``bucket_cap_bytes``: the largest flat buffer of the gradient sync. ``module``: this worker's layers
    already built and filled (a joiner's, copied from its peers) instead of materialising them.
    ``tensor_parallel_plan``: each layer's tensor-parallel plan (:data:`LayerPlans`; by default the layer's
    own ``tensor_parallel_plan()``), for a plan whose stages run on ``t > 1`` devices: the layers are built
    whole from the seed, then split over the stage's devices.

    Gradients accumulate into ``.grad`` like plain PyTorch: zero them between steps.
    """

    def __init__(
        self,
        layers_or_factory: LayerSource,
        loss_fn: LossFn,
        groups: ProcessGroups,
        device: torch.device,
        seed: int = 0,
        abort: threading.Event | None = None,
        dtype: torch.dtype | None = None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        init: LayerInit = reset_parameters,
        module: StageModule | None = None,
        tensor_parallel_plan: LayerPlans = declared_plan,
    ) -> None:
        layers = resolve_layers(layers_or_factory)
        self.num_layers = len(layers)
        self.tied_layers = tuple(tie.layers for tie in find_ties(layers))
        check_plan(groups.plan, self.num_layers, self.tied_layers)
        self.loss_fn = loss_fn
        self.device = device
        self.abort = abort if abort is not None else threading.Event()
        self.bucket_cap_bytes = bucket_cap_bytes
        self._grad_sync: GradientSync | None = None
        self.tensor_parallel_plan = tensor_parallel_plan
        role = groups.plan.role(*groups.worker)
        if module is None:
            module = build_stage(layers_or_factory, role.layers, device, seed, dtype, init)
            if groups.tensor_group is not None:
                layers = {i: module.layer(i) for i in module.layer_indices}
                parallelize_stage(layers, groups.tensor_mesh(device.type), tensor_parallel_plan)
        self.module: StageModule = module
        self.reconfigure(groups, self.module)

    def reconfigure(self, groups: ProcessGroups, module: StageModule) -> None:
        """Run under a new generation's plan and groups; ``module`` must hold the new role's layers.

        Recovery builds ``module`` (e.g. with :func:`build_stage`) and fills it from surviving
        replicas before calling this; nothing else of the old generation is kept. The ``abort`` event
        is left as it is: whoever set it clears it once the new generation may run.
        """
        plan = groups.plan
        check_plan(plan, self.num_layers, self.tied_layers)
        if groups.tensor_group is not None:
            check_split_for(module, groups)
        self.groups = groups
        self.plan = plan
        self.role = plan.role(*groups.worker)
        if module.layer_indices != tuple(self.role.layers):
            raise ValueError(
                f"the module holds layers {list(module.layer_indices)} but this worker's role under the "
                f"new plan is layers {list(self.role.layers)}"
            )
        self.module = module
        pipeline = plan.pipelines[self.role.pipeline]
        module.recompute = pipeline.stages[self.role.stage].recompute
        self.batch_slice = pipeline_batch_slice(plan, self.role.pipeline)
        self._context = StageContext(
            module, self.device, groups.world, groups.waiter, self.abort, groups.rank_of, self.num_layers
        )
        if self._grad_sync is not None:
            self._grad_sync.close()
        self._grad_sync = GradientSync(module, groups, self.bucket_cap_bytes)
        self.train_actions = self._lists(train=True)
        self._eval_actions: list[Action] | None = None
        self.microbatch_ids = tuple(sorted({a.microbatch for a in self.train_actions if a.op is Op.F}))
        """The global micro-batches this worker runs in a step: its pipeline's, and those rerouted to it."""
        b = plan.microbatch_size
        self.samples = tuple(
            range(run[0] * b, (run[-1] + 1) * b) for run in _consecutive_runs(self.microbatch_ids)
        )
        """The offsets in every global batch of the samples :meth:`train_step` takes, in order: its
        pipeline's share (``batch_slice``) and, on a rerouted plan, the shares of the micro-batches rerouted
        to this worker."""
        self.trace: list[Timing] | None = None
        """Set to a list to record when each action of the following steps ran (benchmarks, timelines)."""
        # Each parameter counts once in the norm: on the lowest pipeline's replica of its layer (of a tie's
        # canonical layer); a parameter split over a stage's devices by each of its shards, a whole one on
        # the stage's first device.
        tied = module.tied()
        tied_ids = {id(p) for p in tied}
        rank = groups.tensor_rank
        self._counted = [
            p
            for i in module.layer_indices
            if plan.layer_owners(i, rank)[0] == groups.worker
            for p in module.layer(i).parameters()
            if id(p) not in tied_ids and (rank == 0 or is_split(p))
        ]
        self._counted += [
            p
            for p, tie in tied.items()
            if plan.layer_owners(tie.layers[0], rank)[0] == groups.worker and (rank == 0 or is_split(p))
        ]

    def _lists(self, train: bool) -> list[Action]:
        """This worker's training or evaluation action list under its plan, validated with its whole
        pipeline's; in a pipeline a rerouted plan changes (a damaged one or a helper), taken from the merge
        of every such pipeline's and validated with its peers' (once per generation: the lists are the same
        every step)."""
        plan, groups, worker = self.plan, self.groups, self.groups.worker
        sync = self._grad_sync
        assert sync is not None
        buckets = {worker: sync.bucket_layers} if train else None
        touched = affected(plan)
        merged = self.role.pipeline in touched
        if merged:  # the routes sharing workers with this one, merged
            if train and groups.backend == "nccl" and (shared := shared_pairs(plan)):
                raise NotImplementedError(
                    f"this rerouted step sends two routes' micro-batches between workers {list(shared[0])}, "
                    "which NCCL cannot keep apart (it has no message tags): recover with "
                    "recovery_policy='reinstantiate' on NCCL"
                )
            lists, limits = step_actions(plan, groups.tensor_rank, buckets, train, touched)
        else:
            role = self.role
            pipeline = plan.pipelines[role.pipeline]
            num_stages = len(pipeline.stages)
            # at t > 1, the devices of one tensor rank form a pipeline of their own: each sends to its
            # counterpart
            spec = PipelineSpec(
                tuple(pipeline.workers_of_stage(s)[role.tensor_rank] for s in range(num_stages)),
                tuple(tuple(s.layers) for s in pipeline.stages),
                tuple(plan.microbatch_range(role.pipeline)),
            )
            lists = pipeline_actions(spec, plan.schedule, buckets, train)
            limits = {
                w: in_flight_limit(plan.schedule, num_stages, s, pipeline.microbatches)
                for s, w in enumerate(spec.workers)
            }
        # a merge's lists finish by construction: each worker checks its own (its pipeline's are few)
        checked = worker if merged else None
        if train:
            validate(lists, limits, {worker: len(sync.bucket_layers)}, worker=checked)
        else:
            validate(lists, worker=checked)
        return lists[worker]

    @property
    def eval_actions(self) -> list[Action]:
        """This worker's evaluation list, made at the first evaluation step of a generation: a rerouted
        plan's merge takes seconds at scale, which a recovery need not wait for."""
        if self._eval_actions is None:
            self._eval_actions = self._lists(train=False)
        return self._eval_actions

    @property
    def is_first_stage(self) -> bool:
        return self.role.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.role.stage == len(self.plan.pipelines[self.role.pipeline].stages) - 1

    def _microbatches(self, inputs: Any, targets: Any, context: Context | None) -> dict[int, Microbatch]:
        """This pipeline's share, cut into micro-batches along the first dimension of every tensor, by
        global micro-batch index."""
        for name, part, needed in (
            ("inputs", inputs, self.is_first_stage),
            ("targets", targets, self.is_last_stage),
        ):
            if needed and part is None:
                where = "first" if name == "inputs" else "last"
                raise ValueError(f"the {where} stage of a pipeline needs {name}, got None")
        ids = self.microbatch_ids
        xs = self._split("inputs", inputs) if self.is_first_stage else [None] * len(ids)
        ys = self._split("targets", targets) if self.is_last_stage else [None] * len(ids)
        side = {k: self._split(f"context[{k!r}]", v) for k, v in (context or {}).items()}
        return {mb: Microbatch(xs[i], ys[i], {k: v[i] for k, v in side.items()}) for i, mb in enumerate(ids)}

    def _split(self, name: str, batch: Any) -> list[Any]:
        """``batch`` (a tensor or pytree of tensors) cut into the micro-batches this worker runs."""
        b, m = self.plan.microbatch_size, len(self.microbatch_ids)
        leaves, spec = pytree.tree_flatten(batch)
        cut = []
        for leaf in leaves:
            if not isinstance(leaf, Tensor) or leaf.dim() == 0 or leaf.shape[0] != m * b:
                got = f"{leaf.shape[0]} samples" if isinstance(leaf, Tensor) and leaf.dim() else repr(leaf)
                raise ValueError(
                    f"{name} has {got} but this worker runs {m} micro-batches of {b}: every tensor of it "
                    f"must hold the samples engine.samples of the global batch ({m * b}) along its first "
                    "dimension"
                )
            cut.append(leaf.to(self.device, non_blocking=True).split(b))
        return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(m)]

    def train_step(self, inputs: Any, targets: Any, context: Context | None = None) -> Tensor | None:
        """One training step of this stage: its action list (the plan's schedule) over the pipeline's
        micro-batches, with the gradient sync.

        ``inputs`` (first stage), ``targets`` (last stage) and ``context`` (every stage: the side inputs the
        layers take by name) are this pipeline's share of the global batch
        (``global_batch[engine.batch_slice]``), each a tensor or a pytree of tensors. Returns, on the last
        stage, this pipeline's part of the global mean loss (the sum of its micro-batch losses times
        ``b / B``), else ``None``.
        """
        sync = self._grad_sync
        assert sync is not None
        with self.stage_peers_bounded():
            loss = run_actions(
                self._context,
                self.train_actions,
                self._microbatches(inputs, targets, context),
                self.loss_fn,
                self.plan.microbatch_size / self.plan.global_batch_size,
                sync,
                self.trace,
            )
        sync.finish(self.abort)
        return loss

    @contextmanager
    def stage_peers_bounded(self) -> Iterator[None]:
        """At tensor parallelism ``t > 1``: a collective of the stage's layers (DTensor's, which no waiter
        can interrupt) that fails once a failure was announced means a device of this stage left for the
        recovery while this one waited for it (its tensor group's timeout is ``slow_after``): a peer
        failure, not the model's error."""
        try:
            yield
        except RuntimeError as e:
            if self.groups.tensor_group is None or not self.abort.is_set() or isinstance(e, PeerFailure):
                raise
            raise PeerFailure(f"a device of this stage left during a tensor-parallel collective: {e}") from e

    def eval_step(self, inputs: Any, targets: Any, context: Context | None = None) -> Tensor | None:
        """Forward-only pipeline over this pipeline's share; same arguments and loss as :meth:`train_step`."""
        with self.stage_peers_bounded():
            return run_actions(
                self._context,
                self.eval_actions,
                self._microbatches(inputs, targets, context),
                self.loss_fn,
                self.plan.microbatch_size / self.plan.global_batch_size,
                None,
            )

    def commit(
        self, loss: Tensor | None, shared: Mapping[str, float] | None = None, grad_norm: bool = True
    ) -> StepResult:
        """The end of a training step, after :meth:`train_step`: all-reduce (sum, bounded, abortable) this
        worker's part of the squared gradient norm, its loss part and the numbers ``shared`` over every
        worker; its completion on any worker proves that every worker finished the step's gradient sync.

        ``shared`` lets the layers above share more numbers per step without another collective (the
        Lightning glue: its SIGTERM flag; the unit runner: the nodes waiting to join); every worker passes the
        same names in the same order. Without ``grad_norm`` (a step that does not clip by norm) the norm is
        not computed and comes back NaN.
        """
        shared = dict(shared or {})
        # a split stage's devices all compute its loss: it counts once, on the first
        counts = loss is not None and self.groups.tensor_rank == 0
        part = loss if counts else torch.zeros((), device=self.device)
        values = torch.cat(
            [
                self.grad_norm_sq().reshape(1)
                if grad_norm
                else torch.full((1,), math.nan, dtype=torch.float64, device=self.device),
                part.detach().to(torch.float64).reshape(1),
                torch.tensor(list(shared.values()), dtype=torch.float64, device=self.device),
            ]
        )
        norm_sq, mean_loss, *sums = self.groups.all_reduce(values, self.abort).tolist()
        faults.reach(faults.FaultPoint.COMMIT)
        return StepResult(norm_sq, mean_loss, dict(zip(shared, sums, strict=True)))

    def evaluate(self, inputs: Any, targets: Any, context: Context | None = None) -> Tensor:
        """:meth:`eval_step`, then the global mean loss (an all-reduce over every worker, abortable)."""
        part = self.eval_step(inputs, targets, context)
        counts = part is not None and self.groups.tensor_rank == 0
        loss = part.detach().reshape(1) if counts else torch.zeros(1, device=self.device)
        return self.groups.all_reduce(loss, self.abort)[0]

    def grad_norm_sq(self) -> Tensor:
        """This worker's part of the global squared gradient norm, each layer counted once.

        A layer counts on its replica in the lowest-index pipeline; all-reduce (sum) the result over
        the default group to get the global squared norm.
        """
        grads = [local_grad(p).detach() for p in self._counted if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        # One fused pass over the gradients, in their own dtype, as clip_grad_norm_ computes its norm.
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).double().square()
