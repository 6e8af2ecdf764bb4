"""Template search: exact against exhaustive enumeration, stages never span nodes, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from planning_cases import brute_force_template_time, random_cost

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.profile import synthetic_gpt_profile
from lightning_oobleck.planning.templates import InfeasibleTemplateError, generate_template, is_feasible


@pytest.mark.parametrize("seed", range(6))
def test_template_is_optimal_against_every_split(seed: int) -> None:
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(40):
        layers = int(rng.integers(2, 10))
        gpus = int(rng.integers(1, 3))
        cost = random_cost(rng, layers, gpus=gpus)
        nodes = int(rng.integers(1, layers // gpus + 1))
        m = int(rng.integers(1, 12))
        best = brute_force_template_time(cost, nodes, m)
        if not np.isfinite(best):
            with pytest.raises(InfeasibleTemplateError):
                generate_template(cost, nodes, m)
            assert not is_feasible(cost, nodes)
            continue
        template = generate_template(cost, nodes, m)
        assert template.iteration_time_s(m) == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_stages_cover_the_layers_in_order_and_never_span_nodes(gpus: int) -> None:
    cost = CostModel(synthetic_gpt_profile(64, 2048, 2048, 1), ClusterSpec(8, gpus, device_memory_bytes=80e9))
    for nodes in range(1, 64 // gpus + 1):
        if not is_feasible(cost, nodes):
            continue
        t = generate_template(cost, nodes, 16)
        assert len(t.stages) == nodes * gpus
        assert [s.first_layer for s in t.stages[1:]] == [s.end_layer for s in t.stages[:-1]]
        assert (t.stages[0].first_layer, t.stages[-1].end_layer) == (0, 64)
        assert all((s.node, s.device) == divmod(i, gpus) for i, s in enumerate(t.stages))
        assert all(0 < m <= cost.cluster.device_memory_bytes for m in t.stage_memory_bytes)


def test_more_devices_than_layers_is_a_clear_error() -> None:
    cost = CostModel(synthetic_gpt_profile(8), ClusterSpec(4, 4))
    with pytest.raises(
        InfeasibleTemplateError, match=r"needs 12 stages .* 8 layers; use pipelines of at most 2 nodes"
    ):
        generate_template(cost, 3, 4)


def test_model_too_large_for_the_nodes_is_a_clear_error() -> None:
    cost = CostModel(synthetic_gpt_profile(24, 8192), ClusterSpec(4, 1, device_memory_bytes=16e9))
    with pytest.raises(
        InfeasibleTemplateError, match=r"does not fit in 1 node\(s\) .* use more nodes per pipeline"
    ):
        generate_template(cost, 1, 4)
