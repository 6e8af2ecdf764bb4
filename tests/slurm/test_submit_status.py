"""What ``oobleck submit`` shows while a job runs, read from the tasks' output files as a running job leaves
them (the job itself runs on the local SLURM cluster in ``test_slurm_jobs.py``)."""

from __future__ import annotations

from pathlib import Path

from submitit.slurm.slurm import SlurmJob

from lightning_oobleck.cli.submit import status_line
from lightning_oobleck.slurm.submit import JobStatus, training_progress


def test_the_status_line_shows_the_last_step_and_the_last_join_whichever_task_printed_them(
    tmp_path: Path,
) -> None:
    job = SlurmJob(folder=tmp_path / "%j", job_id="12", tasks=[0, 1, 2])
    job.paths.folder.mkdir(parents=True)
    # Task 0 was rank 0 until its node was lost; task 1 is rank 0 since; task 2 printed nothing.
    job.task(0).paths.stdout.write_text(
        "oobleck: step 50/200 (epoch 0) train_loss=2.913 0.14 s/step\nGPU available: False\n"
    )
    job.task(1).paths.stdout.write_text("oobleck: step 100/200 (epoch 0) train_loss=1.207 0.15 s/step\n")
    job.task(1).paths.stderr.write_text(
        "oobleck: node(s) 0 (node1) lost at step 61 [...]; training goes on\n"
        "oobleck: node(s) 3 (node1) joined at step 90: 3 pipelines on 3 nodes, f=1\n"
    )
    progress, joined = training_progress(job)
    assert progress == "step 100/200 (epoch 0) train_loss=1.207 0.15 s/step"
    assert joined == "node(s) 3 (node1) joined at step 90"
    line = status_line(JobStatus("12", "RUNNING", 83.0, 0, 3, ("node1",), progress, joined))
    assert line == (
        "job 12 RUNNING 0:01:23 · step 100/200 (epoch 0) train_loss=1.207 0.15 s/step · 0/3 tasks done · "
        "lost node1 · node(s) 3 (node1) joined at step 90"
    )
