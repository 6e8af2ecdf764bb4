"""The fault matrix in the loop users run: failures anywhere in ``Trainer.fit``, not only in the step.

The loop: validation every 3 steps (``val_loss`` logged with ``sync_dist``), ``ModelCheckpoint`` every 4
steps, ``DataLoader(num_workers=2)`` for training and validation, a warm-up + cosine ``SequentialLR``
stepped per step, ``gradient_clip_algorithm="value"``, AdamW with decay / no-decay parameter groups,
float32 data under ``precision="64-true"``, a CSV logger, pipelines of unequal shares. Workers are
SIGKILLed or SIGSTOPped for real, at a chosen moment: in a training forward, after a step's commit while
another worker has not yet seen it (that worker catches up through Lightning's own update), in a
validation forward, in a checkpoint save (its shard written, its peers waiting), in the ``sync_dist``
reduce of ``val_loss``, two nodes at once.

Every run must end with all steps done; every sample of every counted global batch fed exactly once; the
final weights, the logged ``val_loss`` values and the learning rate at every step equal to single-process
Lightning training on the same global batches (1e-9); no half-written checkpoint; and its last checkpoint
must resume, on another layout, to the same final weights.

=================  =========================================  ==========================
who                when                                       test
=================  =========================================  ==========================
rank 0             training forward (SIGKILL)                 rank0_then_catch_up...
last stage         after its commit (SIGKILL), while a first  rank0_then_catch_up...
                   stage has not seen the commit (catch-up)
middle stage       validation forward (SIGKILL)               middle_stage_in_validation...
last stage         checkpoint save (SIGKILL)                  middle_stage_in_validation...
first stage        sync_dist reduce of val_loss (SIGSTOP)     middle_stage_in_validation...
two nodes at once  checkpoint save (SIGKILL), f = 2           two_nodes_in_a_checkpoint...
the coordinator    training backward (SIGKILL)                coordinator_lost_twice...
its successor +    training forward (SIGKILL), together       coordinator_lost_twice...
a node
last stage, ZB-H1  input gradient ``I`` (SIGKILL)             zero_bubble_schedule...
first stage, ZB-H1 weight gradient ``W`` (SIGKILL)            zero_bubble_schedule...
last stage, ZB-H1  gradient ``REDUCE`` (SIGKILL)              zero_bubble_schedule...
=================  =========================================  ==========================
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_fault_matrix import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OPTIMIZER,
    REDUCE,
    WEIGHT_GRAD,
    Fault,
    Faults,
    TinyNet,
    assert_every_sample_fed_once,
    dataset,
    planned,
)  # tests/lightning on the path
from torch.utils.data import DataLoader

from lightning_oobleck.execution import PeerFailure
from lightning_oobleck.execution.checkpoint import INDEX_FILE, METADATA_FILE, missing_shards
from lightning_oobleck.lightning import GlobalBatchSampler, OobleckStrategy
from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.recovery import read_events
from lightning_oobleck.testing import Fault as PointFault
from lightning_oobleck.testing import FaultPoint, arm

SEED, STEPS, GLOBAL_BATCH, MICRO, SAMPLES, VAL_SAMPLES = 3, 9, 12, 2, 60, 24
CLIP = 0.02
VALIDATION, CHECKPOINT, LOGGING, LAG = "validation", "checkpoint", "logging", "lag"


class RealisticNet(TinyNet):
    """TinyNet with what real runs configure: decay / no-decay groups, warm-up then cosine per step."""

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=0.05
        )
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LoopFaults(Faults):
    """:class:`Faults` plus the moments outside the training step, keyed by ``(node, global_step)``:
    ``VALIDATION`` (a few layers into the validation run after that step), ``CHECKPOINT`` (right after
    this worker wrote its shard of the checkpoint of that step), ``LOGGING`` (when the validation run's
    ``val_loss`` is reduced over the workers), ``LAG`` (this worker sees the step's commit only after a
    failure notice: it must catch up). Records the learning rates of every step."""

    def __init__(self, out: Path, faults: dict[tuple[int, int], Fault]) -> None:
        super().__init__(out, faults)
        self.lrs: dict[int, list[float]] = {}

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_fit_start(trainer, module)
        self.trainer, self.validation_forwards = trainer, 0
        for (node, step), fault in self.faults.items():
            if (node, fault.device) == tuple(self.worker) and fault.when == CHECKPOINT:
                # the save of global step G comes after training step G - 1 (the fault points' step)
                arm(PointFault(FaultPoint.CHECKPOINT, step=step - 1), report=self._record)
        strategy = trainer.strategy
        reduce, engine = strategy.reduce, strategy.engine
        commit = engine.commit

        def reduce_fire_first(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            if floating and trainer.state.stage == "validate":
                self._signal(trainer, LOGGING)
            return reduce(tensor, *args, **kwargs)

        def commit_late_if_armed(loss: Any, *args: Any, **kwargs: Any) -> Any:
            """A race, not a fault: see the step's commit only once a failure was announced."""
            if self._mine(trainer, LAG) is not None:
                waiter = engine.groups.waiter

                def see_it_late(works: Any, abort: Any) -> None:
                    deadline = time.monotonic() + 10
                    while not abort.is_set() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    (self.out / f"lagged-{self.name}").write_text(str(trainer.global_step))
                    raise PeerFailure("test: this worker saw the commit only after the failure notice")

                waiter.wait = see_it_late
            return commit(loss, *args, **kwargs)

        strategy.reduce = reduce_fire_first
        engine.commit = commit_late_if_armed

    def _mine(self, trainer: L.Trainer, when: str) -> Fault | None:
        fault = self.faults.get((self.worker[0], trainer.global_step))
        return fault if fault is not None and fault.device == self.worker[1] and fault.when == when else None

    def _signal(self, trainer: L.Trainer, when: str) -> None:
        """The moments no fault point names (a validation forward, the reduce of a logged value)."""
        if (fault := self._mine(trainer, when)) is not None:
            (self.out / f"fault-{self.name}.json").write_text(json.dumps(fault))
            os.kill(os.getpid(), fault.signal)

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.validation_forwards = 0

    def _on_forward(self, layer: torch.nn.Module, args: tuple) -> None:
        trainer = self.trainer
        if trainer.state.stage == "validate" and not trainer.sanity_checking:
            self.validation_forwards += 1
            if self.validation_forwards == 2:
                self._signal(trainer, VALIDATION)
            return
        super()._on_forward(layer, args)

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.lrs[trainer.global_step] = [g["lr"] for g in optimizer.param_groups]
        super().on_before_optimizer_step(trainer, module, optimizer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_end(trainer, module)
        (self.out / f"lrs-{self.name}.json").write_text(json.dumps(self.lrs))


class LearningRates(L.Callback):
    def __init__(self) -> None:
        self.lrs: dict[int, list[float]] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.lrs[trainer.global_step] = [g["lr"] for g in optimizer.param_groups]


def loop_kwargs(out: Path, callbacks: list, checkpoints: bool = True) -> dict[str, Any]:
    saver = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=4, save_top_k=-1)
    return dict(
        accelerator="cpu",
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="value",
        val_check_interval=3,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=CSVLogger(out, name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[*callbacks, saver] if checkpoints else callbacks,
    )


def float32_data(samples: int, seed: int) -> torch.utils.data.TensorDataset:
    return dataset(samples, seed=seed, dtype=torch.float32)


def logged(out: Path, metric: str) -> dict[int, float]:
    """``metric`` per step in the run's one CSV file (there must be one version: every rank 0 wrote it)."""
    (path,) = out.glob("logs/version_*/metrics.csv")
    with open(path, newline="") as f:
        return {int(r["step"]): float(r[metric]) for r in csv.DictReader(f) if r.get(metric)}


@pytest.fixture(scope="module")
def loop_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Single-process Lightning on the same global batches and validation batches."""
    return reference_run(tmp_path_factory.mktemp("loop-reference"), RealisticNet())


def reference_run(out: Path, model: L.LightningModule) -> dict[str, Any]:
    """Train ``model`` in one process on the loop's global batches; its weights, LRs and logged losses."""
    train, val = float32_data(SAMPLES, 1), float32_data(VAL_SAMPLES, 2)
    rates = LearningRates()
    L.Trainer(devices=1, **loop_kwargs(out, [rates], checkpoints=False)).fit(
        model,
        DataLoader(train, batch_sampler=GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)),
        DataLoader(val, batch_sampler=GlobalBatchSampler(VAL_SAMPLES, GLOBAL_BATCH, shuffle=False)),
    )
    return {
        "weights": dict(model.state_dict()),
        "lrs": rates.lrs,
        "val_loss": logged(out, "val_loss"),
        "train_loss": logged(out, "train_loss"),
    }


def fit_loop(
    out: Path,
    faults: LoopFaults,
    num_nodes: int,
    ckpt_path: str | None = None,
    module: L.LightningModule | None = None,
    trainer_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> L.Trainer:
    """Train with the planner's f = 2 plan of ``planned(num_nodes)``, unless ``kw`` fixes the layout or
    sets ``fault_tolerance`` (then the strategy plans by itself)."""
    if "layout" not in kw and "fault_tolerance" not in kw:
        plan_path = out / "plan.json"
        plan_path.write_text(planned(num_nodes, schedule=kw.get("schedule", "1f1b")).to_json())
        kw = {"plan_path": str(plan_path), "fault_tolerance": 2, **kw}
    strategy = OobleckStrategy(
        **{
            "global_batch_size": GLOBAL_BATCH,
            "microbatch_size": MICRO,
            "seed": SEED,
            "collective_timeout_s": 20,
            # 7 workers and 14 loader workers share 2 cores here: a heartbeat thread can starve for seconds
            "heartbeat_timeout_s": 8.0,
            **kw,
        }
    )
    train = DataLoader(float32_data(SAMPLES, 1), batch_size=GLOBAL_BATCH, shuffle=True, num_workers=2)
    val = DataLoader(float32_data(VAL_SAMPLES, 2), batch_size=GLOBAL_BATCH, num_workers=2)
    trainer = L.Trainer(
        devices=num_nodes, strategy=strategy, **{**loop_kwargs(out, [faults]), **(trainer_kw or {})}
    )
    trainer.fit(module or RealisticNet(), train, val, ckpt_path=ckpt_path)
    return trainer


def check_loop(
    trainer: L.Trainer,
    out: Path,
    reference: dict[str, Any],
    dead: set[int],
    num_nodes: int,
    lost_before_start: set[int] = frozenset(),
    joined: set[int] = frozenset(),
) -> None:
    assert trainer.state.finished and trainer.global_step == STEPS
    assert {int(p.stem.split("-")[1].split(".")[0]) for p in out.glob("fault-*.json")} == dead
    survivors = {n for n in range(num_nodes) if n not in dead} | joined
    assert {int(p.stem[6:].split(".")[0]) for p in out.glob("final-*.pt")} == survivors
    # the caller's module got the survivors' weights merged: what trainer.validate / test / save go on with
    merged = trainer.lightning_module.state_dict()
    assert merged.keys() == reference["weights"].keys()
    held = {"merged": merged} | {f"on {n}": torch.load(out / f"final-{n}.0.pt") for n in survivors}
    for where, weights in held.items():
        for name, value in weights.items():
            torch.testing.assert_close(
                value, reference["weights"][name], rtol=0, atol=1e-9, msg=f"{name} {where}"
            )
    for node in survivors:
        lrs = {int(k): v for k, v in json.loads((out / f"lrs-{node}.0.json").read_text()).items()}
        for step, rates in lrs.items():
            assert rates == pytest.approx(reference["lrs"][step], rel=0, abs=1e-12), (
                f"lr at step {step} on {node}"
            )
    # every step's LR was seen by some survivor, and every step's samples fed exactly once
    seen = {int(k) for node in survivors for k in json.loads((out / f"lrs-{node}.0.json").read_text())}
    assert seen == set(range(STEPS))
    assert_every_sample_fed_once(out, float32_data(SAMPLES, 1).tensors[0].double(), STEPS)
    # the logged losses (one CSV file, continued by whichever worker is rank 0) equal the reference, over
    # the whole history, also from before a rank 0 died
    for metric in ("val_loss", "train_loss"):
        values = logged(out, metric)
        assert values.keys() == reference[metric].keys(), metric
        for step, value in values.items():
            assert math.isclose(value, reference[metric][step], rel_tol=0, abs_tol=1e-9), (
                f"{metric} at {step}"
            )
    # checkpoints: every one complete, none half-written
    saved = sorted((out / "ckpt").iterdir())
    assert [p.name for p in saved] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    for checkpoint in saved:  # every shard the index lists is there, complete
        shards = set(json.loads((checkpoint / INDEX_FILE).read_text())["layers"].values())
        assert (checkpoint / METADATA_FILE).exists() and not missing_shards(checkpoint, shards), checkpoint
    assert not list((out / "ckpt").glob(".*"))
    _, recoveries = read_events(out / "logs" / "version_0" / EVENTS_FILE)
    assert sorted(w[0] for e in recoveries for w in e.removed) == sorted(dead - lost_before_start)


def resume_check(
    out: Path, reference: dict[str, Any], module: type[L.LightningModule] = RealisticNet
) -> None:
    """The run's last checkpoint resumes on another layout (a 2-stage pipeline beside a 1-stage one) to the
    reference's final weights."""
    resumed = out / "resumed"
    resumed.mkdir()
    trainer = fit_loop(
        resumed,
        LoopFaults(resumed, {}),
        3,
        ckpt_path=str(out / "ckpt" / "epoch=1-step=8.ckpt"),
        module=module(),
        layout=[[0, 3, 6], [0, 6]],
        fault_tolerance=0,
    )
    assert trainer.global_step == STEPS
    finals = list(resumed.glob("final-*.pt"))
    assert len(finals) == 3
    for path in finals:
        for name, value in torch.load(path).items():
            torch.testing.assert_close(value, reference["weights"][name], rtol=0, atol=1e-9, msg=name)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_rank0_then_catch_up_through_lightnings_update(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """6 nodes, 3 pipelines of 2. Rank 0 dies in a training forward of step 1. In step 5 a last stage
    (node 5) dies after its commit while a first stage (node 3) has not yet seen that commit: node 3
    applies step 5 through Lightning's own update (clip by value, hooks, scheduler), nothing is redone."""
    faults = {
        (0, 1): Fault(signal.SIGKILL, FORWARD),
        (5, 5): Fault(signal.SIGKILL, OPTIMIZER),
        (3, 5): Fault(0, LAG),
    }
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 6)
    check_loop(trainer, tmp_path, loop_reference, dead={0, 5}, num_nodes=6)
    assert (tmp_path / "lagged-3.0").read_text() == "5"
    resume_check(tmp_path, loop_reference)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_middle_stage_in_validation_last_stage_in_a_checkpoint_hang_in_logging(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """7 nodes: pipelines (0, 1, 2), (3, 4), (5, 6). The middle stage node 1 dies in the validation after
    step 3; the last stage node 4 dies in the checkpoint save of step 4 (its shard written, its peers
    waiting to commit); the first stage node 5 hangs (SIGSTOP) in the sync_dist reduce of val_loss after
    step 6 and is fenced after the heartbeat timeout."""
    faults = {
        (1, 3): Fault(signal.SIGKILL, VALIDATION),
        (4, 4): Fault(signal.SIGKILL, CHECKPOINT),
        (5, 6): Fault(signal.SIGSTOP, LOGGING),
    }
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 7)
    check_loop(trainer, tmp_path, loop_reference, dead={1, 4, 5}, num_nodes=7)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_nodes_in_a_checkpoint_save_at_once(tmp_path: Path, loop_reference: dict[str, Any]) -> None:
    """f = 2: a first stage and a last stage of two pipelines die together in the checkpoint save of step
    4; then more nodes than the plan tolerates are gone and the run says so (f reduced) and goes on."""
    kill = Fault(signal.SIGKILL, CHECKPOINT)
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, {(1, 4): kill, (2, 4): kill, (3, 8): kill}), 6)
    check_loop(trainer, tmp_path, loop_reference, dead={1, 2, 3}, num_nodes=6)
    _, recoveries = read_events(tmp_path / "logs" / "version_0" / EVENTS_FILE)
    assert recoveries[-1].fault_tolerance is not None and recoveries[-1].fault_tolerance < 2
    assert any("tolerates f=" in w for e in recoveries for w in e.warnings)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_zero_bubble_schedule_kills_in_an_i_a_w_and_a_reduce(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """``schedule="auto"``, which the planner resolves to ZB-H1 (split backward) here: 6 nodes, 3 pipelines of
    2. A last stage (node 1) dies in an ``I`` of step 1; a first stage (node 2) in a ``W`` of step 3; a last
    stage (node 5) in a ``REDUCE`` of step 6. Same weights, LRs, logged losses, samples and checkpoints as
    single-process training."""
    faults = {
        (1, 1): Fault(signal.SIGKILL, INPUT_GRAD),
        (2, 3): Fault(signal.SIGKILL, WEIGHT_GRAD),
        (5, 6): Fault(signal.SIGKILL, REDUCE),
    }
    assert planned(6, schedule="auto").schedule == "zb-h1"
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 6, schedule="auto")
    check_loop(trainer, tmp_path, loop_reference, dead={1, 2, 5}, num_nodes=6)
    # the plans made in the recoveries keep the schedule
    assert {p.read_text() for p in tmp_path.glob("schedule-*")} == {"zb-h1"}
    _, recoveries = read_events(tmp_path / "logs" / "version_0" / EVENTS_FILE)
    assert recoveries and {e.schedule for e in recoveries} == {"zb-h1"}


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_coordinator_lost_twice_the_second_time_with_a_node(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """6 nodes, 3 pipelines of 2. The job's coordinator is SIGKILLed in a training backward of step 2: its
    standby takes over, no worker is lost. In step 6 the coordinator that took over is SIGKILLed too, and
    node 3 dies in the same step: the standby started after the first loss takes over and runs the recovery.
    Same weights, LRs, logged losses, samples and checkpoints as single-process training."""
    faults = {
        (1, 2): Fault(signal.SIGKILL, BACKWARD, target="coordinator"),
        (2, 6): Fault(signal.SIGKILL, FORWARD, target="coordinator"),
        (3, 6): Fault(signal.SIGKILL, BACKWARD),
    }
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 6)
    check_loop(trainer, tmp_path, loop_reference, dead={3}, num_nodes=6)
    events = (tmp_path / "logs" / "version_0" / EVENTS_FILE).read_text().splitlines()
    failovers = [r for r in map(json.loads, events) if r["kind"] == "failover"]
    assert [f["epoch"] for f in failovers] == [1, 2]
