"""Errors of the execution engine, and which communication errors mean "a peer was lost"."""

from __future__ import annotations

import torch.distributed as dist


class PeerFailure(RuntimeError):
    """A peer this worker communicates with is dead, silent, or the wait was aborted.

    Raised instead of blocking for the whole process-group timeout: the caller (recovery) rebuilds the
    process groups for a new membership; the current generation's groups are unusable afterwards.
    """


PEER_LOST_MESSAGES = (
    "connection reset",
    "connection closed",
    "broken pipe",
    "connection refused",
    "timed out",
    "application timeout caused pair closure",
)
"""Fragments of the messages of plain ``RuntimeError``s that gloo raises when a peer died or went silent
(gloo reports every transport error as a ``RuntimeError``; NCCL and the stores raise typed errors)."""


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error``, raised by a collective or point-to-point operation, means a peer was lost.

    By type first: ``DistNetworkError`` and ``DistBackendError`` (NCCL, c10d's network layer) and
    ``TimeoutError``; a plain ``RuntimeError`` only by its message (:data:`PEER_LOST_MESSAGES`), which is
    how gloo reports resets, closed pairs and timeouts. Anything else (a shape mismatch, a user bug) is not
    a peer failure and must not be recovered from.
    """
    if isinstance(error, dist.DistNetworkError | dist.DistBackendError | TimeoutError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in message for m in PEER_LOST_MESSAGES)
