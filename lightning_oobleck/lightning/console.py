"""One console for a run of many workers: what Lightning prints once under DDP is printed once here too, and
the strategy's own lines (the plan, where the run writes what).

Lightning prints its own messages on rank 0 only (``rank_zero_info``/``rank_zero_warn``), but Python warnings
raised by library code (a deprecation inside Lightning or torch) print in every process, and a worker knows
its rank only once the strategy set it. :func:`show_warnings_on_rank_zero` lets a worker print Python
warnings only while it is rank 0 (the rank of the current generation, so the new rank 0 takes over when the
old one is lost). Where the output is not a terminal (a batch job's output file, a pipe), :class:`StepLines`
takes the place of Lightning's progress bar: plain lines instead of a bar redrawn with ``\\r`` and escape
codes (:func:`use_step_lines`).
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from lightning_oobleck.planning.plan import Plan

_INSTALLED = "_oobleck_rank_zero"


def show_warnings_on_rank_zero() -> None:
    """From now on this process prints Python warnings only while it is rank 0 (idempotent)."""
    shown = warnings.showwarning
    if getattr(shown, _INSTALLED, False):
        return

    def showwarning(*args: Any, **kwargs: Any) -> None:
        if rank_zero_only.rank == 0:
            shown(*args, **kwargs)

    setattr(showwarning, _INSTALLED, True)
    warnings.showwarning = showwarning


UNTRUE_LIGHTNING_WARNINGS = (
    # the DistributedSampler Lightning puts into evaluation loaders may repeat samples; the strategy replaces
    # it (process_dataloader) with global batches, which repeat none
    "Using `DistributedSampler` with the dataloaders",
)
"""The starts of Lightning's warnings that are not true under the strategy."""


def hide_untrue_lightning_warnings() -> None:
    """From now on this process does not print :data:`UNTRUE_LIGHTNING_WARNINGS`."""
    for message in UNTRUE_LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message))


class StepLines(ProgressBar):
    """Lightning's progress as plain lines, printed by the current rank 0 (so by the new one after a failure):
    ``oobleck: step 50/200 (epoch 0) loss=0.4321 0.14 s/step`` every ``every`` steps and at the end of
    training, and ``oobleck: validation at step 50: val_loss=0.3561`` after each validation. The values are
    the progress-bar metrics (``self.log(..., prog_bar=True)``)."""

    def __init__(self, every: int = 50) -> None:
        super().__init__()
        self.every = max(every, 1)
        self._enabled = True
        self._since: tuple[float, int] | None = None
        self._epoch = 0
        """The epoch of the last step: past the last one, Lightning's count has moved to the next epoch."""

    @property
    @override
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # every rank keeps it: whichever is rank 0 prints

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._since = (time.monotonic(), trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._epoch = trainer.current_epoch
        if trainer.global_step % self.every == 0:
            self._print_step(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._since is None or self._since[1] != trainer.global_step:
            self._print_step(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._print(f"validation at step {trainer.global_step}: {self._values(trainer, pl_module)}")

    def _print_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now, step = time.monotonic(), trainer.global_step
        rate = ""
        if self._since is not None and step > self._since[1]:
            rate = f" {(now - self._since[0]) / (step - self._since[1]):.2f} s/step"
        self._since = (now, step)
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        values = self._values(trainer, pl_module)
        self._print(f"step {step}{total} (epoch {self._epoch}){' ' + values if values else ''}{rate}")

    def _values(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())

    def _print(self, line: str) -> None:
        if self._enabled and rank_zero_only.rank == 0:
            print(f"oobleck: {line}", flush=True)


def output_is_terminal() -> bool:
    """Whether this process writes to a terminal: ``isatty()``, unless ``TTY_COMPATIBLE=0`` says otherwise
    (rich's convention; SLURM tasks set it, see :mod:`lightning_oobleck.slurm.task`)."""
    return sys.stdout.isatty() and os.environ.get("TTY_COMPATIBLE") != "0"


def use_step_lines(trainer: pl.Trainer) -> None:
    """Where this process's output is not a terminal, put :class:`StepLines` in place of Lightning's own
    progress bar (``TQDMProgressBar``, ``RichProgressBar``), which would write its redrawn frames there."""
    bar = trainer.progress_bar_callback
    if bar is None or output_is_terminal() or not isinstance(bar, (TQDMProgressBar, RichProgressBar)):
        return
    trainer.callbacks[trainer.callbacks.index(bar)] = StepLines(every=trainer.log_every_n_steps)


def print_start(plan: Plan, events: Path | None, profiles: Path | None) -> None:
    """What rank 0 prints when training starts: the plan, what the planner warns of, and where the run writes
    what (the events file lies in the run's log directory, beside the logs and the default checkpoints)."""
    console = Console()
    console.print(plan_table(plan))
    for warning in plan.warnings:
        console.print(f"oobleck: warning: {warning}", highlight=False, soft_wrap=True)
    where = [f"logs, checkpoints and recovery events in {events.parent}"] if events is not None else []
    if profiles is not None:
        where.append(f"layer profiles in {profiles}")
    if where:
        console.print(f"oobleck: {'; '.join(where)}", highlight=False, soft_wrap=True)


def plan_table(plan: Plan) -> Table:
    """The plan as a table: each pipeline's nodes, stages, micro-batches and samples of the global batch;
    below it, where the planner chose the degree or the schedule, what each alternative would have given."""
    table = Table(
        caption="\n".join(plan.choices()) or None,
        caption_justify="left",
        title=f"Oobleck plan: {counted(len(plan.pipelines), 'pipeline')}, f={plan.fault_tolerance}, "
        f"global batch {plan.global_batch_size} = {plan.num_microbatches} x {plan.microbatch_size}"
        + (f", each stage on {plan.tensor_parallel} devices" if plan.tensor_parallel > 1 else "")
        + (f", schedule {plan.schedule}" if plan.schedule != "1f1b" else "")
        + (f", predicted {plan.iteration_time_s:.3g} s/step" if plan.iteration_time_s > 0 else ""),
    )
    for name in ("pipeline", "nodes", "stages: [first, end) layers", "micro-batches", "samples [first, end)"):
        table.add_column(name, justify="left" if name.startswith("stages") else "right")
    for i, p in enumerate(plan.pipelines):
        stages = " | ".join(f"{s.first_layer}-{s.end_layer}" for s in p.stages)
        samples = plan.samples(i)
        table.add_row(
            str(i),
            ", ".join(map(str, p.nodes)),
            stages,
            str(p.microbatches),
            f"{samples.start}-{samples.stop}",
        )
    return table


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
