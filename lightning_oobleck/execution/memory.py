"""Count the activation memory autograd keeps for backward, each tensor view once.

The tensors saved for backward are what a micro-batch in flight costs a stage; counting them through
``saved_tensors_hooks`` works the same on every device (the CUDA allocator's peak would also include
temporaries and fragmentation). A saved tensor counts by its own size, not its storage's: a
micro-batch that is a view of the whole batch costs the micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
from torch import Tensor


class _Saved:
    """A saved tensor whose lifetime (until autograd frees it) is reported to the meter."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: Tensor, meter: SavedTensorMeter, key: tuple[int, int]) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key
        meter._acquire(key)

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager: bytes of tensors saved for backward, live now and at peak.

    ``exclude``: tensors whose storage is not activation memory (the parameters).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[tuple[int, int], int] = {}
        """Reference counts of live saved views, keyed by (address, bytes)."""
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, value, tb)

    def _pack(self, t: Tensor) -> _Saved | Tensor:
        if t.untyped_storage().data_ptr() in self._excluded:
            return t
        # detached: a saved output holding its own grad_fn would keep its graph alive in a reference cycle
        # that only running the backward without retain_graph breaks
        return _Saved(t.detach(), self, (t.data_ptr(), t.numel() * t.element_size()))

    @staticmethod
    def _unpack(packed: _Saved | Tensor) -> Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _acquire(self, key: tuple[int, int]) -> None:
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: tuple[int, int]) -> None:
        count = self._refs.pop(key) - 1
        if count:
            self._refs[key] = count
        else:
            self.live_bytes -= key[1]
