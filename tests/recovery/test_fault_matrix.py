"""The fault matrix through ``Trainer.fit(strategy="oobleck")``: real SIGKILL / SIGSTOP of workers.

Six single-device nodes run 3 pipelines of 2 stages (f = 2, the planner's plan from ``six_node_plan``);
float64, AdamW with a per-step LR schedule, gradient clipping active, shuffled data crossing an epoch.
Each run loses several nodes one after another and must end normally with ``global_step == max_steps``,
every sample of every counted global batch fed exactly once, and weights equal to single-process
Lightning training on the same global batches (1e-9).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_runtime import six_node_plan
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parents[1] / "lightning"))
from pipeline_testing import TinyNet, dataset

from lightning_oobleck.lightning import GlobalBatchSampler, OobleckStrategy
from lightning_oobleck.recovery import read_events
from lightning_oobleck.recovery.fit import EVENTS_FILE

SEED, STEPS, CLIP, GLOBAL_BATCH, MICRO, SAMPLES = 3, 5, 0.05, 12, 2, 36


FORWARD, OPTIMIZER = "forward", "optimizer"


class Faults(L.Callback):
    """On node ``n`` at step ``s`` (``faults[(n, s)] = (signal, when)``), signal this very process a few
    layers into the step's 1F1B (``FORWARD``) or after its commit, before the optimizer update
    (``OPTIMIZER``); records, per counted step, the samples the pipeline's first stage fed."""

    def __init__(self, out: Path, faults: dict[tuple[int, int], tuple[int, str]]) -> None:
        self.out, self.faults = out, faults
        self.fed: list[tuple[int, torch.Tensor]] = []
        self.armed: tuple[int, str] | None = None
        self.forwards = 0

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        self.node = trainer.strategy._environment().worker[0]
        self.engine = lambda: trainer.strategy.engine

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.fed.clear()
        self.forwards = 0
        self.armed = self.faults.get((self.node, trainer.global_step))

    def _on_forward(self, layer: torch.nn.Module, args: tuple) -> None:
        engine = self.engine()
        if engine.is_first_stage and layer is engine.module.layer(0):
            self.fed.append((engine.groups.generation, args[0].detach().clone()))
        self.forwards += 1
        if self.forwards == 3:
            self._fire(FORWARD)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._fire(OPTIMIZER)

    def _fire(self, when: str) -> None:
        if self.armed is not None and self.armed[1] == when:
            (self.out / f"fault-{self.node}.json").write_text(json.dumps(self.armed))
            os.kill(os.getpid(), self.armed[0])

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        counted = self.engine().groups.generation  # an attempt interrupted by a recovery does not count
        rows = [r for g, rows in self.fed if g == counted for r in rows.tolist()]
        with open(self.out / f"fed-{self.node}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step - 1, "rows": rows}) + "\n")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.save(dict(module.state_dict()), self.out / f"final-{self.node}.pt")


def trainer_kwargs(tmp_path: Path, callbacks: list) -> dict:
    return dict(
        accelerator="cpu",
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    data = dataset(SAMPLES, seed=1, dtype=torch.float64)
    loader = DataLoader(data, batch_sampler=GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED))
    model = TinyNet()
    L.Trainer(devices=1, **trainer_kwargs(tmp_path_factory.mktemp("reference"), [])).fit(model, loader)
    return dict(model.state_dict())


def fit_with_faults(tmp_path: Path, faults: dict[tuple[int, int], tuple[int, str]]) -> L.Trainer:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(six_node_plan().to_json())
    strategy = OobleckStrategy(
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        plan_path=str(plan_path),
        fault_tolerance=2,
        seed=SEED,
        start_method="forkserver",
        collective_timeout_s=20,
        heartbeat_timeout_s=4.0,
    )
    loader = DataLoader(dataset(SAMPLES, seed=1, dtype=torch.float64), batch_size=GLOBAL_BATCH, shuffle=True)
    trainer = L.Trainer(devices=6, strategy=strategy, **trainer_kwargs(tmp_path, [Faults(tmp_path, faults)]))
    model = TinyNet()
    trainer.fit(model, loader)
    return trainer


def check(trainer: L.Trainer, tmp_path: Path, reference: dict[str, torch.Tensor], dead: set[int]) -> None:
    assert trainer.state.finished and trainer.global_step == STEPS
    assert {int(p.stem[6:]) for p in tmp_path.glob("fault-*.json")} == dead
    survivors = set(range(6)) - dead
    for node in survivors:
        weights = torch.load(tmp_path / f"final-{node}.pt")
        for name, value in weights.items():
            torch.testing.assert_close(
                value, reference[name], rtol=0, atol=1e-9, msg=f"{name} on node {node}"
            )
    # Every sample of every counted global batch was fed exactly once.
    data = dataset(SAMPLES, seed=1, dtype=torch.float64).tensors[0]
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    fed: dict[int, list[tuple[float, ...]]] = {}
    for path in tmp_path.glob("fed-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            fed.setdefault(record["step"], []).extend(map(tuple, record["rows"]))
    for step in range(STEPS):
        epoch, index = divmod(step, len(sampler))
        expected = sorted(tuple(data[i].tolist()) for i in sampler.global_batch(epoch, index))
        assert sorted(fed[step]) == expected, f"step {step}"


@pytest.mark.timeout(300)
def test_rank0_then_a_hung_first_stage(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Global rank 0 (node 0, a first stage) is SIGKILLed mid-step 1; a last stage (node 5) after its
    commit of step 2, before its optimizer update (the step counts: nothing is redone); node 4 (a first
    stage) hangs (SIGSTOP) mid-step 3 and is fenced after the heartbeat timeout."""
    faults = {
        (0, 1): (signal.SIGKILL, FORWARD),
        (5, 2): (signal.SIGKILL, OPTIMIZER),
        (4, 3): (signal.SIGSTOP, FORWARD),
    }
    trainer = fit_with_faults(tmp_path, faults)
    check(trainer, tmp_path, reference, dead={0, 4, 5})
    # Node 4 may stop while the others already recover from node 5: that agreement then waits for it
    # until it is declared dead, and one recovery removes both.
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert [w[0] for w in recoveries[0].removed] == [0] and len(recoveries) in (2, 3)
    assert all(e.resumed_at is not None and {w[0] for w in e.removed} <= {0, 4, 5} for e in recoveries)


@pytest.mark.timeout(300)
def test_two_nodes_at_once_then_a_last_stage(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """f = 2: a last stage (node 1) and a first stage (node 2) of two pipelines die together mid-step 1;
    then the last stage node 3 dies mid-step 3."""
    kill = (signal.SIGKILL, FORWARD)
    trainer = fit_with_faults(tmp_path, {(1, 1): kill, (2, 1): kill, (3, 3): kill})
    check(trainer, tmp_path, reference, dead={1, 2, 3})
