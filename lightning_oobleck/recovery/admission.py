"""Admitting joiners, the members' side: when to admit the nodes that wait (:class:`JoinPolicy`), the
request to the coordinator at a step boundary, and the handover a joiner needs besides layers.

A training step's commit carries how many whole nodes wait to join (the first worker's view, so that every
worker decides alike); at the next step's start the members ask the coordinator to admit as many as the
policy says, and recover into the generation that includes them as after a failure, with nothing to redo.
The first member at the newest unit hands the joiners the layout, its progress, its optimizer settings and
its training loop's :meth:`~lightning_oobleck.recovery.unit_runner.TrainingLoop.join_state`
(:func:`hand_over`); the joiner's side is :mod:`~lightning_oobleck.recovery.joiner`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import PlannerInputs, PlanningError
from lightning_oobleck.recovery.agent import AgreementTimeout, WorkerAgent
from lightning_oobleck.recovery.errors import UnrecoverableFailure
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.store import dump, handover_key

log = logging.getLogger(__name__)


class JoinPolicy(str, enum.Enum):
    """When the members admit the nodes that wait to join (decided from a step's commit: alike everywhere)."""

    AT_ONCE = "at_once"
    """At the next step boundary; a joiner waiting when a failure interrupts a step joins in its recovery."""
    WHOLE_TEMPLATE = "whole_template"
    """Once the waiting nodes form a pipeline of their own (``n0`` nodes): a join never lengthens the
    pipelines that run."""
    HOT_STANDBY = "hot_standby"
    """Only to replace lost nodes: joiners wait, started, until the plan has fewer nodes than it was made
    for, and as many are admitted as were lost."""

    @property
    def lengthens(self) -> bool:
        """Whether admitted nodes may lengthen running pipelines (when the cost model says it is faster)."""
        return self is not JoinPolicy.WHOLE_TEMPLATE

    def nodes_to_admit(self, waiting: int, plan: Plan) -> int:
        """How many of ``waiting`` whole nodes to admit into ``plan`` now."""
        if waiting <= 0:
            return 0
        if self is JoinPolicy.WHOLE_TEMPLATE:
            return waiting if waiting >= plan.n0 else 0
        if self is JoinPolicy.HOT_STANDBY:
            return min(waiting, max(0, planned_nodes(plan) - len(plan.nodes)))
        return waiting


def planned_nodes(plan: Plan) -> int:
    """The number of nodes ``plan``'s job was planned for (what failures took away and joins give back)."""
    try:
        return PlannerInputs.from_plan(plan).cluster.num_nodes
    except PlanningError:
        return len(plan.nodes)


def request_admission(agent: WorkerAgent, generation: int, nodes: int, timeout_s: float) -> None:
    """Ask the coordinator to admit ``nodes`` waiting nodes after ``generation`` (it announces the next
    generation, which every member recovers into)."""
    try:
        admitted = agent.request_admission(generation, nodes, timeout_s)
    except AgreementTimeout as e:
        raise UnrecoverableFailure(f"the joiners could not be admitted: {e}") from e
    if admitted:
        log.info("admitting %d node(s) at the step boundary (generation %d)", nodes, generation)


@dataclass
class Progress:
    """Where a worker stands: units completed, the last one's result, optimizer steps applied."""

    done: int = 0
    """Units completed in this run (the same count on every worker at the same point of the program)."""
    result: Any = None
    """The result of unit ``done - 1``: what a laggard inside that unit adopts (serialised only then)."""
    steps: int = 0
    """Optimizer steps applied (Lightning's ``global_step``)."""


@dataclass
class Handover:
    """What the members hand a joiner besides layers and optimizer state, taken at the start of the unit
    the members are at."""

    plan: Plan
    """The layout the members hold."""
    lengthen: bool
    """Whether the joiners may lengthen running pipelines (the :class:`JoinPolicy`)."""
    progress: Progress
    settings: list[dict[str, Any]]
    """The members' optimizer hyperparameters per parameter group (the learning rate its schedule set...)."""
    loop_state: Any = field(repr=False)
    """The training loop's counters, schedulers, data position (picklable)."""


def hand_over(
    store: dist.Store,
    membership: Membership,
    plan: Plan,
    lengthen: bool,
    progress: Progress,
    optimizer: torch.optim.Optimizer,
    loop_state: Any,
) -> None:
    """Publish the :class:`Handover` for the joiners of ``membership``'s generation."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    snapshot = Progress(progress.done, progress.result, progress.steps)
    store.set(handover_key(membership), dump(Handover(plan, lengthen, snapshot, settings, loop_state)))
