"""Node specification: the smallest pipeline (n0), the template sizes, and why they cover every failure.

``n0`` is the fewest nodes whose devices hold the model with its gradients, optimizer state and
in-flight activations, i.e. the smallest node count with a memory-feasible split.

**Coverage.** Let the template sizes include every size ``n0, n0 + 1, ..., 2 n0 - 1``. Then every node
count ``M >= (f + 1) n0`` is a sum of ``q = floor(M / n0) >= f + 1`` template sizes. Proof: write
``M = q n0 + r`` with ``0 <= r < n0``. Start from ``q`` parts of ``n0`` nodes and hand the ``r``
remaining nodes out, at most ``n0 - 1`` per part; this is possible because ``r <= n0 - 1 <= q (n0 - 1)``
when ``q >= 1`` (and ``r = 0`` when ``n0 = 1``). Every part then has between ``n0`` and ``2 n0 - 1``
nodes, so it is a template size. Conversely no split of ``M`` nodes has more than ``floor(M / n0)``
parts, since each has at least ``n0`` nodes. (This is the coin-problem argument: consecutive sizes
``n0..2n0-1`` leave no gap above their Frobenius bound.) Hence after any failures that leave ``M``
survivors, the precomputed templates always give ``floor(M / n0)`` pipelines: at least ``f + 1`` while
``M >= (f + 1) n0``, which tolerates ``f`` more failures, and the largest ``f`` still possible below it.

Sizes beyond ``2 n0 - 1`` only improve speed (fewer, longer pipelines waste fewer nodes on tiny
stages); we generate them up to the largest pipeline an instantiation with ``f + 1`` pipelines can use,
``N - f n0``, bounded by one layer per device (``L // G``) and by memory (1F1B's first stage keeps
``S`` micro-batches in flight, so very long pipelines can stop fitting). When one of those bounds
removes a size below ``2 n0``, the argument above no longer applies: instantiation and replanning then
work with the sizes that exist (:func:`max_parts`), and ``make_plan`` warns that some survivor counts
may not be coverable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.templates import InfeasibleTemplateError, is_feasible


def min_nodes(cost: CostModel) -> int:
    """``n0``: the fewest nodes with a memory-feasible split of the model."""
    largest = cost.num_layers // cost.stages_per_node
    for n in range(1, largest + 1):
        if is_feasible(cost, n):
            return n
    at = f" at tensor parallelism {cost.tensor_parallel}" if cost.tensor_parallel > 1 else ""
    raise InfeasibleTemplateError(
        f"the model ({cost.num_layers} layers) does not fit on any number of nodes with "
        f"{cost.cluster.gpus_per_node} GPU(s) of {cost.cluster.device_memory_bytes / 1e9:.3g} GB{at}: use "
        "devices with more memory, a smaller micro-batch, more tensor parallelism, or fewer GPUs per node"
    )


def template_sizes(cost: CostModel, n0: int, num_nodes: int, fault_tolerance: int) -> tuple[int, ...]:
    """Memory-feasible sizes from ``n0`` to ``max(2 n0 - 1, N - f n0)``, at most ``L // (G / t)``."""
    largest = min(cost.num_layers // cost.stages_per_node, max(2 * n0 - 1, num_nodes - fault_tolerance * n0))
    return tuple(n for n in range(n0, largest + 1) if n == n0 or is_feasible(cost, n))


def max_parts(sizes: Sequence[int], total: int) -> int:
    """The most parts ``total`` splits into with every part in ``sizes`` (0 if it cannot be split)."""
    return _max_parts(tuple(sorted(set(sizes))), total)


@functools.lru_cache(maxsize=4096)
def _max_parts(sizes: tuple[int, ...], total: int) -> int:
    best = np.full(total + 1, -1, dtype=np.int64)
    best[0] = 0
    for t in range(1, total + 1):
        options = [best[t - n] for n in sizes if n <= t and best[t - n] >= 0]
        best[t] = max(options) + 1 if options else -1
    return max(int(best[total]), 0)


def split_into(sizes: Sequence[int], total: int, parts: int) -> list[int]:
    """``parts`` sizes from ``sizes`` summing to ``total``, as even as possible, largest first.

    Raises ``ValueError`` when impossible.
    """
    if parts < 1:
        raise ValueError(f"cannot split {total} nodes into {parts} pipelines")
    base, extra = divmod(total, parts)
    even = [base + 1] * extra + [base] * (parts - extra)
    if set(even) <= set(sizes):
        return even
    # reach[p, t]: some p sizes sum to t.
    reach = np.zeros((parts + 1, total + 1), dtype=bool)
    reach[0, 0] = True
    for p in range(1, parts + 1):
        for n in sizes:
            if n <= total:
                reach[p, n:] |= reach[p - 1, : total + 1 - n]
    if not reach[parts, total]:
        raise ValueError(f"{total} nodes cannot form {parts} pipelines of sizes {sorted(sizes)}")
    result, t = [], total
    for p in range(parts, 0, -1):
        n = next(n for n in sorted(sizes, reverse=True) if n <= t and reach[p - 1, t - n])
        result.append(n)
        t -= n
    return sorted(result, reverse=True)
