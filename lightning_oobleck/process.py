"""What every process of a job needs of the operating system, in a module light enough for all of them (the
coordinators import no torch): dying with the process that started it, and telling whether a process runs."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; a no-op
    elsewhere). The caller checks afterwards that its parent is still the one it expects: it may have died
    before the call took effect."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts: it cannot be signalled, but it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
