"""Slow is not dead, and a failing worker is lost at once.

A worker that spends longer than ``collective_timeout_s`` in a rank-zero callback (a slow logger upload, a
long ``on_validation_end``) while its peers wait in the next collective is waited for: nobody is declared
dead, fenced or recovered. A worker that raises (out of memory, a bug) is a failure its peers recover from
at once. Both runs train to the weights, learning rates, logged losses and checkpoints of single-process
training (the loop of ``test_realistic_loop``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.utilities import rank_zero_only
from test_realistic_loop import LoopFaults, RealisticNet, check_loop, fit_loop
from test_realistic_loop import loop_reference as loop_reference  # the fixture

COLLECTIVE_TIMEOUT_S = 10.0  # above the loop's heartbeat timeout (8 s)
SLOW_S = 1.5 * COLLECTIVE_TIMEOUT_S


class SlowRankZero(RealisticNet):
    """Rank 0 spends ``SLOW_S`` in its first ``on_validation_end`` (a rank-zero-only upload, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow_once = True

    @rank_zero_only
    def _upload(self) -> None:
        if self.slow_once:
            self.slow_once = False
            time.sleep(SLOW_S)

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._upload()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_rank_zero_callback_longer_than_the_collective_timeout_is_waited_for(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    started = time.monotonic()
    trainer = fit_loop(
        tmp_path,
        LoopFaults(tmp_path, {}),
        4,
        module=SlowRankZero(),
        layout=[[0, 3, 6], [0, 3, 6]],
        fault_tolerance=1,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    check_loop(trainer, tmp_path, loop_reference, dead=set(), num_nodes=4)
    assert time.monotonic() - started > SLOW_S


class RaisesOnNode2(RealisticNet):
    """Node 2 raises in its training step of step 4 (out of memory, say); the others are fine."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.global_step == 4 and self.trainer.strategy.worker[0] == 2:
            raise RuntimeError("CUDA out of memory (simulated on node 2)")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(300)
def test_an_exception_in_one_worker_is_a_failure_the_others_recover_from(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """The failed worker's peers see it lost at once (not a worker that finished) and train on; its
    traceback is reported."""
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, {}), 6, module=RaisesOnNode2())
    (tmp_path / "fault-2.0.json").write_text("[]")  # check_loop counts the dead by their fault files
    check_loop(trainer, tmp_path, loop_reference, dead={2}, num_nodes=6)
    report = trainer.strategy.launcher.last_report
    assert "CUDA out of memory (simulated on node 2)" in report.lost[2]
