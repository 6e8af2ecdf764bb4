"""A model whose first and last layers share a weight (a tied embedding and head) survives SIGKILLs in the
realistic loop (validation, checkpoints, loader workers, composite LR schedule, clipping, logging) with the
weights of single-process training: rank 0, which holds the tie's canonical layer, dies in a training
forward; later a last stage, holding the head, dies after its commit. The survivors' state copies carry the
tie, its gradient all-reduce is rebuilt over the new owners, and the last checkpoint resumes on another
layout."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fault_matrix import FORWARD, OPTIMIZER, Fault
from test_realistic_loop import LoopFaults, RealisticNet, check_loop, fit_loop, reference_run, resume_check
from torch import Tensor, nn
from torch.nn import functional as F


class TiedHead(nn.Module):
    """Projects back through the first layer's weight (transposed, as an LM head uses the embedding), then
    classifies."""

    def __init__(self, first: nn.Linear) -> None:
        super().__init__()
        self.weight = first.weight  # named like every weight: RealisticNet's decay group takes it everywhere
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.linear(x, self.weight.t()))


class TiedNet(RealisticNet):
    def configure_layers(self) -> list[nn.Module]:
        first = nn.Linear(4, 8)
        return [first, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), TiedHead(first)]


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return reference_run(tmp_path_factory.mktemp("tied-reference"), TiedNet())


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_tie_survives_the_loss_of_its_canonical_holder_and_of_a_head(
    tmp_path: Path, tied_reference: dict[str, Any]
) -> None:
    """6 nodes, 3 pipelines of 2 (layers 0-2 | 3-5): node 0 (layer 0, the tie's canonical layer) dies in a
    training forward of step 1; node 5 (a head) dies after its commit of step 5."""
    faults = {(0, 1): Fault(signal.SIGKILL, FORWARD), (5, 5): Fault(signal.SIGKILL, OPTIMIZER)}
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 6, module=TiedNet())
    check_loop(trainer, tmp_path, tied_reference, dead={0, 5}, num_nodes=6)
    for path in tmp_path.glob("final-*.pt"):
        weights = torch.load(path)
        if "layers.5.weight" in weights and "layers.0.weight" in weights:
            assert torch.equal(weights["layers.5.weight"], weights["layers.0.weight"])
    resume_check(tmp_path, tied_reference, TiedNet)
