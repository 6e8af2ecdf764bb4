"""The recovery procedure as a table: the phases a worker's units pass through, and what moves them.

:class:`~lightning_oobleck.recovery.unit_runner.UnitRunner` drives it: every step of its recovery fires an
:class:`Event` at its :class:`Procedure`, which moves to the phase :data:`TRANSITIONS` names or raises
:class:`ProcedureError` (a bug, never a failure of the cluster). The table, in words:

================  =====================  ================  ==================================================
phase             event                  next phase        what happened
================  =====================  ================  ==================================================
RUNNING           FAILED                 AGREEING          a unit's communication failed, or a join announced
AGREEING          AGREED                 EXCHANGING        the coordinator announced the next membership
AGREEING          FINISHED_ELSEWHERE     RUNNING           the run's last unit completed on another worker
EXCHANGING        EXCHANGED              SETTLING          every member's position is read from the store
EXCHANGING        FAILED                 AGREEING          a member was lost meanwhile: the next attempt
SETTLING          REDO                   SWITCH_PENDING    this worker is at the newest unit: redo it
SETTLING          ADOPT                  SWITCH_PENDING    others completed this unit: adopt their result
SETTLING          VIOLATED               STOPPED           positions differ by more than one unit
SWITCH_PENDING    SWITCHED               RUNNING           groups built, state copied, switch barrier passed
SWITCH_PENDING    FAILED                 AGREEING          a failure during the switch: the next attempt
SWITCH_PENDING    NO_PLAN                CHECKPOINTING     the survivors cannot train: they write a checkpoint
CHECKPOINTING     FAILED                 AGREEING          a survivor lost while writing it: the next attempt
AGREEING          GAVE_UP                STOPPED           too many attempts, or no agreement in time
================  =====================  ================  ==================================================

A worker runs units only in ``RUNNING``; ``STOPPED``, and ``CHECKPOINTING`` once the checkpoint is written
(or cannot be), end training with :class:`~lightning_oobleck.recovery.errors.UnrecoverableFailure`.
"""

from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    """Where a worker is in the procedure."""

    RUNNING = "running"
    AGREEING = "agreeing"
    EXCHANGING = "exchanging"
    SETTLING = "settling"
    SWITCH_PENDING = "switch_pending"
    CHECKPOINTING = "checkpointing"
    STOPPED = "stopped"


class Event(str, enum.Enum):
    """What moves the procedure (see the module's table)."""

    FAILED = "failed"
    AGREED = "agreed"
    FINISHED_ELSEWHERE = "finished_elsewhere"
    EXCHANGED = "exchanged"
    REDO = "redo"
    ADOPT = "adopt"
    VIOLATED = "violated"
    SWITCHED = "switched"
    NO_PLAN = "no_plan"
    GAVE_UP = "gave_up"


P, E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (P.RUNNING, E.FAILED): P.AGREEING,
    (P.AGREEING, E.AGREED): P.EXCHANGING,
    (P.AGREEING, E.FINISHED_ELSEWHERE): P.RUNNING,
    (P.EXCHANGING, E.EXCHANGED): P.SETTLING,
    (P.EXCHANGING, E.FAILED): P.AGREEING,
    (P.SETTLING, E.REDO): P.SWITCH_PENDING,
    (P.SETTLING, E.ADOPT): P.SWITCH_PENDING,
    (P.SETTLING, E.VIOLATED): P.STOPPED,
    (P.SWITCH_PENDING, E.SWITCHED): P.RUNNING,
    (P.SWITCH_PENDING, E.FAILED): P.AGREEING,
    (P.SWITCH_PENDING, E.NO_PLAN): P.CHECKPOINTING,
    (P.CHECKPOINTING, E.FAILED): P.AGREEING,
    (P.AGREEING, E.GAVE_UP): P.STOPPED,
}
"""``(phase, event) -> next phase``: the module's table."""
del P, E


class ProcedureError(RuntimeError):
    """An event the table does not allow in the current phase: the recovery code is wrong."""


def settle(done: int, newest: int) -> Event:
    """What a worker that completed ``done`` units does when the newest survivor completed ``newest``: redo
    the unit it is in, adopt the result of the unit others completed, or report a violated protocol."""
    if done == newest:
        return Event.REDO
    if done == newest - 1:
        return Event.ADOPT
    return Event.VIOLATED


class Procedure:
    """One worker's position in the table; starts ``RUNNING``."""

    def __init__(self) -> None:
        self.phase = Phase.RUNNING
        self.history: list[tuple[Phase, Event]] = []

    def fire(self, event: Event) -> Phase:
        """Move on ``event``; raise :class:`ProcedureError` if the table has no such transition."""
        try:
            after = TRANSITIONS[(self.phase, event)]
        except KeyError:
            raise ProcedureError(
                f"recovery event {event.value!r} in phase {self.phase.value!r}: the table has no such "
                "transition (a bug in the recovery code)"
            ) from None
        self.history.append((self.phase, event))
        self.phase = after
        return after
