"""The start of a run: generation 0, one plan for every worker, and the plan for the workers alive.

With a coordinator (:func:`start`), every worker registers first; generation 0 is every worker alive once
all registered or were lost (the local launcher reports a process that ended before it registered). The
lowest worker of the newest agreed generation makes the plan for the whole launch (every node) and
publishes it in the rendezvous store, first writer wins; the others read it, waiting abortably. Workers
lost before the start, while the plan is made or while the first process groups are built are then taken
out of it by the reconfiguration recovery uses, in a newer generation. Nothing has trained yet, so no
state is copied: every layer is initialised from its seed, whatever worker holds it. When the survivors
cannot run without the lost workers, the run stops at once with an error that names them; it never waits
out the plan timeout for a worker known to be dead.

Without a coordinator (:func:`publish_plan` on rank 0, :func:`read_plan` elsewhere) a lost worker ends
the run at the first collective.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.process_groups import ProcessGroups, join_generation
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.reconfigure import ReconfigurationError, after_failures
from lightning_oobleck.recovery.agent import WorkerAgent
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.store import wait_for_keys, wait_for_members

log = logging.getLogger(__name__)

PLAN_KEY = "oobleck/plan"


class StartFailure(RuntimeError):
    """The run cannot start: the workers lost before the first step took what the survivors need.

    ``lost`` are the nodes this worker saw lost. Every survivor raises it, each from its own view: one that
    agreed again after another survivor had already stopped counts that survivor among the lost too, so the
    view naming the fewest nodes is the cause."""

    def __init__(self, message: str, lost: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.lost = lost


class PlanFailure(RuntimeError):
    """No plan could be made (a configuration the planner refuses, a model that cannot be profiled): raised
    alike on the worker that planned and on every worker that waited for its plan."""


def publish_plan(store: dist.Store, make_plan: Callable[[], Plan], who: str = "rank 0") -> Plan:
    """Make the plan and publish it; the first plan published wins and is returned. When ``make_plan``
    fails, its error is published for the readers and raised here as the same :class:`PlanFailure`."""
    try:
        value = make_plan().to_json()
    except Exception as e:
        error = f"{who} could not make a plan: {type(e).__name__}: {e}"
        store.compare_set(PLAN_KEY, "", json.dumps({"error": error}))
        raise PlanFailure(error) from e
    return _parse(store.compare_set(PLAN_KEY, "", value))


def read_plan(store: dist.Store, timeout_s: float, abort: threading.Event | None = None) -> Plan | None:
    """The published plan; ``None`` if ``abort`` was set first (a worker was lost: agree again)."""
    try:  # answered by the store when the plan is published
        wait_for_keys(store, [PLAN_KEY], abort, timedelta(seconds=timeout_s), "the plan")
    except PeerFailure:
        if abort is not None and abort.is_set():
            return None
        raise TimeoutError(
            f"no plan was published within plan_timeout_s={timeout_s:g} s: did the worker that makes it "
            "(the lowest rank) start? Raise plan_timeout_s if profiling the model takes longer"
        ) from None
    return _parse(store.get(PLAN_KEY))


def _parse(value: bytes) -> Plan:
    message = json.loads(value)
    if "error" in message:
        raise PlanFailure(message["error"])
    return Plan.from_dict(message)


def start(
    agent: WorkerAgent,
    store: dist.Store,
    make_plan: Callable[[], Plan],
    timeout_s: float,
    *,
    backend: str,
    group_timeout: timedelta,
    slow_after: timedelta | None = None,
) -> tuple[Membership, Plan, ProcessGroups]:
    """Agree on the first generation, its plan and its process groups (module docstring)."""
    worker = agent.worker
    membership = agent.agree(-1, timeout_s)
    launched: Plan | None = None
    while True:
        try:
            if launched is None:
                if membership.workers[0] == worker and not store.check([PLAN_KEY]):
                    who = f"worker {tuple(worker)}"
                    launched = publish_plan(store, make_plan, who)
                else:
                    launched = read_plan(store, timeout_s, agent.abort)
            if launched is not None and not agent.abort.is_set():
                plan = _without_lost(launched, membership)
                wait_for_members(store, membership, worker, "start", agent.abort, group_timeout)
                generation = membership.generation
                groups = join_generation(plan, worker, store, generation, backend, group_timeout, slow_after)
                return membership, plan, groups
        except PeerFailure as e:
            log.warning("starting generation %d failed: %s", membership.generation, e)
        membership = agent.agree(membership.generation, timeout_s)


def _without_lost(plan: Plan, membership: Membership) -> Plan:
    lost = sorted(set(plan.nodes) - set(membership.nodes))
    if not lost:
        return plan
    try:
        reduced = after_failures(plan, lost).plan
    except ReconfigurationError as e:
        raise StartFailure(
            f"node(s) {lost} were lost before training started ({membership.cause}), and the others cannot "
            f"train without them: {e}",
            tuple(lost),
        ) from e
    log.warning(
        "starting without node(s) %s (%s): %d pipeline(s) on %d node(s)",
        lost,
        membership.cause,
        len(reduced.pipelines),
        len(reduced.nodes),
    )
    return reduced
