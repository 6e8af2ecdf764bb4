"""Instantiation: how many pipelines of each template, using every node, with at least f + 1 pipelines.

The predicted iteration time of a choice of ``k`` pipelines is

    max_p T_p(m_p)  +  max over used templates of (gradient sync across k replicas + optimizer step)

with the micro-batches ``m_p`` distributed optimally (:mod:`lightning_oobleck.planning.batch`).

Search. When the cluster admits few enough multisets of template sizes (at most ``exact_limit``),
every one is evaluated exactly. Otherwise three candidates per pipeline count ``k`` are shortlisted:
the most even split of the nodes into ``k`` pipelines, and the multisets a dynamic programme over
(number of pipelines, nodes used) finds for two linear scores, the steady-state throughput
``sum 1 / max_stage_time`` and the micro-batch capacity under the best deadline found so far. They
are evaluated exactly, and the fastest few are improved by a local search (split, merge or resize one
or two pipelines) while the exact time drops. This path is a heuristic without an optimality proof;
``tests/planning/test_instantiation.py`` shows that the exhaustive path equals brute force and that
the large-cluster path finds the same optimum on every sampled cluster small enough to enumerate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_oobleck.planning.batch import min_slowest_times
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import PipelineTemplate

_EPS = 1e-9
_STARTS = 8
"""Shortlisted multisets the local search starts from."""


class InstantiationError(ValueError):
    """No multiset of templates uses the cluster with enough pipelines."""


@dataclass(frozen=True)
class Instantiation:
    """``counts[i]`` pipelines of ``templates[i]``, and the predicted iteration time."""

    templates: tuple[PipelineTemplate, ...]
    counts: tuple[int, ...]
    iteration_time_s: float

    @property
    def num_pipelines(self) -> int:
        return sum(self.counts)

    def pipeline_templates(self) -> list[PipelineTemplate]:
        """One template per pipeline, largest first."""
        pairs = sorted(zip(self.templates, self.counts, strict=True), key=lambda tc: -tc[0].num_nodes)
        return [t for t, c in pairs for _ in range(c)]


class IterationTimeModel:
    """Predicted iteration time of any multiset of the given templates."""

    def __init__(
        self,
        templates: Sequence[PipelineTemplate],
        cost: CostModel,
        num_microbatches: int,
        max_pipelines: int,
    ) -> None:
        self.templates = tuple(templates)
        self.sizes = np.array([t.num_nodes for t in templates])
        self.sums = np.array([t.fill_s for t in templates])
        self.maxes = np.array([t.slope_s for t in templates])
        self.num_microbatches = num_microbatches
        replicas = np.arange(1, max(max_pipelines, 1) + 1)
        self._tails = np.stack([cost.template_tails_s(t, replicas) for t in templates])

    def tails(self, replicas: int) -> np.ndarray:
        """Sync + optimizer time of each template when ``replicas`` pipelines hold every layer."""
        return self._tails[:, replicas - 1]

    def slowest_pipelines_s(self, counts: np.ndarray) -> np.ndarray:
        """The slowest pipeline's time of each row of ``counts`` (the batch distributed optimally)."""
        return min_slowest_times(self.sums, self.maxes, counts, self.num_microbatches)

    def __call__(self, counts: np.ndarray) -> float:
        return float(self.times(counts[None, :])[0])

    def times(self, counts: np.ndarray) -> np.ndarray:
        """The predicted iteration time of each row of ``counts``."""
        tails = self._tails[:, counts.sum(axis=1) - 1].T  # [row, template]
        return self.slowest_pipelines_s(counts) + np.where(counts > 0, tails, -np.inf).max(axis=1)


def _count_multisets(sizes: Sequence[int], total: int, cap: int) -> int:
    """Number of multisets of ``sizes`` summing to ``total`` (stops counting above ``cap``)."""
    ways = [1] + [0] * total
    for n in sizes:
        for t in range(n, total + 1):
            ways[t] = min(ways[t] + ways[t - n], cap + 1)
    return ways[total]


def _multisets(sizes: Sequence[int], total: int, min_parts: int, max_parts: int) -> Iterator[np.ndarray]:
    """Every count vector over ``sizes`` summing to ``total`` with ``min_parts..max_parts`` parts, in the
    order of a depth-first search over ``counts[0], counts[1], ...`` entering only branches that finish."""
    n = len(sizes)
    # fewest[i][left] / most[i][left]: the fewest / most parts of sizes[i:] summing to left (None: impossible)
    fewest: list[list[int | None]] = [[0] + [None] * total for _ in range(n + 1)]
    most: list[list[int | None]] = [[0] + [None] * total for _ in range(n + 1)]
    for i in reversed(range(n)):
        lo, hi, size = fewest[i], most[i], sizes[i]
        for left in range(1, total + 1):
            options = [(fewest[i + 1][left], most[i + 1][left])]
            if left >= size and lo[left - size] is not None:
                options.append((lo[left - size] + 1, hi[left - size] + 1))
            options = [o for o in options if o[0] is not None]
            if options:
                lo[left] = min(o[0] for o in options)
                hi[left] = max(o[1] for o in options)
    counts = np.zeros(n, dtype=np.int64)

    def can_finish(i: int, left: int, parts: int) -> bool:
        lo, hi = fewest[i][left], most[i][left]
        return lo is not None and parts + lo <= max_parts and parts + hi >= min_parts

    def rec(i: int, left: int, parts: int) -> Iterator[np.ndarray]:
        if left == 0:  # every later count is 0
            yield counts.copy()
            return
        for c in range(min(left // sizes[i], max_parts - parts) + 1):
            if can_finish(i + 1, left - c * sizes[i], parts + c):
                counts[i] = c
                yield from rec(i + 1, left - c * sizes[i], parts + c)
        counts[i] = 0

    if can_finish(0, total, 0):
        yield from rec(0, total, 0)


def shortlist(
    sizes: np.ndarray, score: np.ndarray, total: int, min_parts: int, max_parts: int
) -> list[np.ndarray]:
    """For each pipeline count ``k`` in range, the multiset using ``total`` nodes with the best score.

    ``best[k, t]`` is the highest summed score of ``k`` pipelines on exactly ``t`` nodes; ``pick[k, t]``
    is the template index of the last pipeline added.
    """
    best = np.full((max_parts + 1, total + 1), -np.inf)
    best[0, 0] = 0.0
    pick = np.zeros((max_parts + 1, total + 1), dtype=np.int64)
    for k in range(1, max_parts + 1):
        cand = np.full((len(sizes), total + 1), -np.inf)
        for i, n in enumerate(sizes):
            if n <= total:
                cand[i, n:] = best[k - 1, : total + 1 - n] + score[i]
        pick[k] = cand.argmax(axis=0)
        best[k] = cand.max(axis=0)
    result = []
    for k in range(min_parts, max_parts + 1):
        if np.isfinite(best[k, total]):
            counts = np.zeros(len(sizes), dtype=np.int64)
            t = total
            for kk in range(k, 0, -1):
                i = pick[kk, t]
                counts[i] += 1
                t -= sizes[i]
            result.append(counts)
    return result


def instantiate(
    templates: Sequence[PipelineTemplate],
    cost: CostModel,
    num_nodes: int,
    fault_tolerance: int,
    num_microbatches: int,
    exact_limit: int = 20_000,
) -> Instantiation:
    """The fastest multiset of ``templates`` using all ``num_nodes`` nodes in ``>= f + 1`` pipelines."""
    min_parts = fault_tolerance + 1
    max_parts = min(num_microbatches, num_nodes // min(t.num_nodes for t in templates))
    model = IterationTimeModel(templates, cost, num_microbatches, max_parts)
    if _count_multisets(model.sizes.tolist(), num_nodes, exact_limit) <= exact_limit:
        candidates = list(_multisets(model.sizes.tolist(), num_nodes, min_parts, max_parts))
    else:
        shortlisted = search_shortlist(model, num_nodes, min_parts, max_parts)
        times = model.times(np.array(shortlisted))
        starts = [shortlisted[i] for i in np.argsort(times, kind="stable")[:_STARTS]]
        candidates = [local_search(model, c, min_parts, max_parts)[0] for c in starts]
    if not candidates:
        raise InstantiationError(
            f"{num_nodes} nodes cannot form {min_parts} or more pipelines of "
            f"{sorted(set(model.sizes.tolist()))} nodes with {num_microbatches} micro-batches: lower the "
            "fault tolerance, add nodes, or raise the global batch"
        )
    times = model.times(np.array(candidates)).tolist()
    best = min(range(len(candidates)), key=lambda i: (times[i], -int(candidates[i].sum())))
    return Instantiation(model.templates, tuple(int(c) for c in candidates[best]), times[best])


def search_shortlist(
    model: IterationTimeModel, num_nodes: int, min_parts: int, max_parts: int
) -> list[np.ndarray]:
    """Shortlisted multisets for every pipeline count ``k``: the most even split of the nodes, the best
    steady-state throughput, and the best micro-batch capacity under the best deadline found so far."""
    if max_parts < min_parts:
        return []
    first = shortlist(model.sizes, 1.0 / model.maxes, num_nodes, min_parts, max_parts)
    if not first:
        return []
    index = {int(n): i for i, n in enumerate(model.sizes)}
    even = []
    for k in range(min_parts, max_parts + 1):
        base, extra = divmod(num_nodes, k)
        if base in index and (extra == 0 or base + 1 in index):
            counts = np.zeros(len(model.sizes), dtype=np.int64)
            counts[index[base]] += k - extra
            if extra:
                counts[index[base + 1]] += extra
            even.append(counts)
    deadline = float(model.slowest_pipelines_s(np.array(first + even)).min())
    capacity = np.floor((deadline - model.sums) / model.maxes + _EPS) + 1
    return even + first + shortlist(model.sizes, capacity, num_nodes, min_parts, max_parts)


def _exchanges(sizes: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Moves that keep the node count: take out up to two pipelines, put in up to two of equal total."""
    groups: dict[int, list[np.ndarray]] = {}
    n = len(sizes)
    for i in range(n):
        for j in [None, *range(i, n)]:
            v = np.zeros(n, dtype=np.int64)
            v[i] += 1
            if j is not None:
                v[j] += 1
            groups.setdefault(int(sizes @ v), []).append(v)
    return [(out, into) for vs in groups.values() for out in vs for into in vs if (out != into).any()]


def local_search(
    model: IterationTimeModel, counts: np.ndarray, min_parts: int, max_parts: int
) -> tuple[np.ndarray, float]:
    """Hill-climb from ``counts`` with :func:`_exchanges` (split, merge, resize) while the time drops."""
    moves = _exchanges(model.sizes)
    best, best_time = counts, model(counts)
    improved = True
    while improved:
        improved = False
        for out, into in moves:
            cand = best - out + into
            if (cand < 0).any() or not min_parts <= cand.sum() <= max_parts:
                continue
            t = model(cand)
            if t < best_time - _EPS * best_time:
                best, best_time, improved = cand, t, True
    return best, best_time
