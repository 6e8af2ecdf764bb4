"""Nodes that come back join a running SLURM job's training as a job of their own: ``oobleck join JOBID``.

The running job's rendezvous process (:mod:`~lightning_oobleck.slurm.rendezvous`) writes a *join file*,
``oobleck-JOBID-join.json`` in the job's working directory, readable by its user only (mode 0600): the
store's and the coordinator's addresses, the job's secret, the tasks per node and the training command.
``oobleck join JOBID`` reads it and submits a job on the returned (or spare) nodes whose tasks run that
command as joiners (``OOBLECK_NODE_KEY=JOINJOB.NODEID``: the coordinator gives them new node ids); they wait
to be admitted at a step boundary and train on with the running job. The running job keeps its own
allocation (no ``scontrol update`` of its nodes, no ``permit_job_expansion``): the cluster shows two jobs.
When the training ends, the join job's tasks end too, with status 0, admitted or not.

``slurm/oobleck-join.sbatch`` is the same as a batch script (``sbatch ... slurm/oobleck-join.sbatch
JOINFILE [SCRIPT ARGS]``); both run ``python -m lightning_oobleck.slurm.join JOINFILE [SCRIPT ARGS]`` on
the join job's batch host, which starts the ``srun`` step.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_oobleck.recovery.protocol import ADDRESS_ENV, SECRET_ENV
from lightning_oobleck.slurm.cluster import SlurmError, run
from lightning_oobleck.slurm.task import MODULE as TASK_MODULE

MODULE = "lightning_oobleck.slurm.join"
STORE_ADDR_VAR = "OOBLECK_STORE_ADDR"
SRUN = ("srun", "--no-kill", "--kill-on-bad-exit=0", "--wait=0", "--unbuffered")
"""The join step: like the training's (a lost task does not end the others), see ``slurm/oobleck.sbatch``."""


@dataclass(frozen=True)
class JoinInfo:
    """What a join job needs of the running job (the join file's content)."""

    job_id: str
    store: str
    coordinator: str
    secret: str
    tasks_per_node: int
    command: tuple[str, ...]
    """The training script and its arguments, as the running job's tasks run them (empty: not known)."""
    setup: tuple[str, ...] = ()
    """Shell lines the running job ran before its tasks (``submit.setup``: modules, environment); a join
    job runs them too, so that its tasks train in the same environment."""


def join_file(workdir: str | Path, job_id: str) -> Path:
    """Where job ``job_id`` (working directory ``workdir``) keeps its join file."""
    return Path(workdir) / f"oobleck-{job_id}-join.json"


def write_join_file(path: Path, info: JoinInfo) -> None:
    """Write ``info`` to ``path``, readable and writable by this user only (it holds the job's secret)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(info), f)


def read_join_file(path: str | Path) -> JoinInfo:
    path = Path(path)
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise SlurmError(
            f"no join file {path}: the job is not running an oobleck training, or it has ended"
        ) from None
    return JoinInfo(**{**fields, "command": tuple(fields["command"]), "setup": tuple(fields["setup"])})


def submit_join(
    job_id: str,
    nodes: int,
    *,
    time_limit: str | None = None,
    command: Sequence[str] = (),
    sbatch_options: Sequence[str] = (),
) -> str:
    """Submit the join job of running job ``job_id`` on ``nodes`` nodes; return its id.

    ``time_limit``: the join job's ``--time`` (default: what the running job has left, so that the join job
    does not outlive it). ``command``: the training script and arguments (default: the running job's).
    """
    fields = _job_fields(job_id)
    if fields.get("JobState") != "RUNNING":
        raise SlurmError(f"job {job_id} is {fields.get('JobState', 'unknown')}, not RUNNING: nothing to join")
    path = join_file(fields["WorkDir"], job_id)
    info = read_join_file(path)
    if not (command or info.command):
        raise SlurmError(
            f"job {job_id} did not record its training command (submitted with submitit): pass it, "
            "`oobleck join JOBID -- SCRIPT [ARGS]`"
        )
    limit = time_limit or _time_left(fields)
    wrapped = "\n".join([*info.setup, shlex.join([sys.executable, "-m", MODULE, str(path), *command])])
    out = run(
        "sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={info.tasks_per_node}",
        f"--time={limit}", f"--chdir={fields['WorkDir']}", f"--job-name=oobleck-join-{job_id}",
        f"--output=oobleck-join-{job_id}-%j.out", "--no-kill", "--no-requeue", *sbatch_options,
        f"--wrap={wrapped}",
    )  # fmt: skip
    return out.strip().split(";")[0]


def _job_fields(job_id: str) -> dict[str, str]:
    text = run("scontrol", "show", "job", job_id, "--oneliner")
    return dict(token.split("=", 1) for token in text.split() if "=" in token)


def _time_left(fields: dict[str, str]) -> str:
    """What the running job has left of its time limit, as ``--time=MINUTES``."""
    end = time.mktime(time.strptime(fields["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    minutes = int((end - time.time()) // 60)
    if minutes < 1:
        raise SlurmError(f"job {fields.get('JobId')} ends in less than a minute: too late to join it")
    return str(minutes)


def run_join_step(path: str | Path, command: Sequence[str]) -> None:
    """On the join job's batch host: start the ``srun`` step whose tasks join the training (never returns)."""
    info = read_join_file(path)
    command = tuple(command) or info.command
    os.environ.update({STORE_ADDR_VAR: info.store, ADDRESS_ENV: info.coordinator, SECRET_ENV: info.secret})
    print(
        f"oobleck join: job {os.environ.get('SLURM_JOB_ID', '?')} joins job {info.job_id}'s training "
        f"(coordinator {info.coordinator}): {shlex.join(command)}",
        flush=True,
    )
    python = os.environ.get("OOBLECK_PYTHON", sys.executable)
    os.execvp(SRUN[0], [*SRUN, python, "-m", TASK_MODULE, "--join", *command])


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_oobleck.slurm.join JOINFILE [SCRIPT ARGS]``: :func:`run_join_step`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(f"usage: python -m {MODULE} JOINFILE [SCRIPT ARGS]")
    try:
        run_join_step(argv[0], argv[1:])
    except SlurmError as e:
        sys.exit(f"oobleck join: error: {e}")


if __name__ == "__main__":
    main()
