"""Instantiation: exact against brute force on small clusters; the large-cluster search measured."""

from __future__ import annotations

import time

import numpy as np
import pytest
from planning_cases import random_cost

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.instantiation import (
    InstantiationError,
    IterationTimeModel,
    instantiate,
)
from lightning_oobleck.planning.node_spec import min_nodes, template_sizes
from lightning_oobleck.planning.profile import synthetic_gpt_profile
from lightning_oobleck.planning.templates import InfeasibleTemplateError, generate_template


def _brute_force(templates, cost, nodes, f, microbatches) -> float:
    """Every multiset of templates, each timed by :class:`IterationTimeModel`: the reference optimum.

    The model's batch split is the proven optimum (``test_batch.py`` checks it against the MILP and
    against enumeration); the plan's own MILP split is checked in ``test_planner.py``.
    """
    model = IterationTimeModel(templates, cost, microbatches, nodes)
    sizes = [t.num_nodes for t in templates]

    def partitions(left: int, smallest: int) -> list[list[int]]:
        if left == 0:
            return [[]]
        return [[n, *rest] for n in sizes if smallest <= n <= left for rest in partitions(left - n, n)]

    best = np.inf
    for parts in partitions(nodes, 0):
        if f + 1 <= len(parts) <= microbatches:
            best = min(best, model(np.array([parts.count(n) for n in sizes])))
    return best


def _cases(seed: int, count: int, synthetic: bool):
    rng = np.random.default_rng(seed)
    while count:
        nodes, f = int(rng.integers(2, 17)), int(rng.integers(0, 3))
        if synthetic:
            profile = synthetic_gpt_profile(int(rng.choice([8, 12, 24])), int(rng.choice([1024, 2048, 4096])))
            memory = float(rng.choice([16e9, 24e9, 48e9]))
            cost = CostModel(profile, ClusterSpec(nodes, int(rng.choice([1, 2])), device_memory_bytes=memory))
        else:
            cost = random_cost(rng, int(rng.integers(4, 12)), nodes)
        try:
            n0 = min_nodes(cost)
        except InfeasibleTemplateError:
            continue
        if nodes < (f + 1) * n0:
            continue
        microbatches = int(rng.integers(f + 1, 40))
        sizes = template_sizes(cost, n0, nodes, f)
        templates = [generate_template(cost, n, max(1, microbatches * n // nodes)) for n in sizes]
        reference = _brute_force(templates, cost, nodes, f, microbatches)
        if not np.isfinite(reference):
            continue
        count -= 1
        yield templates, cost, nodes, f, microbatches, reference


@pytest.mark.parametrize("seed", range(3))
def test_instantiation_equals_brute_force_on_small_clusters(seed: int) -> None:
    for templates, cost, nodes, f, microbatches, reference in _cases(seed, 15, synthetic=seed == 2):
        chosen = instantiate(templates, cost, nodes, f, microbatches)
        assert chosen.iteration_time_s == pytest.approx(reference, rel=1e-9)
        assert sum(t.num_nodes for t in chosen.pipeline_templates()) == nodes
        assert f + 1 <= chosen.num_pipelines <= microbatches


@pytest.mark.parametrize(("seed", "synthetic"), [(11, True), (12, True), (5, False)])
@pytest.mark.slow
def test_large_cluster_search_equals_brute_force_on_small_clusters(seed: int, synthetic: bool) -> None:
    """The shortlist + local search path (used above ``exact_limit`` multisets), forced on small clusters."""
    for templates, cost, nodes, f, microbatches, reference in _cases(seed, 60, synthetic):
        kmax = min(microbatches, nodes // templates[0].num_nodes)
        model = IterationTimeModel(templates, cost, microbatches, kmax)
        forced = instantiate(templates, cost, nodes, f, microbatches, exact_limit=0)
        assert forced.iteration_time_s == pytest.approx(reference, rel=1e-9)
        assert model(np.array(forced.counts)) == pytest.approx(forced.iteration_time_s)


def test_thousand_nodes_use_every_node_quickly() -> None:
    cost = CostModel(synthetic_gpt_profile(96, 4096, 2048, 1), ClusterSpec(1024, 8, device_memory_bytes=80e9))
    started = time.perf_counter()
    n0 = min_nodes(cost)
    sizes = template_sizes(cost, n0, 1024, 4)
    templates = [generate_template(cost, n, max(1, 8192 * n // 1024)) for n in sizes]
    chosen = instantiate(templates, cost, 1024, 4, 8192)
    assert time.perf_counter() - started < 5.0
    assert sum(t.num_nodes for t in chosen.pipeline_templates()) == 1024
    assert chosen.num_pipelines >= 5


def test_impossible_cluster_is_a_clear_error() -> None:
    cost = CostModel(synthetic_gpt_profile(24), ClusterSpec(7, 1))
    templates = [generate_template(cost, 4, 8)]
    with pytest.raises(InstantiationError, match="7 nodes cannot form 1 or more pipelines of \\[4\\] nodes"):
        instantiate(templates, cost, 7, 0, 64)
