"""``oobleck submit CONFIG.yaml [submit.KEY=VALUE ...]``: run a training on SLURM, survive node crashes.

Submits the config's ``submit:`` section (:class:`~lightning_oobleck.slurm.config.SubmitConfig`) with
submitit, shows a live status line until the job ends, then a table of what became of each task. Exit status:
0 when the training finished (nodes lost or failed on the way included), 1 when it failed, 2 for bad input
(nothing submitted, or the job's check on its batch host ended it before its tasks started).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from lightning_oobleck.cli import CliError
from lightning_oobleck.slurm.cluster import SlurmError
from lightning_oobleck.slurm.config import load_submit_config
from lightning_oobleck.slurm.submit import JobStatus, SubmitResult, collect, submit, wait


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``oobleck submit`` to the ``oobleck`` command."""
    parser = subparsers.add_parser(
        "submit",
        help="submit a training to SLURM (survives node crashes)",
        description="Submit a training to SLURM with submitit, wait for it with a live status line, report "
        "each task. The job survives node crashes (--no-kill, no requeue).",
    )
    parser.add_argument("config", help="YAML file with a 'submit:' section")
    parser.add_argument("overrides", nargs="*", help="overrides such as submit.nodes=4 submit.time=02:00:00")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Submit, wait with a live status line, report each task; 0 if the training finished, else 1."""
    config = load_submit_config(args.config, args.overrides)
    console = Console(stderr=True)
    try:
        job = submit(config)
    except SlurmError as e:
        raise CliError(str(e)) from e
    console.print(
        f"submitted job {job.job_id}: {config.nodes} nodes, logs in {job.paths.folder}", soft_wrap=True
    )
    try:
        with console.status(f"job {job.job_id} submitted") as line:
            wait(job, lambda s: line.update(status_line(s)), config.poll_interval_s)
    except KeyboardInterrupt:
        console.print(f"stopped waiting; job {job.job_id} goes on (cancel it with: scancel {job.job_id})")
        return 130
    result = collect(job)
    if result.not_started is not None:
        console.print(
            f"job {job.job_id} ended {result.state} before its tasks started: {result.not_started}",
            soft_wrap=True, markup=False, highlight=False,
        )  # fmt: skip
        return 2
    lost = ", ".join(result.lost_nodes) or "none"
    console.print(f"job {job.job_id} ended {result.state}; lost nodes: {lost}", soft_wrap=True)
    if result.ended_by_oobleck is not None:  # SLURM shows CANCELLED: say what it was
        console.print(result.ended_by_oobleck, soft_wrap=True, markup=False, highlight=False)
    console.print(task_table(result))
    for task, error in sorted(result.failed.items()):
        console.print(f"task {task} failed: {error}", soft_wrap=True, markup=False, highlight=False)
    return 0 if result.succeeded else 1


def status_line(status: JobStatus) -> str:
    """``job 12 RUNNING 0:01:23 · step 50/200 (epoch 0) loss=0.41 0.14 s/step · 2/3 tasks done · lost node2
    · node(s) 3 (node2) joined at step 60``."""
    minutes, seconds = divmod(int(status.elapsed_s), 60)
    text = f"job {status.job_id} {status.state} {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    if status.progress:
        text += f" · {status.progress}"
    text += f" · {status.tasks_done}/{status.num_tasks} tasks done"
    if status.lost_nodes:
        text += f" · lost {', '.join(status.lost_nodes)}"
    if status.joined:
        text += f" · {status.joined}"
    return text


def task_table(result: SubmitResult) -> Table:
    """One row per task: finished, failed, or lost (with its node)."""
    table = Table()
    table.add_column("task", justify="right")
    table.add_column("outcome")
    for task in sorted({*result.results, *result.failed, *result.lost}):
        if task in result.results:
            outcome = "[green]finished[/]"
        elif task in result.failed:
            outcome = "[red]failed[/] (error below)"
        else:
            outcome = f"[yellow]lost[/] (no result; node {result.lost[task]})"
        table.add_row(str(task), outcome)
    return table
