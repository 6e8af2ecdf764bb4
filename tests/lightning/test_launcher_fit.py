"""A real ``Trainer.fit`` through OobleckLauncher (``spawn``): what comes back into the caller's Trainer.

The strategy here is a DDPStrategy without a process group (every worker trains its own replica), so that
rank 0 can die without the others blocking in a collective: it isolates the launcher's hand-off of
results, which the Oobleck strategy uses unchanged.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck.lightning.environment import LocalOobleckEnvironment
from lightning_oobleck.lightning.launcher import OobleckLauncher

WORKERS = 3
MAX_STEPS = 6


class ReplicaStrategy(DDPStrategy):
    """DDP's Lightning plumbing on OobleckLauncher, minus the process group and the DDP wrapper."""

    def __init__(self) -> None:
        super().__init__(cluster_environment=LocalOobleckEnvironment())

    def _configure_launcher(self) -> None:
        # All workers on one node, so DDP's rank formula (node * processes + device) is the launch rank.
        self._launcher = OobleckLauncher(
            self.num_processes, devices_per_node=self.num_processes, timeout_s=100
        )

    def setup_distributed(self) -> None:
        self.set_world_ranks()

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model


class TinyRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class RankSpecificRun(L.Callback):
    """Makes each rank's weights distinct, kills rank 0 mid-run, saves every other rank's final state."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.add_(0.01 * trainer.global_rank)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0 and batch_idx == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, pl_module):
        state = {"weights": pl_module.state_dict(), "loss": trainer.callback_metrics["loss"]}
        torch.save(state, self.out / f"final-{trainer.global_rank}.pt")


@pytest.mark.timeout(240)
def test_trainer_results_come_back_from_a_survivor_when_rank_0_dies(tmp_path: Path):
    model = TinyRegression()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORKERS,
        strategy=ReplicaStrategy(),
        max_steps=MAX_STEPS,
        use_distributed_sampler=False,
        callbacks=[RankSpecificRun(tmp_path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)

    report = trainer.strategy.launcher.last_report
    assert report.lost == {0: "killed by SIGKILL"} and report.finished == (1, 2)
    assert trainer.state.finished and trainer.global_step == MAX_STEPS
    rank1 = torch.load(tmp_path / "final-1.pt", weights_only=True)
    rank2 = torch.load(tmp_path / "final-2.pt", weights_only=True)
    for name, tensor in model.state_dict().items():
        assert not torch.equal(tensor, initial[name]), name
        assert not torch.equal(rank1["weights"][name], rank2["weights"][name]), name
        assert torch.equal(tensor, rank1["weights"][name]), name  # the lowest survivor's weights
    assert torch.equal(trainer.callback_metrics["loss"], rank1["loss"])
    assert not (tmp_path / "final-0.pt").exists()
