"""Pipeline schedules as data: one action list per worker and step, a validator and an event simulation.

A schedule is, for every worker, the ordered list of what it does in one training step: compute
(``F`` forward, ``I`` input gradient, ``W`` weight gradients, ``B`` = ``I`` + ``W``), point-to-point
transfers (``SEND``/``RECV`` of an activation or a gradient to or from another worker) and the gradient
sync (``REDUCE`` of one bucket). One executor (:mod:`lightning_oobleck.execution.schedule`) runs any list
that :func:`validate` accepts; the generators here (:data:`SCHEDULES`) are the only place a schedule's
shape is written, and :func:`simulate` times the same lists for the planner.

Identities: workers are ``(node, device)`` as in the plan; a micro-batch is named by its *global* index in
the step (``Plan.microbatch_range``) and every compute action names the layers it runs, so a list can
describe a micro-batch crossing pipelines, or a device running part of its layers for another pipeline.

Transfers. A ``SEND`` posts an asynchronous send and never blocks; a ``RECV`` is where the data is taken
(it blocks until it has arrived). The executor posts an activation's receive *ahead*: the first at the
start of the step, each next one as soon as the one before it has arrived (its buffer is shaped like
it, see :mod:`lightning_oobleck.execution.p2p`); a gradient's receive is posted where it is taken. With
NCCL the transfers between two ranks run one after another in the order they were posted, so both
sides of every pair must post them in the same order; :func:`validate` checks that order, computed
with the rule above, which makes the lists deadlock-free with gloo and NCCL alike.

1F1B and ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24). Stage ``s`` of ``S`` with ``m``
micro-batches runs ``w = min(S - s - 1, m)`` warm-up forwards, then one forward and one backward per
micro-batch, then the ``w`` cool-down backwards. ZB-H1 splits each backward into ``I`` (sent upstream at
once) and ``W``, and defers ``s`` of the ``W`` to the end of the step, where stage ``s`` would otherwise
wait for the stages before it: with ``F = I = W`` its bubble is ``(S - 1)`` time units against 1F1B's
``3 (S - 1)``, at most ``min(S, m)`` micro-batches in flight on any stage, 1F1B's peak (stage 0).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from lightning_oobleck.worker import Worker

SCHEDULE_NAMES = ("1f1b", "zb-h1")
"""The schedules a plan may name."""


class Op(str, Enum):
    F = "F"
    I = "I"  # noqa: E741 (the paper's name)
    W = "W"
    B = "B"
    SEND = "SEND"
    RECV = "RECV"
    REDUCE = "REDUCE"


COMPUTE = (Op.F, Op.I, Op.W, Op.B)
GRADIENT_OPS = (Op.B, Op.W)
"""The actions after which a micro-batch's parameter gradients are complete."""


class Payload(str, Enum):
    ACTIVATION = "activation"
    GRADIENT = "gradient"


@dataclass(frozen=True, slots=True)
class Action:
    """One thing one worker does in a step.

    ``microbatch``: the global micro-batch index (compute and transfers). ``layers``: the layers a compute
    action runs, or a bucket's layers. ``peer``: the other worker of a transfer. ``bucket``: the index of
    a gradient bucket in the worker's issue order (``REDUCE``). ``channel``: the stream of a transfer
    (micro-batches of different routes between the same two workers travel on their own channels, each in
    its own order; :func:`merge`).
    """

    op: Op
    microbatch: int = -1
    layers: tuple[int, ...] = ()
    peer: Worker | None = None
    payload: Payload | None = None
    bucket: int = -1
    channel: int = 0

    def __str__(self) -> str:
        if self.op in COMPUTE:
            return f"{self.op.value}(micro-batch {self.microbatch})"
        if self.op is Op.REDUCE:
            return f"REDUCE(bucket {self.bucket}, layers {list(self.layers)})"
        assert self.payload is not None
        arrow = "to" if self.op is Op.SEND else "from"
        on = f" on channel {self.channel}" if self.channel else ""
        what = f"{self.payload.value} of micro-batch {self.microbatch}"
        return f"{self.op.value}({what} {arrow} {self.peer}{on})"


PhaseTimes = tuple[float, float, float]
"""A stage's ``(F, I, W)`` seconds per micro-batch."""

Schedule = dict[Worker, list[Action]]
"""The action lists of one step, by worker."""


class ScheduleError(ValueError):
    """An action list that cannot run: the message names the worker and the action."""


# ---------------------------------------------------------------------------------------------- generators


@dataclass(frozen=True)
class PipelineSpec:
    """What a generator needs of one pipeline: its workers and layers stage by stage, and the global
    indices of the micro-batches it runs."""

    workers: tuple[Worker, ...]
    layers: tuple[tuple[int, ...], ...]
    microbatches: tuple[int, ...]


Generator = Callable[[int, int, int], list[tuple[Op, int]]]
"""``(num_stages, stage, microbatches)`` -> the stage's compute order, as ``(op, local micro-batch)``."""


def one_f_one_b_order(num_stages: int, stage: int, microbatches: int) -> list[tuple[Op, int]]:
    """1F1B: warm-up forwards, one forward and one whole backward per micro-batch, cool-down backwards."""
    warmup = min(num_stages - stage - 1, microbatches)
    order = [(Op.F, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(Op.F, warmup + i), (Op.B, i)]
    return order + [(Op.B, i) for i in range(microbatches - warmup, microbatches)]


def zb_h1_order(num_stages: int, stage: int, microbatches: int) -> list[tuple[Op, int]]:
    """ZB-H1: 1F1B's order with every backward split into ``I`` and ``W``, and ``stage`` of the ``W``
    deferred into the end of the step."""
    order = []
    weights = 0
    for op, i in one_f_one_b_order(num_stages, stage, microbatches):
        if op is Op.F:
            order.append((Op.F, i))
            continue
        order.append((Op.I, i))
        if i >= stage:
            order.append((Op.W, weights))
            weights += 1
    return order + [(Op.W, i) for i in range(weights, microbatches)]


SCHEDULES: dict[str, Generator] = {"1f1b": one_f_one_b_order, "zb-h1": zb_h1_order}


def check_schedule_name(name: str) -> str:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {list(SCHEDULE_NAMES)}")
    return name


def in_flight_limit(schedule: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches a stage holds activations for at most (forwarded, weight gradients not yet done)."""
    if check_schedule_name(schedule) == "zb-h1":
        return min(num_stages, microbatches)
    return min(num_stages - stage, microbatches)


def pending_weight_limit(schedule: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches a stage holds an input gradient's leftovers for at most (``I`` done, ``W`` not: what
    ``I`` keeps for ``W``). Under ZB-H1 each stage's ``W`` trail its ``I`` by ``stage``, so ``stage + 1`` are
    pending right after an ``I``, at the moment :func:`in_flight_limit` is reached too; 1F1B has none."""
    if check_schedule_name(schedule) == "zb-h1":
        return min(stage + 1, microbatches)
    return 0


def pipeline_actions(
    spec: PipelineSpec,
    schedule: str,
    buckets: Mapping[Worker, Sequence[tuple[int, ...]]] | None = None,
    train: bool = True,
    channel: int = 0,
) -> Schedule:
    """The action lists of one pipeline's workers for one step.

    ``buckets[worker]``: the layers of each of its gradient buckets, in issue order (default: one bucket
    of all its layers); their ``REDUCE`` follow the stage's last gradient action. Without ``train``, every
    stage only forwards (evaluation). ``channel``: the channel of every transfer.
    """
    generator = SCHEDULES[check_schedule_name(schedule)]
    num_stages, m = len(spec.workers), len(spec.microbatches)
    forward, backward, send, recv = Op.F, (Op.I, Op.B), Op.SEND, Op.RECV  # hundreds of thousands at scale
    activation, gradient = Payload.ACTIVATION, Payload.GRADIENT
    out: Schedule = {}
    for s, worker in enumerate(spec.workers):
        prev = spec.workers[s - 1] if s > 0 else None
        nxt = spec.workers[s + 1] if s < num_stages - 1 else None
        layers = spec.layers[s]
        order = generator(num_stages, s, m) if train else [(forward, i) for i in range(m)]
        actions: list[Action] = []
        for op, i in order:
            mb = spec.microbatches[i]
            if op is forward:
                if prev is not None:
                    actions.append(Action(recv, mb, peer=prev, payload=activation, channel=channel))
                actions.append(Action(op, mb, layers))
                if nxt is not None:
                    actions.append(Action(send, mb, peer=nxt, payload=activation, channel=channel))
            elif op in backward:
                if nxt is not None:
                    actions.append(Action(recv, mb, peer=nxt, payload=gradient, channel=channel))
                actions.append(Action(op, mb, layers))
                if prev is not None:
                    actions.append(Action(send, mb, peer=prev, payload=gradient, channel=channel))
            else:
                actions.append(Action(op, mb, layers))
        if train:
            actions += reduce_actions((buckets or {}).get(worker, [layers]))
        out[worker] = actions
    return out


def reduce_actions(buckets: Sequence[tuple[int, ...]]) -> list[Action]:
    """The ``REDUCE`` of each gradient bucket (its layers), in issue order: the end of a worker's list."""
    return [Action(Op.REDUCE, layers=tuple(layers), bucket=b) for b, layers in enumerate(buckets)]


# ---------------------------------------------------------------------------------------------- validation


def _fail(worker: Worker, index: int, action: Action, why: str) -> ScheduleError:
    return ScheduleError(f"worker {worker}, action {index} {action}: {why}")


def _check_worker(
    worker: Worker, actions: Sequence[Action], limit: int | None, bucket_count: int | None
) -> None:
    """The checks one list allows alone: data dependencies, buckets, activations in flight."""
    done: dict[tuple[Op, int], int] = {}
    receives = {(a.payload, a.microbatch): i for i, a in enumerate(actions) if a.op is Op.RECV}
    in_flight: set[int] = set()
    reduced: dict[int, int] = {}
    last_gradient: dict[int, int] = {}  # layer -> index of the last action producing its gradient
    for index, a in enumerate(actions):
        mb = a.microbatch
        if a.op is Op.REDUCE:
            if a.bucket in reduced:
                raise _fail(
                    worker, index, a, f"bucket {a.bucket} is already reduced at action {reduced[a.bucket]}"
                )
            reduced[a.bucket] = index
            continue
        if a.op is Op.RECV:
            continue
        if a.op is Op.SEND:
            source = Op.F if a.payload is Payload.ACTIVATION else None
            if source is not None and (Op.F, mb) not in done:
                raise _fail(worker, index, a, "sends an activation before its forward")
            if a.payload is Payload.GRADIENT and (Op.I, mb) not in done and (Op.B, mb) not in done:
                raise _fail(worker, index, a, "sends an input gradient before its I or B")
            continue
        if (a.op, mb) in done:
            raise _fail(worker, index, a, f"runs twice (first at action {done[(a.op, mb)]})")
        needs = Payload.ACTIVATION if a.op is Op.F else Payload.GRADIENT if a.op in (Op.I, Op.B) else None
        if needs is not None and receives.get((needs, mb), -1) > index:
            raise _fail(worker, index, a, f"runs before the {needs.value} it takes is received")
        if a.op is Op.F:
            in_flight.add(mb)
            if limit is not None and len(in_flight) > limit:
                raise _fail(
                    worker,
                    index,
                    a,
                    f"{len(in_flight)} micro-batches in flight, above the plan's bound of {limit}",
                )
        elif (Op.F, mb) not in done:
            raise _fail(worker, index, a, "runs before the micro-batch's forward")
        if a.op is Op.W and (Op.I, mb) not in done:
            raise _fail(worker, index, a, "runs before the micro-batch's I")
        if (a.op in (Op.I, Op.B) and (Op.B, mb) in done) or (a.op is Op.B and (Op.I, mb) in done):
            raise _fail(worker, index, a, "computes the micro-batch's input gradient twice")
        done[(a.op, mb)] = index
        if a.op in GRADIENT_OPS:
            in_flight.discard(mb)
            for layer in a.layers:
                last_gradient[layer] = index
    missing = sorted(mb for (op, mb) in done if op is Op.I and (Op.W, mb) not in done)
    if missing:
        raise ScheduleError(f"worker {worker}: micro-batch {missing[0]} has its I but no W")
    if bucket_count is not None and sorted(reduced) != list(range(bucket_count)):
        absent = sorted(set(range(bucket_count)) - set(reduced))
        raise ScheduleError(f"worker {worker}: gradient bucket(s) {absent} are never reduced")
    for index in reduced.values():
        a = actions[index]
        late = [last_gradient[layer] for layer in a.layers if last_gradient.get(layer, -1) > index]
        if late:
            raise _fail(
                worker,
                index,
                a,
                f"comes before action {max(late)} {actions[max(late)]}, which adds to its gradients",
            )


def _posted_order(
    worker: Worker, actions: Sequence[Action]
) -> dict[tuple[Worker, int], list[tuple[float, Op, Payload, int]]]:
    """The transfers ``worker`` posts to each peer on each channel, in posting order (the executor's rule,
    see the module)."""
    by_peer: dict[tuple[Worker, int], list[tuple[float, Op, Payload, int]]] = defaultdict(list)
    last_activation: dict[tuple[Worker, int], int] = {}
    for index, a in enumerate(actions):
        if a.op not in (Op.SEND, Op.RECV):
            continue
        assert a.peer is not None and a.payload is not None
        at: float = index
        stream = (a.peer, a.channel)
        if a.op is Op.RECV and a.payload is Payload.ACTIVATION:
            at = last_activation.get(stream, -1) + 0.5  # posted once the one before it has arrived
            last_activation[stream] = index
        by_peer[stream].append((at, a.op, a.payload, a.microbatch))
    return {stream: sorted(posted, key=lambda p: p[0]) for stream, posted in by_peer.items()}


def validate(
    schedule: Mapping[Worker, Sequence[Action]],
    in_flight: Mapping[Worker, int] | None = None,
    buckets: Mapping[Worker, int] | None = None,
    worker: Worker | None = None,
) -> None:
    """Raise :class:`ScheduleError`, naming the action, unless every list of ``schedule`` can run.

    Checks: each send has its receive on the peer and the two sides of each pair post their transfers
    in the same order (on each channel); every micro-batch's actions come after what they depend on;
    every gradient bucket is reduced once, after the last action adding to its gradients
    (``buckets[worker]``: how many the worker has); no worker holds more than ``in_flight[worker]``
    micro-batches' activations; and the lists, run together, finish (:func:`simulate` with no durations).

    With ``worker``: only what concerns its list (its own checks and its pairs' order), not that the lists
    finish together. For the lists of a :func:`merge`, which finish by construction, where every worker
    checks its own: together the same checks, in 1/workers of the time each (a rerouted step of 500
    workers: 2.7 s on every worker otherwise).
    """
    checked = list(schedule) if worker is None else [worker]
    for w in checked:
        _check_worker(
            w,
            schedule[w],
            None if in_flight is None else in_flight.get(w),
            None if buckets is None else buckets.get(w),
        )
    posted = {w: _posted_order(w, schedule[w]) for w in checked}
    if worker is not None:
        peers = {peer for peer, _ in posted[worker]}
        posted |= {peer: _posted_order(peer, schedule.get(peer, ())) for peer in peers}
    flip = {Op.SEND: Op.RECV, Op.RECV: Op.SEND}
    for w in checked:
        for (peer, channel), mine in posted[w].items():
            theirs = posted.get(peer, {}).get((w, channel), [])
            for k, (_, op, payload, mb) in enumerate(mine):
                action = Action(op, mb, peer=peer, payload=payload, channel=channel)
                if k >= len(theirs):
                    raise ScheduleError(f"worker {w}: {action} has no matching {flip[op].value} on {peer}")
                _, their_op, their_payload, their_mb = theirs[k]
                if (their_op, their_payload, their_mb) != (flip[op], payload, mb):
                    other = Action(their_op, their_mb, peer=w, payload=their_payload, channel=channel)
                    raise ScheduleError(
                        f"worker {w}: {action} is its transfer number {k} with {peer}, where {peer} "
                        f"posts {other}: the two sides of a pair must post their transfers in the same order"
                    )
            if len(theirs) > len(mine):
                _, op, payload, mb = theirs[len(mine)]
                action = Action(op, mb, peer=w, payload=payload, channel=channel)
                raise ScheduleError(f"worker {peer}: {action} has no matching {flip[op].value} on {w}")
    if worker is None:
        simulate(schedule)


# ---------------------------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Timing:
    """When one action ran in a simulation (or a measurement): ``start`` to ``end`` seconds."""

    action: Action
    start: float
    end: float


def simulate(
    schedule: Mapping[Worker, Sequence[Action]],
    duration: Callable[[Worker, Action], float] | None = None,
    transfer: Callable[[Worker, Worker, Action], float] | None = None,
    start: Mapping[Worker, float] | None = None,
) -> dict[Worker, list[Timing]]:
    """Run the lists together on idealised devices: each worker does one action at a time, from
    ``start[worker]`` (default 0), compute takes ``duration(worker, action)``, a sent message arrives
    ``transfer(sender, receiver, action)`` after its ``SEND`` (which does not block), a ``RECV`` waits for
    it; ``REDUCE`` is issued and not waited for. Returns every action's timing; raises
    :class:`ScheduleError` naming the blocked actions when the lists cannot finish (a deadlock)."""
    position = dict.fromkeys(schedule, 0)
    clock = {worker: (start or {}).get(worker, 0.0) for worker in schedule}
    timings: dict[Worker, list[Timing]] = {worker: [] for worker in schedule}
    arrivals: dict[tuple[Worker, Worker, Payload, int], float] = {}
    progressed = True
    while progressed:
        progressed = False
        for worker, actions in schedule.items():
            while position[worker] < len(actions):
                a = actions[position[worker]]
                start = clock[worker]
                end = start
                if a.op is Op.RECV:
                    assert a.peer is not None and a.payload is not None
                    key = (a.peer, worker, a.payload, a.microbatch)
                    if key not in arrivals:
                        break
                    end = start = max(start, arrivals.pop(key))
                elif a.op is Op.SEND:
                    assert a.peer is not None and a.payload is not None
                    delay = transfer(worker, a.peer, a) if transfer is not None else 0.0
                    arrivals[(worker, a.peer, a.payload, a.microbatch)] = start + delay
                elif a.op in COMPUTE and duration is not None:
                    end = start + duration(worker, a)
                timings[worker].append(Timing(a, start, end))
                clock[worker] = end
                position[worker] += 1
                progressed = True
    blocked = {w: actions[position[w]] for w, actions in schedule.items() if position[w] < len(actions)}
    if blocked:
        waits = "; ".join(f"worker {w} at action {position[w]} {a}" for w, a in blocked.items())
        raise ScheduleError(f"the action lists deadlock: {waits}")
    return timings


_PRIORITY = {Op.I: 0, Op.B: 0, Op.F: 1, Op.W: 2}
"""What a worker of :func:`merge` takes first among actions that can start at once: an input gradient (the
stage before it waits for it), then a forward, then a weight gradient (it fills what would be a bubble)."""


def merge(
    parts: Sequence[Mapping[Worker, Sequence[Action]]],
    duration: Callable[[Worker, Action], float] | None = None,
    transfer: Callable[[Worker, Worker, Action], float] | None = None,
    memory: Callable[[Worker, Action], float] | None = None,
    limits: Mapping[tuple[int, Worker], float] | None = None,
) -> tuple[Schedule, float]:
    """One list per worker from several schedules that share workers (the routes of a rerouted step, each on
    its own channel), each part's lists keeping their order, without their ``REDUCE`` (the caller ends each
    worker's list with its buckets', :func:`reduce_actions`); and when the last worker finishes them:
    ``iteration_time_s(simulate(lists, duration, transfer))``, which the merge already simulated.

    The interleaving is an event simulation of the parts together (:func:`simulate`'s rules): a compute
    action moves with the receives before it and the sends after it, and whenever a worker is free it takes
    the action that can start first, on a tie by :data:`_PRIORITY`, then by part (a pipeline's own work
    before work rerouted to it). Actions are taken in the order of their start times, so every receive in
    the result is taken after its send was made: the lists finish whatever the real durations (a deadlock
    would need a receive waiting for a send that comes later in this order). Work rerouted to a worker thus
    lands where its own lists would wait: in their bubbles. Each worker's first startable action waits in
    a heap, re-offered only when the worker or a message to it moves: ``O(actions log workers)``.

    ``memory(worker, action)``: how many bytes more the worker holds after the action (fewer: negative);
    ``limits[(k, worker)]``: the most the worker may hold. An action of part ``k`` that adds some waits while
    the worker's bytes with it, plus the most its parts without a limit will still add above what they hold
    (their lists are known), would pass the limit: what it holds then stays within it whatever those parts
    do next. It waits until they are done at the latest, or until no worker can go on otherwise (parts
    holding each other back): then it goes on, and the caller measures the result.
    """
    # Workers by index (their order of first appearance, the last tie-break), each's parts as units.
    index: dict[Worker, int] = {}
    for part in parts:
        for worker in part:
            index.setdefault(worker, len(index))
    workers = list(index)
    units: list[list[list[_Unit]]] = [[] for _ in workers]
    limit: list[list[float]] = [[] for _ in workers]  # of each worker's parts, in its own order
    for k, part in enumerate(parts):
        for worker, actions in part.items():
            units[index[worker]].append(_units(worker, actions, index))
            limit[index[worker]].append(math.inf if limits is None else limits.get((k, worker), math.inf))
    held = [0.0] * len(workers)
    unlimited_left = [
        sum(len(us) for us, most in zip(units[w], limit[w], strict=True) if most == math.inf)
        for w in range(len(workers))
    ]
    # rise[w][k][i]: the most part k (without a limit) of a worker with limited parts adds above what it
    # holds at its i-th unit, over its units from there on
    rise: list[list[list[float]]] = [[] for _ in workers]
    if memory is not None:
        for w in range(len(workers)):
            if all(most == math.inf for most in limit[w]):
                continue
            for us, most in zip(units[w], limit[w], strict=True):
                if most < math.inf:
                    rise[w].append([])
                    continue
                held_after = list(
                    itertools.accumulate((memory(workers[w], u.compute) for u in us), initial=0.0)
                )
                ahead = held_after[:]
                for i in range(len(us) - 1, -1, -1):
                    ahead[i] = max(held_after[i], ahead[i + 1])
                rise[w].append([a - h for a, h in zip(ahead, held_after, strict=True)])
    position = [[0] * len(ps) for ps in units]
    merged: list[list[Action]] = [[] for _ in workers]
    clock = [0.0] * len(workers)
    version = [0] * len(workers)
    arrivals: dict[_MessageKey, float] = {}
    # Each worker's action that can start first, in a heap keyed (start, priority, part, worker); an entry
    # is stale once its worker's version moved on (its clock advanced or a message arrived).
    ready: list[tuple[float, int, int, int, int]] = []

    def offer(w: int) -> None:
        version[w] += 1
        waiting.discard(w)
        best: tuple[float, int, int] | None = None
        at, now = position[w], clock[w]
        for k, chunk_list in enumerate(units[w]):
            if at[k] >= len(chunk_list):
                continue
            unit = chunk_list[at[k]]
            if memory is not None and limit[w][k] < math.inf and unlimited_left[w] and w not in released:
                more = memory(workers[w], unit.compute)
                if more > 0:
                    coming = sum(r[at[j]] for j, r in enumerate(rise[w]) if r)
                    if held[w] + more + coming > limit[w][k]:
                        waiting.add(w)
                        continue
            start = now
            for key in unit.receives:
                arrival = arrivals.get(key)
                if arrival is None:
                    break
                if arrival > start:
                    start = arrival
            else:
                candidate = (start, unit.priority, k)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            heapq.heappush(ready, (*best, w, version[w]))

    waiting: set[int] = set()  # workers whose last offer held an action back for memory
    released: set[int] = set()  # workers that no longer hold back: every worker was waiting for another
    for w in range(len(workers)):
        offer(w)
    while ready or waiting:
        if not ready:  # parts holding each other back (two damaged pipelines helping each other)
            released |= waiting
            for w in list(waiting):
                offer(w)
            continue
        start, _, k, w, seen = heapq.heappop(ready)
        if seen != version[w]:
            continue
        unit = units[w][k][position[w][k]]
        position[w][k] += 1
        worker = workers[w]
        end = start + (duration(worker, unit.compute) if duration is not None else 0.0)
        clock[w] = end
        if limit[w][k] == math.inf:
            unlimited_left[w] -= 1
        if rise[w]:  # a worker with limited parts: what it holds
            held[w] += memory(worker, unit.compute)  # type: ignore[misc]
        merged[w] += unit.actions
        offer(w)
        for peer, key, send in unit.sends:
            arrivals[key] = end + (transfer(worker, workers[peer], send) if transfer is not None else 0.0)
            offer(peer)
    stuck = [(w, k) for w, ps in enumerate(position) for k, at in enumerate(ps) if at < len(units[w][k])]
    if stuck:
        w, k = stuck[0]
        waits = units[w][k][position[w][k]].actions[0]
        raise ScheduleError(f"the parts deadlock: worker {workers[w]} waits at {waits}")
    return dict(zip(workers, merged, strict=True)), max(clock, default=0.0)


_MessageKey = tuple[int, int, bool, int]
"""A message of :func:`merge`: sender, receiver (by index), whether it is a gradient, micro-batch."""


@dataclass(slots=True)
class _Unit:
    """What :func:`merge` moves as one: a compute action with the receives before it and the sends after it,
    with what the merge's event loop asks of it worked out once."""

    actions: list[Action]
    compute: Action
    priority: int
    receives: tuple[_MessageKey, ...]
    sends: list[tuple[int, _MessageKey, Action]]


def _units(worker: Worker, actions: Sequence[Action], index: Mapping[Worker, int]) -> list[_Unit]:
    """``worker``'s list of one part cut into :class:`_Unit` (its ``REDUCE`` left out); ``index``: every
    worker's index."""
    recv, send, reduce, gradient = Op.RECV, Op.SEND, Op.REDUCE, Payload.GRADIENT  # the merge's hot loop
    me = index[worker]
    out: list[_Unit] = []
    pending: list[Action] = []
    receives: list[_MessageKey] = []
    for a in actions:
        op = a.op
        if op is send and out:
            assert a.peer is not None
            peer = index[a.peer]
            out[-1].actions.append(a)
            out[-1].sends.append((peer, (me, peer, a.payload is gradient, a.microbatch), a))
        elif op is recv:
            assert a.peer is not None
            pending.append(a)
            receives.append((index[a.peer], me, a.payload is gradient, a.microbatch))
        elif op is not reduce:
            pending.append(a)
            if op in COMPUTE:
                out.append(_Unit(pending, a, _PRIORITY[op], tuple(receives), []))
                pending, receives = [], []
    if pending:
        raise ScheduleError(f"worker {worker}: {pending[0]} is not followed by a compute action")
    return out


def iteration_time_s(timings: Mapping[Worker, Sequence[Timing]]) -> float:
    """The step's length in a simulation: when the last worker finishes."""
    return max((t[-1].end for t in timings.values() if t), default=0.0)


def pipeline_times_s(
    schedule: str, pipelines: Sequence[tuple[Sequence[PhaseTimes], Sequence[float], int]]
) -> np.ndarray:
    """``iteration_time_s(simulate(pipeline_actions(spec, schedule), ...))`` of each pipeline of one worker
    per stage, all simulated at once without building their action lists: the planner's inner loop (a
    template's fit simulates it at ``S`` and ``2 S`` micro-batches on ``S`` stages, for every template
    of every degree).

    A pipeline is ``(phases, delays, m)``: ``phases[s]`` is stage ``s``'s ``(F, I, W)`` per micro-batch (a
    ``B`` takes ``I + W``), ``delays[s]`` the transfer time across the boundary after stage ``s`` either way,
    ``m`` its micro-batches. The event rules are :func:`simulate`'s and so is the arithmetic, so the times are
    equal to the last bit: each stage (a *lane*) runs its order (:data:`SCHEDULES`) one action at a time, a
    forward waits for its activation and an ``I`` or ``B`` for its gradient, each sent when the neighbour's
    action ends. Every lane takes its next action in the same round when it can (NumPy over the lanes), so
    the rounds are the longest chain of actions, about ``2 m + 2 S``, not their number.
    """
    check_schedule_name(schedule)
    zero_bubble = schedule == "zb-h1"
    lanes = [(s, len(phases), m) for phases, _, m in pipelines for s in range(len(phases))]
    if not lanes:
        return np.zeros(len(pipelines))
    stage, depth, count = (np.array(v, dtype=np.int64) for v in zip(*lanes, strict=True))
    phase = np.array([p for phases, _, _ in pipelines for p in phases], dtype=np.float64).reshape(-1, 3)
    delay = np.array([d for _, delays, _ in pipelines for d in delays], dtype=np.float64)
    n = len(lanes)
    # The actions of every lane, one after the other in flat arrays (lane k's from offset[k]): its order
    # (:func:`_orders`) with each action's duration, the arrival it waits for and the one it sends.
    trailing = np.minimum(stage, count) if zero_bubble else np.zeros(n, dtype=np.int64)
    length = 2 * count + trailing
    offset = np.cumsum(length) - length
    code, micro = _orders(stage, depth, count, trailing, offset)
    lane = np.repeat(np.arange(n), length)
    took = phase[lane, np.where(code == 0, 0, np.where(code == 2, 2, 1))]
    tail = np.zeros_like(took)
    if zero_bubble:  # the W of micro-batch i - s runs right after the I of i on stage s: as that I's tail
        tail = np.where((code == 1) & (micro >= stage[lane]), phase[lane, 2], 0.0)
    else:  # every backward is a B: I + W
        took = np.where(code == 1, phase[lane, 1] + phase[lane, 2], took)
    # arrivals[c * M + first[k] + mb]: when micro-batch mb's activation (c = 0) or gradient (c = 1) reaches
    # lane k (-1: not yet sent), M micro-batches over all lanes; then a slot that is always 0 (what a W, a
    # first stage's forward or a last stage's backward waits for) and one that absorbs sends to nowhere
    total = int(count.sum())
    first = np.cumsum(count) - count
    arrivals = np.full(2 * total + 2, -1.0)
    ready_slot, sink = 2 * total, 2 * total + 1
    arrivals[ready_slot] = 0.0
    head, tail_stage = stage[lane] == 0, stage[lane] == depth[lane] - 1
    waits = np.minimum(code, 1) * total + first[lane] + micro
    waits = np.where((code == 2) | ((code == 0) & head) | ((code == 1) & tail_stage), ready_slot, waits)
    neighbour = np.where(code == 0, lane + 1, lane - 1)  # a forward sends down the pipeline, a backward up
    sends = np.where(code == 0, 0, total) + first[np.clip(neighbour, 0, n - 1)] + micro
    sends = np.where((code == 2) | ((code == 0) & tail_stage) | ((code == 1) & head), sink, sends)
    lag = delay[np.where(code == 0, lane, np.maximum(lane - 1, 0))]
    position = np.zeros(n, dtype=np.int64)
    clock = np.zeros(n)
    while True:
        active = np.flatnonzero(position < length)
        if active.size == 0:
            break
        at = offset[active] + position[active]
        arrival = arrivals[waits[at]]
        ready = arrival >= 0.0
        if not ready.any():
            raise ScheduleError(f"the {schedule} lists of {len(pipelines)} pipeline(s) deadlock")
        end = np.maximum(clock[active], arrival) + took[at]
        clock[active] = np.where(ready, end + tail[at], clock[active])
        position[active] += ready
        arrivals[np.where(ready, sends[at], sink)] = end + lag[at]
    bounds = np.cumsum([0] + [len(phases) for phases, _, _ in pipelines])
    return np.array([clock[a:b].max(initial=0.0) for a, b in itertools.pairwise(bounds)])


def _orders(
    stage: np.ndarray, depth: np.ndarray, count: np.ndarray, trailing: np.ndarray, offset: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every lane's compute order as in :data:`SCHEDULES`, as flat arrays ``code`` (0: F, 1: I or B, 2: a W
    left for the end of the step) and ``micro``, lane ``k``'s from ``offset[k]``.

    With ``w`` warm-up forwards the order is ``F(0..w-1)``, then ``F(w + i), I(i)`` for ``i < m - w``, then
    the other ``I``, then the ``W`` of the last ``trailing`` micro-batches (ZB-H1; its others are tails).
    """
    size = int((2 * count + trailing).sum())
    code, micro = np.full(size, 2, dtype=np.int64), np.zeros(size, dtype=np.int64)
    lane = np.repeat(np.arange(len(count)), count)
    j = np.arange(len(lane)) - np.repeat(np.cumsum(count) - count, count)  # micro-batch j of its lane
    m, w, base = count[lane], np.minimum(depth - stage - 1, count)[lane], offset[lane]
    at_f = base + np.where(j < w, j, 2 * j - w)
    at_i = base + np.where(j < m - w, w + 2 * j + 1, m + j)
    code[at_f], micro[at_f] = 0, j
    code[at_i], micro[at_i] = 1, j
    lane = np.repeat(np.arange(len(count)), trailing)
    k = np.arange(len(lane)) - np.repeat(np.cumsum(trailing) - trailing, trailing)
    micro[offset[lane] + 2 * count[lane] + k] = count[lane] - trailing[lane] + k
    return code, micro
