"""A user's own module split over the devices of a node (``OobleckStrategy(tensor_parallel=2)``) with every
``Trainer`` argument at Lightning's default but ``strategy``, ``devices``, ``max_steps`` and
``precision="64-true"``: the default ``ModelCheckpoint``, summary, progress bar and logger, validation, a
loader worker, a per-step LR schedule. It trains as one device does, and its checkpoints resume across
tensor-parallel degrees: written at 2, resumed at 1, and the other way, to the uninterrupted run's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_user_defaults import Regressor, assert_same_weights, assert_validate_and_test_equal_one_device, data
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_oobleck import OobleckStrategy


class SplitRegressor(Regressor):
    """The README's regressor with a tensor-parallel plan: Megatron's column- then row-parallel pairs (a
    layer's columns cross the stage boundary when a pipeline is cut after it, each device sending its own)."""

    def tensor_parallel_plan(self, index: int, layer: nn.Module) -> dict:
        style = ColwiseParallel() if index % 2 == 0 else RowwiseParallel()
        return {"0": style} if isinstance(layer, nn.Sequential) else {"": style}


def split_strategy(tensor_parallel: int, **options: Any) -> OobleckStrategy:
    return OobleckStrategy(
        microbatch_size=2,
        fault_tolerance=0,
        devices_per_node=2,
        tensor_parallel=tensor_parallel,
        planner={"cluster": {"device_memory_bytes": 75_000}},
        **options,
    )


def fit(
    steps: int, tensor_parallel: int, devices: int, ckpt_path: Path | None = None, **options: Any
) -> dict[str, torch.Tensor]:
    module = SplitRegressor()
    strategy = split_strategy(tensor_parallel, **options)
    trainer = L.Trainer(strategy=strategy, devices=devices, max_steps=steps, precision="64-true")
    trainer.fit(module, data(), data(seed=1, workers=0), ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return {k: v.clone() for k, v in module.state_dict().items()}


def checkpoint_of(root: Path, step: int) -> Path:
    [path] = (root / "lightning_logs").glob(f"version_*/checkpoints/epoch=0-step={step}.ckpt")
    return path


@pytest.mark.timeout(400)
def test_a_split_run_trains_as_one_device_and_resumes_across_degrees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for run in ("whole", "split"):
        (tmp_path / run).mkdir()
    monkeypatch.chdir(tmp_path / "whole")
    whole_half = fit(4, tensor_parallel=1, devices=2)
    uninterrupted = fit(8, tensor_parallel=1, devices=2)
    whole_checkpoint = checkpoint_of(tmp_path / "whole", 4)

    monkeypatch.chdir(tmp_path / "split")
    split_half = fit(4, tensor_parallel=2, devices=4)
    assert_same_weights(split_half, whole_half)
    # each stage's shard written by both its devices, each its own half of every split tensor
    shards = list((checkpoint_of(tmp_path / "split", 4) / "shards").iterdir())
    assert shards and all(len(list(shard.glob("*.distcp"))) == 2 for shard in shards)
    # written at t = 2, resumed at t = 1; written at t = 1, resumed at t = 2
    resumed_whole = fit(8, tensor_parallel=1, devices=2, ckpt_path=checkpoint_of(tmp_path / "split", 4))
    assert_same_weights(resumed_whole, uninterrupted)
    resumed_split = fit(8, tensor_parallel=2, devices=4, ckpt_path=whole_checkpoint)
    assert_same_weights(resumed_split, uninterrupted)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_zero_bubble_schedule_over_split_stages_trains_as_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZB-H1 splits each backward into the input's gradient and the weights': at t = 2, on a pipeline of two
    stages each split over a node's two devices, both run on split layers (the input's gradient crossing the
    boundary from each device to its counterpart), each device's weight gradient its own shard."""
    monkeypatch.chdir(tmp_path)
    zero_bubble = fit(4, tensor_parallel=2, devices=4, schedule="zb-h1", layout=[[0, 2, 4]])
    assert_same_weights(zero_bubble, fit(4, tensor_parallel=1, devices=2))


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_validate_and_test_over_split_stages_equal_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other entry points at t = 2, defaults on: ``validate(model, ckpt_path=...)`` on a checkpoint made
    at t = 2, then ``test()`` with that run's module, equal one device on the consolidated file."""
    monkeypatch.chdir(tmp_path)
    fit(4, tensor_parallel=2, devices=4, schedule="auto")  # the strategy's planner chooses the schedule
    checkpoint = checkpoint_of(tmp_path, 4)
    trainer = L.Trainer(strategy=split_strategy(2), devices=4, precision="64-true")
    assert_validate_and_test_equal_one_device(trainer, SplitRegressor, checkpoint, tmp_path)
