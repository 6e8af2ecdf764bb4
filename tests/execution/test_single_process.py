"""Single-process properties: stage construction, process-group lifecycle, clear errors, the profiler."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import exec_workloads as wl
import pytest
import torch
import torch.distributed as dist
from dist_harness import plan_from_splits
from gpt.model import GPTConfig, gpt_layers, gpt_loss
from torch import nn

from lightning_oobleck.execution import (
    PipelineEngine,
    ProcessGroups,
    build_reference_model,
    build_stage,
    profile_layers,
)
from lightning_oobleck.execution.process_groups import check_plan_size
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.profile import ModelProfile

SINGLE = plan_from_splits([[(0, 6)]], [3], 2)


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


@pytest.fixture
def groups(store: dist.Store) -> Iterator[ProcessGroups]:
    g = ProcessGroups(SINGLE, (0, 0), store, generation=0)
    yield g
    g.destroy()


def test_a_stage_materialises_only_its_layers_with_the_reference_weights() -> None:
    built_on: list[torch.device] = []

    def factory() -> list[nn.Module]:
        layers = wl.model()
        built_on.extend(p.device for layer in layers for p in layer.parameters())
        return layers

    stage = build_stage(factory, range(2, 4), wl.CPU, seed=wl.SEED, dtype=torch.float64)
    reference = build_reference_model(wl.model(), wl.CPU, seed=wl.SEED, dtype=torch.float64)
    assert {d.type for d in built_on} == {"meta"}
    names = [n for n, _ in stage.named_parameters()]
    assert names and all(n.startswith(("layers.2.", "layers.3.")) for n in names)
    ref = dict(reference.named_parameters())
    for name, p in stage.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float64
        assert torch.equal(p, ref[name]), name
    assert not torch.equal(stage.layer(2).fc.weight, stage.layer(3).fc.weight)  # per-layer seeds differ


def test_process_groups_and_engine_move_to_a_new_generation_in_process(store: dist.Store) -> None:
    first = ProcessGroups(SINGLE, (0, 0), store, generation=0)
    engine = PipelineEngine(wl.model, gpt_loss, first, wl.CPU, seed=wl.SEED, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="destroy"):
        ProcessGroups(SINGLE, (0, 0), store, generation=1)
    first.destroy()
    first.destroy()  # idempotent
    assert not dist.is_initialized()
    other = plan_from_splits([[(0, 6)]], [6], 2)
    second = ProcessGroups(other, (0, 0), store, generation=1)
    try:
        engine.reconfigure(second, engine.module)
        inputs, targets = wl.global_batch(0, 12)
        loss = engine.train_step(inputs, targets)
        reference = build_reference_model(wl.model, wl.CPU, seed=wl.SEED, dtype=torch.float64)
        assert loss is not None and loss.item() == pytest.approx(gpt_loss(reference(inputs), targets).item())
        assert (second.generation, len(engine.microbatch_ids), engine.batch_slice) == (1, 6, slice(0, 12))
    finally:
        second.destroy()


def test_model_that_is_not_a_sequence_of_layers_is_refused(groups: ProcessGroups) -> None:
    with pytest.raises(TypeError, match="ordered sequence of layers"):
        PipelineEngine(nn.Linear(4, 4), gpt_loss, groups, wl.CPU)
    with pytest.raises(TypeError, match=r"sequence of nn\.Module layers"):
        PipelineEngine([nn.Linear(4, 4), "relu"], gpt_loss, groups, wl.CPU)


def test_plan_for_another_world_size_is_refused_before_any_rendezvous(store: dist.Store) -> None:
    plan = plan_from_splits([[(0, 3), (3, 6)], [(0, 6)]], [2, 1], 2)
    with pytest.raises(ValueError, match="the plan has 3 workers but 2 processes were launched"):
        check_plan_size(plan, 2)
    with pytest.raises(ValueError, match=r"worker \(7, 0\) is not part of the plan"):
        ProcessGroups(plan, (7, 0), store, generation=0)
    assert not dist.is_initialized()


def test_micro_batch_that_does_not_divide_the_batch_is_refused(store: dist.Store) -> None:
    plan = dataclasses.replace(SINGLE, global_batch_size=7)
    groups = ProcessGroups(plan, (0, 0), store, generation=0)
    try:
        with pytest.raises(ValueError, match="micro-batch size 2 does not divide the global batch size 7"):
            PipelineEngine(wl.model, gpt_loss, groups, wl.CPU)
    finally:
        groups.destroy()


def test_plan_for_another_model_and_wrong_batch_share_are_refused(groups: ProcessGroups) -> None:
    with pytest.raises(ValueError, match="plan is for a model of 6 layers but the model has 4"):
        PipelineEngine(gpt_layers(GPTConfig(n_blocks=2)), gpt_loss, groups, wl.CPU)
    engine = PipelineEngine(wl.model, gpt_loss, groups, wl.CPU)
    inputs, targets = wl.global_batch(0, 4)
    with pytest.raises(ValueError, match="inputs has 4 samples but this worker runs 3 micro-batches of 2"):
        engine.train_step(inputs, targets)


def test_a_tie_starts_from_its_canonical_layer_and_a_plan_without_it_is_refused(
    groups: ProcessGroups,
) -> None:
    layers = wl.model()
    layers[-1].lm_head.weight = layers[0].tokens.weight
    head, embedding = build_stage(layers, [5], wl.CPU), build_stage(layers, [0], wl.CPU)
    assert torch.equal(head.layer(5).lm_head.weight, embedding.layer(0).tokens.weight)
    both = build_stage(layers, [0, 5], wl.CPU)
    assert both.layer(5).lm_head.weight is both.layer(0).tokens.weight
    assert torch.equal(both.layer(0).tokens.weight, embedding.layer(0).tokens.weight)
    with pytest.raises(
        ValueError, match=r"ties parameters across layers \[\[0, 5\]\] but the plan was made for ties \[\]"
    ):
        PipelineEngine(layers, gpt_loss, groups, wl.CPU)


def test_uninitialised_parameters_are_refused() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    with pytest.raises(
        ValueError, match=r"\['gain'\] are not initialised by any submodule's reset_parameters"
    ):
        build_stage(lambda: [Scale()], [0], wl.CPU)


def profile_of(config: GPTConfig, cache: object) -> ModelProfile:
    inputs = torch.randint(0, config.vocab_size, (2, config.seq_len))
    return profile_layers(lambda: gpt_layers(config), inputs, wl.CPU, torch.float64, 1, 2, cache_dir=cache)


def test_profiler_measures_layers_and_caches_by_model_structure(tmp_path: object) -> None:
    config = wl.CONFIG
    first = profile_of(config, tmp_path)
    assert len(first.layers) == config.n_blocks + 2 and first.dtype == "float64"
    reference = build_reference_model(wl.model, wl.CPU, dtype=torch.float64)
    for index, layer in enumerate(first.layers):
        params = reference.layer(index).parameters()
        assert layer.parameter_bytes == sum(p.numel() * 8 for p in params)
        assert layer.forward_s > 0 and layer.backward_s > 0 and layer.activation_bytes > 0
    assert first.layers[1].output_activation_bytes == 2 * config.seq_len * config.d_model * 8
    assert ModelProfile.load(next(tmp_path.iterdir())) == first  # type: ignore[attr-defined]
    again = profile_of(config, tmp_path)
    assert again == first  # measured times never repeat exactly: this came from the cache
    changed = profile_of(dataclasses.replace(config, d_model=24), tmp_path)
    assert changed.layers[1].parameter_bytes > first.layers[1].parameter_bytes
    assert len(list(tmp_path.iterdir())) == 2  # type: ignore[attr-defined]


def test_plan_helper_builds_the_layout_asked_for() -> None:
    plan: Plan = plan_from_splits([[(0, 3), (3, 6)], [(0, 6)]], [2, 1], 2)
    assert plan.workers == ((0, 0), (1, 0), (2, 0))
    assert plan.role(1, 0).layers == range(3, 6)
    assert plan.layer_owners(4) == ((1, 0), (2, 0))
