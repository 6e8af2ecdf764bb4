"""Jobs on a real 3-node SLURM cluster training ``examples/gpt/train.py`` (tiny, float64, one task per node):
a normal run, a node crashed for real mid-run (submitit and sbatch), bad input refused before submission.

Every run must end with the weights of a single-process run on the same batches (``gpt_training.py``), to
1e-9: the survivors of a crash recover in process (no requeue, no restart), redo the interrupted step and
train on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from gpt_training import (
    CHECKPOINT,
    CRASH_AT_STEP,
    EXAMPLE,
    STEPS,
    VAL_BATCHES,
    events,
    full_model,
    held_training,
    training_args,
)
from slurm_cluster import REPO, Cluster, DownWatch

from lightning_oobleck import cli
from lightning_oobleck.cli import CliError
from lightning_oobleck.cli import submit as submit_cli
from lightning_oobleck.execution.checkpoint import load_sharded_model
from lightning_oobleck.slurm.cluster import TERMINAL_STATES, JobRecord, job_fields, job_records, run
from lightning_oobleck.slurm.config import SubmitConfig, SubmitConfigError
from lightning_oobleck.slurm.submit import collect, submit, wait

JOB_TIMEOUT_S = 150
HELD_STEP_S = 0.5
"""A crash test's step until the crash (:func:`~gpt_training.held_training`): 18 steps, 9 s, to see step
CRASH_AT_STEP and crash a node before the training ends."""
REFERENCE_TIMEOUT_S = 120

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The failure-free single-process run: its weights (reference.pt) and validation (reference-val.json)."""
    out = tmp_path_factory.mktemp("reference")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("gpt_training.py")), str(out)],
        capture_output=True, text=True, timeout=REFERENCE_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(reference_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the failure-free single-process run."""
    return torch.load(reference_dir / "reference.pt")


def _assert_reference_weights(out: Path, reference: dict[str, torch.Tensor]) -> None:
    """The run's final sharded checkpoint holds exactly the reference's weights (every parameter)."""
    full = full_model()
    load_sharded_model(out / CHECKPOINT, full)
    weights = full.state_dict()
    assert sorted(weights) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-9, msg=name)


def _cli(*argv: str) -> int:
    """``oobleck submit ARGV`` through the sub-command's own parser, as the dispatcher calls it."""
    parser = argparse.ArgumentParser(prog="oobleck")
    submit_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["submit", *argv])
    return args.func(args)


def _write_config(
    path: Path,
    out: Path,
    logs: Path,
    flags: Sequence[str] = (),
    overrides: Sequence[str] = (),
    **submit_keys: object,
) -> Path:
    args = [*flags, *training_args(out), *overrides]  # the overrides last: they win
    section = {"nodes": 3, "time": "00:05:00", "script": str(EXAMPLE), "args": args}
    section.update({"log_dir": str(logs), **submit_keys})
    path.write_text(
        json.dumps({"submit": {k: v for k, v in section.items() if v is not None}})
    )  # JSON is YAML
    return path


def _sbatch(workdir: Path, options: list[str], args: list[str]) -> subprocess.CompletedProcess[str]:
    """``sbatch --parsable OPTIONS slurm/oobleck.sbatch ARGS`` in ``workdir``, tasks on this interpreter."""
    return subprocess.run(
        ["sbatch", "--parsable", f"--chdir={workdir}", *options, str(REPO / "slurm/oobleck.sbatch"), *args],
        capture_output=True, text=True, timeout=90, check=False,
        env={**_without_thread_settings(), "OOBLECK_PYTHON": sys.executable},
    )  # fmt: skip


def _sbatch_until_done(workdir: Path, options: list[str], args: list[str]) -> tuple[str, int]:
    """:func:`_sbatch`, then the job's end (:func:`_wait_for_end`; ``sbatch --wait`` looks at 2 s and then
    at 10 s, and a job that ends in its check takes about 1 s): its id and its exit status."""
    done = _sbatch(workdir, options, args)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    _wait_for_end(job_id, timeout_s=90)
    return job_id, int(job_fields(job_id)["ExitCode"].split(":")[0])


def _without_thread_settings() -> dict[str, str]:
    """This environment without ``OMP_NUM_THREADS``: the tasks must limit their threads themselves."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def _all_job_ids() -> list[str]:
    return run(
        "sacct", "--allusers", "--allocations", "--noheader", "--starttime=2000-01-01", "-o", "JobID"
    ).split()


def _wait_for_step(out: Path, step: int, job_id: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e["kind"] == "step" and e["step"] >= step for e in events(out)):
            return
        records = job_records(job_id)
        if records and records[-1].state in TERMINAL_STATES:
            raise AssertionError(f"job {job_id} ended ({records[-1].state}) before step {step}")
        time.sleep(0.05)
    raise TimeoutError(f"training did not reach step {step} in {timeout_s:.0f} s")


def _crash_non_batch_node(
    cluster: Cluster, job_id: str, out: Path, hold: Path | None
) -> tuple[str, float, DownWatch]:
    """Once training has done CRASH_AT_STEP steps, crash a node of the job that is not its batch host; then
    let go of the training (``hold``: :func:`~gpt_training.held_training`; ``None``: the test holds it)."""
    _wait_for_step(out, CRASH_AT_STEP, job_id)
    victim = next(n for n in cluster.nodes if n != job_fields(job_id)["BatchHost"])
    watch = DownWatch(cluster, victim)
    crashed_at = cluster.crash(victim)
    if hold is not None:
        hold.unlink()
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


def _assert_no_process_outlives(job_id: str, timeout_s: float = 30.0) -> None:
    """No process of the job is left on any node (they all run on this machine), by PID: the tasks of the
    crashed node, the survivors, their children and the batch host's rendezvous included."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in environ and state != "Z":
                left.append(
                    (int(entry), Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")[:120])
                )
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes of job {job_id} outlive it: {left}"


def _assert_steps_once(out: Path) -> list[dict]:
    """Every optimizer step counted exactly once (a step interrupted by a crash is redone, not repeated)."""
    steps = [e for e in events(out) if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1)), "steps lost or repeated"
    return steps


def _assert_survived_crash(
    records: list[JobRecord], out: Path, victim: str, crashed_at: float, watch: DownWatch
) -> None:
    """Job shrank but was neither cancelled nor requeued; the survivors recovered in process, once, without
    the lost node, before SLURM called it DOWN, and trained every step."""
    assert records[-1].state == "COMPLETED"
    assert {r.state for r in records[:-1]} <= {"RESIZING"}, f"job was not just shrunk: {records}"
    assert records[0].nodes == ("node1", "node2", "node3")
    assert victim not in records[-1].nodes and len(records[-1].nodes) == 2
    steps = _assert_steps_once(out)
    (recovery,) = [e for e in events(out) if e["kind"] == "recovery"]
    lost_worker = [cluster_node_id(victim), 0]  # one task per node: the plan's worker (node id, device 0)
    assert recovery["removed"] == [lost_worker] and not recovery["added"]
    after = [e for e in steps if e["generation"] == recovery["generation"]]
    assert steps[0]["generation"] == 0 and CRASH_AT_STEP <= after[0]["step"] < STEPS, "not mid-run"
    watch.join(timeout=90)
    assert watch.down_at is not None, f"SLURM never declared {victim} DOWN"
    phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in recovery["durations"].items())
    print(
        f"\n[{victim} crashed near step {after[0]['step']}] "
        f"detected +{recovery['detected_at'] - crashed_at:.2f} s, "
        f"first step after recovery +{after[0]['time'] - crashed_at:.2f} s ({phases}); "
        f"SLURM: not responding +{(watch.not_responding_at or float('nan')) - crashed_at:.1f} s, "
        f"DOWN +{watch.down_at - crashed_at:.1f} s"
    )
    assert after[0]["time"] < watch.down_at, "training waited for SLURM to notice the crash"


def cluster_node_id(node: str) -> int:
    """SLURM_NODEID of ``node`` in a job on node1..node3 (the job's node index)."""
    return int(node.removeprefix("node")) - 1


@pytest.mark.timeout(240)
def test_oobleck_submit_trains_on_3_nodes_to_the_reference_weights_then_validates(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor], reference_dir: Path
) -> None:
    """A second entry point in the same tasks: ``fit``, then ``validate`` (its own plan and generations)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    before = set(_all_job_ids())
    validated = out / "validated.json"
    config = _write_config(
        tmp_path / "job.yaml",
        out,
        logs,
        flags=[f"--validate={validated}"],
        overrides=[f"trainer.limit_val_batches={VAL_BATCHES}"],
        time=None,
    )
    assert _cli(str(config), "submit.time=0:05:00", "submit.job_name=normal") == 0
    (job_id,) = set(_all_job_ids()) - before
    assert [r.state for r in job_records(job_id)] == ["COMPLETED"]
    assert sorted(p.name for p in (logs / job_id).glob("*_result.pkl")) == [
        f"{job_id}_{i}_result.pkl" for i in range(3)
    ]
    assert {e["generation"] for e in _assert_steps_once(out)} == {0}
    assert not [e for e in events(out) if e["kind"] == "recovery"]
    _assert_reference_weights(out, reference)
    expected = json.loads((reference_dir / "reference-val.json").read_text())
    assert json.loads(validated.read_text()) == pytest.approx(expected, rel=0, abs=1e-9)


@pytest.mark.timeout(180)
def test_oobleck_submit_exits_1_when_the_training_fails(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failing = tmp_path / "failing.py"  # passes the check on the batch host, fails in the tasks
    failing.write_text("import os, sys\nsys.exit(0 if os.environ.get('OOBLECK_PLAN_CHECK') else 3)\n")
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({"submit": {"nodes": 1, "time": "5", "script": str(failing)}}))
    assert _cli(str(config), f"submit.log_dir={tmp_path / 'logs'}") == 1
    assert f"task 0 failed: RuntimeError: {failing} exited with status 3" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_submitit_job_survives_its_batch_host_crash_and_reports_each_task(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Submitted with submitit, the job loses its batch host (task 0's node, the coordinator's) mid-run: the
    standby takes over and the training completes to the reference weights; ``collect`` reports the two
    survivors' results, task 0 lost on its node, and why SLURM shows the job CANCELLED (the coordinator that
    took over ended it, the training completed). A non-batch node's crash under submitit: the two-tasks
    test."""
    out = tmp_path / "out"
    out.mkdir()
    script, hold = held_training(tmp_path, HELD_STEP_S)
    config = SubmitConfig(
        nodes=3, time="5", log_dir=str(tmp_path / "logs"), job_name="crash-submitit",
        script=str(script), args=training_args(out),
    )  # fmt: skip
    job = submit(config)
    _wait_for_step(out, CRASH_AT_STEP, job.job_id)
    rendezvous_log = job.paths.folder / "rendezvous.log"
    _wait_for(lambda: "follows (node" in rendezvous_log.read_text(), "a standby coordinator", 60)
    batch_host = job_fields(job.job_id)["BatchHost"]
    watch = DownWatch(cluster, batch_host)
    cluster.crash(batch_host)
    hold.unlink()
    watch.start()
    try:
        assert wait(job, poll_interval_s=1.0, timeout_s=JOB_TIMEOUT_S) == "CANCELLED"
        result = collect(job)
        assert result.ended_by_oobleck is not None and "completed" in result.ended_by_oobleck
        assert result.lost == {0: batch_host} and result.succeeded and not result.failed
        assert sorted(result.results) == [1, 2]
        _assert_steps_once(out)
        _assert_reference_weights(out, reference)
    finally:
        watch.join(timeout=90)
        cluster.restart(batch_host)


@pytest.mark.timeout(300)
def test_an_exception_in_one_task_is_survived_and_reported_with_its_error(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Task 2 raises in its training step (a bug, out of memory): the strategy's ``on_exception`` reports
    it lost, the other two recover without it and end with the reference weights, and the job's result
    names the error."""
    out = tmp_path / "out"
    out.mkdir()
    args = [*training_args(out), "--kill-rank=2", f"--kill-at-step={CRASH_AT_STEP}", "--kill-by=exception"]
    config = SubmitConfig(
        nodes=3, time="5", log_dir=str(tmp_path / "logs"), job_name="exception",
        script=str(EXAMPLE), args=args,
    )  # fmt: skip
    job = submit(config)
    wait(job, poll_interval_s=1.0, timeout_s=JOB_TIMEOUT_S)
    result = collect(job)
    assert sorted(result.results) == [0, 1] and result.succeeded
    assert list(result.failed) == [2]
    assert f"RuntimeError: KillAt: an error in rank 2 at step {CRASH_AT_STEP}" in result.failed[2]
    steps = _assert_steps_once(out)
    (recovery,) = [e for e in events(out) if e["kind"] == "recovery"]
    assert recovery["removed"] == [[2, 0]] and not recovery["added"]
    assert next(e for e in steps if e["generation"] == recovery["generation"])["step"] == CRASH_AT_STEP + 1
    _assert_reference_weights(out, reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param([], id="reinstantiate"),
        # a pipeline of 2 stages on the batch host's node and one of 4 (a layer each) on the other two: the
        # crash of either of those leaves the second pipeline 2 surviving stages, the first the lost layers
        pytest.param(
            ["strategy.recovery_policy=reroute", "strategy.layout=[[0,2,4],[0,1,2,3,4]]"], id="reroute"
        ),
    ],
)
def test_two_tasks_per_node_survive_a_real_node_crash_with_the_reference_weights(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor], policy: list[str]
) -> None:
    """The README's multi-node shape on CPU: 3 nodes x 2 tasks, defaults (a node of the job is one failure
    domain, ``devices_per_node`` follows SLURM), a DataLoader worker per task. A node crash takes both of
    its tasks at once; the survivors recover in place (the planner's pipelines re-instantiated; or, with
    ``recovery_policy=reroute``, pipelines that span nodes keep their surviving stages and the lost stages'
    micro-batches run on the other pipeline's replicas, nothing copied) and end with the reference weights,
    and no process of the job (tasks, loader workers, the batch host's rendezvous) outlives it."""
    out = tmp_path / "out"
    out.mkdir()
    args = [*training_args(out), "trainer.devices=2", "trainer.num_nodes=3", "data.num_workers=1", *policy]
    script, hold = held_training(tmp_path, HELD_STEP_S)
    config = SubmitConfig(
        nodes=3, tasks_per_node=2, time="5", log_dir=str(tmp_path / "logs"), job_name="crash-2-tasks",
        script=str(script), args=args,
    )  # fmt: skip
    job = submit(config)
    victim, _, watch = _crash_non_batch_node(cluster, job.job_id, out, hold)
    try:
        assert wait(job, poll_interval_s=1.0, timeout_s=JOB_TIMEOUT_S) == "COMPLETED"
        _assert_steps_once(out)
        (recovery,) = [e for e in events(out) if e["kind"] == "recovery"]
        node = cluster_node_id(victim)
        assert sorted(recovery["removed"]) == [[node, 0], [node, 1]]
        if policy:
            assert recovery["recovery_policy"] == "reroute" and recovery["copied_bytes"] == 0, recovery
            assert recovery["fault_tolerance"] == 0, recovery  # a lost stage's layers: one replica left
            said = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*_log.*"))
            assert "2 pipelines (2 lost stages rerouted to replicas) on 2 nodes, f=0" in said, said[-3000:]
        _assert_reference_weights(out, reference)
        _assert_no_process_outlives(job.job_id)
    finally:
        watch.join(timeout=90)
        cluster.restart(victim)


@pytest.mark.timeout(300)
def test_sbatch_template_survives_a_real_node_crash_with_the_reference_weights(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script, hold = held_training(tmp_path, HELD_STEP_S)
    job_id = _sbatch(tmp_path, ["--nodes=3", "--time=5"], [str(script), *training_args(out)]).stdout.strip()
    victim, crashed_at, watch = _crash_non_batch_node(cluster, job_id, out, hold)
    try:
        records = _wait_for_end(job_id)
        _assert_survived_crash(records, out, victim, crashed_at, watch)
        # srun interleaves the tasks' output chunks: a multi-byte character (rich's tables) may be split.
        batch_log = (tmp_path / f"oobleck-{job_id}.out").read_text(errors="replace")
        assert re.search(r"rendezvous store \S+:\d+", batch_log), batch_log
        assert f"Node failure on {victim}" in batch_log
        assert "training step ended with status 0" in batch_log
        rendezvous_log = (tmp_path / f"oobleck-{job_id}-rendezvous.log").read_text()
        assert f"worker ({cluster_node_id(victim)}, 0) on {victim} declared dead" in rendezvous_log, (
            rendezvous_log
        )
        _assert_reference_weights(out, reference)
    finally:
        cluster.restart(victim)


@pytest.mark.timeout(300)
def test_a_crashed_batch_host_is_survived_and_the_job_ends_with_the_reference_weights(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """The batch host runs the batch script, srun, the active coordinator and a task; a task of another node
    started the standby. The batch host's node crashes mid-run (every process of it SIGKILLed at once) and
    SLURM is told it is DOWN: the standby takes over, the survivors recover without the batch host's task and
    train every step to the reference weights. SLURM cannot end the job without its batch script: the
    coordinator that took over ends it once the last task is done (CANCELLED), saying once in the job's
    output, and in ``oobleck-JOB-end.json``, that the training completed; no process of the job outlives
    it."""
    out = tmp_path / "out"
    out.mkdir()
    script, hold = held_training(tmp_path, HELD_STEP_S)
    job_id = _sbatch(tmp_path, ["--nodes=3", "--time=5"], [str(script), *training_args(out)]).stdout.strip()
    _wait_for_step(out, CRASH_AT_STEP, job_id)
    rendezvous_log = tmp_path / f"oobleck-{job_id}-rendezvous.log"
    _wait_for(lambda: "follows (node" in rendezvous_log.read_text(), "a standby coordinator", 60)
    batch_host = job_fields(job_id)["BatchHost"]
    watch = DownWatch(cluster, batch_host)
    crashed_at = cluster.crash(batch_host)
    hold.unlink()
    run("scontrol", "update", f"NodeName={batch_host}", "State=DOWN", "Reason=test-crash")
    watch.start()
    try:
        assert max(e["step"] for e in events(out) if e["kind"] == "step") < STEPS, "crashed after the end"
        records = _wait_for_end(job_id, timeout_s=JOB_TIMEOUT_S)
        assert records[-1].state == "CANCELLED", records  # by the coordinator that took over, at the end
        steps = _assert_steps_once(out)
        (failover,) = [e for e in events(out) if e["kind"] == "failover"]
        (recovery,) = [e for e in events(out) if e["kind"] == "recovery"]
        assert failover["epoch"] == 1 and recovery["removed"] == [[cluster_node_id(batch_host), 0]]
        after = [e for e in steps if e["generation"] == recovery["generation"]]
        print(
            f"\n[batch host {batch_host} crashed near step {after[0]['step']}] standby took over "
            f"+{failover['took_over_at'] - crashed_at:.2f} s, first step after recovery "
            f"+{after[0]['time'] - crashed_at:.2f} s"
        )
        _assert_reference_weights(out, reference)
        output = (tmp_path / f"oobleck-{job_id}.out").read_text(errors="replace")
        said = f"oobleck: job {job_id} completed: the training ended on the surviving nodes"
        assert output.count(said) == 1, output[-3000:]
        end = json.loads((tmp_path / f"oobleck-{job_id}-end.json").read_text())
        assert end["completed"] and said in end["reason"]
        assert not (tmp_path / f"oobleck-{job_id}-join.json").exists()  # nothing can join it any more
        _assert_no_process_outlives(job_id)
    finally:
        watch.join(timeout=90)  # brought back before SLURM called it DOWN, it would be called DOWN after
        cluster.restart(batch_host)


@pytest.mark.timeout(240)
def test_a_task_dying_before_it_registers_is_not_waited_for(
    cluster: Cluster, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """A task SIGKILLed during its imports, before its agent registers: srun tells no one, but the task's
    presence connection (``lightning_oobleck.slurm.task``) closes, so the other two start without its node
    at once (``plan_timeout_s`` is 300 s, longer than the job may take) and train to the reference weights."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "killed_on_node_2.py"
    script.write_text(
        "import os, runpy, signal, sys\n"
        "if os.environ['SLURM_NODEID'] == '2':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"sys.argv[0] = {str(EXAMPLE)!r}\n"
        f"sys.path.insert(0, {str(EXAMPLE.parent)!r})\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
    )
    job_id = _sbatch(tmp_path, ["--nodes=3", "--time=5"], [str(script), *training_args(out)]).stdout.strip()
    _wait_for_end(job_id, timeout_s=JOB_TIMEOUT_S)
    rendezvous_log = (tmp_path / f"oobleck-{job_id}-rendezvous.log").read_text()
    assert "worker (2, 0) on node3 declared dead before it registered: its process ended" in rendezvous_log, (
        rendezvous_log
    )
    steps = _assert_steps_once(out)
    assert {e["generation"] for e in steps} == {0}
    assert not [e for e in events(out) if e["kind"] == "recovery"]
    _assert_reference_weights(out, reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("submit.nodes=4", "submit.nodes=4 but partition 'debug' has 3 nodes"),
        ("submit.time=null", "submit.time is required"),
        ("submit.nodez=2", "unknown key 'submit.nodez' (did you mean 'nodes'?)"),
        ("submit.partition=gpu", "no partition 'gpu' on this cluster; choose one of: debug"),
        (
            "submit.gpus_per_node=2",
            "submit.gpus_per_node=2 but partition 'debug' has no GPUs: ask for at most 0",
        ),
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
def test_a_job_sbatch_refuses_is_one_line_and_leaves_no_files(cluster: Cluster, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    config = _write_config(
        tmp_path / "job.yaml", tmp_path / "out", logs, sbatch={"constraint": "nosuchfeature"}
    )
    with pytest.raises(CliError, match=r"^sbatch refused the job: .*[Ii]nvalid feature") as error:
        _cli(str(config))
    assert "\n" not in str(error.value)
    assert not [p for p in logs.rglob("*") if p.is_file()], "a refused submission left files"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("missing script", "oobleck: error: no training script missing.py in "),
        ("impossible fault tolerance", "lower the fault tolerance to 2 (OobleckStrategy(fault_tolerance=2)"),
        ("config typo", "unknown key 'fault_tolerence' in the strategy's configuration (OobleckConfig) "
         "(did you mean 'fault_tolerance'?)"),
    ],
)  # fmt: skip
def test_a_mistake_in_the_job_ends_it_in_one_line_before_the_tasks_start(
    cluster: Cluster, tmp_path: Path, mistake: str, message: str
) -> None:
    """What an HPC user gets wrong in a job script costs one line and exit status 2, found on the batch host
    before ``srun`` starts a task: no rendezvous, no training, no traceback per task."""
    out = tmp_path / "out"
    out.mkdir()
    args = {
        "missing script": ["missing.py", *training_args(out)],
        "impossible fault tolerance": [str(EXAMPLE), "--fault-tolerance", "3", *training_args(out)],
        "config typo": [str(EXAMPLE), *training_args(out), "strategy.fault_tolerence=1"],
    }[mistake]
    job_id, status = _sbatch_until_done(tmp_path, ["--nodes=3", "--time=5"], args)
    assert status == 2
    (line,) = (tmp_path / f"oobleck-{job_id}.out").read_text().splitlines()
    assert message in line, line
    assert not (tmp_path / f"oobleck-{job_id}-rendezvous.log").exists(), "the tasks' services started"
    assert not events(out), "training started"


@pytest.mark.timeout(180)
def test_oobleck_submit_reports_a_job_its_check_ended_in_one_line(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same check under ``oobleck submit``: the job ends before its tasks start, and the command says why
    in one line (status 2), not as tasks lost on healthy nodes."""
    out = tmp_path / "out"
    config = _write_config(
        tmp_path / "job.yaml", out, tmp_path / "logs", overrides=["strategy.fault_tolerence=1"]
    )
    assert _cli(str(config)) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "before its tasks started" in line]
    assert "(did you mean 'fault_tolerance'?)" in line
    assert "lost" not in err


@pytest.mark.timeout(60)
def test_unquoted_time_in_yaml_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    """YAML reads ``time: 12:00:00`` as 43200 (base 60): that must not become a 30-day limit."""
    before = _all_job_ids()
    config = tmp_path / "job.yaml"
    config.write_text(f"submit:\n  nodes: 1\n  time: 12:00:00\n  script: {EXAMPLE}\n")
    with pytest.raises(SubmitConfigError, match=re.escape('quote submit.time, e.g. time: "12:00:00"')):
        _cli(str(config))
    assert _all_job_ids() == before


@pytest.mark.timeout(120)
def test_sbatch_template_refuses_to_run_without_a_time_limit(cluster: Cluster, tmp_path: Path) -> None:
    job_id, status = _sbatch_until_done(tmp_path, ["--nodes=1"], [str(EXAMPLE), *training_args(tmp_path)])
    assert status == 2
    assert "no time limit; submit with --time=HH:MM:SS" in (tmp_path / f"oobleck-{job_id}.out").read_text()
    assert not events(tmp_path), "training ran without a time limit"


@pytest.mark.timeout(420)
def test_a_crashed_node_comes_back_and_joins_the_running_training(
    cluster: Cluster,
    tmp_path: Path,
    reference: dict[str, torch.Tensor],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3-node job (``slurm/oobleck.sbatch``) loses a node; SLURM marks it DOWN; its daemon is restarted and
    ``oobleck join JOBID --nodes 1 -- SCRIPT ARGS`` submits a second job, whose task joins at a step boundary
    as node 3: the training grows back to 3 nodes, both jobs complete, every step counts once and the
    weights equal the failure-free run's. No task, the joiner included, runs more than one thread, and the
    batch output reads as a log (Lightning's progress bar on). While the node is away each step idles
    (``HOLD``) so that the run does not end before SLURM, the restart and a cold start of the joiner are
    through."""
    out, threads = tmp_path / "out", tmp_path / "threads"
    out.mkdir()
    threads.mkdir()
    record_threads = (
        "import torch\n"
        f"open(os.path.join({str(threads)!r}, os.environ['SLURM_JOB_ID'] + '.' + os.environ['SLURM_PROCID']),"
        " 'w').write(str(torch.get_num_threads()))\n"
    )
    script, hold = held_training(tmp_path, 3.0, record_threads, held=False)
    # Lightning's progress bar on, as users leave it: the batch output must still read as plain lines.
    command = [str(script), *training_args(out), "trainer.enable_progress_bar=true"]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the join job inherits this environment
    job_id = _sbatch(tmp_path, ["--nodes=3", "--time=8"], command).stdout.strip()
    _wait_for_step(out, 2, job_id)
    hold.touch()
    victim, _, watch = _crash_non_batch_node(cluster, job_id, out, None)
    join_id = None
    try:
        _wait_for(lambda: [e for e in events(out) if e["kind"] == "recovery"], "the survivors' recovery")
        watch.join(timeout=90)
        assert watch.down_at is not None, f"SLURM never declared {victim} DOWN"
        cluster.restart(victim)
        assert cli.main(["join", job_id, "--nodes", "1", "--", *command]) == 0  # as the README writes it
        submitted = re.search(
            rf"submitted job (\d+): 1 node\(s\) join the training of job {job_id}", capsys.readouterr().out
        )
        assert submitted is not None
        join_id = submitted.group(1)
        joined = _wait_for(
            lambda: [e for e in events(out) if e["kind"] == "recovery" and e["added"]], "the join", 180
        )
        hold.unlink()
        records, join_records = _wait_for_end(job_id), _wait_for_end(join_id)
    finally:
        hold.unlink(missing_ok=True)
        if join_id is not None:
            subprocess.run(["scancel", join_id], check=False, timeout=30)
    assert records[-1].state == "COMPLETED" and join_records[-1].state == "COMPLETED"
    assert len(join_records[-1].nodes) == 1  # a job of its own (the test cluster shares its nodes' CPUs)
    (failure,) = [e for e in events(out) if e["kind"] == "recovery" and e["removed"]]
    assert failure["removed"] == [[cluster_node_id(victim), 0]]
    (join,) = joined
    assert join["added"] == [[3, 0]] and not join["removed"]  # a new node id: not SLURM's node index
    assert join["fault_tolerance"] == 1 and not join["warnings"]
    survivors = sorted({0, 1, 2} - {cluster_node_id(victim)})
    grown = f"generation {join['generation']} announced: [({survivors[0]}, 0), ({survivors[1]}, 0), (3, 0)]"
    assert grown in (tmp_path / f"oobleck-{job_id}-rendezvous.log").read_text()  # 3 nodes again
    steps = _assert_steps_once(out)
    assert steps[-1]["generation"] == join["generation"]
    join_file = tmp_path / f"oobleck-{job_id}-join.json"
    _wait_for(lambda: not join_file.exists(), "the join file's removal once the job ended", 15)
    join_log = (tmp_path / f"oobleck-join-{job_id}-{join_id}.out").read_text(errors="replace")
    assert f"joins job {job_id}'s training" in join_log
    _assert_reference_weights(out, reference)
    # One thread per task without OMP_NUM_THREADS, the joiner's included (JOBID.PROCID: thread count).
    counts = {path.name: path.read_text() for path in threads.iterdir()}
    assert sorted(counts) == sorted([f"{job_id}.0", f"{job_id}.1", f"{job_id}.2", f"{join_id}.0"]), counts
    assert set(counts.values()) == {"1"}, counts
    # The batch output reads as a log: plain step lines, the crashed host named, one "done" line.
    batch_log = (tmp_path / f"oobleck-{job_id}.out").read_text(errors="replace")
    assert "\x1b[" not in batch_log and "\r" not in batch_log, "progress-bar frames in the batch output"
    assert f"node(s) {cluster_node_id(victim)} ({victim}) lost at step" in batch_log, batch_log[-3000:]
    assert re.search(rf"oobleck: step {STEPS}/{STEPS} \(epoch \d+\) ", batch_log), batch_log[-3000:]
    assert batch_log.count("done: ") == 1


def _wait_for(condition: Any, what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise TimeoutError(f"no {what} in {timeout_s:.0f} s")
