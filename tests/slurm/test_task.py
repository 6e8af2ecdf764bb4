"""What a SLURM task decides when its training failed: whether the job's batch host, which runs the
coordinator and the store, is gone (then it ends the job; ``test_slurm_jobs.py`` crashes a real batch host).
Real coordinators and agents on loopback; no SLURM needed."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

import pytest

from lightning_oobleck.recovery import Coordinator, WorkerAgent
from lightning_oobleck.recovery import agent as agent_module
from lightning_oobleck.recovery.agent import CoordinatorLost, lost_coordinator
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import ADDRESS_ENV
from lightning_oobleck.slurm import task as task_module
from lightning_oobleck.slurm.task import _append_once, batch_host_lost


def test_a_failed_task_sees_its_batch_host_lost_only_when_the_coordinator_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user's error with the coordinator alive is no loss; a coordinator that takes no connection is, even
    when the task's agent was closed before it noticed (it then recorded nothing)."""
    monkeypatch.setattr(agent_module, "_lost_coordinator", None)
    coordinator = Coordinator(1, "127.0.0.1").start()
    monkeypatch.setenv(ADDRESS_ENV, coordinator.address)
    try:
        assert batch_host_lost() is None
    finally:
        coordinator.stop()
    lost = batch_host_lost()
    assert isinstance(lost, CoordinatorLost)
    assert f"lost the oobleck coordinator at {coordinator.address}" in str(lost)
    monkeypatch.delenv(ADDRESS_ENV)
    assert batch_host_lost() is None  # not a task of a job with a coordinator


def test_the_loss_an_agent_saw_is_kept_for_the_task_after_the_agent_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_module, "_lost_coordinator", None)
    coordinator = Coordinator(1, "127.0.0.1", settings=MembershipSettings(heartbeat_timeout=5.0)).start()
    agent = WorkerAgent((0, 0), coordinator.address).start()
    try:
        agent.agree(after=-1, timeout=5.0)
        assert lost_coordinator() is None
        coordinator.stop()
        assert agent.abort.wait(5.0), "the agent did not see its coordinator lost"
    finally:
        agent.close(finished=False)
    monkeypatch.setenv(ADDRESS_ENV, coordinator.address)
    seen = lost_coordinator()
    assert isinstance(seen, CoordinatorLost) and batch_host_lost() is seen
    assert "it closed the connection" in str(seen)


def test_the_reason_is_written_once_and_a_held_lock_is_waited_for_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several tasks end the job: the job's output gets the reason once; a lock held elsewhere (a stalled
    file system) costs the line, never the cancel that follows it."""
    output = tmp_path / "oobleck-1.out"
    output.write_text("training output\n")
    for _ in range(2):
        _append_once(output, "oobleck: job 1 ends now: lost the oobleck coordinator")
    assert output.read_text().count("job 1 ends now") == 1
    monkeypatch.setattr(task_module, "_PROBE_TIMEOUT_S", 0.2)
    with open(output) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        _append_once(output, "oobleck: job 2 ends now: lost the oobleck coordinator")
        assert time.monotonic() - started < 5.0
    assert "job 2" not in output.read_text()
