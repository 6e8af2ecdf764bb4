"""A tiny pipeline-able LightningModule, its data and a hook recorder, shared by the strategy tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck.execution.tensor_parallel import TensorParallelPlan
from lightning_oobleck.lightning import GlobalBatchSampler, OobleckStrategy, PipelineModule

NUM_LAYERS = 6
GLOBAL_BATCH, MICRO = 8, 2
QUIET: dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
"""Trainer arguments of the tests: CPU, nothing printed or written unless a test asks."""


def layout_strategy(
    layout: list[list[int]], microbatches: list[int], seed: int, **options: Any
) -> OobleckStrategy:
    """The strategy on a hand-written layout of the test batch sizes."""
    return OobleckStrategy(
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        layout=layout,
        microbatches=microbatches,
        seed=seed,
        start_method="forkserver",
        **{"collective_timeout_s": 10, **options},
    )


class TinyNet(PipelineModule, L.LightningModule):
    """Six layers (two without parameters), cross-entropy, AdamW with a per-step LR schedule."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr

    def configure_layers(self) -> list[nn.Module]:
        return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)]

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def tensor_parallel_plan(self, index: int, layer: nn.Module) -> TensorParallelPlan:
        """Megatron's pairs: a column-parallel product, then (after an element-wise layer, on each device's
        columns) a row-parallel one whose outputs are summed; layer 4's columns cross the stage boundary of
        a pipeline cut after it, each device sending its own."""
        return {0: ColwiseParallel(), 2: RowwiseParallel(), 4: ColwiseParallel(), 5: RowwiseParallel()}.get(
            index, {}
        )

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset(n: int, seed: int, dtype: torch.dtype) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g))


def train_loader(dtype: torch.dtype = torch.float64) -> DataLoader:
    """What a user writes; the strategy replaces its sampler."""
    return DataLoader(dataset(40, seed=1, dtype=dtype), batch_size=GLOBAL_BATCH, shuffle=True)


def reference_train_loader(seed: int, dtype: torch.dtype = torch.float64) -> DataLoader:
    """The same global batches in one process."""
    data = dataset(40, seed=1, dtype=dtype)
    return DataLoader(data, batch_sampler=GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=seed))


def val_loader(dtype: torch.dtype = torch.float64) -> DataLoader:
    return DataLoader(dataset(24, seed=2, dtype=dtype), batch_size=GLOBAL_BATCH)


class HookRecorder(L.Callback):
    """Records the training hooks in order, the LR and the unclipped norm of the local gradients, per rank."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.events: list[str] = []
        self.lrs: list[float] = []
        self.local_grad_norms: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.events.append("train_batch_start")

    def on_before_zero_grad(self, *args: Any) -> None:
        self.events.append("before_zero_grad")

    def on_before_backward(self, *args: Any) -> None:
        self.events.append("before_backward")

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        has_grads = all(p.grad is not None for p in module.parameters())
        self.events.append(f"after_backward(grads={has_grads})")

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.events.append("before_optimizer_step")
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.local_grad_norms.append(float(torch.cat([p.grad.flatten() for p in module.parameters()]).norm()))

    def on_train_batch_end(self, *args: Any) -> None:
        self.events.append("train_batch_end")

    def on_validation_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.events.append("validation_epoch_end")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"events": self.events, "lrs": self.lrs, "norms": self.local_grad_norms}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def read(self) -> dict[int, dict[str, Any]]:
        return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(self.directory.glob("rank*.json"))}
