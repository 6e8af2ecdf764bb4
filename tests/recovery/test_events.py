"""Recovery events: phase durations, the JSONL file, a real Lightning logger, and the timeline's errors."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_oobleck.cli import CliError, timeline
from lightning_oobleck.recovery import EventLog, Membership, RecoveryEvent, Worker, read_events


def test_a_recovery_reaches_the_jsonl_file_and_the_lightning_logger_with_its_phase_durations(
    tmp_path: Path,
) -> None:
    membership = Membership(
        3,
        (Worker(0, 0), Worker(2, 0)),
        removed=(Worker(1, 0),),
        cause="(1, 0) died",
        detected_at=100.0,
        agreed_at=100.25,
    )
    event = RecoveryEvent.from_membership(membership)
    event.failed_at = 99.5
    for phase, at in [("replanned", 100.5), ("rebuilt", 101.0), ("state_copied", 102.0), ("resumed", 104.0)]:
        event.mark(phase, at=at)
    event.copied_bytes, event.copy_senders = 3_000_000_000, 2
    logger = CSVLogger(tmp_path, name="run", version=0)
    log = EventLog(tmp_path / "events" / "run.jsonl", logger=logger)
    log.step(7, samples=32, duration_s=0.5, generation=2, at=99.0)
    log.recovery(event, step=8)
    log.step(8, samples=32, duration_s=0.6, generation=3, at=104.6)
    logger.save()

    expected = {
        "detected": 0.5,
        "agreed": 0.25,
        "replanned": 0.25,
        "rebuilt": 0.5,
        "state_copied": 1.0,
        "resumed": 2.0,
        "total": 4.5,
    }
    assert event.durations() == pytest.approx(expected)
    steps, (read_back,) = read_events(tmp_path / "events" / "run.jsonl")
    assert read_back == event and [s["step"] for s in steps] == [7, 8]
    assert read_back.copy_gb_per_s() == pytest.approx(3.0)  # 3 GB over the 1 s state_copied phase
    assert RecoveryEvent(generation=1).copy_gb_per_s() is None  # nothing copied: no speed
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["step"] == "8" and float(row["recovery/generation"]) == 3
    assert (float(row["recovery/nodes_lost"]), float(row["recovery/nodes_joined"])) == (1, 0)
    assert {k: float(row[f"recovery/{k}_s"]) for k in expected} == pytest.approx(expected)
    assert (float(row["recovery/copied_gb"]), float(row["recovery/copy_gb_per_s"])) == pytest.approx(
        (3.0, 3.0)
    )


def test_bad_inputs_get_errors_that_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown recovery phase 'copied'.*state_copied"):
        RecoveryEvent(generation=1).mark("copied")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"kind": "step"}\nnot json\n')
    with pytest.raises(ValueError, match=r"garbage\.jsonl:2 is not a JSON line"):
        read_events(garbage)

    parser = argparse.ArgumentParser()
    timeline.register(parser.add_subparsers())
    missing = parser.parse_args(["timeline", str(tmp_path / "missing.jsonl")])
    with pytest.raises(CliError, match="no event file"):
        missing.func(missing)
    one_step = tmp_path / "one.jsonl"
    EventLog(one_step).step(0, samples=8, duration_s=0.1, generation=0)
    short = parser.parse_args(["timeline", str(one_step)])
    with pytest.raises(CliError, match="1 step records: at least 2"):
        short.func(short)


def test_the_timeline_marks_a_join_with_the_throughput_before_and_after_the_switch(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "run.jsonl")
    for step in range(6):  # 32 samples per 0.5 s before the join, per 0.25 s after
        log.step(step, samples=32, duration_s=0.5, generation=1, at=10.0 + 0.5 * step)
    join = RecoveryEvent(generation=2, added=[[6, 0], [6, 1]], cause="(6, 0) joined; (6, 1) joined")
    join.detected_at, join.resumed_at = 12.6, 13.0
    log.recovery(join)
    for step in range(6, 12):  # the first step after the switch also waited for it: not the new rate
        log.step(
            step,
            samples=32,
            duration_s=0.65 if step == 6 else 0.25,
            generation=2,
            at=13.0 + 0.25 * (step - 5),
        )
    steps, recoveries = read_events(tmp_path / "run.jsonl")
    assert timeline._around(steps, 12.6, 13.0) == pytest.approx((64.0, 128.0))
    assert timeline.recovery_label(recoveries[0], steps, 12.6).splitlines() == [
        "generation 2",
        "node 6 joined",
        "in 0.40 s; 64 -> 128 samples/s",
    ]
    output = tmp_path / "run.png"
    timeline.draw_timeline(steps, recoveries, output)
    assert output.stat().st_size > 10_000


def test_the_timeline_names_the_way_chosen_and_the_candidates_it_was_chosen_from(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "run.jsonl")
    for step in range(12):  # a failure late in the run: its text goes left of the line
        log.step(step, samples=32, duration_s=0.5, generation=0 if step < 9 else 1, at=10.0 + 0.5 * step)
    failure = RecoveryEvent(generation=1, removed=[[2, 0]], recovery_policy="reroute", horizon_s=1800.0)
    failure.candidates = [
        "reinstantiate: 0.2 s/step after 0.3 s of copy, 2.88e+05 samples before the next failure",
        "reroute: 0.199 s/step after 0 s of copy, 2.89e+05 samples before the next failure",
    ]
    failure.detected_at, failure.resumed_at = 14.1, 14.4
    log.recovery(failure)
    steps, recoveries = read_events(tmp_path / "run.jsonl")
    label = timeline.recovery_label(recoveries[0], steps, 14.1).splitlines()
    assert label[:3] == ["generation 1", "lost node 2", "by reroute of:"]
    assert label[3:5] == [f"  {c}" for c in failure.candidates]
    output = tmp_path / "run.png"
    timeline.draw_timeline(steps, recoveries, output)
    assert output.stat().st_size > 10_000


def test_a_new_run_starts_the_file_and_a_later_writer_appends(tmp_path: Path) -> None:
    """A job that runs where an earlier one ran does not append to its records; the rank 0 that takes over
    after a failure continues this run's."""
    path = tmp_path / "run.jsonl"
    EventLog(path, new=True).step(1, samples=8, duration_s=0.1, generation=0)  # an earlier job
    EventLog(path, new=True).step(1, samples=8, duration_s=0.1, generation=0)  # this job's first rank 0
    EventLog(path).step(2, samples=8, duration_s=0.1, generation=1)  # its new rank 0, after a failure
    steps, _ = read_events(path)
    assert [(s["step"], s["generation"]) for s in steps] == [(1, 0), (2, 1)]


def test_the_last_recorded_step_is_read_from_the_end_of_a_long_file(tmp_path: Path) -> None:
    """A new rank 0 learns which steps its lost predecessor recorded from the file's end alone: the newest
    step record, behind later records of other kinds, however long the run was."""
    log = EventLog(tmp_path / "run.jsonl")
    assert log.last_step() == 0
    for step in range(1, 3001):
        log.step(step, samples=12, duration_s=0.01, generation=0)
    log.recovery(RecoveryEvent(generation=1, removed=[[1, 0]], added=[], cause="test"), step=3000)
    assert log.path.stat().st_size > 4 * (1 << 16)
    assert log.last_step() == 3000
