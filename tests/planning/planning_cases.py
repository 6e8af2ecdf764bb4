"""Shared builders for the planner tests: random profiles and clusters small enough to enumerate."""

from __future__ import annotations

import itertools

import numpy as np

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.planning.reconfigure import Reconfiguration


def random_profile(rng: np.random.Generator, num_layers: int) -> ModelProfile:
    """Layers with unrelated random times and sizes: no structure for a search to lean on."""
    layers = tuple(
        LayerProfile(
            forward_s=float(rng.uniform(0.1, 1.0)),
            backward_s=float(rng.uniform(0.1, 2.0)),
            parameter_bytes=int(rng.integers(1, 100)),
            output_activation_bytes=int(rng.integers(1, 1000)),
            activation_bytes=int(rng.integers(1, 50)),
            backward_peak_bytes=int(rng.integers(0, 50)),
        )
        for _ in range(num_layers)
    )
    return ModelProfile(layers, microbatch_size=1)


def random_cost(rng: np.random.Generator, num_layers: int, num_nodes: int = 4, gpus: int = 1) -> CostModel:
    """A random profile on a cluster whose memory, links and latencies are of the same order as it."""
    cluster = ClusterSpec(
        num_nodes=num_nodes,
        gpus_per_node=gpus,
        device_memory_bytes=float(rng.uniform(200, 6000)),  # most cases fit, some do not: both paths run
        intra_node_bandwidth=1000.0,
        inter_node_bandwidth=float(rng.uniform(10, 1000)),
        intra_node_latency_s=0.01,
        inter_node_latency_s=0.05,
        device_memory_bandwidth=1000.0,
    )
    return CostModel(random_profile(rng, num_layers), cluster)


def brute_force_template_time(cost: CostModel, num_nodes: int, microbatches: int) -> float:
    """The best 1F1B time over every split of the layers into ``num_nodes * G`` stages (inf if none fits)."""
    stages = num_nodes * cost.cluster.gpus_per_node
    layers = cost.num_layers
    best = np.inf
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        ranges = list(itertools.pairwise(bounds))
        memory = [cost.stage_memory_bytes(i, j, s, stages) for s, (i, j) in enumerate(ranges)]
        if max(memory) > cost.cluster.device_memory_bytes:
            continue
        times = [cost.stage_time_s(i, j, s, stages) for s, (i, j) in enumerate(ranges)]
        best = min(best, cost.pipeline_time_s(times, microbatches))
    return best


def check_reconfiguration(old: Plan, gone: set[int], result: Reconfiguration, added: int = 0) -> None:
    """The properties the guarantee promises, checked on the new plan and its copies."""
    new = result.plan
    survivors = set(old.nodes) - gone
    assert set(new.nodes) >= survivors and len(new.nodes) == len(set(new.nodes)) == len(survivors) + added
    assert sum(p.microbatches for p in new.pipelines) == old.num_microbatches
    assert all(p.microbatches >= 1 for p in new.pipelines)
    assert all(p.template in old.templates for p in new.pipelines)  # no new template search
    requested = new.extra["requested_fault_tolerance"]
    possible = len(new.nodes) // new.n0 - 1
    assert len(new.pipelines) >= min(requested, possible) + 1
    assert new.fault_tolerance == min(requested, len(new.pipelines) - 1)
    assert bool(new.warnings) == (new.fault_tolerance < requested)
    before = {
        worker: set(stage.layers)
        for p in old.pipelines
        for si, stage in enumerate(p.stages)
        if (worker := p.worker_of_stage(si))[0] in survivors
    }
    held = {worker: set(layers) for worker, layers in before.items()}
    for c in result.copies:
        assert c.from_node in survivors and c.layer in before[(c.from_node, c.from_device)]
        assert c.sources[0] == (c.from_node, c.from_device)
        replicas = {w for w, layers in before.items() if c.layer in layers}
        local = {w for w in replicas if w.node == c.to_node}
        # a replica on the receiver's node sends alone; otherwise every surviving replica sends a share
        assert len(c.sources) == 1 and set(c.sources) <= local if local else set(c.sources) == replicas
        held.setdefault((c.to_node, c.to_device), set()).add(c.layer)
    lacking = 0
    for p in new.pipelines:
        for si, stage in enumerate(p.stages):
            worker = p.worker_of_stage(si)
            assert set(stage.layers) <= held.get(worker, set())
            lacking += len(set(stage.layers) - before.get(worker, set()))
    assert len(result.copies) == lacking  # only what a worker lacks is copied
