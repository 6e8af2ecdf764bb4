"""Point-to-point tensor transfer between neighbouring stages, with shape/dtype metadata.

Receivers do not know what the previous stage produces (token ids, hidden states of some shape), so
the first tensor sent in each direction in a step is preceded by a small header (dtype, whether it
needs a gradient, shape); the remaining micro-batches of the step have the same shape. Sends are
asynchronous and only waited for at the end of the step.

Activations are received one message ahead (prefetch) so the transfer overlaps compute; gradients are
not. With NCCL, the transfers between two ranks run on one stream in the order they were issued, so
each pair of ranks must issue them in the same order: in 1F1B a stage has one more warm-up forward
than the next one, which makes the activation prefetch consistent with the upstream stage's order,
while prefetching a gradient would put its receive ahead of an activation send the peer waits for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
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
_HEADER_LEN = 3 + _MAX_DIMS


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate the buffer of an incoming tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def encode(self) -> Tensor:
        if len(self.shape) > _MAX_DIMS or self.dtype not in _DTYPES:
            raise ValueError(
                f"cannot send a {self.dtype} tensor of {len(self.shape)} dims between stages "
                f"(at most {_MAX_DIMS} dims of {[str(d) for d in _DTYPES]})"
            )
        header = [_DTYPES.index(self.dtype), int(self.requires_grad), len(self.shape), *self.shape]
        return torch.tensor(header + [0] * (_HEADER_LEN - len(header)), dtype=torch.int64)

    @classmethod
    def decode(cls, header: Tensor) -> TensorMeta:
        values = header.tolist()
        return cls(tuple(values[3 : 3 + values[2]]), _DTYPES[values[0]], bool(values[1]))


class Outbox:
    """Asynchronous sends to one peer; tensors stay referenced until :meth:`wait` confirms them.

    With ``header``, the first tensor is preceded by its :class:`TensorMeta` (for an :class:`Inbox`
    created without ``meta``).
    """

    def __init__(
        self, peer: int, device: torch.device, waiter: CommWaiter, abort: threading.Event, header: bool
    ) -> None:
        self.peer = peer
        self.device = device
        self._waiter = waiter
        self._abort = abort
        self._header = header
        self._pending: list[tuple[dist.Work, Tensor]] = []

    def send(self, t: Tensor, requires_grad: bool = False) -> None:
        if self._header:
            self._header = False
            self._isend(TensorMeta(tuple(t.shape), t.dtype, requires_grad).encode().to(self.device))
        self._isend(t.detach().contiguous())

    def _isend(self, t: Tensor) -> None:
        with self._waiter.issuing():
            self._pending.append((dist.isend(t, self.peer), t))

    def wait(self) -> None:
        """Block (abortably) until every tensor sent so far has left."""
        self._waiter.wait([work for work, _ in self._pending], self._abort)
        self._pending.clear()


class Inbox:
    """``count`` tensors from one peer, each received into a fresh buffer.

    ``meta`` is the tensors' metadata when the receiver knows it (gradients have the shape of the
    activation it sent); ``None`` means a header comes first. With ``prefetch`` the next receive is
    posted as soon as the previous one completed, otherwise when :meth:`get` is called.
    """

    def __init__(
        self,
        peer: int,
        count: int,
        device: torch.device,
        waiter: CommWaiter,
        abort: threading.Event,
        meta: TensorMeta | None = None,
        prefetch: bool = True,
    ) -> None:
        self.peer = peer
        self.device = device
        self.meta = meta
        self._prefetch = prefetch
        self._remaining = count
        self._waiter = waiter
        self._abort = abort
        self._header: tuple[dist.Work, Tensor] | None = None
        self._next: tuple[dist.Work, Tensor] | None = None
        if count > 0 and meta is None:
            self._header = self._irecv(torch.empty(_HEADER_LEN, dtype=torch.int64, device=device))
        elif count > 0 and prefetch:
            self._post()

    def _irecv(self, buf: Tensor) -> tuple[dist.Work, Tensor]:
        with self._waiter.issuing():
            return dist.irecv(buf, self.peer), buf

    def _post(self) -> None:
        assert self.meta is not None
        self._next = self._irecv(torch.empty(self.meta.shape, dtype=self.meta.dtype, device=self.device))

    def get(self) -> Tensor:
        """The next tensor (blocks, abortably, until it has arrived)."""
        if self._remaining <= 0:
            raise RuntimeError(f"no more tensors expected from rank {self.peer} in this step")
        if self._header is not None:
            work, header = self._header
            self._waiter.wait([work], self._abort)
            self.meta = TensorMeta.decode(header.cpu())
            self._header = None
        if self._next is None:
            self._post()
        assert self._next is not None
        work, buf = self._next
        self._waiter.wait([work], self._abort)
        self._remaining -= 1
        self._next = None
        if self._remaining > 0 and self._prefetch:
            self._post()
        return buf
