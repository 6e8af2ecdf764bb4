"""Recovery's state copy at tensor parallelism 2: each device copies the shards of its own rank from its
counterparts, the layers a worker keeps are split anew over the new generation's devices, and training goes
on to the weights of single-process training."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from dist_harness import WorkerPool, indexed_pool, plan_from_splits
from execution import exec_workloads as wl

from lightning_oobleck.planning.plan import LayerCopy
from lightning_oobleck.worker import Worker

MICROBATCH = 2
BATCH = 12


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with indexed_pool(6) as workers:
        yield workers


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_lost_node_s_shards_come_from_the_surviving_replica_and_training_goes_on(pool: WorkerPool) -> None:
    # nodes of 2 devices, each stage on both: node 0 holds the whole model; nodes 1 and 2 a pipeline of two
    old = plan_from_splits(
        [[(0, 6)], [(0, 3), (3, 6)]], [3, 3], MICROBATCH, gpus_per_node=2, tensor_parallel=2
    )
    # node 2 is gone: node 1 holds the whole model, receiving layers 3-5 (each device its rank's shards)
    new = plan_from_splits([[(0, 6)], [(0, 6)]], [3, 3], MICROBATCH, gpus_per_node=2, tensor_parallel=2)
    copies = [LayerCopy(layer, 1, 0, 0, 0, (Worker(0, 0),)) for layer in (3, 4, 5)]
    steps = (2, 2)
    task = (wl.recover_split_stages, (old, new, copies, steps))
    results = pool.run(dict.fromkeys(range(6), task), timeout=200)
    reference = wl.reference_run(sum(steps), BATCH)["params"]
    survivors = [r for r in results.values() if not r["left"]]
    assert len(survivors) == 4
    for r in survivors:
        assert r["layers"] == list(range(6))
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference[name].detach(), atol=1e-10, rtol=0)
    # node 1's two devices each received their shards of layers 3-5 (weights and AdamW moments); node 0 none
    received = {old.workers[i]: r["received"] for i, r in results.items() if not r["left"]}
    assert received[Worker(0, 0)] == received[Worker(0, 1)] == 0
    assert received[Worker(1, 0)] == received[Worker(1, 1)] > 0
