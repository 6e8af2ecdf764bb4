"""In-process recovery: the procedure a worker runs when its generation's communication fails.

**Units.** Everything a worker does with its peers is a *unit*, run by :meth:`Recovery.run`: a training
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

**Recovery** (:meth:`Recovery.recover`): agree on the new membership with the coordinator (the agent),
exchange each survivor's position through the rendezvous store (the only channel that does not depend on
the new plan), settle as above and compute the new plan with
:func:`~lightning_oobleck.planning.reconfigure.after_failures` (deterministic: every survivor gets the
same plan from the same inputs). The *switch* to that plan runs at the start of unit ``D`` on every
worker, laggards included (so that the state they send is the one after their update): wait until every
member arrived, build the new generation's process groups, copy the layers and optimizer state the new
plan moves (:mod:`~lightning_oobleck.recovery.state_transfer`) into the same optimizer object (its
parameter groups regrouped in place, so LR schedulers and every other reference to it stay valid), and
switch the engine. The switch is committed like a unit: a barrier after the copy; a worker that copied
but missed the barrier (a failure right then) adopts the copied layout in the next recovery, since the
barrier's completion anywhere proves that every worker had finished its copy.

**Joins.** A training step (:meth:`Recovery.step`) ends with :meth:`Recovery.commit`, whose all-reduce also
carries how many whole nodes wait to join (the first worker's view, so that every worker decides alike);
at the next step's start the members ask the coordinator to admit as many as the :class:`JoinPolicy`
says, and recover into the generation that includes them as after a failure, with nothing to redo: the
plan grows (:func:`~lightning_oobleck.planning.reconfigure.reconfigure` with the joined nodes), the first
member at the newest unit hands the joiners the layout, its ledger, its optimizer settings and its host's
:meth:`RecoveryHost.join_state`, and the copy fills the joiners from live replicas. The joiner's side is
:func:`join_training`. A failure that interrupts a step while nodes wait admits them in the same
recovery (``at_once``).

A failure during recovery (a peer lost, an abort, a bounded wait running out) starts over with the next
generation, at most ``max_attempts`` times. When the survivors cannot form a pipeline, or more failed than
the plan tolerates, :class:`UnrecoverableFailure` is raised at the switch; if every layer still has a live
replica the survivors first write a checkpoint (:mod:`~lightning_oobleck.execution.checkpoint`) to resume
from.
"""

from __future__ import annotations

import enum
import io
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oobleck.execution.checkpoint import (
    commit,
    partial_path,
    shard_name,
    write_metadata,
    write_shard,
)
from lightning_oobleck.execution.engine import PipelineEngine
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.process_groups import ProcessGroups, join_generation
from lightning_oobleck.execution.stage import (
    LayerInit,
    LayerSource,
    StageModule,
    build_stage,
    reset_parameters,
)
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import PlannerInputs, PlanningError
from lightning_oobleck.planning.reconfigure import Reconfiguration, ReconfigurationError, reconfigure
from lightning_oobleck.recovery.agent import AgreementTimeout, WorkerAgent
from lightning_oobleck.recovery.events import EventLog, RecoveryEvent
from lightning_oobleck.recovery.protocol import Membership, Worker
from lightning_oobleck.recovery.state_transfer import (
    LayerBuilder,
    ParamState,
    load_state_by_name,
    state_by_name,
    transfer_state,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

Unit = Callable[[PipelineEngine], T]
"""One unit of work with the peers under the plan of the moment (see the module docstring)."""


class RecoveryHost(Protocol):
    """What the training loop around a :class:`Recovery` provides (the Lightning glue implements it)."""

    def build_optimizer(self, module: StageModule) -> torch.optim.Optimizer:
        """A new optimizer over ``module``'s parameters with the parameter groups training uses.

        Only its grouping is used: the live optimizer keeps its identity, hyperparameters and state."""
        ...

    def checkpoint_metadata(self) -> dict[str, Any]:
        """The non-tensor entries of a survivors' checkpoint (the loop's counters, schedulers, data
        position), taken at the start of the interrupted unit: a resume must redo exactly that unit."""
        ...

    def switched(self, recovery: Recovery, event: RecoveryEvent) -> None:
        """The worker now runs ``recovery.plan`` on ``recovery.engine`` (called after every switch)."""
        ...

    def join_state(self) -> Any:
        """What a joiner needs besides layers and optimizer state to enter the training here, at the start
        of the interrupted unit (picklable): the loop's counters, schedulers, data position..."""
        ...


class UnrecoverableFailure(RuntimeError):
    """Training cannot continue in place; the message says how to resume."""


@dataclass
class Ledger:
    """Where this worker stands: units completed, the last one's result, optimizer steps applied."""

    done: int = 0
    """Units completed in this run (the same count on every worker at the same point of the program)."""
    result: Any = None
    """The result of unit ``done - 1``: what a laggard inside that unit adopts (serialised only then)."""
    steps: int = 0
    """Optimizer steps applied (Lightning's ``global_step``)."""


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


@dataclass
class Admission:
    """What a joiner holds once admitted (:func:`join_training`): its generation, layers and optimizer
    state, the members' position, and what their host handed over."""

    membership: Membership
    event: RecoveryEvent
    groups: ProcessGroups
    module: StageModule
    state: ParamState
    settings: list[dict[str, Any]]
    """The members' optimizer hyperparameters per parameter group (the learning rate its schedule set...)."""
    ledger: Ledger
    host_state: Any = field(repr=False)


@dataclass
class _Copied:
    """A layout whose state copy finished here but whose switch barrier may not have completed."""

    generation: int
    plan: Plan
    module: StageModule
    state: dict[str, dict[str, Any]]


@dataclass
class _Switch:
    """What the next unit must start with: the agreed membership and the plan for it, or the error that
    stops training (with the survivors' checkpoint first)."""

    membership: Membership
    event: RecoveryEvent
    plan: Reconfiguration | ReconfigurationError


class Recovery:
    """Runs a worker's units under the unit protocol and recovers them in place after failures.

    ``engine`` must wait on ``agent.abort`` (``PipelineEngine(..., abort=agent.abort)``) and
    ``optimizer`` must hold exactly ``engine.module``'s parameters. ``layers``, ``seed``, ``dtype`` and
    ``init`` are what the engine was built with (to materialise layers a worker receives: their values not in
    the state copy, such as non-persistent buffers, come from the same initialisation). ``store`` is the
    rendezvous store the process groups use, hosted outside the workers. ``group_timeout`` bounds every
    wait of a generation (collectives, the store exchange, the arrival of every member at a switch).
    """

    def __init__(
        self,
        agent: WorkerAgent,
        store: dist.Store,
        engine: PipelineEngine,
        optimizer: torch.optim.Optimizer,
        layers: LayerSource,
        host: RecoveryHost,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        init: LayerInit = reset_parameters,
        backend: str = "gloo",
        group_timeout: timedelta = timedelta(seconds=30),
        agreement_timeout: float = 60.0,
        max_attempts: int = 4,
        checkpoint_dir: str | Path | None = None,
        events: EventLog | None = None,
        join_policy: JoinPolicy = JoinPolicy.AT_ONCE,
        admission: Admission | None = None,
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
        self.host = host
        self.backend = backend
        self.group_timeout = group_timeout
        self.agreement_timeout = agreement_timeout
        self.max_attempts = max_attempts
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.events = events
        self._unlogged: list[tuple[RecoveryEvent, int]] = []
        self.ledger = Ledger()
        self.plan = engine.plan
        self.module = engine.module
        self.generation = engine.groups.generation
        self.worker = engine.groups.worker
        self.members = agent.members
        """The agreed membership of the generation this worker runs."""
        self.last_event: RecoveryEvent | None = None
        """The newest recovery this worker took part in."""
        self._build_layers = partial(
            build_stage, layers, device=engine.device, seed=seed, dtype=dtype, init=init
        )
        self._copied: _Copied | None = None
        self._switch: _Switch | None = None
        self._pending_groups: ProcessGroups | None = None
        self._finishing = False
        self._aborted: list[dist.ProcessGroup] = []
        """Groups of failed generations, kept referenced: their destructor would wait like a shutdown."""
        self.join_policy = JoinPolicy(join_policy)
        self._admit_nodes = 0
        """Whole nodes the last step's commit says to admit at the next step boundary."""
        self._in_step = False
        if admission is not None:
            self._admitted(admission)

    def _admitted(self, admission: Admission) -> None:
        """Continue as a joiner admitted by :func:`join_training`: the members' position, the optimizer
        state it received and their optimizer settings."""
        self._check_group_count(len(admission.settings), "the members' optimizer")
        for group, settings in zip(self.optimizer.param_groups, admission.settings, strict=True):
            group.update(settings)
        load_state_by_name(self.optimizer, self.module, admission.state)
        self.ledger = admission.ledger
        self.members = admission.membership
        self.last_event = admission.event
        admission.event.mark("resumed")
        if admission.membership.workers[0] == self.worker:
            self._unlogged.append((admission.event, self.ledger.steps))
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
                log.info("unit %d interrupted: %s", self.ledger.done, e)
                adopted = self.recover()
                if adopted is None:
                    continue
                result = _load(adopted)
            self._completed(result)
            return result

    def _completed(self, result: Any) -> None:
        self.ledger.done += 1
        self.ledger.result = result

    def barrier(self) -> None:
        """A barrier unit."""
        self.run(lambda engine: engine.groups.all_reduce(torch.zeros(1, device=engine.device), engine.abort))

    def commit(
        self,
        engine: PipelineEngine,
        loss: Tensor | None,
        extra: Sequence[float] = (),
        grad_norm: bool = True,
    ) -> list[float]:
        """The training step's final all-reduce (:meth:`PipelineEngine.commit`): the step's result, with
        one more number, the whole nodes waiting to join as the first worker knows them (one view, so that
        every worker decides alike whether to admit them)."""
        waiting = float(self.agent.joiners) if engine.groups.rank == 0 else 0.0
        return engine.commit(loss, (*extra, waiting), grad_norm)

    def step(self, unit: Unit[list[float]]) -> list[float]:
        """A training step: ``unit`` ends with :meth:`commit`; returns its result (without the joiners).

        The step boundary is where nodes join: the nodes the previous step's commit saw waiting, as many as
        the join policy admits, are admitted before this step starts (a recovery into the next generation,
        without a failure), so that a joiner never disturbs a step in progress."""
        if self._admit_nodes:
            nodes, self._admit_nodes = self._admit_nodes, 0
            self._request_admission(self.generation, nodes)
        self._in_step = True
        try:
            *committed, waiting = self.run(unit)
        finally:
            self._in_step = False
        self._admit_nodes = self.join_policy.nodes_to_admit(int(waiting), self.plan)
        return committed

    def _request_admission(self, generation: int, nodes: int) -> None:
        try:
            admitted = self.agent.request_admission(generation, nodes, self.agreement_timeout)
        except AgreementTimeout as e:
            raise UnrecoverableFailure(f"the joiners could not be admitted: {e}") from e
        if admitted:
            log.info("admitting %d node(s) at the step boundary (generation %d)", nodes, generation)

    def train_step(
        self,
        batch: Callable[[int], tuple[Tensor, Tensor]],
        update: Callable[[torch.optim.Optimizer, float], None],
    ) -> float:
        """A whole training step of a plain loop: the step unit, then ``update(optimizer, norm²)``, then
        :meth:`advance`. ``batch(step)`` returns that step's whole global batch ``(inputs, targets)``; each
        pipeline takes its slice under the plan of the moment. Returns the global mean loss."""

        def step(engine: PipelineEngine) -> list[float]:
            engine.module.zero_grad(set_to_none=True)
            inputs, targets = batch(self.ledger.steps)
            loss = engine.train_step(
                inputs[engine.batch_slice] if engine.is_first_stage else None,
                targets[engine.batch_slice] if engine.is_last_stage else None,
            )
            return self.commit(engine, loss)

        committed = self.step(step)
        update(self.optimizer, committed[0])
        self.advance()
        return committed[1]

    def start_at(self, step: int) -> None:
        """Number the optimizer steps from ``step`` (a fit resumed from a checkpoint starts past 0)."""
        self.ledger.steps = step

    def advance(self) -> None:
        """Record that an optimizer step was applied."""
        self.ledger.steps += 1

    def finish(self) -> None:
        """The last unit of a run (a barrier): when it completes anywhere, every worker finished every unit.

        A worker that completes it says so in the store before it leaves, so that a worker still in the
        barrier when a peer fails finishes too instead of redoing work with the survivors.
        """
        self._finishing = True
        self.barrier()
        self._switch = None
        self.store.set(self._finished_key(), b"1")

    def _finished_key(self) -> str:
        return f"oobleck/recovery/finished/gen{self.generation}"

    # ------------------------------------------------------------------ recovery

    def recover(self) -> bytes | None:
        """Agree on the survivors, settle the units, re-plan; the switch runs at the next unit's start.

        Returns the serialised result of the interrupted unit when other survivors completed it (this
        worker then returns it as the unit's result), else ``None`` (redo the unit).
        """
        detected = self.agent.aborted_at
        after = self.generation if self._switch is None else self._switch.membership.generation
        if self._in_step and self.join_policy is JoinPolicy.AT_ONCE and self.agent.joiners:
            self._request_admission(after, self.agent.joiners)  # the failure's generation admits them too
        previous = self.last_event
        for attempt in range(1, self.max_attempts + 1):
            try:
                membership = self.agent.agree(after, self.agreement_timeout)
            except AgreementTimeout as e:
                raise UnrecoverableFailure(f"the survivors did not agree on a membership: {e}") from e
            after = membership.generation
            if self._finishing and self.store.check([self._finished_key()]):
                return _dump(None)  # the last unit completed elsewhere: every unit of the run is done
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
            previous = self.last_event = event
            self._drop_groups()
            try:
                records = self._exchange(membership)
            except PeerFailure as e:
                log.warning("recovery to generation %d failed (attempt %d): %s", after, attempt, e)
                continue
            members = {w: r for w, r in records.items() if not r.get("joining")}
            self._adopt_copied_layout(members)
            newest = max(r["done"] for r in members.values())
            joined = sorted({w.node for w in records} - {w.node for w in members})
            if joined:
                self._hand_over(membership, members, newest)
            plan = next_plan(self.plan, membership, joined, self.join_policy.lengthens)
            event.mark("replanned")
            self._switch = _Switch(membership, event, plan)
            if self.ledger.done == newest:
                return None
            if self.ledger.done == newest - 1:
                source = next(w for w, r in members.items() if r["done"] == newest)
                log.info("unit %d was completed by other survivors: adopting its result", self.ledger.done)
                return self._read(membership, source, "result")
            raise UnrecoverableFailure(
                f"this worker completed {self.ledger.done} units, other survivors {newest}: the unit "
                "protocol was violated (a collective outside Recovery.run?); resume from the last checkpoint"
            )
        raise UnrecoverableFailure(
            f"recovery failed {self.max_attempts} times in a row (last generation {after}): failures keep "
            "happening; resume from the last checkpoint (Trainer.fit(ckpt_path=...)) on healthy nodes"
        )

    def _hand_over(self, membership: Membership, members: dict[Worker, dict[str, Any]], newest: int) -> None:
        """The first member at the newest unit hands the joiners what is not in layers: the layout the
        members hold, its ledger and what the host hands over, taken at the start of that unit."""
        writer = min(w for w, r in members.items() if r["done"] == newest)
        if writer != self.worker:
            return
        handover = {
            "plan": self.plan.to_dict(),
            "lengthen": self.join_policy.lengthens,
            "ledger": Ledger(self.ledger.done, self.ledger.result, self.ledger.steps),
            "settings": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "host": self.host.join_state(),
        }
        self.store.set(_handover_key(membership), _dump(handover))

    def _run_switch(self, switch: _Switch) -> None:
        """Move to the agreed plan with every member: build groups, copy state, barrier, install."""
        membership, event = switch.membership, switch.event
        tolerated = self.plan.fault_tolerance
        self._wait_for_members(membership, "switch")
        if isinstance(switch.plan, ReconfigurationError):
            self._checkpoint_and_stop(membership, switch.plan)
        reconfiguration = switch.plan
        groups = self._pending_groups = self._new_groups(reconfiguration.plan, membership.generation)
        event.mark("rebuilt")
        module, state = transfer_state(
            self.module,
            state_by_name(self.optimizer, self.module),
            reconfiguration.copies,
            groups,
            self._build_layers,
            self.agent.abort,
        )
        self._copied = _Copied(membership.generation, reconfiguration.plan, module, state)
        self._switch_barrier(groups)
        self._install(self._copied)
        self._copied = None
        event.mark("state_copied")
        self.engine.reconfigure(groups, self.module)
        self._pending_groups = None
        self._switch = None
        self.members = membership
        event.mark("resumed")
        event.fault_tolerance = reconfiguration.plan.fault_tolerance
        event.warnings = list(reconfiguration.plan.warnings)
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
            self._unlogged.append((event, self.ledger.steps))
            self.log_events(self.events)
        self.host.switched(self, event)

    def log_events(self, events: EventLog | None) -> None:
        """Record recoveries in ``events`` from now on, and those that happened before it was given."""
        self.events = events
        while events is not None and self._unlogged:
            events.recovery(*self._unlogged.pop(0))

    def _switch_barrier(self, groups: ProcessGroups) -> None:
        groups.all_reduce(torch.ones(1, device=self.engine.device), self.agent.abort)

    def _new_groups(self, plan: Plan, generation: int) -> ProcessGroups:
        slow_after = self.engine.groups.slow_after
        return join_generation(
            plan, self.worker, self.store, generation, self.backend, self.group_timeout, slow_after
        )

    def _drop_groups(self) -> None:
        """Leave the failed generation(s) without waiting for operations stuck on silent peers."""
        self._aborted += self.engine.groups.abort()
        if self._pending_groups is not None:
            self._aborted += self._pending_groups.abort()
            self._pending_groups = None

    def _wait_for_members(self, membership: Membership, what: str) -> None:
        wait_for_members(self.store, membership, self.worker, what, self.agent.abort, self.group_timeout)

    def _read(self, membership: Membership, worker: tuple[int, int], what: str) -> bytes:
        return self.store.get(_member_key(membership, what, worker))

    def _exchange(self, membership: Membership) -> dict[tuple[int, int], dict[str, Any]]:
        """Every member's position (layout generation, copied layout, units done) through the store."""
        mine = {
            "layout": self.generation,
            "copied": self._copied.generation if self._copied else -1,
            "done": self.ledger.done,
        }
        self.store.set(_member_key(membership, "result", self.worker), _dump(self.ledger.result))
        return exchange_positions(
            self.store, membership, self.worker, mine, self.agent.abort, self.group_timeout
        )

    def _adopt_copied_layout(self, records: dict[Worker, dict[str, Any]]) -> None:
        """If a survivor switched to a newer layout, its switch barrier proves every worker copied it."""
        newest = max(r["layout"] for r in records.values())
        if newest > self.generation:
            if self._copied is None or self._copied.generation != newest:
                raise UnrecoverableFailure(
                    f"survivors hold the layout of generation {newest}, this worker neither holds nor copied "
                    "it: the recovery protocol was violated; resume from the last checkpoint"
                )
            self._install(self._copied)
        self._copied = None

    def _install(self, copied: _Copied) -> None:
        """Make ``copied`` the layout this worker holds, in the same optimizer object: its parameter
        groups regrouped for the new layers (as the host groups them), the state loaded by name."""
        fresh = self.host.build_optimizer(copied.module)
        self._check_group_count(len(fresh.param_groups), "the optimizer built for the new layers")
        for group, new in zip(self.optimizer.param_groups, fresh.param_groups, strict=True):
            group["params"] = list(new["params"])
        self.optimizer.state = defaultdict(dict)
        load_state_by_name(self.optimizer, copied.module, copied.state)
        copied.module.zero_grad(set_to_none=True)
        self.module, self.plan = copied.module, copied.plan
        self.generation = copied.generation

    def _check_group_count(self, count: int, whose: str) -> None:
        if count != len(self.optimizer.param_groups):
            raise UnrecoverableFailure(
                f"{whose} has {count} param group(s), the running one {len(self.optimizer.param_groups)}: "
                "configure_optimizers must build the same groups for any set of layers (e.g. decay / "
                "no-decay, even when one is empty)"
            )

    def _checkpoint_and_stop(self, membership: Membership, error: ReconfigurationError) -> None:
        """Write a checkpoint of the survivors (every layer once), then raise.

        Every survivor is at the start of the same unit (laggards applied the unit they adopted first), so
        their states agree; the first member writes the metadata, from that very point.
        """
        alive = set(membership.nodes)
        writer = {
            layer: next((w for w in self.plan.layer_owners(layer) if w[0] in alive), None)
            for layer in range(self.plan.num_layers)
        }
        lost = [layer for layer, w in writer.items() if w is None]
        if lost or self.checkpoint_dir is None:
            reason = (
                f"every replica of layers {lost} is lost" if lost else "no checkpoint directory was given"
            )
            raise UnrecoverableFailure(f"{error} (no checkpoint written: {reason})") from error
        path = self.checkpoint_dir / f"survivors-step{self.ledger.steps}"
        partial = partial_path(path, f"gen{membership.generation}")
        write_shard(
            partial,
            self.module,
            [self.optimizer],
            shard_name(self.worker),
            lambda i: writer[i] == self.worker,
        )
        self._wait_for_members(membership, "checkpoint")
        if membership.workers[0] == self.worker:
            shards = {layer: shard_name(w) for layer, w in writer.items() if w is not None}
            write_metadata(partial, self.host.checkpoint_metadata(), shards)
            commit(partial, path)
            self.store.set(_member_key(membership, "checkpoint-committed", self.worker), b"1")
        else:
            self._wait_for(_member_key(membership, "checkpoint-committed", membership.workers[0]))
        raise UnrecoverableFailure(
            f"{error}. The survivors wrote a checkpoint of step {self.ledger.steps} to {path}: resume "
            f"with Trainer.fit(ckpt_path={str(path)!r}) on a new allocation"
        ) from error

    def _wait_for(self, key: str) -> None:
        deadline = time.monotonic() + self.group_timeout.total_seconds()
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise UnrecoverableFailure(
                    f"the survivors' checkpoint was not committed within {self.group_timeout}"
                )
            time.sleep(0.005)


def _dump(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _member_key(membership: Membership, what: str, worker: tuple[int, int]) -> str:
    return f"oobleck/recovery/gen{membership.generation}/{what}/{worker[0]}.{worker[1]}"


def _handover_key(membership: Membership) -> str:
    return f"oobleck/recovery/gen{membership.generation}/handover"


def next_plan(
    plan: Plan, membership: Membership, joined: Sequence[int], lengthen: bool = True
) -> Reconfiguration | ReconfigurationError:
    """The plan for ``membership`` from the layout ``plan`` the members hold (the nodes gone failed; the
    nodes ``joined`` join; ``lengthen``: they may lengthen running pipelines), or why there is none: the
    same on every worker, joiners included."""
    try:
        failed = set(plan.nodes) - set(membership.nodes)
        return reconfigure(plan, failed=failed, joined=joined, lengthen=lengthen)
    except ReconfigurationError as e:
        return e


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
    store.set(_member_key(membership, "position", worker), json.dumps(position))
    wait_for_members(store, membership, worker, "exchange", abort, timeout)
    return {w: json.loads(store.get(_member_key(membership, "position", w))) for w in membership.workers}


def wait_for_key(store: dist.Store, key: str, abort: threading.Event, timeout: timedelta, what: str) -> bytes:
    """The value of ``key`` once it is set (bounded, abortable)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        if abort.is_set():
            raise PeerFailure(f"another failure happened while waiting for {what}")
        if time.monotonic() > deadline:
            raise PeerFailure(f"{what} did not come within {timeout}")
        time.sleep(0.002)
    return store.get(key)


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
) -> Admission:
    """A joiner's way into a running training: wait, pending, until the members admit it at a step
    boundary (``wait_timeout``: how long, ``None`` for as long as the training runs), then take the new
    plan's role: its layers and their optimizer state from live replicas (the same copy as a recovery),
    the members' position and what their host hands over.

    A failure before this worker's copy is complete starts over with the next generation; once it took
    part in the switch barrier, members may run the new layout, so a failure then raises
    :class:`UnrecoverableFailure` (this joiner leaves and the members recover without it). Raises
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
            handover = _load(
                wait_for_key(
                    store, _handover_key(membership), agent.abort, group_timeout, "the members' handover"
                )
            )
            joined = sorted({w.node for w, r in records.items() if r.get("joining")})
            reconfiguration = next_plan(
                Plan.from_dict(handover["plan"]), membership, joined, handover["lengthen"]
            )
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
            module, state = transfer_state(
                StageModule({}), {}, reconfiguration.copies, groups, build_layers, agent.abort, device
            )
        except PeerFailure as e:
            log.warning("admission into generation %d failed (attempt %d): %s", after, attempt, e)
            if groups is not None:
                groups.abort()
            continue
        try:
            groups.all_reduce(torch.ones(1, device=device), agent.abort)  # the members' switch barrier
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
            handover["settings"],
            handover["ledger"],
            handover["host"],
        )
    raise UnrecoverableFailure(f"admission failed {max_attempts} times in a row (last generation {after})")


def wait_for_members(
    store: dist.Store,
    membership: Membership,
    worker: tuple[int, int],
    what: str,
    abort: threading.Event,
    timeout: timedelta,
) -> None:
    """Publish that ``worker`` reached ``what`` and wait (bounded, abortable) until every member did."""
    store.set(_member_key(membership, what, worker), b"1")
    keys = [_member_key(membership, what, w) for w in membership.workers]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        if abort.is_set():
            raise PeerFailure(f"another failure happened while the survivors waited for each other ({what})")
        if time.monotonic() > deadline:
            raise PeerFailure(f"not every survivor reached the {what} within {timeout}")
        time.sleep(0.002)
