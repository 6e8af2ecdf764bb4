"""Throughput of ``strategy="oobleck"`` in a pure data-parallel layout against ``strategy="ddp"``.

Same model, same processes (both started with ``fork``), same global batch, same Trainer flags: each
Oobleck pipeline is one process holding every layer and running one micro-batch per step, which is
exactly what a DDP rank does, so the ratio measures the strategy's overhead (the schedule's bookkeeping,
the layer-wise gradient sync, the step commit, the per-batch SIGTERM unit, recovery's coordinator and
heartbeats). This machine's cores are shared and its speed drifts between minutes, so runs come in *pairs*
(one run of each strategy, back to back, the order alternating from pair to pair) and the ratio is taken
per pair; the table gives the median ratio and its spread.

    python benchmarks/lightning_overhead.py [--devices 2] [--steps 200] [--pairs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck.lightning import OobleckStrategy, PipelineModule

WIDTH, DEPTH, CLASSES = 512, 8, 10


class MLP(PipelineModule, L.LightningModule):
    """``DEPTH`` residual-free Linear+ReLU layers and a classifier: a compute-bound stack."""

    def configure_layers(self) -> list[nn.Module]:
        blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)]
        return [*blocks, nn.Linear(WIDTH, CLASSES)]

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Throughput(L.Callback):
    """Samples per second over the steps after ``warmup``, written by global rank 0 to ``path``."""

    def __init__(self, path: Path, warmup: int, global_batch: int) -> None:
        self.path, self.warmup, self.global_batch = path, warmup, global_batch
        self.start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            steps = trainer.global_step - self.warmup
            self.path.write_text(json.dumps(steps * self.global_batch / (time.perf_counter() - self.start)))


def run(strategy: Any, devices: int, steps: int, warmup: int, global_batch: int, out: Path) -> float:
    data = TensorDataset(torch.randn(global_batch * 8, WIDTH), torch.randint(0, CLASSES, (global_batch * 8,)))
    per_rank = global_batch if isinstance(strategy, OobleckStrategy) else global_batch // devices
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Throughput(out, warmup, global_batch)],
    )
    trainer.fit(MLP(), DataLoader(data, batch_size=per_rank, shuffle=True))
    return float(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    n, batch = args.devices, args.global_batch

    def oobleck() -> OobleckStrategy:
        return OobleckStrategy(
            global_batch_size=batch,
            microbatch_size=batch // n,
            fault_tolerance=n - 1,
            layout=[[0, DEPTH + 1]] * n,
            start_method="fork",
        )

    makers = {"ddp": lambda: DDPStrategy(start_method="fork"), "oobleck": oobleck}
    results: dict[str, list[float]] = {"ddp": [], "oobleck": []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = ["ddp", "oobleck"] if i % 2 == 0 else ["oobleck", "ddp"]
            pair = {}
            for name in order:
                pair[name] = run(
                    makers[name](), n, args.steps, args.warmup, batch, Path(tmp) / f"{name}-{i}.json"
                )
                results[name].append(pair[name])
            ratios.append(pair["oobleck"] / pair["ddp"])
            print(
                f"pair {i + 1}/{args.pairs}: ddp {pair['ddp']:.0f}, oobleck {pair['oobleck']:.0f} samples/s"
            )

    table = Table(
        title=f"Lightning overhead: {n} CPU processes, global batch {batch}, {args.steps} timed steps, "
        f"{args.pairs} pairs of runs"
    )
    for column in ("strategy", "samples/s (median)", "vs ddp (median of per-pair ratios)", "ratio range"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    table.add_row('strategy="ddp"', f"{statistics.median(results['ddp']):.0f}", "1.000", "")
    table.add_row(
        'strategy="oobleck"',
        f"{statistics.median(results['oobleck']):.0f}",
        f"{statistics.median(ratios):.3f}",
        f"{min(ratios):.3f} - {max(ratios):.3f}",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
