"""Node specification: n0 from memory, and the coverage argument checked exhaustively."""

from __future__ import annotations

import pytest

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.node_spec import max_parts, min_nodes, split_into, template_sizes
from lightning_oobleck.planning.profile import synthetic_gpt_profile
from lightning_oobleck.planning.templates import InfeasibleTemplateError, is_feasible


def _all_partition_part_counts(sizes: list[int], total: int) -> set[int]:
    """Part counts of every multiset of ``sizes`` summing to ``total`` (plain recursion)."""
    if total == 0:
        return {0}
    return {
        1 + k
        for n in sizes
        if n <= total
        for k in _all_partition_part_counts([s for s in sizes if s >= n], total - n)
    }


@pytest.mark.parametrize("n0", range(1, 7))
def test_consecutive_sizes_cover_every_count_above_f_plus_one_n0(n0: int) -> None:
    sizes = list(range(n0, 2 * n0))
    for f in range(5):
        for total in range((f + 1) * n0, (f + 1) * n0 + 3 * n0 + 4):
            parts = max_parts(sizes, total)
            assert parts == total // n0 >= f + 1
            split = split_into(sizes, total, parts)
            assert sum(split) == total and len(split) == parts and set(split) <= set(sizes)


@pytest.mark.parametrize("n0", range(1, 5))
def test_max_parts_matches_enumeration(n0: int) -> None:
    sizes = list(range(n0, 2 * n0))
    for total in range(1, 20):
        counts = _all_partition_part_counts(sizes, total)
        assert max_parts(sizes, total) == max(counts, default=0)


def test_split_into_handles_gaps_and_rejects_impossible() -> None:
    assert sorted(split_into([2, 5], 9, 3)) == [2, 2, 5]
    with pytest.raises(ValueError, match="cannot form 2 pipelines"):
        split_into([4, 5], 7, 2)


@pytest.mark.parametrize(
    ("hidden", "memory", "gpus"), [(1024, 48e9, 1), (4096, 24e9, 1), (4096, 24e9, 4), (8192, 80e9, 8)]
)
def test_n0_is_the_fewest_feasible_nodes(hidden: int, memory: float, gpus: int) -> None:
    cost = CostModel(
        synthetic_gpt_profile(32, hidden, 2048, 1), ClusterSpec(16, gpus, device_memory_bytes=memory)
    )
    n0 = min_nodes(cost)
    assert is_feasible(cost, n0)
    assert not any(is_feasible(cost, n) for n in range(1, n0))
    sizes = template_sizes(cost, n0, 16, 1)
    assert sizes[0] == n0 and all(is_feasible(cost, n) for n in sizes)
    assert {n for n in range(n0, min(2 * n0, 32 // gpus + 1)) if is_feasible(cost, n)} <= set(sizes)


def test_model_that_fits_nowhere_names_the_fix() -> None:
    cost = CostModel(synthetic_gpt_profile(8, 16384), ClusterSpec(64, 8, device_memory_bytes=8e9))
    with pytest.raises(InfeasibleTemplateError, match=r"does not fit on any number of nodes .* more memory"):
        min_nodes(cost)
