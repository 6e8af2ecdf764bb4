"""In-process recovery: the unit protocol, and the procedure a worker runs when its generation's
communication fails.

**Units.** Everything a worker does with its peers is a *unit*, run by :meth:`UnitRunner.run`: a training
step (1F1B and gradient sync, then a *commit*: one all-reduce over every worker of the squared gradient
norm and the loss), an evaluation step, a reduce, a broadcast, a barrier, a checkpoint save. Workers run
the same units in the same order (the training loop is the same program on every worker), and every unit
ends with an all-reduce over every worker of the generation. An all-reduce completes only once every
worker contributed, so when unit ``k`` completed on any worker, every worker had done all of unit ``k``
but its result. After a failure the survivors are therefore in one of two places:

* inside unit ``k = D``, the newest unit any survivor is in: it is redone on the new generation (a
  training step with the same global batch re-cut for the new pipelines, a reduce with the same input,
  a checkpoint written anew);
* inside the final all-reduce of unit ``D - 1``, which other survivors completed (*laggards*): they
  adopt its result (the commit of a training step, the reduced value, ...) from a survivor that holds it
  and return it as if their all-reduce had completed, so the code after the unit (the optimizer update
  through the training loop's own code, clipping, hooks, schedulers) runs exactly as on every other worker.

**Recovery** (:meth:`UnitRunner.recover`, the table of :mod:`~lightning_oobleck.recovery.procedure`): agree
on the new membership with the coordinator (the agent), exchange each survivor's position through the
rendezvous store (:mod:`~lightning_oobleck.recovery.store`, the only channel that does not depend on the
new plan), settle as above and compute the new plan (deterministic: every survivor gets the same plan from
the same inputs). The switch to that plan (:mod:`~lightning_oobleck.recovery.switch`) runs at the start of
unit ``D``. Joiners enter the same way (:mod:`~lightning_oobleck.recovery.admission`,
:mod:`~lightning_oobleck.recovery.joiner`). A failure during recovery starts over with the next generation,
at most ``max_attempts`` times. When the survivors cannot form a pipeline, or more failed than the plan
tolerates, :class:`UnrecoverableFailure` is raised at the switch, after the survivors' checkpoint
(:mod:`~lightning_oobleck.recovery.survivors`) if every layer still has a live replica.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.engine import PipelineEngine, StepResult
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.process_groups import ProcessGroups, join_generation
from lightning_oobleck.execution.stage import LayerSource, StageModule, build_stage
from lightning_oobleck.planning.reconfigure import ReconfigurationError
from lightning_oobleck.recovery.admission import JoinPolicy, Progress, hand_over, request_admission
from lightning_oobleck.recovery.agent import AgreementTimeout, WorkerAgent
from lightning_oobleck.recovery.errors import UnrecoverableFailure
from lightning_oobleck.recovery.events import EventLog, RecoveryEvent
from lightning_oobleck.recovery.joiner import Admission
from lightning_oobleck.recovery.procedure import Event, Procedure, settle
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.state_transfer import load_state_by_name, state_by_name, transfer_state
from lightning_oobleck.recovery.store import (
    dump,
    exchange_positions,
    finished_key,
    load,
    member_key,
    wait_for_members,
)
from lightning_oobleck.recovery.survivors import checkpoint_and_stop
from lightning_oobleck.recovery.switch import (
    CopiedLayout,
    PendingSwitch,
    RecoveryPolicy,
    adopt_copied_layout,
    check_group_count,
    install,
    next_plan,
    switch_barrier,
)
from lightning_oobleck.worker import Worker

log = logging.getLogger(__name__)

T = TypeVar("T")

Unit = Callable[[PipelineEngine], T]
"""One unit of work with the peers under the plan of the moment (see the module docstring)."""

JOINERS = "joiners"
"""The name under which a step's commit carries the whole nodes waiting to join."""


class TrainingLoop(Protocol):
    """What the training loop around a :class:`UnitRunner` provides (the Lightning glue implements it)."""

    def build_optimizer(self, module: StageModule) -> torch.optim.Optimizer:
        """A new optimizer over ``module``'s parameters with the parameter groups training uses.

        Only its grouping is used: the live optimizer keeps its identity, hyperparameters and state."""
        ...

    def checkpoint_metadata(self) -> dict[str, Any]:
        """The non-tensor entries of a survivors' checkpoint (the loop's counters, schedulers, data
        position), taken at the start of the interrupted unit: a resume must redo exactly that unit."""
        ...

    def switched(self, runner: UnitRunner, event: RecoveryEvent) -> None:
        """The worker now runs ``runner.plan`` on ``runner.engine`` (called after every switch)."""
        ...

    def join_state(self) -> Any:
        """What a joiner needs besides layers and optimizer state to enter the training here, at the start
        of the interrupted unit (picklable): the loop's counters, schedulers, data position..."""
        ...


class UnitRunner:
    """Runs a worker's units under the unit protocol and recovers them in place after failures.

    ``engine`` must wait on ``agent.abort`` (``PipelineEngine(..., abort=agent.abort)``) and
    ``optimizer`` must hold exactly ``engine.module``'s parameters. ``layers`` and ``dtype`` are what the
    engine was built with (to allocate the layers a worker receives; the state copy writes them).
    ``store`` is the rendezvous store the process groups use, hosted outside the workers.
    ``group_timeout`` bounds every wait of a generation (collectives, the store exchange, the arrival of
    every member at a switch).
    """

    def __init__(
        self,
        agent: WorkerAgent,
        store: dist.Store,
        engine: PipelineEngine,
        optimizer: torch.optim.Optimizer,
        layers: LayerSource,
        loop: TrainingLoop,
        *,
        dtype: torch.dtype | None = None,
        backend: str = "gloo",
        group_timeout: timedelta = timedelta(seconds=30),
        agreement_timeout: float = 60.0,
        max_attempts: int = 4,
        checkpoint_dir: str | Path | None = None,
        events: EventLog | None = None,
        join_policy: JoinPolicy = JoinPolicy.AT_ONCE,
        admission: Admission | None = None,
        recovery_policy: str = "reinstantiate",
        failure_interval_s: float = 3600.0,
        replace_failed_after_s: float | None = None,
    ) -> None:
        if engine.abort is not agent.abort:
            raise ValueError(
                "the engine does not wait on the agent's abort event, so a worker blocked on a silent "
                "peer would not be released: build it with PipelineEngine(..., abort=agent.abort)"
            )
        self.agent = agent
        self.store = store
        self.engine = engine
        self.optimizer = optimizer
        self.loop = loop
        self.backend = backend
        self.group_timeout = group_timeout
        self.agreement_timeout = agreement_timeout
        self.max_attempts = max_attempts
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.events = events
        self._unlogged: list[tuple[RecoveryEvent, int]] = []
        self.progress = Progress()
        self.plan = engine.plan
        self.module = engine.module
        self.generation = engine.groups.generation
        self.worker = engine.groups.worker
        self.members = agent.members
        """The agreed membership of the generation this worker runs."""
        self.last_event: RecoveryEvent | None = None
        """The newest recovery this worker took part in."""
        self.procedure = Procedure()
        self._build_layers = partial(build_stage, layers, device=engine.device, dtype=dtype, init=None)
        self._copied: CopiedLayout | None = None
        self._switch: PendingSwitch | None = None
        self._pending_groups: ProcessGroups | None = None
        self._finishing = False
        self.join_policy = JoinPolicy(join_policy)
        self.recovery = RecoveryPolicy(
            recovery_policy, failure_interval_s, replace_failed_after_s, message_tags=backend != "nccl"
        )
        self._admit_nodes = 0
        """Whole nodes the last step's commit says to admit at the next step boundary."""
        self._in_step = False
        if admission is not None:
            self._admitted(admission)

    def _admitted(self, admission: Admission) -> None:
        """Continue as a joiner admitted by :func:`~lightning_oobleck.recovery.joiner.join_training`: the
        members' position, the optimizer state it received and their optimizer settings."""
        check_group_count(self.optimizer, len(admission.settings), "the members' optimizer")
        for group, settings in zip(self.optimizer.param_groups, admission.settings, strict=True):
            group.update(settings)
        load_state_by_name(self.optimizer, self.module, admission.state)
        self.progress = admission.progress
        self.members = admission.membership
        self.last_event = admission.event
        admission.event.mark("resumed")
        if admission.membership.workers[0] == self.worker:
            self._unlogged.append((admission.event, self.progress.steps))
            self.log_events(self.events)

    # ------------------------------------------------------------------ units

    def run(self, unit: Unit[T]) -> T:
        """Run ``unit(engine)`` with the peers; after a failure, recover and redo it or adopt its result.

        ``unit`` must end with an all-reduce over every worker (see the module docstring), be safe to call
        again on a new engine after a failure, and return a picklable result. A switch agreed in an earlier
        recovery runs first.
        """
        while True:
            try:
                if self._switch is not None:
                    self._run_switch(self._switch)
                if self.agent.abort.is_set():
                    raise PeerFailure("a failure was announced before the unit started")
                result = unit(self.engine)
            except PeerFailure as e:
                log.info("unit %d interrupted: %s", self.progress.done, e)
                self.procedure.fire(Event.FAILED)
                adopted = self.recover()
                if adopted is None:
                    continue
                result = load(adopted)
            self.progress.done += 1
            self.progress.result = result
            return result

    def barrier(self) -> None:
        """A barrier unit."""
        self.run(lambda engine: engine.groups.all_reduce(torch.zeros(1, device=engine.device), engine.abort))

    def commit(
        self,
        engine: PipelineEngine,
        loss: Tensor | None,
        shared: dict[str, float] | None = None,
        grad_norm: bool = True,
    ) -> StepResult:
        """The training step's final all-reduce (:meth:`PipelineEngine.commit`): the step's result, with
        one more number, the whole nodes waiting to join as the first worker knows them (one view, so that
        every worker decides alike whether to admit them)."""
        waiting = float(self.agent.joiners) if engine.groups.rank == 0 else 0.0
        return engine.commit(loss, {**(shared or {}), JOINERS: waiting}, grad_norm)

    def step(self, unit: Unit[StepResult]) -> StepResult:
        """A training step: ``unit`` ends with :meth:`commit`; returns its result (without the joiners).

        The step boundary is where nodes join: the nodes the previous step's commit saw waiting, as many as
        the join policy admits, are admitted before this step starts (a recovery into the next generation,
        without a failure), so that a joiner never disturbs a step in progress."""
        faults.step_starts(self.worker, self.progress.steps)
        if self._admit_nodes:
            nodes, self._admit_nodes = self._admit_nodes, 0
            request_admission(self.agent, self.generation, nodes, self.agreement_timeout)
        self._in_step = True
        try:
            result = self.run(unit)
        finally:
            self._in_step = False
        sums = dict(result.sums)
        self._admit_nodes = self.join_policy.nodes_to_admit(int(sums.pop(JOINERS)), self.plan)
        return replace(result, sums=sums)

    def start_at(self, step: int) -> None:
        """Number the optimizer steps from ``step`` (a fit resumed from a checkpoint starts past 0)."""
        self.progress.steps = step

    def advance(self) -> None:
        """Record that an optimizer step was applied."""
        self.progress.steps += 1

    def finish(self) -> None:
        """The last unit of a run (a barrier): when it completes anywhere, every worker finished every unit.
        Also where every worker stops together (a SIGTERM, a refused checkpoint) before raising.

        A worker that completes it says so in the store before it leaves, so that a worker still in the
        barrier when a peer fails (or leaves, raising) finishes too instead of redoing work with the
        survivors.
        """
        self._finishing, unit = True, self.progress.done
        try:
            self.barrier()
        finally:
            self._finishing = False
        self._switch = None
        self.store.set(finished_key(self.generation, unit), b"1")

    # ------------------------------------------------------------------ recovery

    def recover(self) -> bytes | None:
        """Agree on the survivors, settle the units, re-plan; the switch runs at the next unit's start.

        Returns the serialised result of the interrupted unit when other survivors completed it (this
        worker then returns it as the unit's result), else ``None`` (redo the unit).
        """
        detected = self.agent.aborted_at
        after = self.generation if self._switch is None else self._switch.membership.generation
        if self._in_step and self.join_policy is JoinPolicy.AT_ONCE and self.agent.joiners:
            # the failure's generation admits the waiting nodes too
            request_admission(self.agent, after, self.agent.joiners, self.agreement_timeout)
        previous = self.last_event
        for attempt in range(1, self.max_attempts + 1):
            try:
                membership = self.agent.agree(after, self.agreement_timeout)
            except AgreementTimeout as e:
                self.procedure.fire(Event.GAVE_UP)
                raise UnrecoverableFailure(f"the survivors did not agree on a membership: {e}") from e
            after = membership.generation
            if self._finishing and self.store.check([finished_key(self.generation, self.progress.done)]):
                self.procedure.fire(Event.FINISHED_ELSEWHERE)
                return dump(None)  # the last unit completed elsewhere: every unit of the run is done
            self.procedure.fire(Event.AGREED)
            event = self._event(membership, previous, detected)
            previous = self.last_event = event
            self._abort_groups()
            try:
                records = self._exchange(membership)
            except PeerFailure as e:
                log.warning("recovery to generation %d failed (attempt %d): %s", after, attempt, e)
                self.procedure.fire(Event.FAILED)
                continue
            self.procedure.fire(Event.EXCHANGED)
            members = {w: r for w, r in records.items() if not r.get("joining")}
            try:
                copied = adopt_copied_layout(members, self.generation, self._copied)
            except UnrecoverableFailure:
                self.procedure.fire(Event.VIOLATED)
                raise
            if copied is not None:
                self._install(copied)
            self._copied = None
            newest = max(r["done"] for r in members.values())
            joined = sorted({w.node for w in records} - {w.node for w in members})
            writer = min(w for w, r in members.items() if r["done"] == newest)
            if joined and writer == self.worker:
                lengthen = self.join_policy.lengthens
                loop_state = self.loop.join_state()
                hand_over(
                    self.store, membership, self.plan, lengthen, self.progress, self.optimizer, loop_state
                )
            plan = next_plan(self.plan, membership, joined, self.join_policy.lengthens, self.recovery, event)
            event.mark("replanned")
            self._switch = PendingSwitch(membership, event, plan)
            outcome = settle(self.progress.done, newest)
            self.procedure.fire(outcome)
            if outcome is Event.REDO:
                return None
            if outcome is Event.ADOPT:
                log.info("unit %d was completed by other survivors: adopting its result", self.progress.done)
                return self.store.get(member_key(membership, "result", writer))
            raise UnrecoverableFailure(
                f"this worker completed {self.progress.done} units, other survivors {newest}: the unit "
                "protocol was violated (a collective outside UnitRunner.run?); resume from the last "
                "checkpoint"
            )
        self.procedure.fire(Event.GAVE_UP)
        raise UnrecoverableFailure(
            f"recovery failed {self.max_attempts} times in a row (last generation {after}): failures keep "
            "happening; resume from the last checkpoint (Trainer.fit(ckpt_path=...)) on healthy nodes"
        )

    def _event(
        self, membership: Membership, previous: RecoveryEvent | None, detected: float | None
    ) -> RecoveryEvent:
        event = RecoveryEvent.from_membership(membership)
        event.detected_at = event.detected_at or detected
        if self.members is not None:
            # The coordinator's ``removed`` is relative to the previous *announced* generation; one
            # whose agreement or recovery failed is folded into this event: say who left since the
            # generation this worker ran.
            event.removed = [list(w) for w in sorted(set(self.members.workers) - set(membership.workers))]
        if previous is not None and previous.resumed_at is None:
            event.cause = "; ".join(c for c in (previous.cause, event.cause) if c)
            event.detected_at = previous.detected_at
        return event

    def _run_switch(self, switch: PendingSwitch) -> None:
        """Move to the agreed plan with every member: build groups, copy state, barrier, install."""
        membership, event = switch.membership, switch.event
        tolerated = self.plan.fault_tolerance
        self._await_members(membership, "switch")
        if isinstance(switch.plan, ReconfigurationError):
            self.procedure.fire(Event.NO_PLAN)
            checkpoint_and_stop(
                switch.plan,
                self.store,
                membership,
                self.worker,
                self.plan,
                self.module,
                self.optimizer,
                self.progress.steps,
                self.checkpoint_dir,
                self.loop.checkpoint_metadata,
                self.agent.abort,
                self.group_timeout,
            )
        reconfiguration = switch.plan
        groups = self._pending_groups = join_generation(
            reconfiguration.plan,
            self.worker,
            self.store,
            membership.generation,
            self.backend,
            self.group_timeout,
            self.engine.groups.slow_after,
        )
        event.mark("rebuilt")
        faults.reach(faults.FaultPoint.STATE_COPY)
        module, state, copied = transfer_state(
            self.module,
            state_by_name(self.optimizer, self.module),
            reconfiguration.copies,
            groups,
            self._build_layers,
            self.agent.abort,
            tensor_parallel_plan=self.engine.tensor_parallel_plan,
        )
        self._copied = CopiedLayout(membership.generation, reconfiguration.plan, module, state)
        event.copied_bytes, event.copy_senders = switch_barrier(
            groups, self.engine.device, self.agent.abort, copied
        )
        self._install(self._copied)
        self._copied = None
        event.mark("state_copied")
        self.engine.reconfigure(groups, self.module)
        self._pending_groups = None
        self._switch = None
        self.members = membership
        self.procedure.fire(Event.SWITCHED)
        event.mark("resumed")
        new_plan = reconfiguration.plan
        event.fault_tolerance = new_plan.fault_tolerance
        event.warnings = list(new_plan.warnings)
        event.tensor_parallel, event.schedule = new_plan.tensor_parallel, new_plan.schedule
        event.predicted_step_s = new_plan.iteration_time_s
        if event.fault_tolerance > tolerated:
            log.info(
                "%d node(s) joined: %d pipelines on %d nodes tolerate f=%d failure(s) again (was %d)",
                len({node for node, _ in event.added}),
                len(reconfiguration.plan.pipelines),
                len(reconfiguration.plan.nodes),
                event.fault_tolerance,
                tolerated,
            )
        if membership.workers[0] == self.worker:
            self._unlogged.append((event, self.progress.steps))
            self.log_events(self.events)
        self.loop.switched(self, event)

    def log_events(self, events: EventLog | None) -> None:
        """Record recoveries in ``events`` from now on, and those that happened before it was given."""
        self.events = events
        while events is not None and self._unlogged:
            events.recovery(*self._unlogged.pop(0))

    def _abort_groups(self) -> None:
        """Leave the failed generation(s) without waiting for operations stuck on silent peers."""
        self.engine.groups.abort("a peer failed")
        if self._pending_groups is not None:
            self._pending_groups.abort("a peer failed during the switch")
            self._pending_groups = None

    def _await_members(self, membership: Membership, what: str) -> None:
        wait_for_members(self.store, membership, self.worker, what, self.agent.abort, self.group_timeout)

    def _exchange(self, membership: Membership) -> dict[Worker, dict[str, Any]]:
        """Every member's position (layout generation, copied layout, units done) through the store."""
        mine = {
            "layout": self.generation,
            "copied": self._copied.generation if self._copied else -1,
            "done": self.progress.done,
        }
        self.store.set(member_key(membership, "result", self.worker), dump(self.progress.result))
        return exchange_positions(
            self.store, membership, self.worker, mine, self.agent.abort, self.group_timeout
        )

    def _install(self, copied: CopiedLayout) -> None:
        install(self.optimizer, copied, self.loop.build_optimizer)
        self.module, self.plan = copied.module, copied.plan
        self.generation = copied.generation
