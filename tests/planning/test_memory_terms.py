"""The memory model's terms for parameter state, measured on this torch: what AdamW keeps and allocates in its
step, and what autocast keeps per parameter, counted by the bytes of live tensors (the CPU's stand-in for a
GPU allocator's statistics; the same multi-tensor code runs on a GPU). ``benchmarks/gpu_check.py`` measures
them again on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import OPTIMIZER_STEP_TEMPORARIES, CostModel, default_state_factor
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.testing import LiveTensorMeter


def measured_profile(dtype: str, autocast: str | None = None) -> ModelProfile:
    layer = LayerProfile(1e-3, 2e-3, parameter_bytes=1000, output_activation_bytes=10, activation_bytes=10)
    return ModelProfile((layer,), 1, device="cpu", dtype=dtype, meta={"autocast": autocast})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_keeps_the_state_and_allocates_the_step_temporaries_the_model_counts(
    dtype: torch.dtype,
) -> None:
    with LiveTensorMeter() as meter:
        layers = [nn.Linear(256, 256, dtype=dtype) for _ in range(3)]
        params = [p for layer in layers for p in layer.parameters()]
        parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        optimizer = torch.optim.AdamW(params, foreach=True)  # the default on a GPU
        for _ in range(2):  # the second step starts from the steady state
            for p in params:
                p.grad = torch.ones_like(p)
            meter.reset_peak()
            before = meter.live_bytes
            optimizer.step()
        state = meter.live_bytes / parameter_bytes
        temporaries = (meter.peak_bytes - before) / parameter_bytes
    name = str(dtype).removeprefix("torch.")
    assert state == pytest.approx(default_state_factor(measured_profile(name)), rel=0.01)
    assert temporaries == pytest.approx(OPTIMIZER_STEP_TEMPORARIES, rel=0.01)


def test_autocast_keeps_one_cast_of_each_weight_for_the_step_whatever_the_microbatches() -> None:
    layer = nn.Linear(256, 256)
    weight_bytes = layer.weight.numel() * layer.weight.element_size()
    kept = {}
    for microbatches in (1, 4):
        with LiveTensorMeter() as meter, torch.autocast("cpu", torch.bfloat16):
            before = meter.live_bytes
            # detached: each forward's saved input goes with its graph; what stays is autocast's cache
            outputs = [layer(torch.randn(8, 256)).detach() for _ in range(microbatches)]
            kept[microbatches] = (
                meter.live_bytes - before - sum(y.untyped_storage().nbytes() for y in outputs)
            )
    assert kept[1] == kept[4]  # the casts of the weight and bias, shared by every micro-batch of the region
    cast = default_state_factor(measured_profile("float32", "bfloat16")) - default_state_factor(
        measured_profile("float32")
    )
    assert kept[1] == pytest.approx(cast * weight_bytes, rel=0.01)


def test_a_stage_with_fewer_activation_bytes_than_parameter_bytes_is_charged_the_step() -> None:
    profile = measured_profile("float32")
    cost = CostModel(profile, ClusterSpec())
    state = 1000 * cost.state_factor
    assert cost.stage_memory_bytes(0, 1, 0, 1) == state + 1000 * OPTIMIZER_STEP_TEMPORARIES
    assert cost.stage_choices(1).at(0, 0, 1)[1] == cost.stage_memory_bytes(0, 1, 0, 1)
