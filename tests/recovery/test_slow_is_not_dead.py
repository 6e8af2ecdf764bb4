"""Slow is not dead: a worker that spends longer than ``collective_timeout_s`` in a rank-zero callback (a
slow logger upload, a long ``on_validation_end``) while its peers wait in the next collective is waited for.
Nobody is declared dead, fenced or recovered, and the run trains to the weights, learning rates, logged
losses and checkpoints of single-process training (the loop of ``test_realistic_loop``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.utilities import rank_zero_only
from test_realistic_loop import LoopFaults, RealisticNet, check_loop, fit_loop
from test_realistic_loop import loop_reference as loop_reference  # the fixture

COLLECTIVE_TIMEOUT_S = 5.0  # above the loop's heartbeat timeout (4 s)
SLOW_S = 2.5 * COLLECTIVE_TIMEOUT_S


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
