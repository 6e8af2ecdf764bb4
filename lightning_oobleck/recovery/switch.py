"""The switch to a new generation: the plan for the agreed membership, the state copy into it, the switch
barrier, and the installation of the copied layout in the live optimizer.

The switch runs at the start of the unit the survivors redo, on every member, laggards included (so that
the state they send is the one after their update): wait until every member arrived, build the new
generation's process groups, copy the layers and optimizer state the new plan moves
(:mod:`~lightning_oobleck.recovery.state_transfer`) into the same optimizer object (its parameter groups
regrouped in place, so LR schedulers and every other reference to it stay valid), and switch the engine.
It is committed like a unit: a barrier after the copy; a worker that copied but missed the barrier (a
failure right then) installs the copied layout in the next recovery (:func:`adopt_copied_layout`), since
the barrier's completion anywhere proves that every worker had finished its copy.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.reconfigure import Reconfiguration, ReconfigurationError, reconfigure
from lightning_oobleck.planning.rerouting import choose_recovery, expected_failure_interval_s
from lightning_oobleck.recovery.errors import UnrecoverableFailure
from lightning_oobleck.recovery.events import RecoveryEvent
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.state_transfer import CopyStats, load_state_by_name
from lightning_oobleck.worker import Worker


@dataclass
class PendingSwitch:
    """What the next unit must start with: the agreed membership and the plan for it, or the error that
    stops training (with the survivors' checkpoint first)."""

    membership: Membership
    event: RecoveryEvent
    plan: Reconfiguration | ReconfigurationError


@dataclass
class CopiedLayout:
    """A layout whose state copy finished here but whose switch barrier may not have completed."""

    generation: int
    plan: Plan
    module: StageModule
    state: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class RecoveryPolicy:
    """How failures are recovered from (:func:`~lightning_oobleck.planning.rerouting.choose_recovery`)."""

    policy: str = "reinstantiate"
    failure_interval_s: float = 3600.0
    """The configured expected time from one failure to the next."""
    replace_failed_after_s: float | None = None
    """When a replacement for a failed node joins (the launcher's ``replace_failed_after_s``), if ever."""
    message_tags: bool = True
    """Whether the backend keeps tagged streams apart (gloo does, NCCL does not)."""

    def horizon_s(self, membership: Membership) -> float:
        """How long the layout chosen after the failure that led to ``membership`` is expected to last
        (:func:`choose_recovery`'s horizon): until the next failure, expected from the configured interval
        and the failures the run has seen (:func:`expected_failure_interval_s`; the same on every member),
        or until the replacement joins, whichever comes first."""
        expected = expected_failure_interval_s(self.failure_interval_s, *membership.observed())
        return expected if self.replace_failed_after_s is None else min(expected, self.replace_failed_after_s)


def next_plan(
    plan: Plan,
    membership: Membership,
    joined: Sequence[int],
    lengthen: bool = True,
    recovery: RecoveryPolicy = RecoveryPolicy(),
    event: RecoveryEvent | None = None,
) -> Reconfiguration | ReconfigurationError:
    """The plan for ``membership`` from the layout ``plan`` the members hold (the nodes gone failed; the
    nodes ``joined`` join; ``lengthen``: they may lengthen running pipelines), or why there is none: the
    same on every worker, joiners included. Failures alone are recovered from as ``recovery`` says (the
    choice and its candidates go into ``event``); joiners always re-instantiate (a rerouted pipeline takes
    its micro-batches back)."""
    try:
        failed = set(plan.nodes) - set(membership.nodes)
        if failed and not joined and recovery.policy != "reinstantiate":
            horizon_s = recovery.horizon_s(membership)
            choice = choose_recovery(
                plan, failed, recovery.policy, horizon_s, message_tags=recovery.message_tags
            )
            if event is not None:
                event.recovery_policy, event.horizon_s = choice.policy, horizon_s
                event.candidates = [str(c) for c in choice.candidates]
            return choice.reconfiguration
        return reconfigure(plan, failed=failed, joined=joined, lengthen=lengthen)
    except ReconfigurationError as e:
        return e


def switch_barrier(
    groups: ProcessGroups, device: torch.device, abort: threading.Event, copied: CopyStats
) -> tuple[int, int]:
    """The barrier that commits a switch: its completion anywhere proves every member finished its copy.
    It also sums what the copy moved: the bytes every worker received, and how many workers sent."""
    faults.reach(faults.FaultPoint.SWITCH, groups.worker)
    totals = torch.tensor(
        [copied.received_bytes, int(copied.sent_bytes > 0)], dtype=torch.float64, device=device
    )
    groups.all_reduce(totals, abort)
    return int(totals[0].item()), int(totals[1].item())


def adopt_copied_layout(
    records: dict[Worker, dict[str, Any]], generation: int, copied: CopiedLayout | None
) -> CopiedLayout | None:
    """The layout to install before settling: if a survivor switched to a newer layout than
    ``generation``, its switch barrier proves every worker copied it, so this worker installs ``copied``."""
    newest = max(r["layout"] for r in records.values())
    if newest <= generation:
        return None
    if copied is None or copied.generation != newest:
        raise UnrecoverableFailure(
            f"survivors hold the layout of generation {newest}, this worker neither holds nor copied "
            "it: the recovery protocol was violated; resume from the last checkpoint"
        )
    return copied


def install(
    optimizer: torch.optim.Optimizer,
    copied: CopiedLayout,
    build_optimizer: Callable[[StageModule], torch.optim.Optimizer],
) -> None:
    """Make ``copied``'s layers the ones ``optimizer`` trains, in the same object: its parameter groups
    regrouped for the new layers (as the training loop groups them), the state loaded by name."""
    fresh = build_optimizer(copied.module)
    check_group_count(optimizer, len(fresh.param_groups), "the optimizer built for the new layers")
    for group, new in zip(optimizer.param_groups, fresh.param_groups, strict=True):
        group["params"] = list(new["params"])
    optimizer.state = defaultdict(dict)
    load_state_by_name(optimizer, copied.module, copied.state)
    copied.module.zero_grad(set_to_none=True)


def check_group_count(optimizer: torch.optim.Optimizer, count: int, whose: str) -> None:
    """Refuse an optimizer grouping that differs from the running one (state is regrouped by position)."""
    if count != len(optimizer.param_groups):
        raise UnrecoverableFailure(
            f"{whose} has {count} param group(s), the running one {len(optimizer.param_groups)}: "
            "configure_optimizers must build the same groups for any set of layers (e.g. decay / "
            "no-decay, even when one is empty)"
        )
