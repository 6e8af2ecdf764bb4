"""Activations cross a stage boundary intact whatever their shapes do, in one message per micro-batch
while shapes stay the same (two real gloo processes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import WorkerPool

from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.p2p import Inbox, Outbox, flatten


def activation(length: int, leaves: int = 3) -> dict[str, Any]:
    """A pytree like a transformer block's output for a sequence of ``length``; its values depend on the
    length so a mix-up shows."""
    tree: dict[str, Any] = {
        "hidden": torch.arange(2 * length * 4, dtype=torch.float64).reshape(2, length, 4) / (length + 1),
        "mask": torch.arange(length) % 3 == 0,
        "ids": (torch.arange(2 * length, dtype=torch.int64) * length).reshape(2, length),
    }
    for k in range(leaves - 3):
        tree[f"extra{k}"] = torch.full((k % 3, length), float(k))  # some of them empty
    tree["scale"] = torch.tensor(float(length))  # 0-dim
    return tree


# (step's sequence lengths per micro-batch, leaves per pytree, messages the sender sends per micro-batch):
# the first micro-batch's structure and metadata go ahead of it (in two messages when they are large); while
# shapes stay the same each later one is one message; a change and every micro-batch after it cost two.
STEPS = {
    "same shapes": ([5, 5, 5, 5, 5], 3, [2, 1, 1, 1, 1]),
    "shapes change twice": ([5, 5, 7, 7, 5], 3, [2, 1, 2, 2, 2]),
    "first micro-batch differs": ([4, 6, 6, 6], 3, [2, 2, 2, 2]),
    "one micro-batch": ([3], 3, [2]),
    "metadata beyond the first message": ([5, 5, 9], 24, [3, 1, 2]),
}


def _groups(store: dist.Store, state: dict[str, Any], rank: int) -> None:
    if "waiter" not in state:
        dist.init_process_group("gloo", store=dist.PrefixStore("p2p", store), rank=rank, world_size=2)
        state["rank"], state["waiter"] = rank, CommWaiter(timedelta(seconds=30))


def run_step(
    store: dist.Store, state: dict[str, Any], rank: int, lengths: list[int], leaves: int
) -> tuple[int, list[dict[str, Any]]]:
    """Rank 0 sends one step's activations, rank 1 receives them; returns (messages sent, received)."""
    _groups(store, state, rank)
    args = (torch.device("cpu"), state["waiter"], threading.Event())
    if rank == 0:
        outbox = Outbox(1, dist.group.WORLD, *args, header=True)
        for length in lengths:
            tree, spec = flatten(activation(length, leaves))
            outbox.send(tree, spec, [t.is_floating_point() and t.dim() == 3 for t in tree])
        sent = len(outbox._pending)
        outbox.wait()
        return sent, []
    inbox = Inbox(0, dist.group.WORLD, len(lengths), *args, header=True)
    received = []
    for _ in lengths:
        tree, metas = inbox.get()
        received.append({"tree": tree, "grads": [m.requires_grad for m in metas]})
    return 0, received


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool(2)
    try:
        yield workers
    finally:
        workers.close()


@pytest.mark.parametrize("case", list(STEPS))
def test_activations_arrive_as_sent(pool: WorkerPool, case: str) -> None:
    lengths, leaves, messages = STEPS[case]
    results = pool.run({rank: (run_step, (rank, lengths, leaves)) for rank in (0, 1)}, timeout=60)
    sent, received = results[0][0], results[1][1]
    assert len(received) == len(lengths)
    for length, got in zip(lengths, received, strict=True):
        expected = activation(length, leaves)
        assert got["tree"].keys() == expected.keys()
        for key, value in expected.items():
            assert got["tree"][key].dtype == value.dtype
            assert torch.equal(got["tree"][key], value), (key, length)
        assert got["grads"] == [t.is_floating_point() and t.dim() == 3 for t in flatten(expected)[0]]
    assert sent == sum(messages), "the messages of a step (one per micro-batch while shapes stay the same)"


def test_steps_in_a_row_each_start_afresh(pool: WorkerPool) -> None:
    """Steps of different shapes and structures one after the other on the same ranks."""
    for lengths, leaves in (([5, 5], 3), ([8, 8, 8], 5), ([2], 3)):
        results = pool.run({rank: (run_step, (rank, lengths, leaves)) for rank in (0, 1)}, timeout=60)
        got = results[1][1]
        assert [r["tree"]["hidden"].shape[1] for r in got] == lengths
        assert len(got[0]["tree"]) == max(leaves, 3) + 1
