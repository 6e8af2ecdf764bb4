"""A node comes back in the loop users run: ``Trainer.fit`` with ``replace_failed_after_s``.

The realistic loop of ``test_realistic_loop`` (validation every 3 steps with ``sync_dist`` logging,
``ModelCheckpoint``, ``DataLoader(num_workers=2)``, warm-up + cosine ``SequentialLR``, clipping, a CSV
logger): rank 0 is SIGKILLed in a training forward; the launcher starts a replacement node, which joins at
a step boundary and resumes the fit where the members stand (loops, scheduler, data position, logger run)
with the layers and AdamW state it received. The run must end with all steps; every sample once; the
weights of every replica, the replacement's included, and the learning rates and logged losses equal to
single-process training (1e-9); the pipelines and f back to the plan's.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from test_fault_matrix import FORWARD, Fault, wait_for_the_replacement
from test_realistic_loop import STEPS, LoopFaults, check_loop, fit_loop, loop_reference  # noqa: F401

from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.recovery import read_events

FAILED_AT_STEP = 1
HOLD_AT_STEP = 4


class HoldForTheReplacement(LoopFaults):
    """The loop's faults; and at step ``HOLD_AT_STEP`` the members wait for the replacement
    (:func:`~test_fault_matrix.wait_for_the_replacement`), so that a run of 9 steps cannot end before it."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        if trainer.global_step == HOLD_AT_STEP and trainer.strategy.admission is None:
            wait_for_the_replacement(trainer, 6)


@pytest.mark.timeout(400)
def test_a_replacement_node_rejoins_the_fit(tmp_path: Path, loop_reference: dict[str, Any]) -> None:  # noqa: F811
    faults = HoldForTheReplacement(tmp_path, {(0, FAILED_AT_STEP): Fault(signal.SIGKILL, FORWARD)})
    trainer = fit_loop(tmp_path, faults, 6, replace_failed_after_s=0.2)
    replacement = 6  # the coordinator's id for the first new node: never one the job had
    check_loop(trainer, tmp_path, loop_reference, dead={0}, num_nodes=6, joined={replacement})
    lrs = json.loads((tmp_path / f"lrs-{replacement}.0.json").read_text())
    # it joined mid-run: at a step boundary after the failure (how soon depends on the machine's load)
    assert min(map(int, lrs)) > FAILED_AT_STEP and max(map(int, lrs)) == STEPS - 1
    _, recoveries = read_events(tmp_path / "logs" / "version_0" / EVENTS_FILE)
    failure, join = recoveries
    assert failure.removed == [[0, 0]] and failure.fault_tolerance == 1
    assert join.added == [[replacement, 0]] and join.removed == [] and join.fault_tolerance == 2
    assert not join.warnings and join.resumed_at is not None
