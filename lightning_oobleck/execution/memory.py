"""Count the activation memory autograd keeps for backward, each tensor view once.

The tensors saved for backward are what a micro-batch in flight costs a stage; counting them through
``saved_tensors_hooks`` works the same on every device (the CUDA allocator's peak would also include
temporaries and fragmentation). A saved tensor counts by its own size, not its storage's: a
micro-batch that is a view of the whole batch costs the micro-batch.

Under ``torch.autocast`` a layer saves the 16-bit casts of its weights. Autocast caches those casts for its
whole region (a training step: one copy per parameter, shared by every micro-batch), so they are not
per-micro-batch memory and are not counted here: the planner counts them with the parameters' state
(:func:`lightning_oobleck.planning.cost.default_state_factor`).

:class:`LiveTensorMeter` counts every tensor alive instead, whoever holds it: what
``torch.cuda.memory_allocated`` tells on a GPU, on any device (a CPU's allocator keeps no statistics). It
sees each tensor an operation creates while it is active (a dispatch mode) and counts each storage once until
it is freed: autograd's saved tensors, a backward's gradients, autocast's cache, a pending send, an
optimizer's state. Its peak is sampled after every operation, so it misses only what lives and dies inside
one operation (a kernel's workspace); it knows nothing of allocator rounding or caching. Tensors made before
it started count once :meth:`LiveTensorMeter.track` is given them.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_oobleck.execution.tensor_parallel import local


class _Saved:
    """A saved tensor whose lifetime (until autograd frees it) is reported to the meter."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: Tensor, meter: SavedTensorMeter, key: tuple[int, int]) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key
        meter._acquire(key)

    def __del__(self) -> None:
        self.meter._release(self.key)


_CAST_OR_VIEW = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "AliasBackward0",
    }
)
"""The autograd nodes between a parameter and autocast's cached cast of it as a layer saves it."""


def _casts_parameter(tensor: Tensor, parameters: set[int]) -> bool:
    """Whether ``tensor`` is a cast (or a view of a cast) of one of ``parameters`` (by ``id``)."""
    node, cast = tensor.grad_fn, False
    while node is not None and node.name() in _CAST_OR_VIEW:
        cast = cast or node.name() == "ToCopyBackward0"
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return cast and id(getattr(node, "variable", None)) in parameters


class SavedTensorMeter:
    """Context manager: bytes of tensors saved for backward, live now and at peak.

    ``exclude``: tensors that are not activation memory (the parameters); under autocast, their cached
    casts are not counted either.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        excluded = list(exclude)
        self._excluded = {local(t).untyped_storage().data_ptr() for t in excluded}
        self._parameters = {id(t) for t in excluded}
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
        held = local(t)  # a split tensor (DTensor) counts by the shard this device holds
        if held.untyped_storage().data_ptr() in self._excluded or _casts_parameter(t, self._parameters):
            return t
        # detached: a saved output holding its own grad_fn would keep its graph alive in a reference cycle
        # that only running the backward without retain_graph breaks
        return _Saved(t.detach(), self, (held.data_ptr(), held.numel() * held.element_size()))

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

    def _add(self, t: Tensor) -> bool:
        """Count ``t``'s storage if it is new; whether it was."""
        if t.device.type == "meta":
            return False
        storage = local(t).untyped_storage()  # a split tensor (DTensor) counts by this device's shard
        known = self._storages.get(storage.data_ptr())
        if known is None or known[0].expired():  # a new storage, maybe at a freed one's address
            self._storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            return True
        return False

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
        added = [self._add(t) for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
        if any(added):  # the bytes alive rise only here: the peak is exact sampled after these operations
            self._sweep()
        return out
