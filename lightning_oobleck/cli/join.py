"""``oobleck join JOBID [--nodes N] [--time T] [-- SCRIPT ARGS]``: nodes join a running training.

Submits a job whose tasks join the training of running job JOBID at its next step boundary (see
:mod:`lightning_oobleck.slurm.join`): on nodes that came back after a crash, or on spares. Prints the new
job's id. Exit status 0 when submitted, 2 for bad input (nothing submitted).
"""

from __future__ import annotations

import argparse

from lightning_oobleck.cli import CliError
from lightning_oobleck.slurm.cluster import SlurmError
from lightning_oobleck.slurm.join import submit_join


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``oobleck join`` to the ``oobleck`` command."""
    parser = subparsers.add_parser(
        "join",
        usage="oobleck join JOBID [--nodes N] [--time T] [--sbatch OPTION] [-- SCRIPT ARGS...]",
        help="add nodes to a running training (a second job whose tasks join it)",
        description="Submit a job whose tasks join the running training of job JOBID at its next step "
        "boundary: the pipelines grow back, nobody restarts. The running job keeps its allocation.",
    )
    parser.add_argument("job_id", metavar="JOBID", help="the running oobleck job")
    parser.add_argument("--nodes", type=int, default=1, help="nodes to add (default 1)")
    parser.add_argument("--time", help="the join job's time limit (default: what the running job has left)")
    parser.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="one more sbatch option, e.g. --sbatch=--partition=gpu (repeatable)",
    )
    parser.set_defaults(func=run, trailing=[])
    parser.epilog = (
        "After '--': the training script and its arguments, as the running job's tasks run them. Not needed "
        "for jobs started with slurm/oobleck.sbatch or `oobleck submit` with a script (they record theirs); "
        "needed for a job that submitit runs a Python function in."
    )


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1:
        raise CliError(f"--nodes must be at least 1, got {args.nodes}")
    try:
        job_id = submit_join(
            args.job_id, args.nodes, time_limit=args.time, command=args.trailing, sbatch_options=args.sbatch
        )
    except SlurmError as e:
        raise CliError(str(e)) from e
    print(f"submitted job {job_id}: {args.nodes} node(s) join the training of job {args.job_id}")
    return 0
