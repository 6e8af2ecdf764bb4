"""The error that ends training in place."""

from __future__ import annotations


class UnrecoverableFailure(RuntimeError):
    """Training cannot continue in place; the message says how to resume."""
