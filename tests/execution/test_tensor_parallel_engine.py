"""Stages split over two devices of a node (tensor parallelism, DTensor over gloo) train exactly like one
process on the whole batch: homogeneous and heterogeneous pipelines, every schedule, recomputation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import exec_workloads as wl
import pytest
import torch
from dist_harness import WorkerPool, indexed_pool, plan_from_splits

from lightning_oobleck.execution.grad_sync import DEFAULT_BUCKET_CAP_BYTES
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES

STEPS = 3
MICROBATCH = 2


def recomputing(plan: Plan) -> Plan:
    """``plan`` with every stage recomputing its activations in the backward."""
    templates = {
        t: dataclasses.replace(t, stages=tuple(dataclasses.replace(s, recompute=True) for s in t.stages))
        for t in plan.templates
    }
    pipelines = tuple(dataclasses.replace(p, template=templates[p.template]) for p in plan.pipelines)
    return dataclasses.replace(plan, templates=tuple(templates.values()), pipelines=pipelines)


# tiny GPT: layer 0 embedding, 1-4 blocks, 5 head; nodes of 2 devices, each stage on both (t = 2)
LAYOUTS = {
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
BATCH = 12
PROCESSES = 6


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with indexed_pool(PROCESSES) as workers:
        yield workers


@pytest.fixture(scope="module")
def reference() -> dict:
    return wl.reference_run(STEPS, BATCH)


def check_equal_to_reference(results: dict[int, dict], plan: Plan, reference: dict, name: str) -> None:
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
    # every pipeline's stage holds each parameter on both of its devices
    assert all(n == 2 * len(plan.pipelines) for n in replicas.values()), name
    for step in range(STEPS):
        inputs, _ = wl.global_batch(step, BATCH)
        seen = [r["seen"][step] for r in results.values() if r["seen"][step] is not None]
        # both devices of a pipeline's first stage take its rows (and run its first layer twice when they
        # recompute): every row of the batch exactly that often
        times = 2 * (2 if plan.pipelines[0].stages[0].recompute else 1)
        rows = sorted(map(tuple, torch.cat(seen).tolist()))
        assert rows == sorted(times * list(map(tuple, inputs.tolist()))), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_stages_over_two_devices_equal_single_process_training(
    pool: WorkerPool, reference: dict, schedule: str
) -> None:
    offset = SCHEDULE_NAMES.index(schedule) * len(LAYOUTS)
    for generation, (name, layout) in enumerate(LAYOUTS.items(), start=offset):
        plan = dataclasses.replace(layout, schedule=schedule)
        workers = range(len(plan.workers))
        bucket = 4096 if generation % 2 else DEFAULT_BUCKET_CAP_BYTES
        task = (wl.train_layout, (plan, generation, STEPS, bucket))
        results = pool.run(dict.fromkeys(workers, task), timeout=240)
        check_equal_to_reference(results, plan, reference, name)
