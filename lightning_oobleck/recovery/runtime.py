"""In-process recovery: the procedure a worker runs when its generation's communication fails.

**Step protocol.** Step ``t`` is: 1F1B and gradient sync (:meth:`PipelineEngine.train_step`), then a
*commit*, an all-reduce over every worker of the global squared gradient norm (always issued; it is also
the norm gradient clipping uses), then the local optimizer update. A gradient all-reduce completes only
once every replica contributed, so when the commit completed on any worker, every worker had finished its
gradient sync of step ``t``. After a failure the survivors therefore are in one of two states:

* nobody completed the commit: every survivor is at step ``t - 1``; step ``t``'s gradients are dropped
  and step ``t`` is redone with the same global batch, redistributed over the new pipelines;
* some completed it (and applied step ``t``), others did not: the laggards adopt the committed norm and
  apply step ``t`` locally under the old layout, before any state is copied.

**Recovery** (:meth:`Recovery.recover`): agree on the new membership with the coordinator (the agent),
exchange each survivor's position through the rendezvous store (the only channel that does not depend
on the new plan), settle the step as above, compute the new plan with
:func:`~lightning_oobleck.planning.reconfigure.after_failures` (deterministic: every survivor gets the
same plan from the same inputs), build the new generation's process groups, copy the layers and
optimizer state the new plan moves (:mod:`~lightning_oobleck.recovery.state_transfer`), and switch the
engine to the new layout. The switch is committed like a step: a barrier after the copy; a worker that
copied but missed the barrier (a failure right then) adopts the copied layout in the next recovery, since
the barrier's completion anywhere proves that every worker had finished its copy.

A failure during recovery (a peer lost, an abort, a bounded wait running out) starts over with the next
generation, at most ``max_attempts`` times. When the survivors cannot form a pipeline, or more failed than
the plan tolerates, :class:`UnrecoverableFailure` is raised; if every layer still has a live replica the
survivors first write a checkpoint (:mod:`torch.distributed.checkpoint`, global names) to resume from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oobleck.execution.engine import PipelineEngine
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import LayerSource, StageModule, build_stage
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.reconfigure import ReconfigurationError, after_failures
from lightning_oobleck.recovery.agent import AgreementTimeout, WorkerAgent
from lightning_oobleck.recovery.events import EventLog, RecoveryEvent
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.state_transfer import (
    ParamState,
    copy_hyperparameters,
    load_state_by_name,
    state_by_name,
    transfer_state,
)

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[StageModule], torch.optim.Optimizer]
"""Builds the optimizer over a stage module's parameters (the same groups for any set of layers)."""

ApplyUpdate = Callable[[torch.optim.Optimizer, float], None]
"""Applies one step's update given the global squared gradient norm (clip, ``step()``, scheduler...)."""

CheckpointMetadata = Callable[[], dict[str, Any]]
"""The non-tensor entries of a survivors' checkpoint (e.g. Lightning's loops, schedulers, data position),
taken mid-step: the interrupted step must be the one a resume starts with."""


class UnrecoverableFailure(RuntimeError):
    """Training cannot continue in place; the message says how to resume."""


@dataclass
class StepLedger:
    """Where this worker stands in the step protocol."""

    applied: int = 0
    """Optimizer steps applied: the step to run next."""
    synced: bool = False
    """The gradients of step ``applied`` are summed over every replica (its gradient sync finished)."""
    last_commit: list[float] | None = None
    """The committed values of step ``applied - 1`` (``[grad-norm², *extra]``: :meth:`Recovery.commit`)."""


@dataclass(frozen=True)
class RecoveryOutcome:
    """What a recovery did: its event, and the commit of the interrupted step when this worker applied
    it during the recovery (it had missed a commit that other survivors saw), else ``None`` (redo it)."""

    event: RecoveryEvent
    caught_up: list[float] | None


@dataclass
class _Copied:
    """A layout whose state copy finished here but whose switch barrier may not have completed."""

    generation: int
    plan: Plan
    module: StageModule
    state: ParamState


class Recovery:
    """Runs a worker's steps under the step protocol and recovers them in place after failures.

    ``engine`` must wait on ``agent.abort`` (``PipelineEngine(..., abort=agent.abort)``) and
    ``optimizer`` must hold exactly ``engine.module``'s parameters. ``layers``, ``seed`` and ``dtype``
    are what the engine was built with (to materialise layers a worker receives). ``store`` is the
    rendezvous store the process groups use, hosted outside the workers.
    """

    def __init__(
        self,
        agent: WorkerAgent,
        store: dist.Store,
        engine: PipelineEngine,
        optimizer: torch.optim.Optimizer,
        layers: LayerSource,
        make_optimizer: OptimizerFactory,
        apply_update: ApplyUpdate,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        backend: str = "gloo",
        group_timeout: timedelta = timedelta(seconds=30),
        agreement_timeout: float = 60.0,
        max_attempts: int = 4,
        checkpoint_dir: str | Path | None = None,
        checkpoint_metadata: CheckpointMetadata | None = None,
        events: EventLog | None = None,
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
        self.make_optimizer = make_optimizer
        self.apply_update = apply_update
        self.backend = backend
        self.group_timeout = group_timeout
        self.agreement_timeout = agreement_timeout
        self.max_attempts = max_attempts
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_metadata = checkpoint_metadata or (lambda: {"global_step": self.ledger.applied})
        self.events = events
        self.ledger = StepLedger()
        self.plan = engine.plan
        self.module = engine.module
        self.generation = engine.groups.generation
        self.worker = engine.groups.worker
        self.members = agent.members
        """The agreed membership of the generation this worker runs."""
        self._build_layers = partial(build_stage, layers, device=engine.device, seed=seed, dtype=dtype)
        self._copied: _Copied | None = None
        self._pending_groups: ProcessGroups | None = None
        self._abandoned: list[dist.ProcessGroup] = []
        """Groups of failed generations, kept referenced: their destructor would wait like a shutdown."""

    # ------------------------------------------------------------------ the step protocol

    def run_step(
        self,
        attempt: Callable[[PipelineEngine], Tensor | None],
        after_recovery: Callable[[RecoveryOutcome], None] | None = None,
    ) -> tuple[list[float], bool]:
        """Run step ``ledger.applied``'s pipeline part and commit it; after a failure, recover and redo it.

        ``attempt(engine)`` runs this worker's 1F1B and gradient sync under the plan of the moment and
        returns its part of the loss (last stages) or ``None``; it is called again on the new pipelines
        after a recovery, which ``after_recovery`` hears of first. Returns the commit ``[global squared
        gradient norm, global loss]`` and whether a recovery already applied the step (this worker had
        missed a commit that other survivors saw): the caller must then not apply it again.
        """
        while True:
            try:
                if not self.agent.abort.is_set():
                    part = attempt(self.engine)
                    loss = part if part is not None else torch.zeros((), device=self.engine.device)
                    return self.commit(loss.reshape(1)), False
            except PeerFailure as e:
                log.warning("step %d interrupted: %s", self.ledger.applied, e)
            outcome = self.recover()
            if after_recovery is not None:
                after_recovery(outcome)
            if outcome.caught_up is not None:
                return outcome.caught_up, True

    def train_step(self, batch: Callable[[int], tuple[Tensor, Tensor]]) -> float:
        """Run step ``ledger.applied`` to completion (:meth:`run_step`, then the update); return the loss.

        ``batch(step)`` returns that step's whole global batch ``(inputs, targets)``; each pipeline
        takes its slice under the plan of the moment.
        """

        def attempt(engine: PipelineEngine) -> Tensor | None:
            inputs, targets = batch(self.ledger.applied)
            return engine.train_step(
                inputs[engine.batch_slice] if engine.is_first_stage else None,
                targets[engine.batch_slice] if engine.is_last_stage else None,
            )

        committed, applied = self.run_step(attempt)
        if not applied:
            self.apply(committed)
        return committed[1]

    def commit(self, extra: Tensor | None = None) -> list[float]:
        """The step's commit, after :meth:`PipelineEngine.train_step` returned: all-reduce (sum, abortable)
        ``[this worker's part of the squared gradient norm, *extra]`` over every worker.

        ``extra``: more per-worker values to sum in the same all-reduce (e.g. the loss parts). Returns
        ``[global squared gradient norm, *summed extra]``.
        """
        self.ledger.synced = True
        values = self.engine.grad_norm_sq().reshape(1)
        if extra is not None:
            values = torch.cat([values, extra.detach().to(values).reshape(-1)])
        waiter = self.engine.groups.waiter
        with waiter.issuing():
            work = dist.all_reduce(values, async_op=True)
        self._wait_commit(work)
        return values.tolist()

    def _wait_commit(self, work: dist.Work) -> None:
        self.engine.groups.waiter.wait([work], self.agent.abort)

    def apply(self, committed: list[float]) -> None:
        """Apply the committed step locally (``apply_update``) and :meth:`advance`."""
        self.apply_update(self.optimizer, committed[0])
        self.advance(committed)

    def start_at(self, step: int) -> None:
        """Number the steps from ``step`` (a fit resumed from a checkpoint starts past 0)."""
        self.ledger = StepLedger(step)

    def advance(self, committed: list[float]) -> None:
        """Record that the committed step was applied (by :meth:`apply` or by the caller itself)."""
        self.module.zero_grad(set_to_none=True)
        self.ledger = StepLedger(self.ledger.applied + 1, False, committed)

    # ------------------------------------------------------------------ recovery

    def recover(self) -> RecoveryOutcome:
        """Agree on the survivors, settle the step, re-plan, rebuild groups, copy state, switch.

        Raises :class:`UnrecoverableFailure` when training cannot continue in place.
        """
        detected = self.agent.aborted_at
        after = self.generation
        interrupted: RecoveryEvent | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                membership = self.agent.agree(after, self.agreement_timeout)
            except AgreementTimeout as e:
                raise UnrecoverableFailure(f"the survivors did not agree on a membership: {e}") from e
            after = membership.generation
            event = RecoveryEvent.from_membership(membership)
            event.detected_at = event.detected_at or detected
            if self.members is not None:
                # The coordinator's ``removed`` is relative to the previous *announced* generation; one
                # whose agreement or recovery failed is folded into this event: say who left since the
                # generation this worker ran.
                event.removed = [list(w) for w in sorted(set(self.members.workers) - set(membership.workers))]
            if interrupted is not None:
                event.cause = "; ".join(c for c in (interrupted.cause, event.cause) if c)
                event.detected_at = interrupted.detected_at
            interrupted = event
            applied = self.ledger.applied
            try:
                self._recover_to(membership, event)
            except (PeerFailure, dist.DistError) as e:
                log.warning("recovery to generation %d failed (attempt %d): %s", after, attempt, e)
                continue
            self.members = membership
            if self.events is not None and membership.workers[0] == self.worker:
                self.events.recovery(event, step=self.ledger.applied)
            caught_up = self.ledger.last_commit if self.ledger.applied > applied else None
            return RecoveryOutcome(event, caught_up)
        raise UnrecoverableFailure(
            f"recovery failed {self.max_attempts} times in a row (last generation {after}): failures keep "
            "happening; resume from the last checkpoint (Trainer.fit(ckpt_path=...)) on healthy nodes"
        )

    def _recover_to(self, membership: Membership, event: RecoveryEvent) -> None:
        self._drop_groups()
        if membership.added:
            raise UnrecoverableFailure(
                f"workers {[tuple(w) for w in membership.added]} joined during a failure recovery: joining "
                "is done at a step boundary with `oobleck replan --add`, not in this path"
            )
        records = self._exchange(membership)
        self._adopt_copied_layout(records)
        self._settle_step(records)
        failed = set(self.plan.nodes) - set(membership.nodes)
        try:
            reconfiguration = after_failures(self.plan, failed)
        except ReconfigurationError as e:
            self._checkpoint_and_stop(membership, records, e)
        event.mark("replanned")
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
        self._barrier(groups)
        self._install(self._copied)
        event.mark("state_copied")
        self.engine.reconfigure(groups, self.module)
        self._pending_groups = None
        event.mark("resumed")

    def _new_groups(self, plan: Plan, generation: int) -> ProcessGroups:
        try:
            return ProcessGroups(plan, self.worker, self.store, generation, self.backend, self.group_timeout)
        except RuntimeError as e:  # gloo reports a peer lost while connecting as a plain RuntimeError
            if dist.is_initialized():
                dist.destroy_process_group()
            raise PeerFailure(f"building the groups of generation {generation} failed: {e}") from e

    def _drop_groups(self) -> None:
        """Leave the failed generation(s) without waiting for operations stuck on silent peers."""
        self._abandoned += self.engine.groups.abandon()
        if self._pending_groups is not None:
            self._abandoned += self._pending_groups.abandon()
            self._pending_groups = None

    def _exchange(self, membership: Membership) -> dict[tuple[int, int], dict[str, Any]]:
        """Every member's position (layout generation, copied layout, step) through the store."""
        prefix = f"oobleck/recovery/gen{membership.generation}/"
        mine = {
            "layout": self.generation,
            "copied": self._copied.generation if self._copied else -1,
            "applied": self.ledger.applied,
            "synced": self.ledger.synced,
            "last_commit": self.ledger.last_commit,
        }
        self.store.set(f"{prefix}{self.worker[0]}.{self.worker[1]}", json.dumps(mine))
        keys = [f"{prefix}{node}.{device}" for node, device in membership.workers]
        deadline = time.monotonic() + self.group_timeout.total_seconds()
        while not self.store.check(keys):
            if self.agent.abort.is_set():
                raise PeerFailure("another failure happened while the survivors exchanged their positions")
            if time.monotonic() > deadline:
                raise PeerFailure(f"not every survivor published its position within {self.group_timeout}")
            time.sleep(0.005)
        return {
            (w.node, w.device): json.loads(self.store.get(k))
            for w, k in zip(membership.workers, keys, strict=True)
        }

    def _adopt_copied_layout(self, records: dict[tuple[int, int], dict[str, Any]]) -> None:
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

    def _settle_step(self, records: dict[tuple[int, int], dict[str, Any]]) -> None:
        """Finish a step some survivor committed; otherwise drop the interrupted step's gradients."""
        newest = max(r["applied"] for r in records.values())
        if self.ledger.applied == newest - 1 and self.ledger.synced:
            committed = next(r["last_commit"] for r in records.values() if r["applied"] == newest)
            log.warning("step %d was committed by other survivors: applying it here too", newest - 1)
            self.apply(committed)
        elif self.ledger.applied != newest:
            raise UnrecoverableFailure(
                f"this worker applied {self.ledger.applied} steps, other survivors {newest}, and it has no "
                "synced gradients to catch up with: the step protocol was violated"
            )
        self.module.zero_grad(set_to_none=True)
        self.ledger.synced = False

    def _barrier(self, groups: ProcessGroups) -> None:
        flag = torch.ones(1, device=self.engine.device)
        with groups.waiter.issuing():
            work = dist.all_reduce(flag, async_op=True)
        groups.waiter.wait([work], self.agent.abort)

    def _install(self, copied: _Copied) -> None:
        """Make ``copied`` the layout this worker holds, with a fresh optimizer carrying its state."""
        optimizer = self.make_optimizer(copied.module)
        copy_hyperparameters(self.optimizer, optimizer)
        load_state_by_name(optimizer, copied.module, copied.state)
        copied.module.zero_grad(set_to_none=True)
        self.optimizer, self.module, self.plan = optimizer, copied.module, copied.plan
        self.generation = copied.generation

    def _checkpoint_and_stop(
        self,
        membership: Membership,
        records: dict[tuple[int, int], dict[str, Any]],
        error: ReconfigurationError,
    ) -> None:
        """Write a checkpoint of the survivors' settled step (every layer once), then raise.

        ``checkpoint_metadata`` is written by group rank 0, which is a survivor that had applied the
        newest step before :meth:`_settle_step`: a worker that caught up there applied the interrupted
        step's update while its caller still stands in that step, so its metadata would redo the step.
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
        from lightning_oobleck.lightning.checkpoint import save_sharded  # imports Lightning: only here

        path = self.checkpoint_dir / f"survivors-step{self.ledger.applied}"
        newest = max(r["applied"] for r in records.values())
        order = sorted(records, key=lambda w: (records[w]["applied"] != newest, w))
        rank = order.index(self.worker)
        # Taken outside the checkpoint's group: a collective in a user's checkpoint hook fails, not hangs.
        metadata = self.checkpoint_metadata() if rank == 0 else {}
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"gen{membership.generation}/checkpoint/", self.store),
            rank=rank,
            world_size=membership.world_size,
            timeout=self.group_timeout,
        )
        try:
            save_sharded(
                path,
                self.module,
                [self.optimizer],
                metadata,
                is_writer_for_layer=lambda layer: writer[layer] == self.worker,
            )
        finally:
            dist.destroy_process_group()
        raise UnrecoverableFailure(
            f"{error}. The survivors wrote a checkpoint of step {self.ledger.applied} to {path}: resume "
            f"with Trainer.fit(ckpt_path={str(path)!r}) on a new allocation"
        ) from error
