"""Heterogeneous pipelines on real gloo processes train exactly like one process on the whole batch, with
stages on one device each or split over the two devices of a node (tensor parallelism, DTensor over gloo),
and so do rerouted steps after lost nodes (only the survivors run; ReCycle)."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterator

import exec_workloads as wl
import pytest
import torch
from dist_harness import WorkerPool, indexed_pool, plan_from_splits, set_index

from lightning_oobleck.execution import profile_layers
from lightning_oobleck.execution.grad_sync import DEFAULT_BUCKET_CAP_BYTES
from lightning_oobleck.planning.plan import Plan, WorkerRole
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.rerouting import reroute
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES, in_flight_limit

STEPS = 3
MICROBATCH = 2
# tiny GPT: layer 0 embedding, 1-4 blocks, 5 head
LAYOUTS = {
    "one pipeline of 4 stages": plan_from_splits([[(0, 2), (2, 3), (3, 4), (4, 6)]], [6], MICROBATCH),
    "pipelines of 2 and 3 nodes": plan_from_splits(
        [[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], [2, 4], MICROBATCH
    ),
    "pipelines of 1, 2 and 3 nodes": plan_from_splits(
        [[(0, 6)], [(0, 4), (4, 6)], [(0, 1), (1, 3), (3, 6)]], [1, 2, 3], MICROBATCH
    ),
    "2 devices per node": plan_from_splits(
        [[(0, 3), (3, 6)], [(0, 1), (1, 2), (2, 4), (4, 6)]], [2, 4], MICROBATCH, gpus_per_node=2
    ),
}
BATCH = 12
assert all(p.global_batch_size == BATCH for p in LAYOUTS.values())
PROCESSES = 6


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with indexed_pool(PROCESSES) as workers:
        yield workers


@pytest.fixture(scope="module")
def reference() -> dict:
    return wl.reference_run(STEPS, BATCH)


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    inputs, targets = wl.global_batch(0, MICROBATCH)
    return profile_layers(
        wl.model, inputs, wl.CPU, torch.float64, 0, 1, loss_fn=wl.gpt_loss, example_target=targets
    )


def predicted_activation_bytes(profile: ModelProfile, plan: Plan, role: WorkerRole) -> int:
    """Activations of the stage's layers times the micro-batches the schedule keeps in flight on it."""
    pipeline = plan.pipelines[role.pipeline]
    in_flight = in_flight_limit(plan.schedule, len(pipeline.stages), role.stage, pipeline.microbatches)
    return in_flight * sum(profile.layers[i].activation_bytes for i in role.layers)


def run_layout(pool: WorkerPool, plan: Plan, generation: int, bucket_cap_bytes: int) -> dict[int, dict]:
    workers = range(len(plan.workers))
    task = (wl.train_layout, (plan, generation, STEPS, bucket_cap_bytes))
    return pool.run(dict.fromkeys(workers, task), timeout=120)


def check_equal_to_reference(results: dict[int, dict], plan: Plan, reference: dict, name: str) -> None:
    """Every worker's losses, norms, evaluation and weights are single-process training's; each parameter is
    held by every device of one stage per pipeline that holds its layer on live nodes (every pipeline, unless
    the plan is rerouted); every row of each global batch reached the first layer exactly once per device of
    a first stage that took it (twice there when that stage recomputes)."""
    t = plan.tensor_parallel
    for r in results.values():
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-12, rel=1e-12), name
        assert r["norms"] == pytest.approx(reference["norms"], rel=1e-10), name
        assert r["eval"] == pytest.approx(reference["eval"], abs=1e-12, rel=1e-12), name
    replicas: dict[str, int] = {}
    for r in results.values():
        for param, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][param].detach(), atol=1e-10, rtol=0)
            replicas[param] = replicas.get(param, 0) + 1
    assert set(replicas) == set(reference["params"]), name
    for param, n in replicas.items():
        assert n == t * len(plan.layer_owners(int(param.split(".")[1]))), (name, param)
    times = t * (2 if plan.pipelines[0].stages[0].recompute else 1)
    for step in range(STEPS):
        inputs, _ = wl.global_batch(step, BATCH)
        seen = torch.cat([r["seen"][step] for r in results.values() if r["seen"][step] is not None])
        assert sorted(map(tuple, seen.tolist())) == sorted(times * list(map(tuple, inputs.tolist()))), name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.slow
def test_every_layout_equals_single_process_training(
    pool: WorkerPool, reference: dict, profile: ModelProfile, schedule: str
) -> None:
    """All layouts, one generation each in the same processes, under each schedule: weights, losses,
    norms, samples.

    Also: each stage's peak saved-activation memory is exactly what the profile predicts for the schedule
    (the layers' activation bytes times the micro-batches in flight: ``min(S - s, m)`` for 1F1B,
    ``min(S, m)`` for ZB-H1, whose I keeps the graph for the W).
    """
    offset = SCHEDULE_NAMES.index(schedule) * len(LAYOUTS)
    for generation, (name, layout) in enumerate(LAYOUTS.items(), start=offset):
        plan = dataclasses.replace(layout, schedule=schedule)
        # odd generations: 4 KiB buckets, so a stage syncs in several buckets issued during its backward
        results = run_layout(pool, plan, generation, 4096 if generation % 2 else DEFAULT_BUCKET_CAP_BYTES)
        assert {r["generation"] for r in results.values()} == {generation}, name
        assert sorted(r["rank"] for r in results.values()) == list(range(len(plan.workers)))
        check_equal_to_reference(results, plan, reference, name)
        for r in results.values():
            predicted = predicted_activation_bytes(profile, plan, r["role"])
            assert r["peak_activation_bytes"] == predicted, (name, r["role"])


def recomputing(plan: Plan) -> Plan:
    """``plan`` with every stage recomputing its activations in the backward."""
    templates = {
        t: dataclasses.replace(t, stages=tuple(dataclasses.replace(s, recompute=True) for s in t.stages))
        for t in plan.templates
    }
    pipelines = tuple(dataclasses.replace(p, template=templates[p.template]) for p in plan.pipelines)
    return dataclasses.replace(plan, templates=tuple(templates.values()), pipelines=pipelines)


# nodes of 2 devices, each stage on both (tensor parallelism 2)
SPLIT_LAYOUTS = {
    "one pipeline of 2 nodes": plan_from_splits(
        [[(0, 3), (3, 6)]], [6], MICROBATCH, gpus_per_node=2, tensor_parallel=2
    ),
    "pipelines of 1 and 2 nodes": plan_from_splits(
        [[(0, 6)], [(0, 2), (2, 6)]], [2, 4], MICROBATCH, gpus_per_node=2, tensor_parallel=2
    ),
    "pipelines of 1 and 2 nodes, recomputing": recomputing(
        plan_from_splits([[(0, 6)], [(0, 3), (3, 6)]], [3, 3], MICROBATCH, gpus_per_node=2, tensor_parallel=2)
    ),
}


SPLIT_CASES = [(schedule, name) for schedule in SCHEDULE_NAMES for name in SPLIT_LAYOUTS]
FAST_SPLIT_CASES = {("zb-h1", "pipelines of 1 and 2 nodes, recomputing")}
"""The case ``tox -e fast`` runs (8-16 s here: DTensor dispatches on 6 processes, 2 cores)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("schedule", "name"),
    [pytest.param(*case, marks=() if case in FAST_SPLIT_CASES else pytest.mark.slow) for case in SPLIT_CASES],
)
def test_stages_over_two_devices_equal_single_process_training(
    pool: WorkerPool, reference: dict, schedule: str, name: str
) -> None:
    generation = 300 + SPLIT_CASES.index((schedule, name))  # other tests use 0-7, 100, 101, 200, 400-
    plan = dataclasses.replace(SPLIT_LAYOUTS[name], schedule=schedule)
    results = run_layout(pool, plan, generation, 4096 if generation % 2 else DEFAULT_BUCKET_CAP_BYTES)
    check_equal_to_reference(results, plan, reference, name)


# ReCycle's rerouting: after nodes are lost, the damaged pipelines keep their surviving stages and the lost
# stages' layers run, for their micro-batches, on other pipelines' replicas (planning/rerouting.py)
HOMOGENEOUS = plan_from_splits([[(0, 2), (2, 4), (4, 6)]] * 2, [3, 3], MICROBATCH)
HETEROGENEOUS = plan_from_splits([[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], [2, 4], MICROBATCH)
THREE = plan_from_splits(
    [[(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 3), (3, 6)]], [2, 2, 2], MICROBATCH
)
# nodes of 2 devices, each stage on both (tensor parallelism 2): a 1-node and a 2-node pipeline
SPLIT = plan_from_splits([[(0, 6)], [(0, 2), (2, 6)]], [2, 4], MICROBATCH, gpus_per_node=2, tensor_parallel=2)
REROUTED = {
    "homogeneous, first stage lost": (HOMOGENEOUS, [0]),
    "homogeneous, middle stage lost": (HOMOGENEOUS, [4]),
    "homogeneous, last stage lost": (HOMOGENEOUS, [2]),
    # the 3-node pipeline's middle stage (layers 2-3) maps to both stages of the 2-node pipeline
    "heterogeneous, a lost stage taken by two stages": (HETEROGENEOUS, [3]),
    "heterogeneous, the 2-node pipeline's first stage lost": (HETEROGENEOUS, [0]),
    "two failures in different pipelines": (THREE, [1, 6]),
    # the 2-node pipeline's first stage runs on the 1-node pipeline's devices, tensor rank by tensor rank
    "tensor-parallel stages": (SPLIT, [1]),
}
assert all(p.global_batch_size == BATCH for p, _ in REROUTED.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.slow
def test_rerouted_steps_equal_single_process_training(
    pool: WorkerPool, reference: dict, schedule: str
) -> None:
    """Every case, one generation each: only the survivors run, the lost nodes' layers keep a replica that
    computes their micro-batches, and each parameter is held by every survivor that held it before."""
    offset = 400 + 100 * SCHEDULE_NAMES.index(schedule)  # see the split stages' test
    for generation, (name, (layout, failed)) in enumerate(REROUTED.items(), start=offset):
        plan = reroute(dataclasses.replace(layout, schedule=schedule), failed)
        assert not set(failed) & set(plan.nodes), name
        results = run_layout(pool, plan, generation, 4096)
        check_equal_to_reference(results, plan, reference, name)


@pytest.mark.timeout(120)
def test_abort_interrupts_a_rank_blocked_on_a_stopped_peer(pool: WorkerPool, reference: dict) -> None:
    """SIGSTOP the next stage: the blocked rank raises PeerFailure right after abort, not at the timeout.

    Then both processes build the next generation and train correctly: an aborted generation leaves
    nothing behind.
    """
    plan = plan_from_splits([[(0, 3), (3, 6)]], [6], MICROBATCH)
    timeout_s = 6.0  # the waiter thread of the aborted rank stays blocked in gloo until then
    pool.run({i: (wl.join_groups, (plan, 100, timeout_s)) for i in range(2)}, timeout=60)
    pool.signal(1, signal.SIGSTOP)
    try:
        outcome = pool.run({0: (wl.blocked_step, (0.5,))}, timeout=30)[0]
    finally:
        pool.signal(1, signal.SIGCONT)
    assert outcome["outcome"].startswith("PeerFailure"), outcome
    assert 0.5 <= outcome["elapsed"] < 1.5 < timeout_s, outcome
    assert pool.run({1: (wl.leave_groups, ())}, timeout=30)[1] is True
    results = run_layout(pool, plan, 101, DEFAULT_BUCKET_CAP_BYTES)
    for r in results.values():
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-12, rel=1e-12)


@pytest.mark.timeout(120)
def test_a_killed_peer_raises_peer_failure_at_once_without_abort(pool: WorkerPool) -> None:
    """SIGKILL the next stage: gloo's connection error becomes PeerFailure in far less than the timeout.

    Runs last: it kills one of the module's worker processes.
    """
    plan = plan_from_splits([[(0, 3), (3, 6)]], [6], MICROBATCH)
    first, second = PROCESSES - 2, PROCESSES - 1
    pool.run({first: (set_index, (0,)), second: (set_index, (1,))}, timeout=30)
    pool.run({i: (wl.join_groups, (plan, 200, 30.0)) for i in (first, second)}, timeout=60)
    pool.signal(second, signal.SIGKILL)
    outcome = pool.run({first: (wl.blocked_step, (None,))}, timeout=60)[first]
    assert outcome["outcome"].startswith("PeerFailure: a peer was lost"), outcome
    assert outcome["elapsed"] < 5.0, outcome  # the process-group timeout is 30 s
