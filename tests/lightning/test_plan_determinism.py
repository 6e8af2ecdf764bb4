"""The automatic plan is the same from run to run, and a checkpoint records the profile it was made from.

The first run measures the layers and keeps the profile in ``default_root_dir/oobleck-profiles``; a second
run of the same script finds it there and plans exactly the same layout (timing noise would otherwise
change it). Every checkpoint writes ``profile.json``, which a resume elsewhere passes as ``profile_path``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from pipeline_testing import TinyNet, train_loader

from lightning_oobleck.execution.checkpoint import PROFILE_FILE
from lightning_oobleck.lightning import OobleckStrategy
from lightning_oobleck.planning.plan import Plan


class PlanRecorder(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            (self.out / "plan.json").write_text(trainer.strategy.plan.to_json())


class Profiled(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(1, 4)


def fit(root: Path, out: Path, **strategy: Any) -> Plan:
    out.mkdir()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        strategy=OobleckStrategy(
            global_batch_size=8,
            microbatch_size=2,
            fault_tolerance=1,
            planner={"cluster": {"device_memory_bytes": 20_000}},
            **strategy,
        ),
        precision="64-true",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[PlanRecorder(out), ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2)],
    )
    trainer.fit(Profiled(), train_loader())
    return Plan.load(out / "plan.json")


def layout(plan: Plan) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    return [
        (tuple((s.first_layer, s.end_layer) for s in p.template.stages), p.microbatches)
        for p in plan.pipelines
    ]


CKPT = Path("ckpt", "epoch=0-step=2.ckpt")


def test_the_same_script_plans_the_same_and_its_checkpoints_record_the_profile(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = fit(root, tmp_path / "first")
    assert list((root / "oobleck-profiles").glob("profile-*.json")), "the measured profile is kept"
    second = fit(root, tmp_path / "second")
    assert second.extra["profile"] == first.extra["profile"]
    assert layout(second) == layout(first)

    saved = json.loads((tmp_path / "first" / CKPT / PROFILE_FILE).read_text())
    assert saved == first.extra["profile"]
    # Elsewhere (no cache), the checkpoint's profile plans the same layout.
    elsewhere = fit(
        tmp_path / "elsewhere",
        tmp_path / "third",
        profile_path=str(tmp_path / "first" / CKPT / PROFILE_FILE),
    )
    assert layout(elsewhere) == layout(first)
