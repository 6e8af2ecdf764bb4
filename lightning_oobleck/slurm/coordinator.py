"""The coordinator a SLURM task starts when the active one asks it to host a standby:
``python -m lightning_oobleck.slurm.coordinator --follow ADDRESS ...`` (the recovery coordinator's command
line, :func:`lightning_oobleck.recovery.coordinator.run`).

Its tasks report their end in the store (:func:`lightning_oobleck.slurm.task.report_end`), and it serves them
until the last one did. If it took over from the batch host's coordinator because the batch host was lost,
nothing else can end the job once the training is over (SLURM waits for the lost batch script): it ends it
(:func:`~lightning_oobleck.slurm.task.end_job`), saying that the training completed, and removes the job's
join file (nothing can join a training that is over).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning_oobleck.recovery.coordinator import run
from lightning_oobleck.recovery.replica import Role
from lightning_oobleck.slurm.task import batch_host_lost, end_job


def main(argv: list[str] | None = None) -> int:
    coordinator = run(argv, tasks_report_end=True)
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id and coordinator.role is Role.ACTIVE and coordinator.finished and batch_host_lost() is not None:
        if join_file := coordinator.replica.settings.join_file:  # the lost batch script would have removed it
            Path(join_file).unlink(missing_ok=True)
        end_job(job_id, "completed: the training ended on the surviving nodes", completed=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
