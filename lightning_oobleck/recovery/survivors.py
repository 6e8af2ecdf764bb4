"""The survivors' checkpoint: when the survivors cannot go on training (no pipeline can be formed, or more
nodes failed than the plan tolerates) but every layer still has a live replica, they write a checkpoint
to resume from before training ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.checkpoint import (
    commit,
    partial_path,
    shard_name,
    write_metadata,
    write_shard,
)
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.reconfigure import ReconfigurationError
from lightning_oobleck.recovery.errors import UnrecoverableFailure
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.store import member_key, wait_for_keys, wait_for_members
from lightning_oobleck.worker import Worker


def checkpoint_and_stop(
    error: ReconfigurationError,
    store: dist.Store,
    membership: Membership,
    worker: Worker,
    plan: Plan,
    module: StageModule,
    optimizer: torch.optim.Optimizer,
    steps: int,
    checkpoint_dir: Path | None,
    metadata: Callable[[], dict[str, Any]],
    abort: threading.Event,
    timeout: timedelta,
) -> NoReturn:
    """Write a checkpoint of the survivors of ``membership`` (every layer once, from the layout ``plan``
    they hold), then raise :class:`UnrecoverableFailure` saying how to resume.

    Every survivor is at the start of the same unit (laggards applied the unit they adopted first), so
    their states agree; the first member writes the metadata (``metadata()``), from that very point.
    """
    why = f"{error} [lost: {membership.cause}]" if membership.cause else str(error)  # the user sees why
    if plan.tensor_parallel > 1:
        raise UnrecoverableFailure(
            f"{why} (no checkpoint written: the survivors' checkpoint of stages split over several devices "
            "is not in this release; resume from the run's last checkpoint)"
        ) from error
    alive = set(membership.nodes)
    writer = {
        layer: next((w for w in plan.layer_owners(layer) if w[0] in alive), None)
        for layer in range(plan.num_layers)
    }
    lost = [layer for layer, w in writer.items() if w is None]
    if lost or checkpoint_dir is None:
        reason = f"every replica of layers {lost} is lost" if lost else "no checkpoint directory was given"
        raise UnrecoverableFailure(f"{why} (no checkpoint written: {reason})") from error
    path = checkpoint_dir / f"survivors-step{steps}"
    partial = partial_path(path, f"gen{membership.generation}")
    write_shard(partial, module, [optimizer], shard_name(worker), lambda i: writer[i] == worker)
    faults.reach(faults.FaultPoint.CHECKPOINT, worker)
    committed = member_key(membership, "checkpoint-committed", membership.workers[0])
    wait_for_members(store, membership, worker, "checkpoint", abort, timeout)  # a failure: recover again
    if membership.workers[0] == worker:
        shards = {layer: shard_name(w) for layer, w in writer.items() if w is not None}
        write_metadata(partial, metadata(), shards)
        commit(partial, path)
        store.set(committed, b"1")
    else:
        try:
            wait_for_keys(store, [committed], None, timeout, "the survivors' checkpoint commit")
        except PeerFailure as e:
            raise UnrecoverableFailure(f"{why} (the survivors' checkpoint was not committed: {e})") from error
    raise UnrecoverableFailure(
        f"{why}. The survivors wrote a checkpoint of step {steps} to {path}: resume "
        f"with Trainer.fit(ckpt_path={str(path)!r}) on a new allocation"
    ) from error
