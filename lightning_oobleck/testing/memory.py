"""The peak of a process's resident memory over a block, whatever allocated it (for tests and benchmarks;
the bytes of live tensors on any device are :class:`lightning_oobleck.execution.memory.LiveTensorMeter`'s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os


class PeakResidentMemory:
    """Context manager: how far this process's resident memory rose above its level at the start
    (:attr:`growth_bytes`), whatever allocated it (Python, torch, gloo's buffers, a serialiser's bytes).

    Linux only (``/proc/self/clear_refs`` resets the kernel's peak). From its first use on, the process maps
    and unmaps allocations of 64 KiB or more on their own (glibc's ``M_MMAP_THRESHOLD``, which cannot be
    handed back to glibc's adaptive default), so that memory freed earlier is not reused unseen inside the
    block: the peak is what the block needed. Meant for test and benchmark processes.
    """

    _MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD

    def __init__(self) -> None:
        self.growth_bytes = 0
        self._start = 0

    @staticmethod
    def supported() -> bool:
        return os.path.exists("/proc/self/clear_refs") and ctypes.util.find_library("c") is not None

    def __enter__(self) -> PeakResidentMemory:
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(self._MMAP_THRESHOLD, 1 << 16)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from the current one
        self._start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth_bytes = (_status_kib("VmHWM") - self._start) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
