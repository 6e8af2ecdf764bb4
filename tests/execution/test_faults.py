"""The named fault points: which fault acts where (pure), and real signals and errors when one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lightning_oobleck.execution import faults
from lightning_oobleck.testing import FAULTS_ENV, Fault, FaultAction, FaultPoint, arm, armed, disarm


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    disarm()
    yield
    disarm()


def test_a_fault_acts_once_at_its_worker_step_and_occurrence() -> None:
    fired: list[Fault] = []
    fault = Fault(FaultPoint.FORWARD, FaultAction.RAISE, node=1, step=3, occurrence=2, message="drill")
    arm(fault, report=fired.append)
    for worker, step in (((0, 0), 3), ((1, 0), 2)):  # another worker; another step
        faults.step_starts(worker, step)
        for _ in range(3):
            faults.reach(FaultPoint.FORWARD)
    faults.step_starts((1, 0), 3)
    faults.reach(FaultPoint.BACKWARD)  # another point does not count
    faults.reach(FaultPoint.FORWARD)
    with pytest.raises(RuntimeError, match=r"^drill$"):
        faults.reach(FaultPoint.FORWARD)
    assert fired == [fault] and armed() == ()
    faults.reach(FaultPoint.FORWARD)  # fired once


def test_a_step_redone_after_a_recovery_keeps_its_counts() -> None:
    arm(Fault(FaultPoint.REDUCE, FaultAction.RAISE, step=5, occurrence=2))
    faults.step_starts((0, 0), 5)
    faults.reach(FaultPoint.REDUCE)
    faults.step_starts((0, 0), 5)  # the same step, redone on the next generation
    with pytest.raises(RuntimeError, match="injected error in worker \\(0, 0\\) at reduce \\(step 5\\)"):
        faults.reach(FaultPoint.REDUCE)


def test_a_delay_slows_the_worker_and_lets_it_go_on() -> None:
    arm(Fault(FaultPoint.COMMIT, FaultAction.DELAY, step=7, delay_s=0.3))
    faults.step_starts((0, 0), 7)
    started = time.monotonic()
    faults.reach(FaultPoint.COMMIT)
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"occurrence": 0}, "count the point's occurrences from 1"),
        ({"action": "raise", "after_s": 1.0}, "only a kill or a stop can come later"),
        ({"after_s": -1.0}, "a delay must be >= 0"),
        ({"point": "forwrd"}, "'forwrd' is not a valid FaultPoint"),
    ],
)
def test_a_fault_that_cannot_happen_is_refused(fields: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Fault(**{"point": "forward", **fields})


DRILL = """
import sys, time
from lightning_oobleck.execution import faults
faults.step_starts((2, 1), 4)
print("started", flush=True)
faults.reach(faults.FaultPoint.STATE_COPY)
time.sleep(float(sys.argv[1]))
print("survived", flush=True)
"""


def _drill(fault: Fault, linger_s: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, FAULTS_ENV: json.dumps([fault.to_json()])}
    return subprocess.Popen(
        [sys.executable, "-c", DRILL, str(linger_s)], env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_drill_from_the_environment_kills_the_named_worker() -> None:
    """``OOBLECK_FAULTS`` arms every process of a job as it is submitted; only the named worker dies."""
    victim = _drill(Fault(FaultPoint.STATE_COPY, node=2, device=1, step=4))
    assert victim.wait(timeout=60) == -signal.SIGKILL  # importing torch: 16 s beside the suite's others
    other = _drill(Fault(FaultPoint.STATE_COPY, node=2, device=0, step=4))
    assert other.wait(timeout=60) == 0 and "survived" in other.communicate()[0]


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_kill_after_a_delay_comes_from_a_timer() -> None:
    proc = _drill(Fault(FaultPoint.STATE_COPY, step=4, after_s=0.5), linger_s=20)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    started = time.monotonic()
    assert proc.wait(timeout=15) == -signal.SIGKILL
    assert 0.3 < time.monotonic() - started < 10


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_stall_stops_the_process_silently() -> None:
    proc = _drill(Fault(FaultPoint.STATE_COPY, FaultAction.STALL, step=4), linger_s=0)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('[{"point": "forwrd"}]', "'forwrd' is not a valid FaultPoint"),
        ('[{"point": "forward", "nod": 1}]', "unexpected keyword argument 'nod'"),
        ('{"point": "forward"}', "not a JSON list of objects"),
        ("[{point: forward}]", "Expecting property name"),
    ],
)
def test_a_drill_the_workers_could_not_read_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, value: str, problem: str
) -> None:
    monkeypatch.setenv(FAULTS_ENV, value)
    with pytest.raises(ValueError, match=r"OOBLECK_FAULTS=.* is not a list of faults") as error:
        faults.from_environment()
    assert problem in str(error.value) and '\'[{"point": "backward"' in str(error.value)
    monkeypatch.setenv(FAULTS_ENV, '[{"point": "commit", "node": 2, "step": 4}]')
    assert faults.from_environment() == [Fault(FaultPoint.COMMIT, node=2, step=4)]
