"""Errors of the execution engine."""

from __future__ import annotations


class PeerFailure(RuntimeError):
    """A peer this worker communicates with is dead, silent, or the wait was aborted.

    Raised instead of blocking for the whole process-group timeout: the caller (recovery) rebuilds the
    process groups for a new membership; the current generation's groups are unusable afterwards.
    """
