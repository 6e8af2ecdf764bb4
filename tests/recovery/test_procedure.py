"""The recovery procedure's table, row by row: every transition it lists, every one it does not, the
settling rule, and the module's documented table equal to the one the code runs."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_oobleck.recovery import procedure
from lightning_oobleck.recovery.procedure import TRANSITIONS, Event, Phase, Procedure, ProcedureError, settle


def at(phase: Phase) -> Procedure:
    p = Procedure()
    p.phase = phase
    return p


@pytest.mark.parametrize(("phase", "event"), sorted(TRANSITIONS, key=str), ids=lambda x: x.value)
def test_each_row_moves_to_its_phase(phase: Phase, event: Event) -> None:
    p = at(phase)
    assert p.fire(event) is TRANSITIONS[(phase, event)] is p.phase
    assert p.history == [(phase, event)]


def test_every_other_pair_is_refused_and_leaves_the_phase() -> None:
    refused = [pair for pair in itertools.product(Phase, Event) if pair not in TRANSITIONS]
    assert refused
    for phase, event in refused:
        p = at(phase)
        with pytest.raises(ProcedureError, match=f"{event.value!r} in phase {phase.value!r}"):
            p.fire(event)
        assert p.phase is phase and not p.history


def test_the_documented_table_is_the_table_the_code_runs() -> None:
    rows = re.findall(r"^([A-Z_]+)\s+([A-Z_]+)\s+([A-Z_]+)\s+\S", procedure.__doc__ or "", re.M)
    documented = {(Phase[a.upper()], Event[b.upper()]): Phase[c.upper()] for a, b, c in rows}
    assert documented == TRANSITIONS


@pytest.mark.parametrize(
    ("done", "newest", "outcome"),
    [
        (5, 5, Event.REDO),
        (4, 5, Event.ADOPT),
        (3, 5, Event.VIOLATED),
        (0, 0, Event.REDO),
        (0, 1, Event.ADOPT),
    ],
)
def test_settle_redoes_adopts_or_refuses(done: int, newest: int, outcome: Event) -> None:
    assert settle(done, newest) is outcome


def test_a_recovery_with_a_failed_attempt_then_a_switch_returns_to_running() -> None:
    """The path a recovery takes when a member is lost during the exchange, then the switch succeeds."""
    p = Procedure()
    for event in (Event.FAILED, Event.AGREED, Event.FAILED, Event.AGREED, Event.EXCHANGED, Event.ADOPT):
        p.fire(event)
    assert p.phase is Phase.SWITCH_PENDING
    assert p.fire(Event.SWITCHED) is Phase.RUNNING
