"""Activation recomputation in the cost model, the planner and the engine's stages.

A recomputing stage keeps one input per layer per in-flight micro-batch (measured here with autograd's
saved-tensor hooks against the cost model's prediction), costs one more forward, and trains to the same
weights; ``"auto"`` turns it on exactly where a split would not fit otherwise, which makes the 96-layer,
24 x 8 GPU, micro-batch 4 case of ``oobleck plan`` feasible.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_oobleck.execution.memory import SavedTensorMeter
from lightning_oobleck.execution.profiler import profile_layers
from lightning_oobleck.execution.stage import build_reference_model, build_stage
from lightning_oobleck.planning import ClusterSpec, synthetic_gpt_profile
from lightning_oobleck.planning.config import PlannerConfig, SyntheticModelSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import PlannerInputs, make_plan
from lightning_oobleck.planning.reconfigure import after_failures
from lightning_oobleck.planning.templates import InfeasibleTemplateError

BIG = dict(fault_tolerance=2, global_batch_size=1024, microbatch_size=4)  # the oobleck plan case


def big(checkpointing: bool | str) -> Plan:
    """``oobleck plan --layers 96 --nodes 24 --gpus-per-node 8 --fault-tolerance 2 --global-batch 1024
    --microbatch 4`` (the CLI's synthetic GPT: hidden 2048, sequence 2048, float16)."""
    config = PlannerConfig(model=SyntheticModelSpec(layers=96), cluster=ClusterSpec(24, 8), microbatch=4)
    return make_plan(config.load_profile(), config.cluster, activation_checkpointing=checkpointing, **BIG)


def test_auto_plans_what_does_not_fit_otherwise_recomputing_only_where_needed() -> None:
    with pytest.raises(InfeasibleTemplateError, match="does not fit on any number of nodes"):
        big(False)
    plan = big("auto")
    inputs = PlannerInputs.from_plan(plan)
    plain = CostModel(inputs.profile, inputs.cluster)  # without recomputation
    cap = plain.cluster.device_memory_bytes
    recomputing = 0
    for template in plan.templates:
        num_stages = len(template.stages)
        for index, stage in enumerate(template.stages):
            fits = plain.stage_memory_bytes(stage.first_layer, stage.end_layer, index, num_stages) <= cap
            assert stage.recompute is not fits, f"stage {index} of the {template.num_nodes}-node template"
            recomputing += stage.recompute
    assert recomputing
    assert all(s.recompute for t in big(True).templates for s in t.stages)
    # the mode is a planner input: a re-plan after failures keeps it, and the JSON keeps the flags
    assert Plan.from_dict(plan.to_dict()).templates == plan.templates
    survivors = after_failures(plan, [0, 5]).plan
    assert survivors.extra["activation_checkpointing"] == "auto"
    assert all(p.stages[0].recompute for p in survivors.pipelines)


def test_a_recomputing_stage_costs_one_more_forward() -> None:
    cost = CostModel(synthetic_gpt_profile(8), ClusterSpec(2, 2), activation_checkpointing=True)
    plain = CostModel(synthetic_gpt_profile(8), ClusterSpec(2, 2))
    forward = sum(layer.forward_s for layer in cost.profile.layers[2:5])
    assert cost.stage_choices(4).at(1, 2, 5)[0] == pytest.approx(
        plain.stage_choices(4).at(1, 2, 5)[0] + forward
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def layers() -> list[nn.Module]:
    return [Block() for _ in range(6)]


@pytest.mark.parametrize("recompute", [False, True])
def test_the_memory_a_stage_keeps_per_micro_batch_is_what_the_cost_model_predicts(recompute: bool) -> None:
    cpu = torch.device("cpu")
    x = torch.randn(512, 64)  # activations of two micro-batches above the optimizer step's temporaries
    profile = profile_layers(layers, x, cpu)
    cost = CostModel(profile, ClusterSpec(1, 4, device_memory_bytes=1e12), activation_checkpointing=recompute)
    predicted = cost.held_bytes(2, 6, recompute)  # per micro-batch in flight, in every stage's memory
    assert cost.stage_choices(2).at(1, 2, 6)[2] is recompute

    stage = build_stage(layers, range(2, 6), cpu)
    stage.recompute = recompute
    stage_input = build_reference_model(layers, cpu).layer(1)(x).detach().requires_grad_()
    with SavedTensorMeter(exclude=list(stage.parameters())) as meter:
        out = stage(stage_input)
        # what autograd saves, and the output, which the executor keeps as the root of the backward
        measured = meter.live_bytes + out.numel() * out.element_size()
        out.sum().backward()
    assert measured == pytest.approx(predicted, rel=0.1)


def test_recomputation_gives_the_same_gradients() -> None:
    cpu = torch.device("cpu")
    grads = []
    for recompute in (False, True):
        stage = build_stage(layers, range(6), cpu, dtype=torch.float64)
        stage.recompute = recompute
        stage(
            torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        ).square().sum().backward()
        grads.append([p.grad.clone() for p in stage.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=1e-12)
