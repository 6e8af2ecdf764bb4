"""The joiner's path into a running training: wait until admitted, take the new plan's role, receive its
layers and optimizer state from live replicas, and start where the members are."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.process_groups import ProcessGroups, join_generation
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.execution.tensor_parallel import LayerPlans, declared_plan
from lightning_oobleck.planning.reconfigure import ReconfigurationError
from lightning_oobleck.recovery.admission import Handover, Progress
from lightning_oobleck.recovery.agent import WorkerAgent
from lightning_oobleck.recovery.errors import UnrecoverableFailure
from lightning_oobleck.recovery.events import RecoveryEvent
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.state_transfer import LayerBuilder, ParamState, transfer_state
from lightning_oobleck.recovery.store import (
    exchange_positions,
    handover_key,
    load,
    wait_for_keys,
    wait_for_members,
)
from lightning_oobleck.recovery.switch import next_plan, switch_barrier

log = logging.getLogger(__name__)


@dataclass
class Admission:
    """What a joiner holds once admitted (:func:`join_training`): its generation, layers and optimizer
    state, the members' position, and what their training loop handed over."""

    membership: Membership
    event: RecoveryEvent
    groups: ProcessGroups
    module: StageModule
    state: ParamState
    settings: list[dict[str, Any]]
    """The members' optimizer hyperparameters per parameter group (the learning rate its schedule set...)."""
    progress: Progress
    loop_state: Any = field(repr=False)


def join_training(
    agent: WorkerAgent,
    store: dist.Store,
    build_layers: LayerBuilder,
    device: torch.device,
    *,
    backend: str = "gloo",
    group_timeout: timedelta = timedelta(seconds=30),
    slow_after: timedelta | None = None,
    wait_timeout: float | None = None,
    agreement_timeout: float = 60.0,
    max_attempts: int = 4,
    tensor_parallel_plan: LayerPlans = declared_plan,
) -> Admission:
    """A joiner's way into a running training: wait, pending, until the members admit it at a step
    boundary (``wait_timeout``: how long, ``None`` for as long as the training runs), then take the new
    plan's role: its layers and their optimizer state from live replicas (the same copy as a recovery),
    the members' position and what their training loop hands over.

    A failure before this worker's copy is complete starts over with the next generation; once it took
    part in the switch barrier, members may run the new layout, so a failure then raises
    :class:`UnrecoverableFailure` (this joiner leaves and the members recover without it).
    ``tensor_parallel_plan``: how the model's layers split at tensor parallelism ``t > 1``. Raises
    :class:`~lightning_oobleck.recovery.agent.TrainingFinished` if the training ends first.
    """
    after = -1
    for attempt in range(1, max_attempts + 1):
        agent.wait_announced(after, wait_timeout)  # pending until the members admit it
        membership = agent.agree(after, agreement_timeout)
        after = membership.generation
        event = RecoveryEvent.from_membership(membership)
        groups: ProcessGroups | None = None
        try:
            records = exchange_positions(
                store, membership, agent.worker, {"joining": True}, agent.abort, group_timeout
            )
            key = handover_key(membership)
            wait_for_keys(store, [key], agent.abort, group_timeout, "the members' handover")
            handover: Handover = load(store.get(key))
            joined = sorted({w.node for w, r in records.items() if r.get("joining")})
            reconfiguration = next_plan(handover.plan, membership, joined, handover.lengthen)
            if isinstance(reconfiguration, ReconfigurationError):
                raise UnrecoverableFailure(f"the members cannot continue: {reconfiguration}")
            event.mark("replanned")
            wait_for_members(store, membership, agent.worker, "switch", agent.abort, group_timeout)
            groups = join_generation(
                reconfiguration.plan,
                agent.worker,
                store,
                membership.generation,
                backend,
                group_timeout,
                slow_after,
            )
            event.mark("rebuilt")
            faults.reach(faults.FaultPoint.ADMISSION, agent.worker)
            module, state, copied = transfer_state(
                StageModule({}),
                {},
                reconfiguration.copies,
                groups,
                build_layers,
                agent.abort,
                device,
                tensor_parallel_plan=tensor_parallel_plan,
            )
        except PeerFailure as e:
            log.warning("admission into generation %d failed (attempt %d): %s", after, attempt, e)
            if groups is not None:
                groups.abort(str(e))
            continue
        try:
            event.copied_bytes, event.copy_senders = switch_barrier(groups, device, agent.abort, copied)
        except PeerFailure as e:
            raise UnrecoverableFailure(
                f"a failure during this joiner's switch to generation {after} ({e}): the members may run its "
                "layout, so it cannot start over; it leaves and they recover without it"
            ) from e
        event.mark("state_copied")
        return Admission(
            membership,
            event,
            groups,
            module,
            state,
            handover.settings,
            handover.progress,
            handover.loop_state,
        )
    raise UnrecoverableFailure(f"admission failed {max_attempts} times in a row (last generation {after})")
