"""The rendezvous store as recovery uses it: each generation's keys, and the one bounded, abortable wait.

During a recovery the store is the only channel that does not depend on the new plan: the members publish
their position, the result of the last unit, the joiners' handover and their arrival at each barrier of the
procedure under keys prefixed with the agreed generation, so that keys of an earlier attempt can never be
mistaken for new ones.
"""

from __future__ import annotations

import io
import json
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.worker import Worker

_SLICE = timedelta(seconds=0.02)
"""How long one wait in the store lasts before the abort flag is looked at again."""


def member_key(membership: Membership, what: str, worker: Worker) -> str:
    """The key under which ``worker`` publishes ``what`` in ``membership``'s generation."""
    return f"oobleck/recovery/gen{membership.generation}/{what}/{worker[0]}.{worker[1]}"


def handover_key(membership: Membership) -> str:
    """The key of what the members hand the joiners of ``membership``'s generation."""
    return f"oobleck/recovery/gen{membership.generation}/handover"


def finished_key(generation: int, unit: int) -> str:
    """Set by a worker that completed the run's last unit, unit number ``unit``, in ``generation``."""
    return f"oobleck/recovery/finished/gen{generation}/unit{unit}"


def dump(value: Any) -> bytes:
    """``value`` as store bytes (torch's pickle: tensors included)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def load(data: bytes) -> Any:
    """The value :func:`dump` stored."""
    return torch.load(io.BytesIO(data), weights_only=False)


def wait_for_keys(
    store: dist.Store, keys: list[str], abort: threading.Event | None, timeout: timedelta, what: str
) -> None:
    """Return once every key of ``keys`` is set; raise :class:`PeerFailure` when ``abort`` is set (another
    failure) or ``timeout`` passes, naming ``what`` was waited for."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:  # answered by the store as soon as the last key is set
            store.wait(keys, _SLICE)
            return
        except dist.DistStoreError:  # not yet: look at the abort flag and the deadline
            pass
        if abort is not None and abort.is_set():
            raise PeerFailure(f"another failure happened while waiting for {what}")
        if time.monotonic() > deadline:
            raise PeerFailure(f"{what} did not come within {timeout}")


def wait_for_members(
    store: dist.Store,
    membership: Membership,
    worker: Worker,
    what: str,
    abort: threading.Event,
    timeout: timedelta,
) -> None:
    """Publish that ``worker`` reached ``what`` and wait (bounded, abortable) until every member did."""
    store.set(member_key(membership, what, worker), b"1")
    keys = [member_key(membership, what, w) for w in membership.workers]
    wait_for_keys(store, keys, abort, timeout, f"every survivor to reach the {what}")


def exchange_positions(
    store: dist.Store,
    membership: Membership,
    worker: Worker,
    position: dict[str, Any],
    abort: threading.Event,
    timeout: timedelta,
) -> dict[Worker, dict[str, Any]]:
    """Every member's ``position`` (layout generation, copied layout, units done; ``joining`` for a
    joiner) through the store, once every member published its own."""
    store.set(member_key(membership, "position", worker), json.dumps(position))
    wait_for_members(store, membership, worker, "exchange", abort, timeout)
    return {
        Worker(*w): json.loads(store.get(member_key(membership, "position", w))) for w in membership.workers
    }
