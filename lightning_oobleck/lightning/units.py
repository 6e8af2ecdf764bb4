"""Every exchange of the oobleck strategy with its peers, as a recoverable unit of the fit.

:class:`~lightning_oobleck.lightning.OobleckStrategy` runs each of these through :class:`LightningLoop`: a
training step (pipeline, gradient sync and commit), an evaluation step (validation, sanity check, test),
the reduces, broadcasts, barriers and all-gathers it serves to Lightning (``self.log(..., sync_dist=True)``,
callbacks), a checkpoint save, and the barrier that ends the fit. Lightning's per-batch SIGTERM flag rides
on the training step's commit. Under
in-process recovery each is a unit of :class:`~lightning_oobleck.recovery.unit_runner.UnitRunner`: a peer lost
anywhere in it is recovered from in place and the unit is redone on the new pipelines (or, where other
survivors completed it, its result adopted), so training continues in the same ``fit``. Without a
coordinator (a ``validate``/``test`` call) the same units run once.

:class:`LightningLoop` is also the unit runner's training loop
(:class:`~lightning_oobleck.recovery.unit_runner.TrainingLoop`):
it rebuilds the optimizer's parameter groups with ``configure_optimizers`` for new layers, takes the
survivors' checkpoint metadata from Lightning, and after a switch points the strategy, the data samplers
and the loggers at the new layout.
"""

from __future__ import annotations

import csv
import io
import math
import pickle
import time
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from rich.filesize import decimal
from torch import Tensor

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.checkpoint import (
    commit,
    discard,
    layer_writers,
    missing_shards,
    partial_path,
    shard_name,
    tie_aliases,
    write_metadata,
    write_shard,
)
from lightning_oobleck.execution.engine import PipelineEngine, StepResult
from lightning_oobleck.execution.process_groups import backend_for
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.lightning._internals import (
    batch_to_device,
    dump_checkpoint,
    init_optimizers_and_lr_schedulers,
    mark_sigterm_received,
    resume_from,
    set_logger_version,
    validation_data_ready,
)
from lightning_oobleck.lightning.console import counted
from lightning_oobleck.lightning.data import DataPosition, PipelineDataLoader
from lightning_oobleck.lightning.module import batch_parts, layer_source, meta_layers
from lightning_oobleck.recovery.admission import JoinPolicy
from lightning_oobleck.recovery.agent import WorkerAgent
from lightning_oobleck.recovery.events import EventLog, Failover, RecoveryEvent, StepRecord
from lightning_oobleck.recovery.joiner import Admission
from lightning_oobleck.recovery.protocol import node_name
from lightning_oobleck.recovery.unit_runner import Unit, UnitRunner

if TYPE_CHECKING:
    from lightning_oobleck.lightning.module import PipelineModule
    from lightning_oobleck.lightning.strategy import OobleckStrategy

T = TypeVar("T")

LOGGER_VERSIONS = "logger_versions"
"""The plan's (and a joiner's handover's) entry with the run's logger versions (:func:`logger_versions`)."""

EVENTS_FILE = "oobleck-events.jsonl"


def host_key(node: int) -> str:
    """The run store's key of the host that node ``node``'s workers run on (each worker sets it at its
    start: a joiner too)."""
    return f"hosts/{node}"


"""The recovery and step records of a run, in the trainer's log directory (``oobleck timeline``)."""
SIGTERM = "sigterm"
"""The name under which a step's commit carries the workers that had received SIGTERM."""

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class LightningLoop:
    """The strategy's exchanges with its peers (see the module docstring), recoverable once
    :meth:`enable_recovery` was called. ``trainer`` is the running Trainer."""

    def __init__(self, strategy: OobleckStrategy, trainer: Trainer) -> None:
        self.strategy = strategy
        self.trainer = trainer
        self.committed = StepResult(0.0, 0.0, {SIGTERM: 0.0})
        """The last training step's commit; its sum :data:`SIGTERM` counts the workers that had received
        SIGTERM."""
        module = trainer.lightning_module
        self.clips_by_norm = is_overridden("configure_gradient_clipping", module, LightningModule) or (
            bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")
        )
        """Whether a step may clip by norm (Lightning's clipping, or the module's own): only then does the
        step's commit compute the gradient norm."""
        self._step_started = time.time()
        self._sigterm = False
        self.runner: UnitRunner | None = None
        self.events: EventLog | None = None
        self._failovers_reported = 0
        self._recent_steps: deque[StepRecord] = deque(maxlen=16)
        """This worker's last steps, as rank 0 records them."""
        self._validation_data_ready = False
        self.catching_up = False
        """A joiner between its admission and its first training step: the members wait inside that step,
        so the units Lightning runs before it (the barriers of a fit's start) have nobody to meet."""

    def enable_recovery(
        self, agent: WorkerAgent, store: dist.Store, admission: Admission | None = None
    ) -> None:
        """Make every later unit recoverable, with ``agent`` (the coordinator's notices) and ``store``;
        ``admission``: this process joined the running training (:func:`join_training`)."""
        strategy, trainer = self.strategy, self.trainer
        engine = strategy.engine
        config = strategy.config
        self.runner = UnitRunner(
            agent,
            store,
            engine,
            strategy.optimizers[0],
            layer_source(strategy.lightning_module),
            self,
            dtype=next(engine.module.parameters()).dtype,
            backend=config.backend or backend_for(strategy.root_device),
            group_timeout=engine.groups.timeout,
            agreement_timeout=config.hang_timeout_s,
            checkpoint_dir=Path(trainer.default_root_dir) / "oobleck-survivors",
            join_policy=JoinPolicy(config.join_policy),
            admission=admission,
            recovery_policy=config.recovery_policy,
            failure_interval_s=config.failure_interval_s,
            replace_failed_after_s=config.replace_failed_after_s,
        )
        # The log directory is agreed by a broadcast: a unit, recovered like the others.
        root = Path(trainer.log_dir or trainer.default_root_dir)
        # This fit's rank 0 at its start begins the file: a run never appends to an earlier job's records.
        first_writer = admission is None and engine.groups.rank == 0
        self.events = EventLog(root / EVENTS_FILE, logger=trainer.logger, new=first_writer)
        self.runner.log_events(self.events)

    @property
    def engine(self) -> PipelineEngine:
        return self.strategy.engine

    def run(self, unit: Unit[T]) -> T:
        """Run ``unit`` as a recoverable unit (or once, without recovery)."""
        if self.catching_up:
            raise RuntimeError(
                "a collective (an all_gather, an evaluation step) ran on a worker that "
                "joined the running training before its first training step: its peers are inside that "
                "step and cannot answer. Run collectives of a fit's start in setup() or from the first "
                "training batch on"
            )
        return self.runner.run(unit) if self.runner is not None else unit(self.engine)

    def catch_up(self, handover: dict[str, Any]) -> None:
        """This joiner resumes the fit where the members stand, as from a checkpoint they took at the start
        of the step they wait in (``handover``: :meth:`join_state`), with the layers and optimizer state it
        received. Until that step it meets nobody: its barriers pass, its reduces and broadcasts keep its
        own values (Lightning's checks of its data and directories, which are the members'), the sanity
        check is the members' own, and its validation data are set up before the step if theirs are, so
        that from then on it runs the units they run."""
        trainer = self.trainer
        resume_from(trainer, handover["checkpoint"])
        trainer.num_sanity_val_steps = 0
        set_logger_versions(trainer, handover[LOGGER_VERSIONS])
        self._validation_data_ready = handover["validation_data_ready"]
        self.catching_up = True

    def _finish_catching_up(self) -> None:
        if self._validation_data_ready:
            self.trainer.fit_loop.epoch_loop.val_loop.setup_data()
        self.catching_up = False

    # ------------------------------------------------------------------ steps
    def train_step(self, module: PipelineModule, batch: Any, position: DataPosition) -> Tensor:
        """Pipeline step and commit of training batch ``position``; returns the global mean loss."""
        self._step_started = time.time()

        runner = self.runner
        if self.catching_up:
            self._finish_catching_up()
        if runner is None:  # the runner marks its steps itself
            faults.step_starts(self.engine.groups.worker, self.trainer.global_step)

        def step(engine: PipelineEngine) -> StepResult:
            engine.module.zero_grad(set_to_none=True)
            current = self._current(batch, self.trainer.train_dataloader, position, 0)
            loss = engine.train_step(*batch_parts(module, current))
            shared, norm = {SIGTERM: float(self._sigterm)}, self.clips_by_norm
            if runner is None:
                return engine.commit(loss, shared, grad_norm=norm)
            return runner.commit(engine, loss, shared, grad_norm=norm)

        self.committed = runner.step(step) if runner is not None else step(self.engine)
        return torch.tensor(self.committed.loss, device=self.engine.device)

    def grad_norm_sq(self) -> float:
        """The squared gradient norm of the whole model for the step being applied (for clipping by norm)."""
        if math.isnan(self.committed.grad_norm_sq):
            raise RuntimeError(
                "gradients were clipped by norm outside `configure_gradient_clipping`, so the step did not "
                "compute the model's gradient norm: clip with Trainer(gradient_clip_val=...) or in your "
                "LightningModule's `configure_gradient_clipping`"
            )
        return self.committed.grad_norm_sq

    def eval_step(self, module: PipelineModule, batch: Any, batch_idx: int, dataloader_idx: int) -> Tensor:
        """Forward-only pipelines over evaluation batch ``batch_idx``; the global mean loss."""
        loader = evaluation_loaders(self.trainer)[dataloader_idx]
        sampler = loader.batch_sampler if isinstance(loader, PipelineDataLoader) else None
        epoch = sampler.position.epoch if sampler is not None else 0

        def evaluate(engine: PipelineEngine) -> Tensor:
            current = self._current(batch, loader, DataPosition(epoch, batch_idx), dataloader_idx)
            return engine.evaluate(*batch_parts(module, current))

        return self.run(evaluate)

    def _current(self, batch: Any, loader: Any, position: DataPosition, dataloader_idx: int) -> Any:
        """``batch``, or, if it was cut for an older layout, this pipeline's share of the same global batch
        cut again and passed through the same hooks as every batch of Lightning's loops."""
        if not isinstance(loader, PipelineDataLoader):
            return batch
        sampler = loader.batch_sampler
        if not sampler.is_stale(position.epoch, position.step):
            return batch
        indices = sampler.indices(position.epoch, position.step)
        trainer = self.trainer
        fresh = loader.collate_fn([loader.dataset[i] for i in indices])
        fresh = trainer.precision_plugin.convert_input(fresh)
        return batch_to_device(trainer, fresh, dataloader_idx)

    def optimizer_step(self, update: Callable[[], T]) -> T:
        """Lightning's update of the batch (``update()``); counted, and recorded in the events file."""
        output = update()
        if self.runner is not None:
            self.runner.advance()
            runner, now = self.runner, time.time()
            took = now - self._step_started
            samples = runner.plan.global_batch_size
            step = StepRecord(runner.progress.steps, samples, took, runner.generation, now)
            self._recent_steps.append(step)  # every worker: whichever becomes rank 0 fills what is missing
            if self.engine.groups.rank == 0 and self.events is not None:
                self.events.step(*step)
                self._report_failovers(self.events, runner.agent.failovers)
        return output

    def _report_failovers(self, events: EventLog, failovers: list[Failover]) -> None:
        """(Rank 0) one line and one event per coordinator failover since the last step."""
        for failover in failovers[self._failovers_reported :]:
            events.failover(failover, self.runner.progress.steps if self.runner is not None else None)
            seconds = failover.took_over_at - failover.lost_at
            rank_zero_info(
                f"oobleck: the job's coordinator at {failover.lost} was lost ({failover.reason}); its "
                f"standby at {failover.standby} took over in {seconds:.2f} s; training went on"
            )
        self._failovers_reported = len(failovers)

    def finish(self) -> None:
        """The fit's last unit: every worker completed every step when it completes anywhere."""
        if self.runner is not None:
            self.runner.finish()
        else:
            self.barrier()

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, reduce_op: str | dist.ReduceOp.RedOpType = "sum") -> Tensor:
        """``tensor`` reduced over every worker (a new tensor); ``"mean"`` divides by the world size, in
        floating point (an integer tensor's mean is not truncated)."""
        name = reduce_op.lower() if isinstance(reduce_op, str) else None
        if name is not None and name not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce_op {reduce_op!r}: use one of {', '.join(_REDUCE_OPS)}")
        if self.catching_up:  # Lightning's data setup checks the loaders' lengths: the members' data, too
            return tensor.clone()
        op = _REDUCE_OPS[name] if name is not None else reduce_op
        mean = name in ("mean", "avg")

        def reduce(engine: PipelineEngine) -> Tensor:
            result = engine.groups.all_reduce(tensor.clone(), engine.abort, op)  # type: ignore[arg-type]
            if mean:
                result = (
                    result if result.is_floating_point() else result.double()
                ) / engine.groups.world_size
            return result

        return self.run(reduce)

    def barrier(self) -> None:
        if not self.catching_up:
            self.all_reduce(torch.zeros(1, device=self.engine.device))

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` of rank ``src`` (of the generation that completes the unit). A joiner catching up keeps its
        own ``obj``, as every worker does before the strategy's setup: it has the members' configuration and
        logger versions, so the directories Lightning agrees on at a fit's start are theirs."""
        if self.catching_up:
            return obj
        return self.run(lambda engine: _broadcast_object(engine, obj, src))

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Every worker's ``tensor`` (same shape everywhere), stacked in rank order."""

        def gather(engine: PipelineEngine) -> Tensor:
            groups = engine.groups
            stacked = torch.zeros(groups.world_size, *tensor.shape, dtype=tensor.dtype, device=tensor.device)
            stacked[groups.rank] = tensor
            return groups.all_reduce(stacked, engine.abort)

        return self.run(gather)

    def record_sigterm(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler while training: remember the signal for the next commit, nothing else."""
        self._sigterm = True

    def check_sigterm(self) -> None:
        """Lightning's per-batch SIGTERM check, without a collective of its own: if any worker had received
        SIGTERM by the last step's commit, which carries the flag, every worker (laggards included) ends the
        run's units together and raises ``SIGTERMException`` here, at the same batch."""
        if self.committed.sums[SIGTERM] > 0:
            mark_sigterm_received(self.trainer)
            self.finish()
            raise SIGTERMException()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Write each layer and its optimizer state once, verify every shard, then commit atomically (see
        :mod:`~lightning_oobleck.execution.checkpoint`); a peer lost meanwhile makes it start over.

        Rank 0 commits only once every shard the index lists is complete in the directory it commits; a
        shard written elsewhere (a worker given another path) fails the save on every worker, naming it."""
        metadata = self.strategy.checkpoint_metadata(checkpoint)

        def save(engine: PipelineEngine) -> tuple[str, list[str]]:
            groups = engine.groups
            partial = partial_path(path, f"gen{groups.generation}")
            writers = layer_writers(groups.plan)
            stage = groups.stage_worker  # a stage split over several devices writes one shard together
            with engine.stage_peers_bounded():
                write_shard(
                    partial,
                    engine.module,
                    self.strategy.optimizers,
                    shard_name(stage),
                    lambda layer: writers[layer] == stage,
                    groups.tensor_group,
                )
            faults.reach(faults.FaultPoint.CHECKPOINT)
            if groups.rank == 0:
                shards = {layer: shard_name(w) for layer, w in writers.items()}
                write_metadata(partial, metadata, shards, tie_aliases(self.strategy.ties))
            groups.all_reduce(torch.zeros(1, device=engine.device), engine.abort)
            verdict = None
            if groups.rank == 0:
                missing = missing_shards(partial, {shard_name(w) for w in writers.values()})
                if not missing:
                    commit(partial, path)
                verdict = (str(Path(path).resolve()), missing)
            return _broadcast_object(engine, verdict, 0)

        committed_path, missing = self.run(save)
        if missing:
            discard(path)
            # Every worker raises this refusal; the barrier lets none leave (a peer would take that for a
            # failure, the launcher stops every worker) before every staging directory is gone.
            self.finish()
            raise CheckpointError(
                f"checkpoint {committed_path} was not saved: the shards of worker(s) "
                f"{', '.join(missing)} are missing from it. Every worker must save to the same path on "
                "a file system they all see: give ModelCheckpoint(dirpath=...) or "
                "trainer.save_checkpoint(...) one path on shared storage"
            )

    # ------------------------------------------------------------------ the unit runner's training loop
    def build_optimizer(self, module: StageModule) -> torch.optim.Optimizer:
        optimizer = build_optimizer(self.strategy.lightning_module, module)
        check_tied_parameter_groups(self.strategy.lightning_module, optimizer, module)
        return optimizer

    def checkpoint_metadata(self) -> dict[str, Any]:
        """Lightning's checkpoint entries now, at the start of the interrupted unit: its loops count the
        batch as started but not completed and the data position (advanced only after an optimizer step)
        is this batch, so ``Trainer.fit(ckpt_path=...)`` redoes exactly this step."""
        checkpoint = dump_checkpoint(self.trainer)
        # Lightning rewinds only the epoch's counters of a batch it restarts: the run's total must say the
        # same, or its batch index (which times validation) would count this batch twice.
        batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
        batches.update({k: batches["completed"] for k in ("ready", "started", "processed")})
        return self.strategy.checkpoint_metadata(checkpoint)

    def join_state(self) -> dict[str, Any]:
        """A joiner's entry: Lightning's checkpoint entries now, at the start of the interrupted step (the
        joiner's fit redoes that step with the members), and the loggers' versions (one run directory)."""
        return {
            "checkpoint": self.checkpoint_metadata(),
            LOGGER_VERSIONS: logger_versions(self.trainer),
            "validation_data_ready": validation_data_ready(self.trainer),
        }

    def switched(self, runner: UnitRunner, event: RecoveryEvent) -> None:
        """Point the strategy, Lightning's rank, the data and the loggers at the new layout."""
        strategy = self.strategy
        groups = runner.engine.groups
        was_rank_zero = rank_zero_only.rank == 0
        environment = strategy._environment()
        environment.set_global_rank(groups.rank)
        environment.set_world_size(groups.world_size)
        rank_zero_only.rank = groups.rank
        plan = groups.plan
        for loader in _pipeline_loaders(self.trainer):
            loader.batch_sampler.set_share(runner.engine.samples, groups.generation)
        if groups.rank == 0 and not was_rank_zero:
            continue_logger_runs(self.trainer)
            continue_progress_bar(self.trainer)
            if self.events is not None:  # the old rank 0 may have died before it recorded its last step
                last = self.events.last_step()
                for step in self._recent_steps:
                    if step.step > last:
                        self.events.step(*step)
        pipelines = counted(len(plan.pipelines), "pipeline")
        if plan.reroutes:
            pipelines += f" ({counted(len(plan.reroutes), 'lost stage')} rerouted to replicas)"
        layout = f"{pipelines} on {len(plan.nodes)} nodes, f={plan.fault_tolerance}"
        if plan.tensor_parallel > 1:
            layout += f", each stage on {plan.tensor_parallel} devices"
        copied = ""
        if (speed := event.copy_gb_per_s()) is not None:
            senders = counted(event.copy_senders, "worker")
            rate = decimal(int(speed * 1e9))
            copied = f" ({decimal(event.copied_bytes)} of state copied from {senders} at {rate}/s)"
        if lost := sorted({node for node, _ in event.removed}):
            rank_zero_info(
                f"oobleck: node(s) {self._named(lost)} lost at step {runner.progress.steps} "
                f"[{event.cause}]; training goes on: {layout}, recovered in "
                f"{event.durations().get('total', 0.0):.2f} s{copied}"
            )
        if event.recovery_policy is not None:
            horizon = f" (the next failure expected in {event.horizon_s:.4g} s)" if event.horizon_s else ""
            rank_zero_info(
                f"oobleck: recovered by {event.recovery_policy}{horizon}: {'; '.join(event.candidates)}"
            )
        for warning in event.warnings:  # a line of the run's story, like the one above (no source path)
            rank_zero_info(f"oobleck: warning: {warning}")
        if joined := sorted({node for node, _ in event.added}):
            nodes = self._named(joined)
            rank_zero_info(
                f"oobleck: node(s) {nodes} joined at step {runner.progress.steps}: {layout}{copied}"
            )

    def _named(self, nodes: list[int]) -> str:
        """``1 (gpu-17), 3 (gpu-22)``: node ids with the hosts their workers reported, where that is not this
        host (a local run's nodes share one)."""
        store, here, names = self.strategy._store, node_name(), []
        for node in nodes:
            key = host_key(node)
            host = store.get(key).decode() if store is not None and store.check([key]) else here
            names.append(str(node) if host == here else f"{node} ({host})")
        return ", ".join(names)

    def flush_loggers(self) -> None:
        """Write what rank 0's loggers hold, so that a new rank 0 continues from it if this one is lost."""
        if rank_zero_only.rank != 0:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger.save()
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.flush()


def continue_logger_runs(trainer: Trainer) -> None:
    """This process just became rank 0: its CSV loggers append to the run's file, with its columns.

    Lightning's CSV writer deletes an existing ``metrics.csv`` when it is created (it expects a new run):
    the file is put back, and the writer told its header.
    """
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            path = Path(logger.log_dir) / ExperimentWriter.NAME_METRICS_FILE
            history = path.read_text() if path.exists() else None
            with warnings.catch_warnings():  # it is this run's directory: nothing is deleted
                warnings.filterwarnings("ignore", message="Experiment logs directory")
                writer = logger.experiment
            if history is not None:
                path.write_text(history)
                writer.metrics_keys = sorted(next(csv.reader(io.StringIO(history)), []))


def continue_progress_bar(trainer: Trainer) -> None:
    """This process just became rank 0: its progress bar, disabled on every other rank, takes over where the
    lost rank 0's stopped (the bar's own hooks open it for the current epoch)."""
    bar = trainer.progress_bar_callback
    if bar is None or bar.is_enabled or not trainer.training:
        return
    bar.enable()
    bar.on_train_start(trainer, trainer.lightning_module)
    bar.on_train_epoch_start(trainer, trainer.lightning_module)
    # The bar counts this epoch's batches from its start, not from now.
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    total = min(trainer.num_training_batches, bar.total_train_batches + done)
    if (
        isinstance(bar, RichProgressBar)
        and bar.progress is not None
        and bar.train_progress_bar_id is not None
    ):
        bar.progress.update(bar.train_progress_bar_id, total=total, completed=done)
    elif isinstance(bar, TQDMProgressBar):
        bar.train_progress_bar.total = total
        bar.train_progress_bar.n = done


def build_optimizer(lightning_module: Any, module: StageModule) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` builds for the layers of ``module`` (which the Lightning
    module holds from now on)."""
    lightning_module.layers = module.layers
    optimizers, _ = init_optimizers_and_lr_schedulers(lightning_module)
    if len(optimizers) != 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers; the oobleck strategy supports "
            "exactly one"
        )
    return optimizers[0]


def check_tied_parameter_groups(
    lightning_module: Any, optimizer: torch.optim.Optimizer, module: StageModule
) -> None:
    """Refuse a tied parameter whose optimizer settings here differ from those it gets with the whole model.

    Its holders keep it identical only if they update it alike; a ``configure_optimizers`` that groups
    parameters by name (decay / no-decay) may place it by the name it has where its canonical layer is not
    held. The whole model is built on the meta device for the comparison."""
    if not module.ties:
        return
    held = lightning_module.layers
    whole = StageModule(dict(enumerate(meta_layers(lightning_module))), module.ties)
    try:
        reference = build_optimizer(lightning_module, whole)
    finally:
        lightning_module.layers = held
    for param, tie in module.tied().items():
        canonical = whole.layer(tie.members[0][0]).get_parameter(tie.members[0][1])
        mine, expected = _group_settings(optimizer, param), _group_settings(reference, canonical)
        if mine != expected:
            others = ", ".join(f"layers.{i}.{n}" for i, n in tie.members[1:])
            raise ValueError(
                f"the tied parameter {tie.name} (also {others}) gets optimizer settings {mine} on this "
                f"worker but {expected} in the whole model: configure_optimizers places it by a name that "
                "differs where only some of its layers are held, so its copies would drift apart. Choose its "
                "parameter group by module type, or by a rule that holds for every name of the tie"
            )


def _group_settings(optimizer: torch.optim.Optimizer, param: Tensor) -> dict[str, Any] | None:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return {k: v for k, v in group.items() if k != "params"}
    return None


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved complete: nothing was committed at its path."""


def _broadcast_object(engine: PipelineEngine, obj: Any, src: int) -> Any:
    """``obj`` of rank ``src`` on every worker: its bytes all-reduced (sum) against zeros, so that the
    exchange ends with an all-reduce like every other (abortable when a peer is lost)."""
    groups = engine.groups
    mine = pickle.dumps(obj) if groups.rank == src else b""
    size = groups.all_reduce(
        torch.tensor([len(mine)], dtype=torch.int64, device=engine.device), engine.abort, dist.ReduceOp.MAX
    )
    buffer = torch.zeros(int(size), dtype=torch.uint8, device=engine.device)
    if mine:
        buffer.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    groups.all_reduce(buffer, engine.abort)
    return pickle.loads(buffer.cpu().numpy().tobytes())


def logger_versions(trainer: Trainer) -> list[int | str]:
    """The versions of the trainer's versioned loggers (resolved now: the next free one when first asked for).

    One worker resolves them and every worker takes them (:func:`set_logger_versions`) before Lightning's
    setup, so that the log directory, ``ModelCheckpoint``'s default ``dirpath`` and whichever worker is rank
    0 later all name the same run directory."""
    return [logger.version for logger in _versioned_loggers(trainer)]


def set_logger_versions(trainer: Trainer, versions: list[int | str]) -> None:
    for logger, version in zip(_versioned_loggers(trainer), versions, strict=True):
        set_logger_version(logger, version)


def _versioned_loggers(trainer: Trainer) -> list[CSVLogger | TensorBoardLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, CSVLogger | TensorBoardLogger)]


def _listed(loaders: Any) -> list[Any]:
    """A Trainer's loaders of one kind (one loader, a list of them, or none) as a list."""
    if loaders is None:
        return []
    return list(loaders) if isinstance(loaders, list | tuple) else [loaders]


def evaluation_loaders(trainer: Trainer) -> list[Any]:
    """The loaders of the evaluation that runs (test, or validation in fit and validate), by index."""
    return _listed(trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders)


def _pipeline_loaders(trainer: Trainer) -> list[PipelineDataLoader]:
    """The training and evaluation loaders, whose samplers cut each global batch for this pipeline."""
    loaders = [
        trainer.train_dataloader,
        *_listed(trainer.val_dataloaders),
        *_listed(trainer.test_dataloaders),
    ]
    return [loader for loader in loaders if isinstance(loader, PipelineDataLoader)]
