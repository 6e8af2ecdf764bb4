"""Batch distribution: how many micro-batches each pipeline runs in one step.

Pipeline ``p`` with stage-time sum ``a_p`` and slowest stage ``c_p`` takes ``T_p(m) = a_p + (m - 1) c_p``
for ``m`` micro-batches (1F1B, see :mod:`lightning_oobleck.planning.cost`). We choose integers
``m_p >= 1`` with ``sum_p m_p = B / b`` minimising ``max_p T_p(m_p)``: the step waits for the slowest
pipeline before the gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from lightning_oobleck.planning.plan import PipelineTemplate

_EPS = 1e-9


class BatchError(ValueError):
    """The global batch cannot be split over the pipelines."""


def num_microbatches(global_batch: int, microbatch: int) -> int:
    """``B / b``, or a :class:`BatchError` saying how to fix a batch that does not split evenly."""
    if global_batch < 1 or microbatch < 1:
        raise BatchError(f"the global batch ({global_batch}) and micro-batch ({microbatch}) must be positive")
    if global_batch % microbatch:
        fixed = max(global_batch // microbatch, 1) * microbatch
        raise BatchError(
            f"the global batch {global_batch} is not a multiple of the micro-batch {microbatch}: "
            f"use a global batch of {fixed} or a micro-batch that divides {global_batch}"
        )
    return global_batch // microbatch


def _check(num_pipelines: int, total: int) -> None:
    if total < num_pipelines:
        raise BatchError(
            f"{total} micro-batches cannot feed {num_pipelines} pipelines (each needs at least one): "
            f"raise the global batch to at least {num_pipelines} micro-batches or lower the micro-batch size"
        )


def distribute_microbatches(templates: Sequence[PipelineTemplate], total: int) -> list[int]:
    """Integer micro-batches per pipeline minimising the slowest pipeline (``scipy.optimize.milp``).

    Variables ``m_0..m_{k-1}`` (integers ``>= 1``) and ``z``; minimise ``z`` subject to
    ``a_p + (m_p - 1) c_p <= z`` and ``sum_p m_p = total``, solved to a zero optimality gap. The
    optimum of :func:`min_slowest_time` bounds ``z`` from above, which spares HiGHS most of its
    branching without changing the optimum.
    """
    k = len(templates)
    _check(k, total)
    a = np.array([sum(t.stage_times_s) for t in templates])
    c = np.array([max(t.stage_times_s) for t in templates])
    bound = min_slowest_time(a, c, np.ones(k, dtype=np.int64), total)
    objective = np.zeros(k + 1)
    objective[-1] = 1.0
    slowest = np.hstack([np.diag(c), -np.ones((k, 1))])  # c_p m_p - z <= c_p - a_p
    batch = np.hstack([np.ones((1, k)), np.zeros((1, 1))])
    result = milp(
        objective,
        constraints=[LinearConstraint(slowest, -np.inf, c - a), LinearConstraint(batch, total, total)],
        integrality=np.r_[np.ones(k), 0],
        bounds=Bounds(np.r_[np.ones(k), 0.0], np.r_[np.full(k, total), bound * (1 + _EPS) + _EPS]),
        options={"mip_rel_gap": 0.0},
    )
    if not result.success:
        raise BatchError(f"the batch-distribution program failed: {result.message}")
    counts = [round(x) for x in result.x[:k]]
    if sum(counts) != total:
        raise BatchError(f"the batch-distribution program returned {sum(counts)} micro-batches, not {total}")
    return counts


def min_slowest_time(sums: np.ndarray, maxes: np.ndarray, counts: np.ndarray, total: int) -> float:
    """The optimum of :func:`distribute_microbatches` without a solver, for pipelines grouped by kind.

    ``counts[i]`` pipelines of kind ``i`` share ``(sums[i], maxes[i])``. Pipeline capacity under a
    deadline ``T`` is ``floor((T - a) / c) + 1``; the optimum is the smallest achievable ``T`` whose
    total capacity reaches ``total``, found by bisection and snapped to the exact candidate value.
    """
    _check(int(counts.sum()), total)

    def capacity(t: float) -> int:
        return int((counts * (np.floor((t - sums) / maxes + _EPS) + 1)).sum())

    lo = float(sums.max())
    if capacity(lo) >= total:
        return lo
    hi = float((sums + (total - 1) * maxes).max())
    while hi - lo > _EPS * max(1.0, hi) and np.nextafter(lo, hi) < hi:
        mid = (lo + hi) / 2
        if capacity(mid) >= total:
            hi = mid
        else:
            lo = mid
    # Every deadline reachable above lo is a kind's next finishing time; take the first that suffices.
    candidates = np.sort(sums + (np.floor((lo - sums) / maxes + _EPS) + 1) * maxes)
    return next((float(t) for t in candidates if capacity(t) >= total), hi)
