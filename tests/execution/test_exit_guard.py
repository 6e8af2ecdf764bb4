"""A process whose waiter thread is stuck in an abandoned gloo wait exits with its real status.

Without :mod:`lightning_oobleck.execution.exit_guard`, the stuck wait returning during the interpreter's
finalisation ended a successful run with ``std::terminate`` (status 134) every time."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import TCPStore

WORKER = Path(__file__).with_name("stuck_wait_worker.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "status"), [("ok", 0), ("raise", 1)])
def test_a_stuck_abandoned_wait_does_not_abort_the_exit(mode: str, status: int) -> None:
    store = TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(store.port), mode],
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
    out, err = outputs[1]
    assert procs[1].returncode == status, err[-2000:]
    assert "terminate called" not in err
    if mode == "ok":
        assert "rank 1 finished" in out
    else:
        assert "RuntimeError: the training failed" in err
