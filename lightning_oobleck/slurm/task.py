"""What a submitted task runs for a script; its own module, so a task starts by importing only this."""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ScriptTask:
    """Runs a training script as ``__main__`` inside the submitit task, with ``sys.argv = [script, *args]``.

    The script's directory comes first on ``sys.path``, as ``python SCRIPT`` would put it, so that the script
    imports its neighbours. Returns 0 when the script ends normally or with ``sys.exit(0)``; another exit
    status is raised as an error, so that submitit records the task as failed.
    """

    script: str
    args: tuple[str, ...] = ()

    def __call__(self) -> int:
        sys.argv = [self.script, *self.args]
        sys.path.insert(0, str(Path(self.script).parent))
        try:
            runpy.run_path(self.script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise RuntimeError(f"{self.script} exited with status {e.code}") from None
        return 0
