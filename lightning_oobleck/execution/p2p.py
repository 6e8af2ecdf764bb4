"""Point-to-point transfer of tensor pytrees between neighbouring stages, with shape/dtype headers.

A layer's output may be a tensor or a pytree of tensors (tuples, lists, dicts; ``None`` leaves nothing to
send). Receivers do not know what the previous stage produces, so every transfer of activations is
preceded by a header: the first of a step carries the pytree's structure (``treespec_dumps``, as bytes),
and each micro-batch's carries its leaves' dtypes, shapes and whether they need a gradient, so shapes may
vary from one micro-batch to the next. Gradients need no header: they come back for exactly the leaves
sent with ``requires_grad``, shaped like them. Sends are asynchronous and only waited for at the end of
the step.

The next activation header is received one message ahead (prefetch); gradients are not. With NCCL, the
transfers between two ranks run on one stream in the order they were issued, so each pair of ranks must
issue them in the same order: in 1F1B a stage has one more warm-up forward than the next one, which makes
the activation prefetch consistent with the upstream stage's order, while prefetching a gradient would put
its receive ahead of an activation send the peer waits for.
"""

from __future__ import annotations

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

    def empty(self, device: torch.device) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves (in order) and structure of an activation pytree."""
    return pytree.tree_flatten(tree)


def encode_structure(spec: pytree.TreeSpec) -> Tensor:
    """The structure of a pytree as bytes (uint8); only builtin containers and registered, serialisable
    node types can cross a stage boundary."""
    try:
        dumped = pytree.treespec_dumps(spec)
    except Exception as e:
        raise TypeError(
            f"a stage's output of structure {spec} cannot cross a stage boundary ({e}): return tensors in "
            "tuples, lists or dicts from the stage's last layer"
        ) from e
    return torch.tensor(list(dumped.encode()), dtype=torch.uint8)


class Outbox:
    """Asynchronous sends of pytrees to one peer; tensors stay referenced until :meth:`wait` confirms them.

    With ``header``, every pytree is preceded by its leaves' :class:`TensorMeta` (and the first by its
    structure), for an :class:`Inbox` with ``header``.
    """

    def __init__(
        self, peer: int, device: torch.device, waiter: CommWaiter, abort: threading.Event, header: bool
    ) -> None:
        self.peer = peer
        self.device = device
        self._waiter = waiter
        self._abort = abort
        self._header = header
        self._spec: pytree.TreeSpec | None = None
        self._pending: list[tuple[dist.Work, Tensor]] = []

    def send(
        self, leaves: Sequence[Tensor], spec: pytree.TreeSpec | None = None, grads: Sequence[bool] = ()
    ) -> None:
        """Send one pytree (its ``leaves`` and, with a header, its ``spec`` and which leaves need a gradient).

        Every pytree of a step must have the first one's structure."""
        if self._header:
            assert spec is not None
            if self._spec is None:
                structure = encode_structure(spec).to(self.device)
                self._isend(torch.tensor([structure.numel()], dtype=torch.int64, device=self.device))
                self._isend(structure)
                self._spec = spec
            elif spec != self._spec:
                raise ValueError(
                    f"a stage's output changed structure within a step (from {self._spec} to {spec}): every "
                    "micro-batch must give the same tensors (shapes may differ)"
                )
            metas = [TensorMeta.of(t, g).encode() for t, g in zip(leaves, grads, strict=True)]
            self._isend(torch.tensor(metas, dtype=torch.int64, device=self.device).reshape(-1))
        for t in leaves:
            self._isend(t.detach().contiguous())

    def _isend(self, t: Tensor) -> None:
        if t.numel() == 0:
            return  # gloo refuses empty messages; the receiver knows the shape from the header
        with self._waiter.issuing():
            self._pending.append((dist.isend(t, self.peer), t))

    def wait(self) -> None:
        """Block (abortably) until every tensor sent so far has left."""
        self._waiter.wait([work for work, _ in self._pending], self._abort)
        self._pending.clear()


class Inbox:
    """``count`` pytrees from one peer, each received into fresh buffers.

    With ``header`` the pytrees' structure and metadata come first (activations), and the next header is
    received ahead (prefetch); without, the caller passes the leaves' metadata to :meth:`get` (gradients
    have the shapes of the activations sent).
    """

    def __init__(
        self,
        peer: int,
        count: int,
        device: torch.device,
        waiter: CommWaiter,
        abort: threading.Event,
        header: bool,
    ) -> None:
        self.peer = peer
        self.device = device
        self._header = header
        self._remaining = count
        self._waiter = waiter
        self._abort = abort
        self._spec: pytree.TreeSpec | None = None
        self._next: tuple[dist.Work | None, Tensor] | None = None
        if count > 0 and header:
            self._next = self._irecv(torch.empty(1, dtype=torch.int64, device=device))

    def _irecv(self, buf: Tensor) -> tuple[dist.Work | None, Tensor]:
        if buf.numel() == 0:
            return None, buf
        with self._waiter.issuing():
            return dist.irecv(buf, self.peer), buf

    def _wait(self, received: tuple[dist.Work | None, Tensor]) -> Tensor:
        work, buf = received
        if work is not None:
            self._waiter.wait([work], self._abort)
        return buf

    def get(self, metas: Sequence[TensorMeta] | None = None) -> tuple[Any, list[TensorMeta]]:
        """The next pytree and its leaves' metadata (blocks, abortably, until it has arrived)."""
        if self._remaining <= 0:
            raise RuntimeError(f"no more tensors expected from rank {self.peer} in this step")
        if self._header:
            assert self._next is not None
            if self._spec is None:
                length = int(self._wait(self._next).item())
                structure = self._wait(
                    self._irecv(torch.empty(length, dtype=torch.uint8, device=self.device))
                )
                self._spec = pytree.treespec_loads(bytes(structure.cpu().tolist()).decode())
                self._next = self._post_metas()
            values = self._wait(self._next).cpu().reshape(-1, _META_LEN).tolist()
            metas = [TensorMeta.decode(v) for v in values]
        assert metas is not None
        leaves = [self._irecv(m.empty(self.device)) for m in metas]
        self._remaining -= 1
        self._next = self._post_metas() if self._header and self._remaining > 0 else None
        tensors = [self._wait(leaf) for leaf in leaves]
        return (pytree.tree_unflatten(tensors, self._spec) if self._spec is not None else tensors), list(
            metas
        )

    def _post_metas(self) -> tuple[dist.Work | None, Tensor]:
        assert self._spec is not None
        return self._irecv(
            torch.empty(self._spec.num_leaves * _META_LEN, dtype=torch.int64, device=self.device)
        )
