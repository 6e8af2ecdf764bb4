"""The bytes of tensors alive, on any device: what ``torch.cuda.memory_allocated`` tells on a GPU, for runs on
the CPU (whose allocator keeps no statistics); and the peak of a process's resident memory over a block.

:class:`LiveTensorMeter` sees every tensor an operation creates while it is active (a dispatch mode) and
counts each storage once until it is freed, whoever holds it: autograd's saved tensors, autocast's cache, a
pending send, an optimizer's state. Its peak is sampled after every operation, so it misses only what lives
and dies inside one operation (a kernel's workspace); it knows nothing of allocator rounding or caching.
Tensors made before it started count once :meth:`LiveTensorMeter.track` is given them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensorMeter(TorchDispatchMode):
    """Context manager: bytes of tensor storage alive now (:attr:`live_bytes`) and at most
    (:attr:`peak_bytes`) since it started or since :meth:`reset_peak`, in this thread."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self._live = 0
        self.peak_bytes = 0
        """The most bytes alive after any operation since the start or :meth:`reset_peak`."""

    @property
    def live_bytes(self) -> int:
        """The bytes alive now."""
        self._sweep()
        return self._live

    def track(self, *tensors: Tensor) -> None:
        """Count ``tensors`` (made before the meter started: parameters, say) until they are freed."""
        for t in tensors:
            self._add(t)
        self._sweep()

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak_bytes = self.live_bytes

    def _add(self, t: Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        known = self._storages.get(storage.data_ptr())
        if known is None or known[0].expired():  # a new storage, maybe at a freed one's address
            self._storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def _sweep(self) -> None:
        freed = [address for address, (ref, _) in self._storages.items() if ref.expired()]
        for address in freed:
            del self._storages[address]
        self._live = sum(nbytes for _, nbytes in self._storages.values())
        self.peak_bytes = max(self.peak_bytes, self._live)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                self._add(t)
        self._sweep()
        return out


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
