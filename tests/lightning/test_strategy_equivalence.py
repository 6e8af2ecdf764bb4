"""``Trainer.fit`` with strategy="oobleck" on 4 real processes equals single-process Lightning training.

Float64, AdamW with a per-step LR schedule, gradient clipping active, shuffled data, validation every
2 steps: the final weights, the validation loss, the LR sequence and the order of the training hooks
must match a one-process run on the same global batches, for two heterogeneous layouts.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from pipeline_testing import (
    HookRecorder,
    TinyNet,
    layout_strategy,
    reference_train_loader,
    train_loader,
    val_loader,
)

SEED, STEPS, CLIP = 3, 7, 0.05  # 5 global batches per epoch: the run crosses into epoch 1

LAYOUTS = {
    # a 1-stage pipeline beside a 3-stage one with uneven micro-batch counts
    "1+3": ([[0, 6], [0, 2, 5, 6]], [1, 3]),
    # three pipelines: 2 stages, 1 stage, 1 stage
    "2+1+1": ([[0, 4, 6], [0, 6], [0, 6]], [2, 1, 1]),
}


def trainer_kwargs(recorder: HookRecorder, logs: Path | None = None) -> dict:
    return dict(
        accelerator="cpu",
        precision="64-true",
        max_steps=STEPS,
        val_check_interval=2,
        gradient_clip_val=CLIP,
        num_sanity_val_steps=0,
        logger=CSVLogger(logs, name="", version=0) if logs else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict, list[dict]]:
    directory = tmp_path_factory.mktemp("reference")
    recorder = HookRecorder(directory)
    model = TinyNet()
    trainer = L.Trainer(devices=1, **trainer_kwargs(recorder, directory / "logs"))
    trainer.fit(model, reference_train_loader(SEED), val_loader())
    record = recorder.read()[0]
    assert min(record["norms"]) > 2 * CLIP, (
        "clipping must be active in every step for the test to mean anything"
    )
    return model.state_dict(), dict(trainer.callback_metrics), record, logged(directory / "logs")


def logged(logs: Path) -> list[dict]:
    """The rows the CSV logger wrote (global rank 0 only under a multi-process strategy)."""
    with open(logs / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fit_equals_single_process_training(name: str, reference: tuple, tmp_path: Path) -> None:
    ref_weights, ref_metrics, ref_record, ref_logged = reference
    layout, microbatches = LAYOUTS[name]
    strategy = layout_strategy(layout, microbatches, SEED)
    recorder = HookRecorder(tmp_path)
    model = TinyNet()
    trainer = L.Trainer(devices=4, strategy=strategy, **trainer_kwargs(recorder, tmp_path / "logs"))
    trainer.fit(model, train_loader(), val_loader())

    assert trainer.global_step == STEPS
    weights = model.state_dict()
    assert weights.keys() == ref_weights.keys()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)
    assert weights["layers.0.weight"].dtype == torch.float64
    torch.testing.assert_close(
        trainer.callback_metrics["val_loss"], ref_metrics["val_loss"], rtol=0, atol=1e-10
    )
    torch.testing.assert_close(
        trainer.callback_metrics["train_loss"], ref_metrics["train_loss"], rtol=0, atol=1e-10
    )
    rows = logged(tmp_path / "logs")
    assert [r.keys() for r in rows] == [r.keys() for r in ref_logged]
    for row, ref_row in zip(rows, ref_logged, strict=True):
        for key, value in ref_row.items():
            assert bool(row[key]) == bool(value), (key, row, ref_row)
            if value:
                assert float(row[key]) == pytest.approx(float(value), rel=0, abs=1e-10), (key, row, ref_row)
    # A later validate() runs forward-only pipelines on the trained weights, in new processes.
    validated = trainer.validate(model, val_loader(), verbose=False)[0]["val_loss"]
    single = TinyNet()
    single.load_state_dict(ref_weights)
    expected = L.Trainer(accelerator="cpu", devices=1, precision="64-true", logger=False).validate(
        single, val_loader(), verbose=False
    )[0]["val_loss"]
    assert validated == pytest.approx(expected, rel=0, abs=1e-10)
    records = recorder.read()
    assert sorted(records) == [0, 1, 2, 3]
    for rank, record in records.items():
        assert record["events"] == ref_record["events"], f"rank {rank}"
        assert record["lrs"] == pytest.approx(ref_record["lrs"], rel=0, abs=0)


@pytest.mark.timeout(120)
def test_resume_into_another_layout_equals_the_uninterrupted_run(reference: tuple, tmp_path: Path) -> None:
    """ModelCheckpoint after 2 steps under "1+3", then fit(ckpt_path=...) under "2+1+1" to the end."""
    ref_weights = reference[0]

    def run(layout: str, steps: int, callbacks: list, ckpt_path: str | None = None) -> TinyNet:
        strategy = layout_strategy(*LAYOUTS[layout], SEED)
        kwargs = {
            **trainer_kwargs(HookRecorder(tmp_path / layout)),
            "max_steps": steps,
            "callbacks": callbacks,
        }
        kwargs["enable_checkpointing"] = bool(callbacks)
        model = TinyNet()
        L.Trainer(devices=4, strategy=strategy, **kwargs).fit(
            model, train_loader(), val_loader(), ckpt_path=ckpt_path
        )
        return model

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run("1+3", 2, [saver])
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert (checkpoint / "index.json").exists() and (checkpoint / "lightning.pt").exists()
    resumed = run("2+1+1", STEPS, [], ckpt_path=str(checkpoint))
    weights = resumed.state_dict()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)
