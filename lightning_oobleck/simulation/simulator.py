"""A training job replayed against a failure trace, under each recovery policy, on the real planner.

The job is a plan from :func:`~lightning_oobleck.planning.planner.make_plan`. Training runs in whole steps
of the plan's predicted iteration time (the cost model's, gradient sync and optimizer step included), each
step ``global_batch_size`` samples; only completed steps count, so a step cut by a failure is redone. The
policies charge, on the same trace:

``oobleck``
    In-place recovery: every loss of plan nodes calls the real
    :func:`~lightning_oobleck.planning.reconfigure.after_failures` (its wall time here is charged), plus
    the detection and the protocol (:class:`Costs`), plus copying the layers that workers newly hold
    (parameters and optimizer state, over the inter-node links, the busiest node's share) and the step in
    progress. Nodes that come back join at the next step boundary
    (:func:`~lightning_oobleck.planning.reconfigure.after_joins`): the members pause for the switch and
    the copy to the joiners. The job also checkpoints, rarely (``oobleck_checkpoint_interval_s``): when no
    layout can continue in place (fewer than ``n0`` nodes, or every replica of a layer lost), it restarts
    from its last checkpoint on the machines up then, with the requested ``f`` or the most they allow. The
    job's coordinator and store run on a machine of the job (SLURM's batch host: the allocation's first
    machine, the first up after a relaunch) with a standby on another (the next one up), started
    ``standby_start_s`` after the job or the last failover: losing the coordinator's machine costs a
    failover (``failover_s``, the standby's machine then hosts it and a new standby starts); losing both at
    once, or the coordinator before its standby runs, a restart from the last checkpoint.
    :attr:`PolicyResult.coordinator_failures` counts the failures that hit the coordinator's machine,
    :attr:`PolicyResult.coordinator_restarts` those that cost a restart.
``oobleck-reroute``, ``oobleck-auto``
    ``oobleck`` with ``recovery_policy="reroute"`` or ``"auto"``
    (:func:`~lightning_oobleck.planning.rerouting.choose_recovery`): a failure reroutes the damaged pipelines'
    lost stages to other pipelines' replicas (no copy, the rerouted plan's slower step; re-instantiation
    where a layer has no live replica left), or, under ``auto``, does whichever trains more samples before
    the layout changes again: the next failure or the lost node's return, whichever comes first (a return
    ends a rerouting, and both ways pay its copy), expected after ``1 / (1 / MTBF + 1 / repair)`` from the
    trace's mean time between failures and mean repair time. Nodes that come back join as under ``oobleck``
    (a re-instantiation, the rerouted pipelines whole again).
``checkpoint-restart``
    A checkpoint every ``checkpoint_interval_s`` of training (Young/Daly's ``sqrt(2 C MTBF)`` by default,
    ``C`` the write time and MTBF the trace's), blocking for the write. A loss of a running node loses the
    work since the last checkpoint and costs the job's restart (requeue and start-up) and the reload; the
    job restarts on the nodes available then, with the plan a fresh ``make_plan`` gives that many nodes
    (``f = 0``). Returned nodes are used from the next restart.
``replica-groups`` (torchft-style)
    Each pipeline of the plan is a replica group. A lost node takes its group out; the others redo the
    step in progress and go on with their share of the batch (fewer samples per step). A group whose nodes
    are all back restarts its processes and heals from a live group (its state over one node's link), then
    rejoins at the next step boundary. With no group left the job waits for one (a real job would restart
    from a checkpoint and lose more: this baseline is optimistic there).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import PlannerInputs, PlanningError
from lightning_oobleck.planning.reconfigure import (
    Reconfiguration,
    ReconfigurationError,
    after_joins,
    copy_time_s,
)
from lightning_oobleck.planning.rerouting import choose_recovery
from lightning_oobleck.planning.templates import InfeasibleTemplateError
from lightning_oobleck.simulation.trace import NodeEvent, Trace

PolicyName = Literal["oobleck", "oobleck-reroute", "oobleck-auto", "checkpoint-restart", "replica-groups"]
POLICIES: tuple[PolicyName, ...] = (
    "oobleck",
    "oobleck-reroute",
    "oobleck-auto",
    "checkpoint-restart",
    "replica-groups",
)
OnEvent = Callable[[], None] | None


@dataclass(frozen=True)
class Costs:
    """What recovery costs besides re-planning (measured as it runs) and iteration times (the cost model).
    Defaults: the in-place costs as measured by ``benchmarks/recovery.py`` and ``benchmarks/rejoin.py``;
    the restart and storage figures of a typical cluster with a parallel file system."""

    detection_s: float = 0.05
    """From a node's loss to the survivors' abort (30-42 ms after a SIGKILL here; a hang waits for the
    heartbeat timeout instead)."""
    protocol_s: float = 0.05
    """Agreement and the new process groups (30-40 ms here)."""
    join_s: float = 0.15
    """The members' pause when nodes join, besides the state copy (0.14 s here)."""
    restart_s: float = 600.0
    """Checkpoint-restart: from the failure to the relaunched job's first step, the reload aside: the
    requeue, scheduling, start-up and process groups of the whole job."""
    group_restart_s: float = 60.0
    """Replica groups: restarting one group's processes once its nodes are back, the heal aside."""
    checkpoint_write_bandwidth: float = 20e9
    """Bytes/s the whole job writes to storage."""
    checkpoint_read_bandwidth: float = 40e9
    """Bytes/s the whole job reads from storage."""
    checkpoint_interval_s: float | None = None
    """Checkpoint-restart: seconds between checkpoints; ``None``: Young/Daly for the trace's failure rate."""
    oobleck_checkpoint_interval_s: float = 3600.0
    """Oobleck: seconds between checkpoints, only needed when a failure leaves no layout to continue."""
    state_copy_link_share: float = 0.85
    """The share of a node's link that a state copy moves: ``benchmarks/state_copy.py`` measures 0.81-1.07 of
    a raw send's speed for the streamed copy from one source (the serialised copy before it reached 0.14).
    Charged to Oobleck's copies and to replica groups' heals alike."""
    coordinator_on_first_machine: bool = True
    """Oobleck: the job's coordinator and store run on the allocation's first machine (SLURM's batch host),
    lost with it. ``False``: they run off the training machines (the local launcher's supervisor)."""
    coordinator_failover: bool = True
    """Oobleck: the coordinator has a standby on another machine, which takes over when it is lost.
    ``False``: the loss of its machine restarts the job from its last checkpoint (before failover)."""
    failover_s: float = 2.5
    """Oobleck: the pause a loss of the coordinator's machine adds to that of its workers: the standby takes
    over at once, and gives the lost machine's workers two heartbeat intervals to reconnect before they are
    declared dead (2.5 s at the default 5 s heartbeat timeout; ``benchmarks/recovery.py`` measures it)."""
    standby_start_s: float = 2.0
    """Oobleck: from the start of the job or a failover until a (new) standby follows the coordinator (a
    process started on another machine: about 1 s measured here)."""


@dataclass(frozen=True)
class Segment:
    """From ``start_s`` to ``end_s`` the job trains at ``samples_per_s`` (0: recovering or down)."""

    start_s: float
    end_s: float
    samples_per_s: float


@dataclass
class PolicyResult:
    """One policy on one trace."""

    policy: PolicyName
    horizon_s: float
    samples: int
    """Samples of completed (and, under checkpoint-restart, kept) steps by the horizon."""
    failure_free_samples: int
    """What the first plan trains in the horizon without failures."""
    recovery_s: float = 0.0
    """Time not training: detection, protocol, re-planning, copies, restarts, reloads, checkpoint writes."""
    lost_s: float = 0.0
    """Training time whose steps were lost (redone)."""
    events: int = 0
    """Trace events that touched the job (losses of running nodes, admitted returns)."""
    replan_s: list[float] = field(default_factory=list)
    """Wall time of each call to the real planner."""
    final_pipelines: int = 0
    coordinator_failures: int = 0
    """Oobleck: failures that hit the coordinator's machine."""
    coordinator_restarts: int = 0
    """Oobleck: those of them that cost a restart (its standby lost too, or not running yet)."""
    segments: list[Segment] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.horizon_s

    @property
    def effective_ratio(self) -> float:
        """Samples trained against the failure-free run's."""
        return self.samples / self.failure_free_samples if self.failure_free_samples else 0.0


class _Clock:
    """Training in whole steps between events: what completes, what is lost, and the throughput segments."""

    def __init__(self, result: PolicyResult) -> None:
        self.result = result
        self.t = 0.0
        self.step_s = math.inf
        self.batch = 0
        self.step_started = 0.0
        self.pending = 0  # samples of completed steps since the last checkpoint
        self.pending_s = 0.0  # and the training time they took
        self.durable = 0

    def set_rate(self, step_s: float, batch: int) -> None:
        self.step_s, self.batch, self.step_started = step_s, batch, self.t

    def _segment(self, start: float, end: float, rate: float) -> None:
        segments = self.result.segments
        if end <= start:
            return
        if segments and segments[-1].end_s == start and segments[-1].samples_per_s == rate:
            segments[-1] = replace(segments[-1], end_s=end)
        else:
            segments.append(Segment(start, end, rate))

    def completed(self, until: float) -> int:
        """Steps that complete between the current step's start and ``until``."""
        if self.batch == 0 or until <= self.step_started:
            return 0
        return int((until - self.step_started) / self.step_s * (1 + 1e-12))

    def train(self, until: float, interrupted: bool) -> int:
        """Train to ``until``; with ``interrupted`` the step in progress there is lost. The steps done."""
        steps = self.completed(until)
        done_at = self.step_started + steps * self.step_s
        self._segment(self.t, until, self.batch / self.step_s if self.batch else 0.0)
        self.pending += steps * self.batch
        self.pending_s += steps * self.step_s if steps else 0.0
        if interrupted:
            self.result.lost_s += max(0.0, until - max(done_at, self.t))
        self.t, self.step_started = until, (until if interrupted else done_at)
        return steps

    def boundary(self, after: float) -> float:
        """The first step boundary at or after ``after``."""
        if self.batch == 0:
            return after
        return self.step_started + math.ceil((after - self.step_started) / self.step_s - 1e-12) * self.step_s

    def pause(self, seconds: float) -> None:
        self._segment(self.t, self.t + seconds, 0.0)
        self.result.recovery_s += seconds
        self.t += seconds
        self.step_started = self.t

    def mark(self) -> None:
        """The steps so far are kept whatever happens next (a checkpoint; the end of the run)."""
        self.durable += self.pending
        self.pending, self.pending_s = 0, 0.0

    def roll_back(self) -> None:
        """Steps since the last mark are lost (a restart from a checkpoint)."""
        self.result.lost_s += self.pending_s
        self.pending, self.pending_s = 0, 0.0


def state_bytes(inputs: PlannerInputs) -> float:
    """One replica of the model's parameters and optimizer state (what a checkpoint holds)."""
    return sum(la.parameter_bytes for la in inputs.profile.layers) * inputs.cost().state_factor


def young_daly_interval_s(write_s: float, mtbf_s: float) -> float:
    """The checkpoint interval minimising the expected loss: ``sqrt(2 C MTBF)``."""
    return math.sqrt(2.0 * write_s * mtbf_s)


class _FreshPlans:
    """The plan a relaunched job gets on ``n`` nodes, with ``f`` failures tolerated or the most that ``n``
    nodes allow; ``None`` where the model does not fit."""

    def __init__(self, plan: Plan, result: PolicyResult, fault_tolerance: int) -> None:
        self.plan, self.result, self.fault_tolerance = plan, result, fault_tolerance

    def __call__(self, num_nodes: int) -> Plan | None:
        started = time.perf_counter()
        plan = _fresh_plan(self.plan, num_nodes, self.fault_tolerance)
        self.result.replan_s.append(time.perf_counter() - started)
        return plan


@functools.lru_cache(maxsize=1024)
def _fresh_plan(plan: Plan, num_nodes: int, fault_tolerance: int) -> Plan | None:
    """:func:`make_plan` for ``plan``'s job on ``num_nodes`` nodes (cached: every policy and trace of a
    simulation asks for the same few node counts)."""
    inputs = PlannerInputs.from_plan(plan)
    cluster = replace(inputs.cluster, num_nodes=num_nodes)
    for f in range(fault_tolerance, -1, -1):
        try:
            return replace(inputs, cluster=cluster, fault_tolerance=f).make_plan(
                plan.global_batch_size, plan.microbatch_size
            )
        except (PlanningError, InfeasibleTemplateError, ValueError):
            continue
    return None


class _Restarts:
    """Checkpoints and restarts, shared by every policy that falls back to them."""

    def __init__(
        self,
        clock: _Clock,
        plan: Plan,
        inputs: PlannerInputs,
        costs: Costs,
        interval_s: float,
        fault_tolerance: int,
    ) -> None:
        self.clock, self.costs, self.interval_s = clock, costs, interval_s
        self.write_s = state_bytes(inputs) / costs.checkpoint_write_bandwidth
        self.reload_s = state_bytes(inputs) / costs.checkpoint_read_bandwidth
        self.fresh = _FreshPlans(plan, clock.result, fault_tolerance)
        self.next_checkpoint = math.inf
        self.steps_per_checkpoint = 1

    def start(self, plan: Plan | None) -> None:
        """Train under ``plan`` from now (``None``: down), the next checkpoint one interval later."""
        if plan is None:
            self.clock.set_rate(math.inf, 0)
            self.next_checkpoint = math.inf
            return
        self.clock.set_rate(plan.iteration_time_s, plan.global_batch_size)
        self.steps_per_checkpoint = max(1, round(self.interval_s / plan.iteration_time_s))
        self.next_checkpoint = self.clock.t + self.steps_per_checkpoint * plan.iteration_time_s

    def train_until(self, until: float, interrupted: bool) -> None:
        """Train to ``until``, writing the checkpoints due before it."""
        while self.next_checkpoint <= until:
            self.clock.train(self.next_checkpoint, interrupted=False)
            self.clock.pause(self.write_s)
            self.clock.mark()
            self.next_checkpoint = self.clock.t + self.steps_per_checkpoint * self.clock.step_s
        self.clock.train(until, interrupted)

    def restart(self, nodes: int) -> Plan | None:
        """Lose the steps since the last checkpoint; relaunch on ``nodes`` nodes (``None``: too few)."""
        self.clock.roll_back()
        plan = self.fresh(nodes)
        if plan is not None:
            self.clock.pause(self.costs.restart_s + self.reload_s)
        self.start(plan)
        return plan


def _failure_free(plan: Plan, horizon_s: float) -> int:
    return int(horizon_s / plan.iteration_time_s) * plan.global_batch_size


class _Machines:
    """Which machines are down, and the node id each live one has in the running plan."""

    def __init__(self, trace: Trace) -> None:
        self.num_nodes = trace.num_nodes
        self.node_id = {n: n for n in range(trace.num_nodes)}
        self.down: set[int] = set()
        self.coordinator = 0
        """The machine of the coordinator and the store: the allocation's first (SLURM's batch host)."""
        self.standby = self._next_up(excluding=0)
        """The machine of its standby (-1: none)."""
        self.standby_ready_s = 0.0
        """When the standby follows (a relaunch or a failover starts a new one)."""

    def _next_up(self, excluding: int, also: Iterable[int] = ()) -> int:
        skip = {excluding, *also, *self.down}
        return next((m for m in range(self.num_nodes) if m not in skip), -1)

    def lose_coordinator(self, failed: Iterable[int], t: float, start_s: float) -> bool:
        """The coordinator's machine fails (with ``failed``) at ``t``: whether its standby takes over (it then
        hosts the coordinator, and a new standby starts, ready ``start_s`` later)."""
        failed = set(failed)
        if self.standby < 0 or self.standby in failed or t < self.standby_ready_s:
            return False
        self.coordinator = self.standby
        self.standby = self._next_up(self.coordinator, failed)
        self.standby_ready_s = t + start_s
        return True

    def lose_standby(self, failed: Iterable[int], t: float, start_s: float) -> None:
        """The standby's machine fails: another starts (if the coordinator's machine is not lost too)."""
        if self.standby in set(failed):
            self.standby = self._next_up(self.coordinator, failed)
            self.standby_ready_s = t + start_s

    def running(self, machines: Iterable[int], plan: Plan | None) -> list[int]:
        """The plan's node ids of ``machines`` that it runs on."""
        nodes = set(plan.nodes) if plan is not None else set()
        return [self.node_id[m] for m in machines if self.node_id.get(m) in nodes]

    def relaunch(self, restarts: _Restarts, t: float, interrupted: bool) -> Plan | None:
        """Train to ``t`` (``interrupted``: a failure there), then restart from the last checkpoint on every
        machine up, numbered afresh (``None``: too few for the model)."""
        restarts.train_until(t, interrupted)
        up = [m for m in range(self.num_nodes) if m not in self.down]
        self.node_id = {machine: k for k, machine in enumerate(up)}
        self.coordinator = up[0] if up else -1
        self.standby = up[1] if len(up) > 1 else -1
        plan = restarts.restart(len(up))
        self.standby_ready_s = restarts.clock.t + restarts.costs.standby_start_s
        return plan


def _interval_s(inputs: PlannerInputs, costs: Costs, trace: Trace) -> float:
    if costs.checkpoint_interval_s is not None:
        return costs.checkpoint_interval_s
    write_s = state_bytes(inputs) / costs.checkpoint_write_bandwidth
    return young_daly_interval_s(write_s, trace.horizon_s / max(trace.failures, 1))


def _finish(result: PolicyResult, restarts: _Restarts, horizon_s: float, plan: Plan | None) -> PolicyResult:
    restarts.train_until(horizon_s, interrupted=False)
    return _close(result, restarts.clock, len(plan.pipelines) if plan is not None else 0)


def _close(result: PolicyResult, clock: _Clock, pipelines: int) -> PolicyResult:
    """The steps done by the horizon count (a job that ends writes its last checkpoint)."""
    clock.mark()
    result.samples = clock.durable
    result.final_pipelines = pipelines
    return result


def _start(
    policy: PolicyName, plan: Plan, trace: Trace, costs: Costs, oobleck: bool
) -> tuple[PlannerInputs, PolicyResult, _Clock, _Restarts, _Machines]:
    """The pieces of a run of ``plan`` on ``trace``: checkpoints at Oobleck's interval and relaunches with
    the requested ``f`` (``oobleck``), or at Young/Daly's with ``f = 0``."""
    _check(plan, trace)
    inputs = PlannerInputs.from_plan(plan)
    result = PolicyResult(policy, trace.horizon_s, 0, _failure_free(plan, trace.horizon_s))
    clock = _Clock(result)
    if oobleck:
        restarts = _Restarts(
            clock, plan, inputs, costs, costs.oobleck_checkpoint_interval_s, inputs.fault_tolerance
        )
    else:
        restarts = _Restarts(clock, plan, inputs, costs, _interval_s(inputs, costs, trace), 0)
    restarts.start(plan)
    return inputs, result, clock, restarts, _Machines(trace)


def simulate_oobleck(
    plan: Plan,
    trace: Trace,
    costs: Costs = Costs(),
    on_event: OnEvent = None,
    rejoin: bool = True,
    recovery: str = "reinstantiate",
) -> PolicyResult:
    """In-place recovery and rejoin on the real planner (see the module's docstring); ``recovery``: the
    strategy's ``recovery_policy``."""
    name: PolicyName = "oobleck" if recovery == "reinstantiate" else f"oobleck-{recovery}"  # type: ignore[assignment]
    inputs, result, clock, restarts, machines = _start(name, plan, trace, costs, oobleck=True)
    # auto's horizon: how long the layout lasts, until the next failure or (rejoining) the lost node's return
    lasts_s = trace.horizon_s / max(trace.failures, 1)
    if rejoin and (repair_s := trace.mean_repair_s):
        lasts_s = 1 / (1 / lasts_s + 1 / repair_s)
    machines.standby_ready_s = costs.standby_start_s
    current: Plan | None = plan
    waiting: list[int] = []  # machines back, not yet admitted

    def switch(reconfiguration: Reconfiguration, started: float, pause_s: float) -> Plan:
        result.replan_s.append(time.perf_counter() - started)
        result.events += 1
        copy_s = copy_time_s(reconfiguration.copies, inputs, costs.state_copy_link_share)
        clock.pause(pause_s + result.replan_s[-1] + copy_s)
        restarts.start(reconfiguration.plan)
        return reconfiguration.plan

    for event in _events(trace, on_event):
        t = max(event.time_s, clock.t)
        if event.kind == "fail":
            machines.down |= set(event.nodes)
            waiting = [m for m in waiting if m not in event.nodes]
            lost = machines.running(event.nodes, current)
            pause_s = costs.detection_s + costs.protocol_s
            if costs.coordinator_on_first_machine and current is not None:
                if machines.coordinator in event.nodes:
                    result.coordinator_failures += 1
                    # the standby starts when the coordinator is lost, recovery or not: the event's own time
                    if not costs.coordinator_failover or not machines.lose_coordinator(
                        event.nodes, event.time_s, costs.standby_start_s
                    ):
                        result.coordinator_restarts += 1  # no coordinator, no store: the job restarts
                        result.events += 1
                        current = machines.relaunch(restarts, t, interrupted=True)
                        continue
                    pause_s += costs.failover_s
                else:
                    machines.lose_standby(event.nodes, event.time_s, costs.standby_start_s)
            if not lost:
                continue
            restarts.train_until(t, interrupted=True)
            started = time.perf_counter()
            try:
                choice = choose_recovery(current, lost, recovery, lasts_s, costs.state_copy_link_share)
                current = switch(choice.reconfiguration, started, pause_s)
            except ReconfigurationError:
                result.events += 1
                current = machines.relaunch(restarts, t, interrupted=False)  # the step is already lost
            continue
        machines.down -= set(event.nodes)
        if current is None:  # the job is down: relaunch on the machines there are
            current = machines.relaunch(restarts, t, interrupted=False)
            result.events += current is not None
        elif rejoin:
            waiting += event.nodes
            restarts.train_until(clock.boundary(t), interrupted=False)
            started = time.perf_counter()
            grown = after_joins(current, len(waiting))
            joined = sorted(set(grown.plan.nodes) - set(current.nodes))
            machines.node_id.update(zip(waiting, joined, strict=True))
            waiting = []
            current = switch(grown, started, costs.join_s)
    return _finish(result, restarts, trace.horizon_s, current)


def simulate_checkpoint_restart(
    plan: Plan, trace: Trace, costs: Costs = Costs(), on_event: OnEvent = None
) -> PolicyResult:
    """Checkpoints and a whole-job restart after every loss of a running node (see the module's docstring)."""
    _, result, clock, restarts, machines = _start("checkpoint-restart", plan, trace, costs, oobleck=False)
    current: Plan | None = plan
    for event in _events(trace, on_event):
        t = max(event.time_s, clock.t)
        if event.kind == "return":
            machines.down -= set(event.nodes)
            if current is None:
                current = machines.relaunch(restarts, t, interrupted=False)
                result.events += current is not None
            continue
        lost = machines.running(event.nodes, current)
        machines.down |= set(event.nodes)
        if lost:
            result.events += 1
            current = machines.relaunch(restarts, t, interrupted=True)
    return _finish(result, restarts, trace.horizon_s, current)


def simulate_replica_groups(
    plan: Plan, trace: Trace, costs: Costs = Costs(), on_event: OnEvent = None
) -> PolicyResult:
    """torchft-style replica groups, one per pipeline of ``plan`` (see the module's docstring)."""
    _check(plan, trace)
    inputs = PlannerInputs.from_plan(plan)
    result = PolicyResult("replica-groups", trace.horizon_s, 0, _failure_free(plan, trace.horizon_s))
    clock = _Clock(result)
    groups = [set(p.nodes) for p in plan.pipelines]
    live = [True] * len(groups)
    ready_at = [math.inf] * len(groups)  # when a restarted group can rejoin
    down: set[int] = set()
    heal_s = {k: _group_state_s(plan, k, inputs, costs.state_copy_link_share) for k in range(len(groups))}
    batch = [p.microbatches * plan.microbatch_size for p in plan.pipelines]

    def rate() -> None:
        samples = sum(b for b, up in zip(batch, live, strict=True) if up)
        clock.set_rate(plan.iteration_time_s, samples)

    def admit_ready(until: float) -> None:
        """Groups whose restart finished before ``until`` rejoin at the step boundary after it."""
        while True:
            pending = [k for k in range(len(groups)) if not live[k] and ready_at[k] <= until]
            if not pending:
                return
            at = max(clock.boundary(min(ready_at[k] for k in pending)), clock.t)
            if at > until:
                return
            clock.train(at, interrupted=False)
            clock.mark()
            for k in pending:
                if ready_at[k] <= at:
                    live[k], ready_at[k] = True, math.inf
                    result.events += 1
            clock.pause(costs.protocol_s)
            rate()

    rate()
    for event in _events(trace, on_event):
        t = max(event.time_s, clock.t)
        admit_ready(t)
        if event.kind == "return":
            down -= set(event.nodes)
            for k, nodes in enumerate(groups):
                if not live[k] and ready_at[k] == math.inf and not nodes & down:
                    ready_at[k] = t + costs.group_restart_s + heal_s[k]
            continue
        down |= set(event.nodes)
        hit = [k for k, nodes in enumerate(groups) if live[k] and nodes & set(event.nodes)]
        for k, nodes in enumerate(groups):
            if not live[k] and nodes & set(event.nodes):
                ready_at[k] = math.inf  # its restart is lost with the node
        if not hit:
            continue
        result.events += 1
        clock.train(t, interrupted=True)
        clock.mark()
        for k in hit:
            live[k] = False
        clock.pause(costs.detection_s + costs.protocol_s)
        rate()
    admit_ready(trace.horizon_s)
    clock.train(trace.horizon_s, interrupted=False)
    return _close(result, clock, sum(live))


def _group_state_s(plan: Plan, group: int, inputs: PlannerInputs, link_share: float) -> float:
    """Healing a group: each of its nodes receives its layers' state from a live group over its link (at
    ``link_share`` of its bandwidth)."""
    pipeline = plan.pipelines[group]
    cost = inputs.cost()
    per_node: dict[int, float] = {}
    for s, stage in enumerate(pipeline.stages):
        node = pipeline.worker_of_stage(s)[0]
        nbytes = sum(inputs.profile.layers[i].parameter_bytes for i in stage.layers) * cost.state_factor
        per_node[node] = per_node.get(node, 0.0) + nbytes
    return max(per_node.values()) / (inputs.cluster.inter_node_bandwidth * link_share)


SIMULATORS: dict[PolicyName, Callable[[Plan, Trace, Costs, OnEvent], PolicyResult]] = {
    "oobleck": simulate_oobleck,
    "oobleck-reroute": functools.partial(simulate_oobleck, recovery="reroute"),
    "oobleck-auto": functools.partial(simulate_oobleck, recovery="auto"),
    "checkpoint-restart": simulate_checkpoint_restart,
    "replica-groups": simulate_replica_groups,
}


def simulate(
    plan: Plan,
    trace: Trace,
    policies: Sequence[str] = POLICIES,
    costs: Costs = Costs(),
    on_event: OnEvent = None,
) -> list[PolicyResult]:
    """Every policy in ``policies`` on ``trace``; ``on_event`` is called after each event of each policy."""
    if unknown := [p for p in policies if p not in SIMULATORS]:
        raise ValueError(f"unknown policy {unknown[0]!r}; use one of {', '.join(POLICIES)}")
    return [SIMULATORS[p](plan, trace, costs, on_event) for p in policies]  # type: ignore[index]


def _check(plan: Plan, trace: Trace) -> None:
    if len(plan.nodes) != trace.num_nodes or sorted(plan.nodes) != list(range(trace.num_nodes)):
        raise ValueError(
            f"the trace is for {trace.num_nodes} nodes but the plan runs on {len(plan.nodes)}: make the plan "
            "for the trace's cluster (nodes 0..N-1)"
        )


def _events(trace: Trace, on_event: Callable[[], None] | None) -> Iterator[NodeEvent]:
    for event in trace.events:
        if event.time_s >= trace.horizon_s:
            return
        yield event
        if on_event is not None:
            on_event()
