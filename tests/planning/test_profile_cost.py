"""Profiles (synthetic GPT, JSON) and the cost model's formulas."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from planning_cases import random_cost

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import PipelineTemplate, Stage
from lightning_oobleck.planning.profile import ModelProfile, synthetic_gpt_profile


def test_synthetic_gpt_profile_follows_the_formulas(tmp_path) -> None:
    b, s, h, v, flops = 2, 1024, 1024, 50257, 1e14
    p = synthetic_gpt_profile(10, h, s, b, flops, vocab_size=v)
    assert p.num_layers == 10 and p.microbatch_size == b and p.dtype_bytes == 2
    block = p.layers[1]
    assert block.forward_s * flops == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    assert block.backward_s == pytest.approx(2 * block.forward_s)
    assert block.parameter_bytes == (12 * h * h + 13 * h) * 2
    assert block.output_activation_bytes == b * s * h * 2
    assert p.layers[0].parameter_bytes == (v + s) * h * 2
    assert p.layers[-1].forward_s * flops == pytest.approx(2 * b * s * h * v)
    assert all(layer == block for layer in p.layers[1:-1])
    p.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == p


def test_profile_errors_name_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="at least 3 layers"):
        synthetic_gpt_profile(2)
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        synthetic_gpt_profile(4, dtype="int3")
    (tmp_path / "bad.json").write_text('{"layers": [{"forward_s": 1}]}')
    with pytest.raises(ValueError, match="not a layer profile"):
        ModelProfile.load(tmp_path / "bad.json")


def test_bands_equal_the_scalar_formulas() -> None:
    rng = np.random.default_rng(3)
    cost = random_cost(rng, 7, gpus=2)
    stages = 4
    choices = cost.stage_choices(stages)
    assert choices.times.shape == (stages, 4, 4)  # 7 - 4 + 1 ranges start and end where stage s may
    for s in range(stages):
        # stage s starts at layer s or later and leaves a layer to each stage after it
        for i in range(s, s + 4):
            for j in range(i + 1, s + 5):
                time, memory, _ = choices.at(s, i, j)
                assert memory == pytest.approx(cost.stage_memory_bytes(i, j, s, stages))
                fits = memory <= cost.cluster.device_memory_bytes
                assert time == (pytest.approx(cost.stage_time_s(i, j, s, stages)) if fits else np.inf)
            assert np.isinf(choices.times[s, i - s, : i - s]).all()  # empty ranges


def test_links_inside_a_node_are_cheaper_and_stage_times_use_them() -> None:
    cost = CostModel(synthetic_gpt_profile(8), ClusterSpec(2, 2))
    assert cost.p2p_s(1e8, same_node=True) < cost.p2p_s(1e8, same_node=False)
    out = cost.profile.layers[2].output_activation_bytes
    compute = cost.compute_s(2, 3)
    # Stage 1 of 4 on G=2: its predecessor (stage 0) shares node 0, its successor (stage 2) is on node 1.
    expected = (
        compute
        + cost.p2p_s(out, same_node=False)
        + cost.p2p_s(cost.profile.layers[1].output_activation_bytes, True)
    )
    assert cost.stage_time_s(2, 3, 1, 4) == pytest.approx(expected)


def test_1f1b_memory_keeps_min_of_remaining_stages_and_microbatches_in_flight() -> None:
    cost = CostModel(synthetic_gpt_profile(8), ClusterSpec(1, 1))
    params = cost.parameter_bytes(1, 3) * cost.state_factor
    # what its layers save, and the stage's output, kept as the root of the micro-batch's backward
    acts = sum(layer.activation_bytes for layer in cost.profile.layers[1:3])
    acts += cost.profile.layers[2].output_activation_bytes
    assert cost.stage_memory_bytes(1, 3, 0, 4) == pytest.approx(params + 4 * acts)
    assert cost.stage_memory_bytes(1, 3, 3, 4) == pytest.approx(params + acts)
    assert cost.stage_memory_bytes(1, 3, 0, 4, microbatches=2) == pytest.approx(params + 2 * acts)
    assert cost.state_factor == 8.0


def test_a_stage_holds_its_largest_backward_peak_on_top_of_its_activations() -> None:
    synthetic = synthetic_gpt_profile(6)
    peaks = [0, 7000, 9000, 3000, 5000, 0]
    layers = synthetic.layers
    profile = replace(
        synthetic,
        layers=tuple(replace(la, backward_peak_bytes=b) for la, b in zip(layers, peaks, strict=True)),
    )
    plain, cost = CostModel(synthetic, ClusterSpec(1, 1)), CostModel(profile, ClusterSpec(1, 1))
    for first, end, largest in ((1, 3, 9000), (3, 5, 5000), (0, 1, 0), (1, 5, 9000)):
        assert cost.backward_peak_bytes(first, end, 0) == largest
        # the backward runs while every in-flight micro-batch's activations are alive
        assert (
            cost.stage_memory_bytes(first, end, 0, 2) == plain.stage_memory_bytes(first, end, 0, 2) + largest
        )
    recomputing = CostModel(profile, ClusterSpec(1, 1), activation_checkpointing=True)
    saved = [la.activation_bytes for la in layers]
    # recomputing, the layer being recomputed holds its saved tensors and its backward's rise at once
    expected = max(s + b for s, b in zip(saved[1:5], peaks[1:5], strict=True))
    without = CostModel(synthetic, ClusterSpec(1, 1), activation_checkpointing=True)
    band, plain_band = recomputing.recompute_memory_band(2), without.recompute_memory_band(2)
    assert band[0, 1, 3] - plain_band[0, 1, 3] == pytest.approx(expected - max(saved[1:5]))


def test_under_zb_h1_a_stage_keeps_what_each_pending_i_kept_for_its_w() -> None:
    synthetic = synthetic_gpt_profile(6)
    layers = tuple(
        replace(
            la,
            backward_peak_bytes=100 * k,
            split_backward_peak_bytes=300 * k,
            weight_gradient_kept_bytes=7 * k,
        )
        for k, la in enumerate(synthetic.layers, start=1)
    )
    profile = replace(synthetic, layers=layers)
    plain = CostModel(synthetic, ClusterSpec(1, 1), schedule="zb-h1")
    cost = CostModel(profile, ClusterSpec(1, 1), schedule="zb-h1")
    stages = 3
    for stage, (first, end) in enumerate(((0, 2), (2, 4), (4, 6))):
        extra = cost.stage_memory_bytes(first, end, stage, stages) - plain.stage_memory_bytes(
            first, end, stage, stages
        )
        if stage == 0:  # no input gradient: its I keeps nothing, its W runs the whole backward
            assert extra == 100 * end
        else:  # the split backward's peak, and stage + 1 micro-batches' leftovers of I
            assert extra == 300 * end + (stage + 1) * 7 * sum(range(first + 1, end + 1))
    band = cost.stage_memory_band(stages)
    for stage in range(stages):
        for first in range(stage, stage + 4):
            for last in range(first, stage + 4):
                at = band[stage, first - stage, last - stage]
                assert at == pytest.approx(cost.stage_memory_bytes(first, last + 1, stage, stages))


def test_pipeline_time_allreduce_and_tail_formulas() -> None:
    cluster = ClusterSpec(
        4, 1, inter_node_bandwidth=1e9, inter_node_latency_s=1e-3, device_memory_bandwidth=1e11
    )
    cost = CostModel(synthetic_gpt_profile(6), cluster)
    times = [1.0, 3.0, 2.0]
    assert cost.pipeline_time_s(times, 5) == pytest.approx(6.0 + 4 * 3.0)
    template = PipelineTemplate(3, 1, (Stage(0, 2, 0), Stage(2, 4, 1), Stage(4, 6, 2)), tuple(times))
    assert template.iteration_time_s(5) == pytest.approx(cost.pipeline_time_s(times, 5))
    assert cost.allreduce_s(1e9, 1) == 0.0
    assert cost.allreduce_s(1e9, 2) == pytest.approx(1.0 + 2e-3)
    assert cost.allreduce_s(1e9, 4) == pytest.approx(1.5 + 6e-3)
    for k in (1, 2, 5):
        expected = max(
            sum(float(cost.allreduce_s(cost.profile.layers[layer].parameter_bytes, k)) for layer in s.layers)
            + float(cost.optimizer_step_s(cost.parameter_bytes(s.first_layer, s.end_layer)))
            for s in template.stages
        )
        assert cost.template_tails_s(template, [k])[0] == pytest.approx(expected)
