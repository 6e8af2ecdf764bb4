"""What a task runs for a training script under SLURM: ``python -m lightning_oobleck.slurm.task SCRIPT
[ARGS]`` (the batch template's ``srun`` line), or :class:`ScriptTask` (submitit). Its own module, light to
import, so that a task announces itself to the coordinator before the script's imports begin."""

from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_oobleck.recovery.agent import announce_presence


def announce_slurm_task() -> bool:
    """Announce this task as worker (``SLURM_NODEID``, ``SLURM_LOCALID``) on a presence connection (see
    :func:`~lightning_oobleck.recovery.agent.announce_presence`): if it dies before it registers, the start
    goes on without it at once. Returns whether it was announced (not outside a job with a coordinator)."""
    if "SLURM_NODEID" not in os.environ or "SLURM_LOCALID" not in os.environ:
        return False
    return announce_presence((int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_LOCALID"])))


@dataclass(frozen=True)
class ScriptTask:
    """Runs a training script as ``__main__`` inside the task, with ``sys.argv = [script, *args]``, after
    announcing the task (:func:`announce_slurm_task`).

    The script's directory comes first on ``sys.path``, as ``python SCRIPT`` would put it, so that the script
    imports its neighbours. Returns 0 when the script ends normally or with ``sys.exit(0)``; another exit
    status is raised as an error, so that submitit records the task as failed.
    """

    script: str
    args: tuple[str, ...] = ()

    def __call__(self) -> int:
        announce_slurm_task()
        sys.argv = [self.script, *self.args]
        sys.path.insert(0, str(Path(self.script).parent))
        try:
            runpy.run_path(self.script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise RuntimeError(f"{self.script} exited with status {e.code}") from None
        return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_oobleck.slurm.task SCRIPT [ARGS]``: run SCRIPT as ``python SCRIPT ARGS`` would,
    announced first; its exit status is the process's."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(
            f"usage: python -m {__spec__.name if __spec__ else 'lightning_oobleck.slurm.task'} SCRIPT [ARGS]"
        )
    announce_slurm_task()
    sys.argv = argv
    sys.path[0] = str(Path(argv[0]).parent)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
