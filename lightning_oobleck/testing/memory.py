"""The bytes of tensors alive, on any device: what ``torch.cuda.memory_allocated`` tells on a GPU, for runs on
the CPU (whose allocator keeps no statistics).

:class:`LiveTensorMeter` sees every tensor an operation creates while it is active (a dispatch mode) and
counts each storage once until it is freed, whoever holds it: autograd's saved tensors, autocast's cache, a
pending send, an optimizer's state. Its peak is sampled after every operation, so it misses only what lives
and dies inside one operation (a kernel's workspace); it knows nothing of allocator rounding or caching.
Tensors made before it started count once :meth:`LiveTensorMeter.track` is given them.
"""

from __future__ import annotations

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
