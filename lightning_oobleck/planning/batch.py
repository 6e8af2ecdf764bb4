"""Batch distribution: how many micro-batches each pipeline runs in one step.

Pipeline ``p`` with fill time ``a_p`` and steady-state time per micro-batch ``c_p`` (1F1B: the sum and the
maximum of its stage times) takes
``T_p(m) = a_p + (m - 1) c_p`` for ``m`` micro-batches (see :mod:`lightning_oobleck.planning.cost`). We
choose integers ``m_p >= 1`` with ``sum_p m_p = B / b`` minimising ``max_p T_p(m_p)``: the step waits for
the slowest pipeline before the gradient all-reduce.
"""

from __future__ import annotations

import functools
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

    Pipelines of the same template are grouped into kinds, so the program stays small at any cluster
    size. For kind ``i`` with ``x_i`` pipelines: ``t_i`` micro-batches in all and at most ``h_i`` per
    pipeline (integers). Minimise ``z`` subject to

        a_i + (h_i - 1) c_i <= z,    x_i <= t_i <= x_i h_i,    sum_i t_i = total

    which is exact: ``t_i`` splits over ``x_i`` pipelines with 1 to ``h_i`` each iff
    ``x_i <= t_i <= x_i h_i``, and the even split used below does so. Solved to a zero optimality gap;
    the optimum of :func:`min_slowest_time` bounds ``z`` from above, which spares HiGHS most of its
    branching without changing the optimum.
    """
    _check(len(templates), total)
    kinds = tuple(dict.fromkeys(templates))
    x = tuple(sum(t == kind for t in templates) for kind in kinds)
    per_kind = dict(zip(kinds, _per_kind(kinds, x, total), strict=True))
    counts, seen = [], dict.fromkeys(kinds, 0)
    for t in templates:
        share, extra = divmod(per_kind[t], x[kinds.index(t)])
        counts.append(share + (seen[t] < extra))
        seen[t] += 1
    return counts


@functools.lru_cache(maxsize=4096)
def _per_kind(kinds: tuple[PipelineTemplate, ...], pipelines: tuple[int, ...], total: int) -> tuple[int, ...]:
    """Micro-batches per kind (the program of :func:`distribute_microbatches`), cached: re-planning after
    each failure or join meets the same mixes of pipelines again and again."""
    x = np.array(pipelines, dtype=np.float64)
    a = np.array([t.fill_s for t in kinds])
    c = np.array([t.slope_s for t in kinds])
    n = len(kinds)
    bound = min_slowest_time(a, c, x.astype(np.int64), total)
    # Variables: h_0..h_{n-1}, t_0..t_{n-1}, z.
    eye, zeros = np.eye(n), np.zeros((n, n))
    slowest = np.hstack([np.diag(c), zeros, -np.ones((n, 1))])  # c_i h_i - z <= c_i - a_i
    capacity = np.hstack([-np.diag(x), eye, np.zeros((n, 1))])  # t_i - x_i h_i <= 0
    batch = np.r_[np.zeros(n), np.ones(n), 0.0][None, :]
    result = milp(
        np.r_[np.zeros(2 * n), 1.0],
        constraints=[
            LinearConstraint(slowest, -np.inf, c - a),
            LinearConstraint(capacity, -np.inf, 0.0),
            LinearConstraint(batch, total, total),
        ],
        integrality=np.r_[np.ones(2 * n), 0],
        bounds=Bounds(
            np.r_[np.ones(n), x, 0.0], np.r_[np.full(n, total), np.full(n, total), bound * (1 + _EPS) + _EPS]
        ),
        options={"mip_rel_gap": 0.0},
    )
    if not result.success:
        raise BatchError(f"the batch-distribution program failed: {result.message}")
    per_kind = tuple(round(t) for t in result.x[n : 2 * n])
    if sum(per_kind) != total:
        raise BatchError(
            f"the batch-distribution program returned {sum(per_kind)} micro-batches, not {total}"
        )
    return per_kind


def min_slowest_time(sums: np.ndarray, maxes: np.ndarray, counts: np.ndarray, total: int) -> float:
    """The optimum of :func:`distribute_microbatches` without a solver, for pipelines grouped by kind:
    ``counts[i]`` pipelines of kind ``i`` share ``(sums[i], maxes[i])`` (:func:`min_slowest_times` of one)."""
    return float(min_slowest_times(sums, maxes, np.asarray(counts)[None, :], total)[0])


def min_slowest_times(sums: np.ndarray, maxes: np.ndarray, counts: np.ndarray, total: int) -> np.ndarray:
    """:func:`min_slowest_time` of every row of ``counts`` (a multiset of kinds per row), all at once.

    Pipeline capacity under a deadline ``T`` is ``floor((T - a) / c) + 1``; the optimum is the smallest
    achievable ``T`` whose total capacity reaches ``total``, found by bisection and snapped to the exact
    candidate value: every deadline reachable above the bisection's lower end is a kind's next finishing
    time, and the first of those that suffices is the optimum.
    """
    counts = np.asarray(counts, dtype=np.int64)
    _check(int(counts.sum(axis=1).max(initial=0)), total)
    used = counts > 0
    sums = np.broadcast_to(np.asarray(sums, dtype=np.float64), counts.shape)
    maxes = np.broadcast_to(np.asarray(maxes, dtype=np.float64), counts.shape)

    def capacity(deadlines: np.ndarray) -> np.ndarray:
        """Micro-batches each row's pipelines finish by each of its ``deadlines[row, j]``."""
        per = np.floor((deadlines[:, :, None] - sums[:, None, :]) / maxes[:, None, :] + _EPS) + 1
        return (counts[:, None, :] * per).sum(axis=2)

    lo = np.where(used, sums, -np.inf).max(axis=1)
    hi = np.where(used, sums + (total - 1) * maxes, -np.inf).max(axis=1)
    done = capacity(lo[:, None])[:, 0] >= total
    hi = np.where(done, lo, hi)
    while True:
        open_ = ~done & (hi - lo > _EPS * np.maximum(1.0, hi)) & (np.nextafter(lo, hi) < hi)
        if not open_.any():
            break
        mid = (lo + hi) / 2
        enough = capacity(mid[:, None])[:, 0] >= total
        hi = np.where(open_ & enough, mid, hi)
        lo = np.where(open_ & ~enough, mid, lo)
    nexts = sums + (np.floor((lo[:, None] - sums) / maxes + _EPS) + 1) * maxes
    candidates = np.sort(np.where(used, nexts, np.inf), axis=1)
    real = np.isfinite(candidates)
    enough = real & (capacity(np.where(real, candidates, hi[:, None])) >= total)
    snapped = np.where(enough.any(axis=1), candidates[np.arange(len(lo)), enough.argmax(axis=1)], hi)
    return np.where(done, lo, snapped)
