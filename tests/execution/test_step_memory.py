"""What a stage keeps alive once a step is over does not grow with the step's micro-batches: the tensors of
every send (a stage's input gradients, its activations) are freed once sent, before the optimizer step, and
under autocast ("bf16-mixed") no cast of a received activation outlives the step's use of it."""

from __future__ import annotations

from collections.abc import Iterator

import exec_workloads as wl
import pytest
from dist_harness import WorkerPool, indexed_pool, plan_from_splits


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with indexed_pool(2) as workers:
        yield workers


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_what_a_stage_keeps_after_a_step_does_not_grow_with_its_microbatches(pool: WorkerPool) -> None:
    rows, alive = 16, {}
    for microbatches in (2, 8):
        plan = plan_from_splits([[(0, 1), (1, 2)]], [microbatches], rows)
        task = (wl.bytes_alive_after_a_step, (plan, microbatches))
        alive[microbatches] = pool.run(dict.fromkeys(range(2), task), timeout=120)
    activation = rows * wl.WIDE * 4  # one micro-batch's float32 activation (or its input gradient)
    for stage in (0, 1):
        grown = alive[8][stage] - alive[2][stage]  # a process's first step also makes a few constants
        assert grown < activation, (
            f"stage {stage} keeps {grown} more bytes after a step of 8 micro-batches than after one of 2 "
            f"({grown / activation:.1f} micro-batch activations)"
        )
