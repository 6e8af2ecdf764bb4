"""Point-to-point transfer of tensor pytrees between neighbouring stages, with shape/dtype headers.

A layer's output may be a tensor or a pytree of tensors (tuples, lists, dicts; ``None`` leaves nothing to
send). Receivers do not know what the previous stage produces, so activations travel with headers: a step
starts with a *preamble* (one message of ``_PREAMBLE`` bytes, and a second for what does not fit) holding
the pytree's structure (``treespec_dumps``) and the first micro-batch's leaves' :class:`TensorMeta`
(dtype, shape, whether it needs a gradient), and every micro-batch goes as one *packed* message, its
metadata followed by its leaves' bytes, so shapes may vary from one micro-batch to the next. Gradients
need no header: they come back for exactly the leaves sent with ``requires_grad``, shaped like them. Sends
are asynchronous and only waited for at the end of the step.

A receive must be posted with the message's size. After the first micro-batch, the receiver posts the
next one's receive ahead (prefetch), shaped like the last one (a *speculative* receive): while shapes stay
the same, that is the whole transfer, one message per micro-batch, landing as soon as it is sent. When a
micro-batch's metadata differ, the sender fills the speculative message with the new metadata (and unused
bytes) and sends the real packed message after it; both sides then stop speculating for the rest of the
step, and each later micro-batch's metadata go ahead of it in a message of their own. On a GPU, reading a
micro-batch's metadata waits for its arrival on the host: the price of shapes that may vary.

Gradients are not prefetched. With NCCL, the transfers between two ranks run on one stream in the order
they were issued, so each pair of ranks must issue them in the same order: the rules above decide the
order from what both sides know, and in 1F1B a stage has one more warm-up forward than the next one, which
makes the activation prefetch consistent with the upstream stage's order, while prefetching a gradient
would put its receive ahead of an activation send the peer waits for.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_oobleck.execution.comm import CommWaiter

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8
_META_LEN = 3 + _MAX_DIMS


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate the buffer of an incoming tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: Tensor, requires_grad: bool) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype, requires_grad)

    def encode(self) -> list[int]:
        if len(self.shape) > _MAX_DIMS or self.dtype not in _DTYPES:
            raise ValueError(
                f"cannot send a {self.dtype} tensor of {len(self.shape)} dims between stages "
                f"(at most {_MAX_DIMS} dims of {[str(d) for d in _DTYPES]})"
            )
        header = [_DTYPES.index(self.dtype), int(self.requires_grad), len(self.shape), *self.shape]
        return header + [0] * (_META_LEN - len(header))

    @classmethod
    def decode(cls, values: Sequence[int]) -> TensorMeta:
        return cls(tuple(values[3 : 3 + values[2]]), _DTYPES[values[0]], bool(values[1]))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def empty(self, device: torch.device) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


Metas = tuple[TensorMeta, ...]
"""The metadata of a pytree's leaves, in order."""


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves (in order) and structure of an activation pytree."""
    return pytree.tree_flatten(tree)


_PREAMBLE = 1024  # bytes: the first message of a step, enough for the structure and metadata of a few leaves


def encode_preamble(spec: pytree.TreeSpec, metas: Metas) -> Tensor:
    """The first message of a step (uint8, at least ``_PREAMBLE`` bytes): its size, the pytree's structure
    and the first micro-batch's metadata. Only builtin containers and registered, serialisable node types
    can cross a stage boundary."""
    try:
        structure = list(pytree.treespec_dumps(spec).encode())
    except Exception as e:
        raise TypeError(
            f"a stage's output of structure {spec} cannot cross a stage boundary ({e}): return tensors in "
            "tuples, lists or dicts from the stage's last layer"
        ) from e
    start = 16 + _aligned(len(structure), 8)
    size = start + _metas_size(len(metas))
    message = torch.zeros(max(size, _PREAMBLE), dtype=torch.uint8)
    message[:16].view(torch.int64).copy_(torch.tensor([size, len(structure)]))
    message[16 : 16 + len(structure)] = torch.tensor(structure, dtype=torch.uint8)
    message[start:] = pack(metas, [], torch.device("cpu"), message.numel() - start)
    return message


def decode_preamble(message: Tensor) -> tuple[pytree.TreeSpec, Metas]:
    """The structure and first metadata in a whole preamble (``encode_preamble``)."""
    message = message.cpu()
    size, length = message[:16].view(torch.int64).tolist()
    spec = pytree.treespec_loads(bytes(message[16 : 16 + length].tolist()).decode())
    return spec, unpack_metas(message[16 + _aligned(length, 8) : size], spec.num_leaves)


def preamble_size(first: Tensor) -> int:
    """The size of a whole preamble, from its first ``_PREAMBLE`` bytes."""
    return int(first[:8].view(torch.int64).item())


def _aligned(size: int, align: int) -> int:
    return -(-size // align) * align


_ALIGN = 16  # bytes: every leaf starts at a multiple, so it can be viewed in place with its dtype


@dataclass(frozen=True)
class _Layout:
    """Where each leaf starts in a packed message, the message's size (bytes), and its metadata encoded."""

    offsets: tuple[int, ...]
    size: int
    header: Tensor


@functools.lru_cache(maxsize=64)
def _layout(metas: Metas) -> _Layout:
    offsets, end = [], _metas_size(len(metas))
    for m in metas:
        end = _aligned(end, _ALIGN)
        offsets.append(end)
        end += m.nbytes
    header = torch.tensor([m.encode() for m in metas], dtype=torch.int64).reshape(-1)
    return _Layout(tuple(offsets), end, header)


def _metas_size(count: int) -> int:
    return count * _META_LEN * 8


def pack(metas: Metas, leaves: Sequence[Tensor], device: torch.device, size: int | None = None) -> Tensor:
    """One message (uint8) holding ``metas`` and then the ``leaves``' bytes. Without ``leaves``, the
    metadata alone, in a message of ``size`` bytes."""
    layout = _layout(metas)
    message = torch.empty(layout.size if size is None else size, dtype=torch.uint8, device=device)
    message[: _metas_size(len(metas))].view(torch.int64).copy_(layout.header)
    for t, start in zip(leaves, layout.offsets, strict=False):
        message[start : start + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))
    return message


def unpack_metas(message: Tensor, count: int, last: Metas | None = None) -> Metas:
    """The ``count`` leaves' metadata at the start of a packed message (``last`` if they equal it)."""
    encoded = message[: _metas_size(count)].view(torch.int64).cpu()
    if last is not None and torch.equal(encoded, _layout(last).header):
        return last
    return tuple(TensorMeta.decode(v) for v in encoded.reshape(-1, _META_LEN).tolist())


def unpack_leaves(message: Tensor, metas: Metas) -> list[Tensor]:
    """The leaves of a packed message, as views of it (no copy)."""
    return [
        message[start : start + m.nbytes].view(m.dtype).view(m.shape)
        for m, start in zip(metas, _layout(metas).offsets, strict=True)
    ]


_Received = tuple[dist.Work | None, Tensor]  # a posted receive (no work for an empty tensor) and its buffer


class Outbox:
    """Asynchronous sends of pytrees to one peer; tensors stay referenced until :meth:`wait` confirms them.

    With ``header``, every pytree is preceded by its leaves' :class:`TensorMeta` (and the first by its
    structure), for an :class:`Inbox` with ``header``, which receives speculatively (see the module's
    docstring).
    """

    def __init__(
        self,
        peer: int,
        group: dist.ProcessGroup,
        device: torch.device,
        waiter: CommWaiter,
        abort: threading.Event,
        header: bool,
        tag: int = 0,
    ) -> None:
        self.peer = peer
        self.group = group
        self.tag = tag
        self.device = device
        self._waiter = waiter
        self._abort = abort
        self._header = header
        self._spec: pytree.TreeSpec | None = None
        self._assumed: Metas | None = None  # what the peer's speculative receive is shaped for (None: none)
        self._pending: list[tuple[dist.Work, Tensor]] = []

    def send(
        self, leaves: Sequence[Tensor], spec: pytree.TreeSpec | None = None, grads: Sequence[bool] = ()
    ) -> None:
        """Send one pytree (its ``leaves`` and, with a header, its ``spec`` and which leaves need a gradient).

        Every pytree of a step must have the first one's structure."""
        if not self._header:
            for t in leaves:
                self._isend(t.detach().contiguous())
            return
        assert spec is not None
        metas = tuple(TensorMeta.of(t, g) for t, g in zip(leaves, grads, strict=True))
        first, assumed = self._spec is None, self._assumed
        if first:
            preamble = encode_preamble(spec, metas).to(self.device)
            self._isend(preamble[:_PREAMBLE])
            self._isend(preamble[_PREAMBLE:])
            self._spec = spec
        elif spec != self._spec:
            raise ValueError(
                f"a stage's output changed structure within a step (from {self._spec} to {spec}): every "
                "micro-batch must give the same tensors (shapes may differ)"
            )
        elif assumed is None:  # speculation stopped: the metadata go ahead
            self._isend(pack(metas, [], self.device, _metas_size(len(metas))))
        elif metas != assumed:  # fills the speculative receive; speculation stops
            self._isend(pack(metas, [], self.device, _layout(assumed).size))
        self._isend(pack(metas, leaves, self.device))
        self._assumed = metas if first or metas == assumed else None

    def _isend(self, t: Tensor) -> None:
        if t.numel() == 0:
            return  # gloo refuses empty messages; the receiver knows the shape from the header
        with self._waiter.issuing():
            self._pending.append((dist.isend(t, self.peer, group=self.group, tag=self.tag), t))

    def wait(self) -> None:
        """Block (abortably) until every tensor sent so far has left."""
        self._waiter.wait([work for work, _ in self._pending], self._abort)
        self._pending.clear()


class Inbox:
    """``count`` pytrees from one peer.

    With ``header`` the pytrees' structure and metadata come with them (activations), and the next pytree
    is received ahead, speculatively (see the module's docstring); its leaves are views of the message.
    Without, the caller passes the leaves' metadata to :meth:`get` (gradients have the shapes of the
    activations sent), and each leaf is received into a fresh buffer. ``tag``: the channel (an
    :class:`Outbox` with the same tag sends to it; streams of other tags between the same ranks keep their
    own order).
    """

    def __init__(
        self,
        peer: int,
        group: dist.ProcessGroup,
        count: int,
        device: torch.device,
        waiter: CommWaiter,
        abort: threading.Event,
        header: bool,
        tag: int = 0,
    ) -> None:
        self.peer = peer
        self.group = group
        self.tag = tag
        self.device = device
        self._header = header
        self._remaining = count
        self._waiter = waiter
        self._abort = abort
        self._spec: pytree.TreeSpec | None = None
        self._metas: Metas | None = None  # what the speculative receive is shaped for (None: none)
        self._next: _Received | None = None  # the structure's length, metadata, or a speculative message
        if count > 0 and header:
            self._next = self._irecv(self._empty(_PREAMBLE))

    def _irecv(self, buf: Tensor) -> _Received:
        if buf.numel() == 0:
            return None, buf
        with self._waiter.issuing():
            return dist.irecv(buf, self.peer, group=self.group, tag=self.tag), buf

    def _wait(self, received: Sequence[_Received]) -> list[Tensor]:
        self._waiter.wait([work for work, _ in received if work is not None], self._abort)
        return [buf for _, buf in received]

    def _empty(self, size: int) -> Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _receive(self, size: int) -> Tensor:
        return self._wait([self._irecv(self._empty(size))])[0]

    def get(self, metas: Sequence[TensorMeta] | None = None) -> tuple[Any, list[TensorMeta]]:
        """The next pytree and its leaves' metadata (blocks, abortably, until it has arrived)."""
        if self._remaining <= 0:
            raise RuntimeError(f"no more tensors expected from rank {self.peer} in this step")
        self._remaining -= 1
        if not self._header:
            assert metas is not None
            return self._wait([self._irecv(m.empty(self.device)) for m in metas]), list(metas)
        assert self._next is not None
        [head] = self._wait([self._next])
        first = self._spec is None
        if first:
            if (size := preamble_size(head)) > _PREAMBLE:
                head = torch.cat([head, self._receive(size - _PREAMBLE)])
            self._spec, metas = decode_preamble(head)
        else:
            metas = unpack_metas(head, self._spec.num_leaves, self._metas)
        # ``head`` is the whole packed message when the speculative receive was shaped for it; otherwise it
        # held the metadata alone and the data follow (and speculation stops for the step)
        hit = self._metas is not None and metas == self._metas
        message = head if hit else self._receive(_layout(metas).size)
        self._metas = metas if first or hit else None
        if self._remaining > 0:
            size = _layout(metas).size if self._metas is not None else _metas_size(len(metas))
            self._next = self._irecv(self._empty(size))
        return pytree.tree_unflatten(unpack_leaves(message, metas), self._spec), list(metas)
