"""Batch distribution: the MILP is optimal (against enumeration) and matches the closed-form optimum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_oobleck.planning.batch import (
    BatchError,
    distribute_microbatches,
    min_slowest_time,
    min_slowest_times,
    num_microbatches,
)
from lightning_oobleck.planning.plan import PipelineTemplate, Stage


def _template(rng: np.random.Generator) -> PipelineTemplate:
    stages = int(rng.integers(1, 5))
    times = tuple(float(x) for x in rng.uniform(0.1, 3.0, stages))
    return PipelineTemplate(stages, 1, tuple(Stage(s, s + 1, s) for s in range(stages)), times)


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(4))
def test_milp_is_optimal_against_every_distribution(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(15):
        templates = [_template(rng) for _ in range(int(rng.integers(1, 5)))]
        total = int(rng.integers(len(templates), 14))
        counts = distribute_microbatches(templates, total)
        assert sum(counts) == total and min(counts) >= 1
        got = max(t.iteration_time_s(m) for t, m in zip(templates, counts, strict=True))
        best = min(
            max(t.iteration_time_s(m) for t, m in zip(templates, c, strict=True))
            for c in _compositions(total, len(templates))
        )
        assert got == pytest.approx(best, rel=1e-9)
        sums = np.array([sum(t.stage_times_s) for t in templates])
        maxes = np.array([max(t.stage_times_s) for t in templates])
        assert min_slowest_time(sums, maxes, np.ones(len(templates), dtype=np.int64), total) == pytest.approx(
            best
        )


def test_grouped_kinds_equal_expanded_pipelines() -> None:
    rng = np.random.default_rng(7)
    kinds = [_template(rng) for _ in range(3)]
    multiplicity = np.array([3, 1, 2])
    expanded = [t for t, c in zip(kinds, multiplicity, strict=True) for _ in range(c)]
    counts = distribute_microbatches(expanded, 40)
    expected = max(t.iteration_time_s(m) for t, m in zip(expanded, counts, strict=True))
    sums = np.array([sum(t.stage_times_s) for t in kinds])
    maxes = np.array([max(t.stage_times_s) for t in kinds])
    assert min_slowest_time(sums, maxes, multiplicity, 40) == pytest.approx(expected)


def test_multisets_evaluated_together_equal_each_alone() -> None:
    """Instantiation prices every candidate multiset in one call: each row as if it were alone (kinds a row
    does not use change nothing)."""
    rng = np.random.default_rng(11)
    kinds = [_template(rng) for _ in range(5)]
    sums = np.array([sum(t.stage_times_s) for t in kinds])
    maxes = np.array([max(t.stage_times_s) for t in kinds])
    rows = rng.integers(0, 4, (40, 5))
    rows[:, 2] = np.maximum(rows[:, 2], 1)
    together = min_slowest_times(sums, maxes, rows, 60)
    for row, time in zip(rows, together, strict=True):
        used = row > 0
        assert time == min_slowest_time(sums[used], maxes[used], row[used], 60)


def test_bad_batches_are_clear_errors() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(BatchError, match="3 micro-batches cannot feed 4 pipelines"):
        distribute_microbatches([_template(rng) for _ in range(4)], 3)
    with pytest.raises(BatchError, match="not a multiple of the micro-batch 4: use a global batch of 12"):
        num_microbatches(14, 4)
    assert num_microbatches(512, 4) == 128
