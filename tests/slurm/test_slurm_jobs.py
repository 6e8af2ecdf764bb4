"""Jobs on a real 3-node SLURM cluster: a normal run, a node crashed for real mid-run (submitit and sbatch),
bad input refused before submission.

The training is the stand-in in ``standin_training.py`` (gloo all-reduce steps that re-form their group
without a lost rank); to run the real example instead, point ``TRAINING`` at ``examples/gpt/train.py``
with its arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import standin_training
from slurm_cluster import REPO, STANDIN, Cluster, DownWatch

from lightning_oobleck.cli import submit as submit_cli
from lightning_oobleck.slurm.cluster import TERMINAL_STATES, JobRecord, job_records, run
from lightning_oobleck.slurm.config import SubmitConfig, SubmitConfigError
from lightning_oobleck.slurm.submit import collect, submit, wait

STEPS = 40
STEP_S = 0.25
CRASH_AT_STEP = 8
TRAINING = [str(STANDIN), "--steps", str(STEPS), "--step-s", str(STEP_S)]
"""The script each task runs, with its arguments (``--out DIR`` is added per test)."""
JOB_TIMEOUT_S = 150

pytestmark = pytest.mark.slurm


def _cli(*argv: str) -> int:
    """``oobleck submit ARGV`` through the sub-command's own parser, as the dispatcher calls it."""
    parser = argparse.ArgumentParser(prog="oobleck")
    submit_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["submit", *argv])
    return args.func(args)


def _write_config(path: Path, out: Path, logs: Path, **submit_keys: object) -> Path:
    section = {
        "nodes": 3,
        "time": "00:05:00",
        "script": TRAINING[0],
        "args": [*TRAINING[1:], "--out", str(out)],
    }
    section.update({"log_dir": str(logs), **submit_keys})
    path.write_text(
        json.dumps({"submit": {k: v for k, v in section.items() if v is not None}})
    )  # JSON is YAML
    return path


def _sbatch(workdir: Path, options: list[str], args: list[str]) -> subprocess.CompletedProcess[str]:
    """``sbatch --parsable OPTIONS slurm/oobleck.sbatch ARGS`` in ``workdir``, tasks on this interpreter."""
    return subprocess.run(
        ["sbatch", "--parsable", f"--chdir={workdir}", *options, str(REPO / "slurm/oobleck.sbatch"), *args],
        capture_output=True, text=True, env={**os.environ, "OOBLECK_PYTHON": sys.executable}, timeout=90,
        check=False,
    )  # fmt: skip


def _all_job_ids() -> list[str]:
    return run(
        "sacct", "--allusers", "--allocations", "--noheader", "--starttime=2000-01-01", "-o", "JobID"
    ).split()


def _wait_for_progress(out: Path, step: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with_progress = out / "progress"
        if with_progress.exists() and int(with_progress.read_text() or -1) >= step:
            return
        time.sleep(0.1)
    raise TimeoutError(f"training did not reach step {step} in {timeout_s:.0f} s")


def _crash_non_batch_node(cluster: Cluster, job_id: str, out: Path) -> tuple[str, float, DownWatch]:
    """Once training is at CRASH_AT_STEP, crash a node of the job that is not its batch host."""
    _wait_for_progress(out, CRASH_AT_STEP)
    fields = dict(
        t.split("=", 1) for t in run("scontrol", "show", "job", job_id, "--oneliner").split() if "=" in t
    )
    victim = next(n for n in cluster.nodes if n != fields["BatchHost"])
    watch = DownWatch(cluster, victim)
    crashed_at = cluster.crash(victim)
    watch.start()
    return victim, crashed_at, watch


def _wait_for_end(job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> list[JobRecord]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = job_records(job_id)
        if records and records[-1].state in TERMINAL_STATES:
            return records
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not end in {timeout_s:.0f} s")


def _assert_steps_exact(logs: dict[int, dict], lost_rank: int | None) -> None:
    """Every survivor completed each step once; each all-reduce summed exactly the ranks of its group."""
    for rank, log in logs.items():
        entries = log["log"]
        assert [e["step"] for e in entries] == list(range(STEPS)), f"rank {rank} lost or repeated steps"
        for e in entries:
            assert e["sum"] == sum(m + 1 for m in e["members"]), (
                f"rank {rank} step {e['step']}: wrong group sum"
            )
        if lost_rank is None:
            assert all(e["members"] == [0, 1, 2] for e in entries)
        else:
            before = [e for e in entries if lost_rank in e["members"]]
            after = [e for e in entries if lost_rank not in e["members"]]
            assert before and after and before[-1]["step"] < after[0]["step"], "the crash was not mid-run"
            assert all(e["members"] == sorted({0, 1, 2} - {lost_rank}) for e in after)


def _assert_survived_crash(
    records: list[JobRecord],
    logs: dict[int, dict],
    victim: str,
    crashed_at: float,
    ended_at: float,
    watch: DownWatch,
) -> None:
    """Job shrank but was neither cancelled nor requeued; survivors recovered before SLURM called it DOWN."""
    assert records[-1].state == "COMPLETED"
    assert {r.state for r in records[:-1]} <= {"RESIZING"}, f"job was not just shrunk: {records}"
    assert records[0].nodes == ("node1", "node2", "node3")
    assert victim not in records[-1].nodes and len(records[-1].nodes) == 2
    lost_rank = int(victim.removeprefix("node")) - 1  # one task per node, block distribution
    assert sorted(logs) == sorted({0, 1, 2} - {lost_rank})
    _assert_steps_exact(logs, lost_rank)
    watch.join(timeout=90)
    assert watch.down_at is not None, f"SLURM never declared {victim} DOWN"
    first_step_after = min(
        e["t"] for log in logs.values() for e in log["log"] if lost_rank not in e["members"]
    )
    print(
        f"\n[{victim} crashed] first step after recovery +{first_step_after - crashed_at:.2f} s; "
        f"SLURM: not responding +{(watch.not_responding_at or float('nan')) - crashed_at:.1f} s, "
        f"DOWN +{watch.down_at - crashed_at:.1f} s; job seen ended +{ended_at - crashed_at:.1f} s"
    )
    assert first_step_after < watch.down_at, "training waited for SLURM to notice the crash"


def _rank_logs(out: Path) -> dict[int, dict]:
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.timeout(240)
def test_oobleck_submit_runs_a_3_node_job_to_completion(cluster: Cluster, tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    before = set(_all_job_ids())
    config = _write_config(tmp_path / "job.yaml", out, logs, time=None)
    assert _cli(str(config), "submit.time=0:05:00", "submit.job_name=normal") == 0
    (job_id,) = set(_all_job_ids()) - before
    records = job_records(job_id)
    assert [r.state for r in records] == ["COMPLETED"]
    rank_logs = _rank_logs(out)
    assert sorted(rank_logs) == [0, 1, 2]
    assert {log["node"] for log in rank_logs.values()} == {"node1", "node2", "node3"}
    _assert_steps_exact(rank_logs, lost_rank=None)
    assert sorted(p.name for p in (logs / job_id).glob("*_result.pkl")) == [
        f"{job_id}_{i}_result.pkl" for i in range(3)
    ]


@pytest.mark.timeout(180)
def test_oobleck_submit_exits_1_when_the_training_fails(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({"submit": {"nodes": 1, "time": "5", "script": str(failing)}}))
    assert _cli(str(config), f"submit.log_dir={tmp_path / 'logs'}") == 1
    assert f"task 0 failed: RuntimeError: {failing} exited with status 3" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_submitit_job_survives_a_real_node_crash(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cloudpickle.register_pickle_by_value(standin_training)  # the task need not import the tests
    config = SubmitConfig(nodes=3, time="5", log_dir=str(tmp_path / "logs"), job_name="crash-submitit")
    job = submit(config, functools.partial(standin_training.train, STEPS, STEP_S, str(out)))
    victim, crashed_at, watch = _crash_non_batch_node(cluster, job.job_id, out)
    try:
        assert wait(job, poll_interval_s=1.0, timeout_s=JOB_TIMEOUT_S) == "COMPLETED"
        ended_at = time.time()
        result = collect(job)
        _assert_survived_crash(job_records(job.job_id), result.results, victim, crashed_at, ended_at, watch)
        lost_rank = int(victim.removeprefix("node")) - 1
        assert result.lost == {lost_rank: victim} and result.lost_nodes == (victim,)
        assert result.succeeded and not result.failed
        assert {r["node"] for r in result.results.values()} == set(cluster.nodes) - {victim}
    finally:
        cluster.restart(victim)


@pytest.mark.timeout(300)
def test_sbatch_template_survives_a_real_node_crash(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job_id = _sbatch(tmp_path, ["--nodes=3", "--time=5"], [*TRAINING, "--out", str(out)]).stdout.strip()
    victim, crashed_at, watch = _crash_non_batch_node(cluster, job_id, out)
    try:
        records = _wait_for_end(job_id)
        _assert_survived_crash(records, _rank_logs(out), victim, crashed_at, time.time(), watch)
        batch_log = (tmp_path / f"oobleck-{job_id}.out").read_text()
        assert re.search(r"rendezvous store \S+:\d+", batch_log), batch_log
        assert f"Node failure on {victim}" in batch_log
        assert "training step ended with status 0" in batch_log
    finally:
        cluster.restart(victim)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("submit.nodes=4", "submit.nodes=4 but partition 'debug' has 3 nodes"),
        ("submit.time=null", "submit.time is required"),
        ("submit.nodez=2", "unknown key 'submit.nodez' (did you mean 'nodes'?)"),
        ("submit.partition=gpu", "no partition 'gpu' on this cluster; choose one of: debug"),
    ],
)
def test_bad_input_is_refused_before_submission(
    cluster: Cluster, tmp_path: Path, override: str, message: str
) -> None:
    before = _all_job_ids()
    config = _write_config(tmp_path / "job.yaml", tmp_path / "out", tmp_path / "logs")
    with pytest.raises(SubmitConfigError) as error:
        _cli(str(config), override)
    assert message in str(error.value)
    assert _all_job_ids() == before, "a job was submitted despite the error"


@pytest.mark.timeout(60)
def test_unquoted_time_in_yaml_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    """YAML reads ``time: 12:00:00`` as 43200 (base 60): that must not become a 30-day limit."""
    before = _all_job_ids()
    config = tmp_path / "job.yaml"
    config.write_text(f"submit:\n  nodes: 1\n  time: 12:00:00\n  script: {STANDIN}\n")
    with pytest.raises(SubmitConfigError, match=re.escape('quote submit.time, e.g. time: "12:00:00"')):
        _cli(str(config))
    assert _all_job_ids() == before


@pytest.mark.timeout(120)
def test_sbatch_template_refuses_to_run_without_a_time_limit(cluster: Cluster, tmp_path: Path) -> None:
    done = _sbatch(tmp_path, ["--wait", "--nodes=1"], [str(STANDIN), "--steps", "1", "--out", str(tmp_path)])
    job_id = done.stdout.strip()
    assert done.returncode == 2
    assert "no time limit; submit with --time=HH:MM:SS" in (tmp_path / f"oobleck-{job_id}.out").read_text()
    assert not list(tmp_path.glob("rank*.json")), "training ran without a time limit"
