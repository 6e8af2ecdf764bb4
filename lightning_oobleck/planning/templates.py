"""Pipeline templates: the best contiguous split of the layers over ``n`` nodes.

A template for ``n`` nodes of ``G`` devices at tensor parallelism ``t`` has ``S = n * G / t`` stages, each
on ``t`` devices of one node; stage ``s`` runs on template node ``s // (G / t)``, devices
``(s mod G / t) * t`` onwards, so a stage never spans nodes. Among all splits of the ``L`` layers into
``S`` non-empty contiguous stages whose memory fits a device, we want the one minimising the 1F1B
iteration time at a reference micro-batch count ``m``::

    T = sum_s t_s + (m - 1) * max_s t_s

The objective is not decomposable (sum plus max), so the search is exact by parametrising on the
bottleneck. Let ``g(B)`` be the least sum of stage times over splits whose every stage takes at most
``B`` (a dynamic programme over (stage, layer), vectorised with NumPy). ``g`` is a non-increasing step
function that only changes at stage-time values, and a split whose slowest stage takes ``B`` costs at
least ``g(B) + (m - 1) * B``. Starting from the least feasible bottleneck ``B*`` (a min-max programme),
we jump each time to the smallest candidate bound that lowers ``g`` (found by batched bisection over
the sorted candidate values): every bound in between gives the same sum with a larger max, so it cannot
win. We stop when ``g(inf) + (m - 1) * B`` reaches the best objective found, since no split with a
larger bottleneck can beat it. ``tests/planning/test_templates.py`` checks the result against an
exhaustive enumeration of all splits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import PipelineTemplate, Stage

_PROBES = 16
"""Bounds evaluated at once per bisection round of the bottleneck search."""


class InfeasibleTemplateError(ValueError):
    """No split of the layers fits the requested number of nodes."""


class _SplitSearch:
    """Dynamic programmes over the stage-time band ``times[s, a, b]`` of :class:`StageChoices` (the range
    ``[s + a, s + 1 + b)``; ``inf`` = not allowed).

    Stage ``s`` of ``S`` may only cover ``[i, j)`` with ``s <= i`` and ``j <= L - (S - 1 - s)``, so that
    every stage keeps at least one layer: a band of width ``W = L - S + 1`` per stage.
    """

    def __init__(self, times: np.ndarray) -> None:
        self.times = times
        self.num_stages, self.width, _ = times.shape
        self.num_layers = self.width + self.num_stages - 1

    def min_sum(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each bound, the least stage-time sum with every stage ``<= bound``, and the choices.

        Returns ``sums`` (``inf`` where infeasible) and ``choice[s, k, j]``: the first layer of stage
        ``s`` in the best split of ``[0, s + 1 + j)`` into ``s + 1`` stages under bound ``k``.
        """
        bounds = np.asarray(bounds, dtype=np.float64)
        w, k = self.width, len(bounds)
        f = np.full((k, w), np.inf)
        f[:, 0] = 0.0  # after zero stages, zero layers are covered
        choice = np.empty((self.num_stages, k, w), dtype=np.int64)
        for s in range(self.num_stages):
            t = self.times[s]
            t = np.where(t[None] <= bounds[:, None, None], t[None], np.inf)
            cand = f[:, :, None] + t
            arg = cand.argmin(axis=1)
            choice[s] = arg + s
            f = cand.min(axis=1)
        return f[:, -1], choice

    def min_max(self) -> float:
        """The least achievable slowest-stage time (``inf`` if no split is allowed)."""
        h = np.full(self.width, np.inf)
        h[0] = 0.0
        for s in range(self.num_stages):
            h = np.maximum(h[:, None], self.times[s]).min(axis=0)
        return float(h[-1])

    def split(self, choice: np.ndarray, k: int) -> list[tuple[int, int]]:
        """The ``[first, end)`` ranges of the split chosen under bound number ``k``."""
        ranges = []
        end = self.num_layers
        for s in reversed(range(self.num_stages)):
            first = int(choice[s, k, end - s - 1])
            ranges.append((first, end))
            end = first
        return ranges[::-1]

    def stage_times(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        return np.array([self.times[s, i - s, j - s - 1] for s, (i, j) in enumerate(ranges)])

    def best_split(self, microbatches: int) -> list[tuple[int, int]] | None:
        """The split minimising ``sum + (m - 1) * max``, or ``None`` if no split is allowed."""
        unconstrained_sum, choice = self.min_sum(np.array([np.inf]))
        lower = float(unconstrained_sum[0])
        if not np.isfinite(lower):
            return None
        if microbatches <= 1:
            return self.split(choice, 0)
        slope = microbatches - 1
        values = np.unique(self.times[np.isfinite(self.times)])
        bound = self.min_max()
        sums, choice = self.min_sum(np.array([bound]))
        best_ranges = self.split(choice, 0)
        current_sum = float(sums[0])
        best = current_sum + slope * self.stage_times(best_ranges).max()
        while True:
            window = values[(values > bound) & (values < (best - lower) / slope)]
            if window.size == 0 or self.min_sum(window[-1:])[0][0] >= current_sum:
                break
            # Invariant: g(window[-1]) < current_sum; find the first bound in the window with that property.
            while window.size > 1:
                probes = window[
                    np.unique(np.linspace(0, window.size - 1, min(_PROBES, window.size)).astype(int))
                ]
                lowered = self.min_sum(probes)[0] < current_sum
                first = int(np.argmax(lowered))
                previous = probes[first - 1] if first > 0 else -np.inf
                window = window[(window > previous) & (window <= probes[first])]
            bound = float(window[0])
            sums, choice = self.min_sum(window)
            ranges = self.split(choice, 0)
            current_sum = float(sums[0])
            objective = current_sum + slope * self.stage_times(ranges).max()
            if objective < best:
                best, best_ranges = objective, ranges
        return best_ranges


def generate_template(cost: CostModel, num_nodes: int, microbatches: int) -> PipelineTemplate:
    """The fastest memory-feasible template for ``num_nodes`` nodes at ``microbatches`` micro-batches.

    Raises :class:`InfeasibleTemplateError` when the nodes have more devices than the model has layers,
    or when no split fits the device memory.
    """
    return with_fits(cost, [_best_template(cost, num_nodes, microbatches)])[0]


def _best_template(cost: CostModel, num_nodes: int, microbatches: int) -> PipelineTemplate:
    """:func:`generate_template` without its schedule's fit."""
    g, t = cost.stages_per_node, cost.tensor_parallel
    num_stages = num_nodes * g
    if num_nodes < 1 or num_stages > cost.num_layers:
        per = "one per GPU" if t == 1 else f"one per {t} GPUs"
        raise InfeasibleTemplateError(
            f"a {num_nodes}-node template needs {num_stages} stages ({per}) but the model has "
            f"{cost.num_layers} layers; use pipelines of at most {cost.num_layers // g} nodes"
        )
    choices = cost.stage_choices(num_stages)
    ranges = _SplitSearch(choices.times).best_split(microbatches)
    if ranges is None:
        raise InfeasibleTemplateError(
            f"the model does not fit in {num_nodes} node(s) of {cost.cluster.gpus_per_node} GPU(s) with "
            f"{cost.cluster.device_memory_bytes / 1e9:.3g} GB each"
            + (f" at tensor parallelism {t}" if t > 1 else "")
            + "; use more nodes per pipeline"
        )
    chosen = [choices.at(s, i, j) for s, (i, j) in enumerate(ranges)]
    stages = tuple(
        Stage(i, j, node=s // g, device=(s % g) * t, recompute=recompute)
        for s, ((i, j), (_, _, recompute)) in enumerate(zip(ranges, chosen, strict=True))
    )
    return PipelineTemplate(
        num_nodes=num_nodes,
        gpus_per_node=cost.cluster.gpus_per_node,
        stages=stages,
        stage_times_s=tuple(time for time, _, _ in chosen),
        stage_memory_bytes=tuple(memory for _, memory, _ in chosen),
        microbatches=microbatches,
        tensor_parallel=t,
        stage_tensor_parallel_s=tuple(cost.tensor_parallel_s(i, j) for i, j in ranges) if t > 1 else (),
    )


def is_feasible(cost: CostModel, num_nodes: int) -> bool:
    """Whether some split of the model over ``num_nodes`` nodes fits the device memory."""
    num_stages = num_nodes * cost.stages_per_node
    if num_nodes < 1 or num_stages > cost.num_layers:
        return False
    return bool(np.isfinite(_SplitSearch(cost.stage_choices(num_stages).times).min_max()))


def generate_templates(
    cost: CostModel, sizes: Iterable[int], microbatches: dict[int, int]
) -> tuple[PipelineTemplate, ...]:
    """One template per size, each optimised for ``microbatches[size]`` micro-batches, with its schedule's
    fit (:meth:`CostModel.schedule_fits_s`)."""
    return with_fits(cost, [_best_template(cost, n, microbatches[n]) for n in sizes])


def with_fits(cost: CostModel, templates: Sequence[PipelineTemplate]) -> tuple[PipelineTemplate, ...]:
    """``templates`` with their schedule's fit, simulated together."""
    fits = cost.schedule_fits_s(templates)
    return tuple(replace(t, schedule_fit_s=f) for t, f in zip(templates, fits, strict=True))
