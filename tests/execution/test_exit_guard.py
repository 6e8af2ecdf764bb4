"""A process whose waiter thread is stuck in an abandoned gloo wait exits with its real status, and says
goodbye to its coordinator when it ended normally (a worker that failed is seen dead).

Without :mod:`lightning_oobleck.execution.exit_guard`, the stuck wait returning during the interpreter's
finalisation ended a successful run with ``std::terminate`` (status 134) every time."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from lightning_oobleck.recovery import Coordinator

WORKER = Path(__file__).with_name("stuck_wait_worker.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "status"), [("ok", 0), ("raise", 1)])
@pytest.mark.slow
def test_a_stuck_abandoned_wait_does_not_abort_the_exit(mode: str, status: int) -> None:
    store = TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    with Coordinator(1, "127.0.0.1") as coordinator:
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(rank), str(store.port), mode, coordinator.address],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        try:
            outputs = [proc.communicate(timeout=90) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        deadline = time.monotonic() + (10.0 if mode == "raise" else 1.5)  # a goodbye, or the closed socket
        while not coordinator.deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        deaths = [death.worker for death in coordinator.deaths]
    # The goodbye ran although the process ended without finalisation: no "declared dead" after a normal end.
    assert deaths == ([] if mode == "ok" else [(1, 0)]), deaths
    out, err = outputs[1]
    assert procs[1].returncode == status, err[-2000:]
    assert "terminate called" not in err
    if mode == "ok":
        assert "rank 1 finished" in out
    else:
        assert "RuntimeError: the training failed" in err
