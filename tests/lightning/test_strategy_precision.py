"""bf16-mixed under the oobleck strategy trains like bf16-mixed on one process (autocast in every stage)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from pipeline_testing import GLOBAL_BATCH, MICRO, TinyNet, reference_train_loader, train_loader, val_loader

from lightning_oobleck.execution import profile_layers
from lightning_oobleck.lightning import OobleckStrategy
from lightning_oobleck.lightning.strategy import PROFILE_CACHE
from lightning_oobleck.planning.profile import ModelProfile

SEED, STEPS = 5, 3


def fit(devices: int, strategy: object) -> tuple[dict[str, torch.Tensor], float]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=STEPS,
        val_check_interval=STEPS,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyNet()
    f32 = torch.float32
    loader = reference_train_loader(SEED, f32) if devices == 1 else train_loader(f32)
    trainer.fit(model, loader, val_loader(f32))
    return model.state_dict(), float(trainer.callback_metrics["val_loss"])


@pytest.mark.timeout(120)
def test_bf16_mixed_pipeline_matches_single_process_bf16() -> None:
    ref_weights, ref_val = fit(1, "auto")
    two_stages = OobleckStrategy(
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        fault_tolerance=0,
        layout=[[0, 3, 6]],
        seed=SEED,
        start_method="forkserver",
    )
    weights, val = fit(2, two_stages)
    assert weights["layers.0.weight"].dtype == torch.float32  # master weights stay fp32 under autocast
    assert ref_weights["layers.0.weight"].dtype == torch.float32
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=2e-2, msg=key)
    assert val == pytest.approx(ref_val, abs=2e-2)


class ProfiledNet(TinyNet):
    """TinyNet with the float32 ``example_input_array`` the README shows, planned automatically."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(1, 4)


def planned_fit(precision: str, steps: int, root: Path, devices: int = 2) -> tuple[L.Trainer, ProfiledNet]:
    """Fit :class:`ProfiledNet` on ``devices`` processes under ``precision``, planned automatically
    (profiled), as a user runs it: Lightning's defaults on (logger, checkpoints, progress bar, model
    summary), validation at the end."""
    strategy = OobleckStrategy(
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        fault_tolerance=devices - 1,
        start_method="forkserver",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    model = ProfiledNet()
    trainer.fit(model, train_loader(torch.float32), val_loader(torch.float32))
    return trainer, model


@pytest.mark.timeout(120)
def test_a_float32_example_input_plans_under_64_true(tmp_path: Path) -> None:
    """The automatic plan profiles the layers in the precision's dtype: float32 example inputs (and float32
    data) train float64 weights under ``precision="64-true"``."""
    trainer, model = planned_fit("64-true", 2, tmp_path)
    assert trainer.global_step == 2
    assert model.state_dict()["layers.0.weight"].dtype == torch.float64


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bf16_mixed_plans_from_layers_profiled_as_its_steps_run_them(tmp_path: Path) -> None:
    """Under ``bf16-mixed`` the layers are profiled under the run's autocast, so the plan counts the
    bfloat16 tensors the steps keep for the backward, not the float32 ones a plain forward would."""
    planned_fit("bf16-mixed", 1, tmp_path, devices=1)
    [cached] = (tmp_path / PROFILE_CACHE).glob("profile-*.json")
    profile = ModelProfile.load(cached)
    assert profile.meta["autocast"] == "bfloat16"
    assert profile.dtype == "float32"  # the parameters, which the optimizer steps
    plain = profile_layers(ProfiledNet().configure_layers(), torch.zeros(MICRO, 4), torch.device("cpu"))
    # the last Linear saves its input, cast to bfloat16 under autocast: half the bytes of the float32 one
    assert profile.layers[5].activation_bytes * 2 == plain.layers[5].activation_bytes
