"""What a task runs for a training script under SLURM: ``python -m lightning_oobleck.slurm.task SCRIPT
[ARGS]`` (the batch template's ``srun`` line), or :class:`ScriptTask` (submitit). Its own module, light to
import, so that a task announces itself to the coordinator before the script's imports begin."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_oobleck.recovery.agent import TrainingFinished, announce_presence
from lightning_oobleck.recovery.protocol import NODE_KEY_ENV


def announce_slurm_task() -> bool:
    """Announce this task as worker (``SLURM_NODEID``, ``SLURM_LOCALID``) on a presence connection (see
    :func:`~lightning_oobleck.recovery.agent.announce_presence`): if it dies before it registers, the start
    goes on without it at once. Returns whether it was announced (not outside a job with a coordinator)."""
    if "SLURM_NODEID" not in os.environ or "SLURM_LOCALID" not in os.environ:
        return False
    return announce_presence((int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_LOCALID"])))


def run_script(script: str, args: Sequence[str], join: bool = False) -> None:
    """Announce this task, then run ``script`` as ``__main__`` as ``python SCRIPT ARGS`` would: with
    ``sys.argv = [script, *args]`` and the script's directory first on ``sys.path`` (so that it imports its
    neighbours).

    ``join``: the task joins a running training (a join job's, :mod:`~lightning_oobleck.slurm.join`): its
    node is named by this job and its node index (``OOBLECK_NODE_KEY``), never by ``SLURM_NODEID``, which
    starts at 0 in every job; if the training ends before it was admitted, the script stops there and the
    task ends with status 0."""
    if join:
        os.environ[NODE_KEY_ENV] = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_NODEID']}"
    else:
        announce_slurm_task()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except TrainingFinished as e:
        print(f"oobleck: {e}: nothing to do", file=sys.stderr)


@dataclass(frozen=True)
class ScriptTask:
    """Runs a training script in a submitit task (:func:`run_script`). Returns 0 when the script ends
    normally or with ``sys.exit(0)``; another exit status is raised as an error, so that submitit records the
    task as failed.
    """

    script: str
    args: tuple[str, ...] = ()

    def __call__(self) -> int:
        try:
            run_script(self.script, self.args)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise RuntimeError(f"{self.script} exited with status {e.code}") from None
        return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_oobleck.slurm.task [--join] SCRIPT [ARGS]``: :func:`run_script`; its exit
    status is the process's."""
    argv = sys.argv[1:] if argv is None else argv
    join = argv[:1] == ["--join"]
    argv = argv[join:]
    if not argv:
        sys.exit("usage: python -m lightning_oobleck.slurm.task [--join] SCRIPT [ARGS]")
    run_script(argv[0], argv[1:], join)


if __name__ == "__main__":
    main()
