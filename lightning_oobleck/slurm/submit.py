"""Submit a training to SLURM with submitit so that it survives node crashes; wait; collect the survivors.

::

    from lightning_oobleck.slurm.config import SubmitConfig
    from lightning_oobleck.slurm.submit import collect, submit, wait

    config = SubmitConfig(nodes=4, gpus_per_node=8, time="12:00:00", script="examples/gpt/train.py")
    job = submit(config)                 # or submit(config, function=my_callable)
    wait(job, status_callback=print)
    result = collect(job)                # result.results: per surviving task; result.lost: lost tasks

The job runs with ``--no-kill --no-requeue`` and its step with ``srun --no-kill --kill-on-bad-exit=0
--wait=0``: a crashed node takes only its own tasks down, the job is neither cancelled nor requeued, and the
survivors' in-process recovery carries the training on. SLURM tells the survivors nothing and ``srun`` still
exits 0, so which tasks were lost is read here from accounting (the job's rows before and after it shrank)
and from the tasks that left no result. The rendezvous store and the recovery coordinator are started on the
batch host by the batch script's setup lines (see :mod:`lightning_oobleck.slurm.rendezvous`).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from lightning_oobleck.slurm import cluster, rendezvous
from lightning_oobleck.slurm.config import SECTION, SubmitConfig, SubmitConfigError
from lightning_oobleck.slurm.task import CHECK_ERROR, ScriptTask, end_file
from lightning_oobleck.slurm.task import MODULE as TASK_MODULE

FAULT_TOLERANT_SBATCH: dict[str, Any] = {"no-kill": True, "no-requeue": True}
"""Job options: a node failure neither cancels nor requeues the job (``{"requeue": False}`` would render
the invalid ``--requeue=False``)."""
FAULT_TOLERANT_SRUN: tuple[str, ...] = ("--no-kill", "--kill-on-bad-exit=0", "--wait=0")
"""Step options: the step survives a lost node, and no task is killed because another one ended."""
CHECK_LOG = "check.log"
"""The check's output (:func:`check_lines`), in the job's folder."""
RESULT_GRACE_S = 15.0
"""How long a finished job's surviving tasks may take to show their result files (slow shared filesystems)."""


@dataclass(frozen=True)
class JobStatus:
    """A snapshot for the live status line."""

    job_id: str
    state: str
    elapsed_s: float
    tasks_done: int
    num_tasks: int
    lost_nodes: tuple[str, ...]
    progress: str = ""
    """The training's last step line (``step 50/200 (epoch 0) loss=0.41 0.14 s/step``), if one was printed."""
    joined: str = ""
    """The last join the training reported (``node(s) 3 (node2) joined at step 196``), if any."""


@dataclass
class SubmitResult:
    """What became of each task of a finished job."""

    job_id: str
    state: str
    """SLURM's final job state (COMPLETED after a node loss too: the job shrank)."""
    nodes: tuple[str, ...]
    """The nodes the job started on."""
    results: dict[int, Any] = field(default_factory=dict)
    """Task id -> the value its function returned (0 for a script that ended normally)."""
    failed: dict[int, str] = field(default_factory=dict)
    """Task id -> the error it raised (its last line) and its log file."""
    lost: dict[int, str] = field(default_factory=dict)
    """Task id -> its node, for tasks that left no result (their node crashed, or the process was killed)."""
    lost_nodes: tuple[str, ...] = ()
    """Nodes SLURM took out of the job while it ran."""
    not_started: str | None = None
    """Why the job ended before its tasks started: the check's line (:func:`check_lines`), else ``None``."""
    ended_by_oobleck: str | None = None
    """Why oobleck cancelled the job, which SLURM could not end (its batch host was lost): the line it wrote
    in the job's output (the training completed on the surviving nodes, or could not go on)."""

    @property
    def succeeded(self) -> bool:
        """The training finished: some tasks returned. Tasks lost or failed on the way (a node crash, an
        error on one node) were survived by the others, which recovered without them."""
        return bool(self.results)


def submit(config: SubmitConfig, function: Callable[[], Any] | None = None) -> submitit.Job:
    """Check ``config`` against the cluster, then submit ``function`` (or ``config.script``) on every task.

    Raises :class:`SubmitConfigError` before submitting anything if the config is wrong or asks for more
    nodes than the partition has.
    """
    config.validate()
    task = _task(config, function)
    try:
        partition, size = cluster.partition_size(config.partition)
        gpus = cluster.partition_gpus(partition) if config.gpus_per_node else 0
    except cluster.SlurmError as e:
        raise SubmitConfigError(str(e)) from e
    if config.nodes > size:
        raise SubmitConfigError(
            f"{SECTION}.nodes={config.nodes} but partition '{partition}' has {size} nodes: "
            f"ask for at most {size} or choose another partition ({SECTION}.partition=...)"
        )
    if gpus < config.gpus_per_node:
        has = f"nodes of {gpus} GPUs" if gpus else "no GPUs"
        raise SubmitConfigError(
            f"{SECTION}.gpus_per_node={config.gpus_per_node} but partition '{partition}' has {has}: "
            f"ask for at most {gpus}{' (a CPU-only cluster)' if not gpus else ''} or choose another "
            f"partition ({SECTION}.partition=...)"
        )
    log_dir = Path(config.log_dir).absolute()
    executor = submitit.AutoExecutor(folder=log_dir / "%j", cluster="slurm")
    parameters: dict[str, Any] = {
        "name": config.job_name,
        "nodes": config.nodes,
        "tasks_per_node": config.num_tasks_per_node,
        "timeout_min": config.time_minutes,
        "slurm_partition": partition,
        "slurm_additional_parameters": {**config.sbatch, **FAULT_TOLERANT_SBATCH},
        "slurm_srun_args": [*FAULT_TOLERANT_SRUN, *config.srun_args],
        "slurm_setup": [
            *config.setup,
            *check_lines(config, log_dir),
            *rendezvous_setup_lines(log_dir, config),
        ],
    }
    if config.gpus_per_node:
        parameters["gpus_per_node"] = config.gpus_per_node
    executor.update_parameters(**parameters)
    before = set(log_dir.iterdir()) if log_dir.is_dir() else set()
    try:
        return executor.submit(task)
    except submitit.core.utils.FailedJobError as e:  # sbatch refused the job: its reason, nothing left behind
        for stray in set(log_dir.iterdir()) - before:
            if stray.is_file():
                stray.unlink()
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise cluster.SlurmError(f"sbatch refused the job: {lines[-1] if lines else e}") from None


def _task(config: SubmitConfig, function: Callable[[], Any] | None) -> Callable[[], Any]:
    """What every task runs: ``function``, or ``config.script`` with ``config.args`` (exactly one of them)."""
    if function is not None:
        if config.script is not None:
            raise SubmitConfigError(
                f"both a function and {SECTION}.script={config.script!r}: submit one of them"
            )
        return function
    if config.script is None:
        raise SubmitConfigError(f"nothing to run: set {SECTION}.script=path/to/train.py")
    if not Path(config.script).is_file():
        raise SubmitConfigError(
            f"{SECTION}.script={config.script!r} is not a file (paths are relative to here)"
        )
    script, *args = config.command
    return ScriptTask(script, tuple(args))


def check_lines(config: SubmitConfig, log_dir: Path) -> list[str]:
    """Batch-script lines that check the script on the batch host before the tasks start (see
    :func:`~lightning_oobleck.slurm.task.check_script`): the job ends there, in one line, with status 2, if it
    cannot start. A submitted function is not checked, nor is a script with ``check=False``."""
    if config.script is None or not config.check:
        return []
    log = shlex.quote(str(log_dir)) + f'/"$SLURM_JOB_ID"/{CHECK_LOG}'
    check = f"{shlex.quote(sys.executable)} -m {TASK_MODULE} --check --log {log} {shlex.join(config.command)}"
    return [f"{check} || exit 2"]


def rendezvous_setup_lines(log_dir: Path, config: SubmitConfig | None = None) -> list[str]:
    """Batch-script lines that start store and coordinator on the batch host, exporting their addresses; the
    join file they write records ``config``'s setup lines and script (what a join job runs)."""
    log = shlex.quote(str(log_dir)) + '/"$SLURM_JOB_ID"/rendezvous.log'
    start = f"{shlex.quote(sys.executable)} -m {rendezvous.MODULE} --detach --watch-pid $$ --log {log}"
    if config is not None:
        start += "".join(f" --setup {shlex.quote(line)}" for line in config.setup)
        if config.command:
            start += " -- " + shlex.join(config.command)
    return [f"oobleck_exports=$({start}) || exit 1", 'eval "$oobleck_exports"']


def status(job: submitit.Job, elapsed_s: float = 0.0) -> JobStatus:
    """The job's state from accounting, the nodes it lost so far and how many tasks have finished."""
    records = cluster.job_records(job.job_id)
    state = records[-1].state if records else "PENDING"
    lost = tuple(n for n in records[0].nodes if n not in records[-1].nodes) if records else ()
    done = sum(job.task(i).paths.result_pickle.exists() for i in range(job.num_tasks))
    progress, joined = training_progress(job)
    return JobStatus(job.job_id, state, elapsed_s, done, job.num_tasks, lost, progress, joined)


def training_progress(job: submitit.Job, tail_bytes: int = 16384) -> tuple[str, str]:
    """The last step line the training printed (by whichever task was rank 0) and its last join, from the
    ends of the tasks' output files (:class:`~lightning_oobleck.lightning.console.StepLines`)."""
    last, step, joined, joined_at = "", -1, "", -1
    for i in range(job.num_tasks):
        for path in (job.task(i).paths.stdout, job.task(i).paths.stderr):
            for line in _tail(path, tail_bytes):
                if match := _STEP_LINE.match(line):
                    if int(match.group(1)) >= step:
                        last, step = line.removeprefix("oobleck: "), int(match.group(1))
                elif (match := _JOIN_LINE.match(line)) and int(match.group(2)) >= joined_at:
                    joined, joined_at = match.group(1), int(match.group(2))
    return last, joined


_STEP_LINE = re.compile(r"^oobleck: step (\d+)")
_JOIN_LINE = re.compile(r"^oobleck: (node\(s\) .* joined at step (\d+))")


def _tail(path: Path, size: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, 2) - size, 0))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def wait(
    job: submitit.Job,
    status_callback: Callable[[JobStatus], None] | None = None,
    poll_interval_s: float = 2.0,
    timeout_s: float | None = None,
) -> str:
    """Poll until the job ends (a terminal state in accounting); return that state.

    ``status_callback`` gets a :class:`JobStatus` after every poll. ``timeout_s`` bounds the wait
    (:class:`TimeoutError`); the job's own time limit bounds it anyway once the job runs.
    """
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        snapshot = status(job, elapsed)
        if status_callback is not None:
            status_callback(snapshot)
        if snapshot.state in cluster.TERMINAL_STATES:
            return snapshot.state
        if timeout_s is not None and elapsed > timeout_s:
            raise TimeoutError(f"job {job.job_id} still {snapshot.state} after {timeout_s:.0f} s")
        time.sleep(poll_interval_s)


def collect(job: submitit.Job, grace_s: float = RESULT_GRACE_S) -> SubmitResult:
    """Each task's outcome for an ended job: returned, raised, or lost (no result; its node is named).

    Tasks on nodes the job lost are not waited for; the others get ``grace_s`` for their result files.
    """
    records = cluster.job_records(job.job_id)
    if not records or records[-1].state not in cluster.TERMINAL_STATES:
        raise RuntimeError(f"job {job.job_id} has not ended; call wait(job) first")
    started, final = records[0].nodes, records[-1].nodes
    check = job.paths.folder / CHECK_LOG
    verdict = check.read_text().splitlines()[-1:] if check.exists() else []
    if verdict and verdict[0].startswith(CHECK_ERROR):
        return SubmitResult(job.job_id, records[-1].state, started, not_started=verdict[0])
    lost_nodes = tuple(n for n in started if n not in final)
    # srun's block distribution; a job that never started has no nodes.
    tasks_per_node = max(job.num_tasks // max(len(started), 1), 1)
    node_of = {i: started[i // tasks_per_node] if started else "none" for i in range(job.num_tasks)}
    deadline = time.monotonic() + grace_s
    pending = [i for i in range(job.num_tasks) if node_of[i] not in lost_nodes]
    while any(not job.task(i).paths.result_pickle.exists() for i in pending) and time.monotonic() < deadline:
        time.sleep(0.5)
    result = SubmitResult(job.job_id, records[-1].state, started, lost_nodes=lost_nodes)
    if (end := end_file(job.paths.folder, job.job_id)).exists():
        result.ended_by_oobleck = json.loads(end.read_text())["reason"]
    for i in range(job.num_tasks):
        task = job.task(i)
        if not task.paths.result_pickle.exists():
            result.lost[i] = node_of[i]
        elif (error := task.exception()) is not None:
            result.failed[i] = f"{_last_trace_line(error)} (log: {task.paths.stderr})"
        else:
            result.results[i] = task.result()
    return result


def _last_trace_line(error: Exception) -> str:
    """The exception line of a task's traceback (submitit frames it between dashed rules)."""
    parts = str(error).split("-" * 22)
    trace = parts[1] if len(parts) >= 3 else str(error)
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
