"""Profiling one rank of a split layer: its shard's bytes, what it keeps, and the collectives it runs,
measured in one process (torch's fake process group answers the other ranks)."""

from __future__ import annotations

import exec_workloads as wl
import pytest
import torch
from gpt.model import Block
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_oobleck.execution import profile_layers
from lightning_oobleck.execution.tensor_parallel import like, local, one_rank_of, parallelize_stage
from lightning_oobleck.planning import ClusterSpec, make_plan


@pytest.fixture(scope="module")
def profile():
    inputs, targets = wl.global_batch(0, 2)
    return profile_layers(
        wl.model,
        inputs,
        wl.CPU,
        torch.float64,
        0,
        1,
        loss_fn=wl.gpt_loss,
        example_target=targets,
        tensor_parallel=(2,),
    )


def test_one_rank_holds_its_shard_and_runs_megatrons_all_reduces(profile) -> None:
    c = wl.CONFIG
    d, v, e = c.d_model, c.vocab_size, 8  # float64
    whole, half = profile.at(1).layers, profile.at(2).layers
    tokens = 2 * c.seq_len * d * e  # one micro-batch's activations between layers
    # the embedding splits its vocabulary, a block its four products (biases of the row-parallel ones whole)
    assert half[0].parameter_bytes == (v // 2 + c.seq_len) * d * e
    block = 2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d + 4 * d * d + 4 * d + 4 * d * d + d
    assert whole[1].parameter_bytes == block * e
    assert half[1].parameter_bytes == (4 * d + (12 * d * d + 7 * d) // 2 + 2 * d) * e
    assert half[5].parameter_bytes == (2 * d + v * d // 2) * e
    assert half[1].activation_bytes < whole[1].activation_bytes
    # a block: two all-reduces of its output forward (after the row-parallel products), two backward
    assert half[1].tensor_parallel_forward_bytes == half[1].tensor_parallel_backward_bytes == (tokens, tokens)
    assert half[0].tensor_parallel_forward_bytes == (tokens,) and half[0].tensor_parallel_backward_bytes == ()
    # the head gathers the logits forward (an all-gather: half an all-reduce of the gathered bytes)
    logits = 2 * c.seq_len * v * e
    assert half[5].tensor_parallel_forward_bytes == (logits // 2,)
    assert half[5].tensor_parallel_backward_bytes == (tokens,)
    assert all(la.tensor_parallel_forward_bytes == () for la in whole)
    assert all(
        a.output_activation_bytes == b.output_activation_bytes for a, b in zip(whole, half, strict=True)
    )


def test_a_layer_without_a_plan_keeps_the_model_at_one_device_per_stage_and_is_named() -> None:
    class Plain(Block):  # a block that declares no plan
        tensor_parallel_plan = None

    def model():
        layers = wl.model()
        layers[2] = Plain(wl.CONFIG)
        return layers

    inputs, _ = wl.global_batch(0, 2)
    profile = profile_layers(model, inputs, wl.CPU, torch.float64, 0, 1, tensor_parallel=(2,))
    assert profile.tensor_parallel_degrees == (1,)
    assert profile.meta["tensor_parallel"] == "no tensor-parallel plan: layer 2 (Plain)"
    plan = make_plan(
        profile, ClusterSpec(2, 2), fault_tolerance=1, global_batch_size=4, tensor_parallel="auto"
    )
    assert plan.tensor_parallel == 1
    assert any("declare no tensor-parallel plan" in w for w in plan.warnings)


def tied_pair() -> tuple[nn.Module, nn.Module]:
    """Two layers sharing one weight, as an embedding and a head do."""
    first, second = nn.Sequential(nn.Linear(4, 6, bias=False)), nn.Sequential(nn.Linear(4, 6, bias=False))
    second[0].weight = first[0].weight
    return first, second


def test_a_parameter_two_layers_of_a_stage_share_stays_one_split_parameter() -> None:
    first, second = tied_pair()
    with one_rank_of(2, "cpu") as mesh:
        parallelize_stage({0: first, 1: second}, mesh, lambda index, layer: {"0": ColwiseParallel()})
        assert isinstance(first[0].weight, DTensor) and first[0].weight is second[0].weight


def test_a_parameter_two_layers_of_a_stage_split_differently_is_refused_by_name() -> None:
    first, second = tied_pair()
    plans = {0: {"0": ColwiseParallel()}, 1: {"0": RowwiseParallel()}}
    with (
        one_rank_of(2, "cpu") as mesh,
        pytest.raises(
            ValueError,
            match=r"layers.0.0.weight as \(Shard\(dim=0\),\), layers.1.0.weight as \(Shard\(dim=1\),\)\): "
            "give every use of a tied parameter the same split",
        ),
    ):
        parallelize_stage({0: first, 1: second}, mesh, lambda index, layer: plans[index])


def test_a_shard_of_an_uneven_split_is_rebuilt_at_the_whole_shape() -> None:
    """A vocabulary of 13 over 2 devices: shards of 7 and 6 rows. A gradient or optimizer state rebuilt from
    this device's shard (gradient sums, state copies) has the parameter's shape, not twice the shard's."""
    with one_rank_of(2, "cpu") as mesh:
        param = distribute_tensor(torch.zeros(13, 8), mesh, [Shard(0)])
        assert local(param).shape == (7, 8)
        assert like(param, local(param).clone()).shape == param.shape == (13, 8)
