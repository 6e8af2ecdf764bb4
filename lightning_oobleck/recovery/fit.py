"""Recovery inside ``Trainer.fit``: what :class:`~lightning_oobleck.lightning.OobleckStrategy` delegates to.

The strategy runs each training step's pipeline part through :meth:`FitRecovery.pipeline_step`: the 1F1B
schedule and gradient sync, then the commit (one abortable all-reduce of the squared gradient norm and the
loss parts, see :mod:`~lightning_oobleck.recovery.runtime`). A failure there recovers in place and then
either redoes the step on the new pipelines (with the same global batch, re-cut for the new plan) or, when
other survivors had already committed it, applies it during the recovery and tells the strategy to skip
Lightning's optimizer update for this batch. The rest of Lightning's step (``backward`` hooks, clipping
with the committed norm, ``optimizer.step()``, LR schedulers, logging, checkpoints) is unchanged; after
a recovery the strategy's optimizer is the rebuilt one (``configure_optimizers`` run again over the new
layers, hyperparameters and per-parameter state carried over) and the LR schedulers point at it.

Known limit: Lightning's own collectives outside the pipeline step (``self.log(sync_dist=True)``, its
SIGTERM flag broadcast, barriers around checkpoints and validation) are not abortable: a failure while a
rank is inside one is seen at the collective timeout (``collective_timeout_s``), not at once.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from lightning_oobleck.execution.engine import PipelineEngine
from lightning_oobleck.execution.process_groups import backend_for
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.lightning.data import DataPosition, PipelineDataLoader, share_of_pipeline
from lightning_oobleck.recovery.agent import WorkerAgent
from lightning_oobleck.recovery.events import EventLog
from lightning_oobleck.recovery.protocol import ADDRESS_ENV
from lightning_oobleck.recovery.runtime import Recovery, RecoveryOutcome

if TYPE_CHECKING:
    from lightning_oobleck.lightning.module import PipelineModule
    from lightning_oobleck.lightning.strategy import OobleckStrategy

EVENTS_FILE = "oobleck-events.jsonl"
"""The recovery and step records of a run, in the trainer's log directory (``oobleck timeline``)."""


def start_agent(worker: tuple[int, int], timeout_s: float) -> tuple[WorkerAgent | None, int]:
    """The worker's agent and the first agreed generation, when a coordinator runs (``ADDRESS_ENV``)."""
    if not os.environ.get(ADDRESS_ENV):
        return None, 0
    agent = WorkerAgent(worker, connect_timeout=timeout_s).start()
    return agent, agent.agree(-1, timeout_s).generation


def clip_to_norm(optimizer: torch.optim.Optimizer, norm_sq: float, clip_val: float) -> None:
    """``clip_grad_norm_(max_norm=clip_val)`` of ``optimizer``'s gradients, given the global squared norm."""
    coef = min(1.0, clip_val / (math.sqrt(norm_sq) + 1e-6))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(coef)


class FitRecovery:
    """The in-process recovery of one ``Trainer.fit`` under the oobleck strategy."""

    def __init__(self, strategy: OobleckStrategy, trainer: Trainer, agent: WorkerAgent, store: Any) -> None:
        self.strategy = strategy
        self.trainer = trainer
        module = strategy.lightning_module
        engine = strategy.engine
        root = Path(trainer.log_dir or trainer.default_root_dir)
        self.events = EventLog(root / EVENTS_FILE, logger=trainer.logger)
        self.recovery = Recovery(
            agent,
            store,
            engine,
            strategy.optimizers[0],
            module.configure_layers,
            self._make_optimizer,
            self._apply_update,
            seed=module.init_seed,
            dtype=next(engine.module.parameters()).dtype,
            backend=strategy.config.backend or backend_for(strategy.root_device),
            group_timeout=engine.groups.timeout,
            agreement_timeout=max(30.0, engine.groups.timeout.total_seconds()),
            checkpoint_dir=Path(trainer.default_root_dir) / "oobleck-survivors",
            checkpoint_metadata=self._checkpoint_metadata,
            events=self.events,
        )
        self.committed: list[float] = [0.0, 0.0]
        self.caught_up = False
        """The batch's update was applied during a recovery: Lightning's optimizer step must be skipped."""
        self._stale: set[DataPosition] = set()
        self._step_started = time.time()

    # ------------------------------------------------------------------ the step
    def pipeline_step(self, module: PipelineModule, batch: Any) -> Tensor:
        """Forward, backward and commit of this batch, recovering in place; returns the global mean loss."""
        self._step_started = time.time()

        def attempt(engine: PipelineEngine) -> Tensor | None:
            inputs, targets = module.split_batch(self._current_batch(batch))
            return engine.train_step(
                inputs if engine.is_first_stage else None, targets if engine.is_last_stage else None
            )

        self.committed, self.caught_up = self.recovery.run_step(attempt, after_recovery=self._adopt)
        return torch.tensor(self.committed[1], device=self.recovery.engine.device)

    def optimizer_step(self, run_update: Any, closure: Any) -> Any:
        """Run the batch (``closure``), then Lightning's update (``run_update(optimizer, closure)``) with the
        optimizer of the moment, unless a recovery already applied it."""
        result = closure()
        if self.caught_up:
            output = result
        else:
            output = run_update(self.strategy.optimizers[0], lambda *_, **__: result)
            self.recovery.advance(self.committed)
        if self.recovery.engine.groups.rank == 0:
            generation = self.recovery.generation
            samples = self.recovery.plan.global_batch_size
            self.events.step(
                self.recovery.ledger.applied, samples, time.time() - self._step_started, generation
            )
        return output

    # ------------------------------------------------------------------ recovery
    def _adopt(self, outcome: RecoveryOutcome) -> None:
        """Point the strategy, Lightning's optimizer and schedulers and the data at the recovered run."""
        strategy, recovery = self.strategy, self.recovery
        groups = recovery.engine.groups
        strategy._groups = groups
        environment = strategy._environment()
        environment.set_global_rank(groups.rank)
        environment.set_world_size(groups.world_size)
        rank_zero_only.rank = groups.rank
        strategy.optimizers = [recovery.optimizer]
        for config in self.trainer.lr_scheduler_configs:
            config.scheduler.optimizer = recovery.optimizer
        pipeline = groups.plan.role(*groups.worker).pipeline
        share = share_of_pipeline(groups.plan.microbatch_range(pipeline), groups.plan.microbatch_size)
        for loader in self._loaders():
            loader.batch_sampler.set_share(share)
        # The batch in flight, and the one Lightning prefetched, were cut for the old pipelines.
        position = strategy._in_flight
        self._stale = {position, DataPosition(position.epoch, position.step + 1)}

    def _loaders(self) -> list[PipelineDataLoader]:
        """The training and validation loaders, whose samplers cut each global batch for this pipeline."""
        val = self.trainer.val_dataloaders
        val = [] if val is None else list(val) if isinstance(val, list | tuple) else [val]
        loaders = [self.trainer.train_dataloader, *val]
        return [loader for loader in loaders if isinstance(loader, PipelineDataLoader)]

    def _current_batch(self, batch: Any) -> Any:
        """``batch``, or this pipeline's share of the same global batch re-cut after a plan change."""
        position = self.strategy._in_flight
        if position not in self._stale:
            return batch
        sampler = self.strategy._train_sampler()
        loader = self.trainer.train_dataloader
        assert sampler is not None and loader is not None
        indices = sampler.global_batch(position.epoch, position.step)[
            sampler.share.start : sampler.share.stop
        ]
        return self.strategy.batch_to_device(loader.collate_fn([loader.dataset[i] for i in indices]))

    def _checkpoint_metadata(self) -> dict[str, Any]:
        """Lightning's checkpoint entries now, in the interrupted step: its loops count the batch as started
        but not completed and the data position (advanced only after an optimizer step) is this batch,
        so ``Trainer.fit(ckpt_path=...)`` redoes exactly this step."""
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return self.strategy.checkpoint_metadata(checkpoint)

    def _make_optimizer(self, stage: StageModule) -> torch.optim.Optimizer:
        module = self.strategy.lightning_module
        module.layers = stage.layers
        optimizers, _ = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers; in-process recovery rebuilds "
                "exactly one (the oobleck strategy supports one optimizer)"
            )
        return optimizers[0]

    def _apply_update(self, optimizer: torch.optim.Optimizer, norm_sq: float) -> None:
        """The update of a step this worker finishes during a recovery: clip as Lightning would, step."""
        clip_val = self.trainer.gradient_clip_val
        if clip_val:
            clip_to_norm(optimizer, norm_sq, float(clip_val))
        optimizer.step()
