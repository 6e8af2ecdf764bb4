"""The state copy of a recovery when two workers copy to each other at once.

Worker (0, 0) holds layers 0-2 and worker (1, 0) layers 3-5; the new plan swaps them, so each must send
its layers (parameters and AdamW state) to the other while receiving the other's. With NCCL, sends and
receives issued one by one can wait on each other in that case; the copy issues each exchange as one batch
of point-to-point operations. The gloo variant runs here; the NCCL one needs two GPUs (none is lent to this
project), so it runs only on a machine that has them.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from dist_harness import WorkerPool, plan_from_splits
from torch import nn

from lightning_oobleck.execution import ProcessGroups, build_stage
from lightning_oobleck.planning.plan import LayerCopy, Plan
from lightning_oobleck.recovery.state_transfer import state_by_name, transfer_state

SEED = 11


def layers() -> list[nn.Module]:
    return [nn.Linear(3, 3) for _ in range(6)]


def trained(held: range, device: torch.device) -> tuple[Any, torch.optim.Optimizer]:
    """The layers ``held`` after one AdamW step on a fixed loss: the same on any process."""
    module = build_stage(layers, held, device, seed=SEED, dtype=torch.float64)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    sum((p**2).sum() for p in module.parameters()).backward()
    optimizer.step()
    return module, optimizer


def copy_to_each_other(store: Any, state: dict, node: int, backend: str, old: Plan, new: Plan) -> dict:
    device = torch.device(f"cuda:{node}") if backend == "nccl" else torch.device("cpu")
    held = old.role(node, 0).layers
    module, optimizer = trained(held, device)
    copies = [
        LayerCopy(layer, to_node=to, from_node=1 - to)
        for to in (0, 1)
        for layer in new.role(to, 0).layers
        if layer not in old.role(to, 0).layers
    ]
    groups = ProcessGroups(
        new, (node, 0), store, generation=7, backend=backend, timeout=timedelta(seconds=20)
    )
    try:
        built = lambda indices: build_stage(layers, indices, device, seed=SEED + 1, dtype=torch.float64)  # noqa: E731
        new_module, new_state = transfer_state(
            module, state_by_name(optimizer, module), copies, groups, built, threading.Event()
        )
    finally:
        groups.destroy()
    return {
        "weights": {k: v.cpu() for k, v in new_module.state_dict().items()},
        "exp_avg": {k: s["exp_avg"].cpu() for k, s in new_state.items()},
    }


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="NCCL between two ranks needs 2 GPUs"
            ),
        ),
    ],
)
@pytest.mark.timeout(120)
def test_two_workers_copy_their_layers_to_each_other(backend: str) -> None:
    old = plan_from_splits([[(0, 3), (3, 6)]], [2], 1)
    pipeline = old.pipelines[0]
    new = dataclasses.replace(old, pipelines=(dataclasses.replace(pipeline, nodes=(1, 0)),))
    assert new.role(0, 0).layers == old.role(1, 0).layers
    pool = WorkerPool(2)
    try:
        results = pool.run({n: (copy_to_each_other, (n, backend, old, new)) for n in (0, 1)}, timeout=90)
    finally:
        pool.close()
    reference, reference_optimizer = trained(range(6), torch.device("cpu"))
    reference_state = state_by_name(reference_optimizer, reference)
    for node, result in results.items():
        wanted = tuple(f"layers.{i}." for i in new.role(node, 0).layers)
        assert {int(k.split(".")[1]) for k in result["weights"]} == set(new.role(node, 0).layers)
        for name, value in result["weights"].items():
            assert torch.equal(value, reference.state_dict()[name]), (node, name)
        assert result["exp_avg"].keys() == {n for n in reference_state if n.startswith(wanted)}
        for name, value in result["exp_avg"].items():
            assert torch.equal(value, reference_state[name]["exp_avg"]), (node, name)
