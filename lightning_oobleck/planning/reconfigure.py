"""Reconfiguration: the next plan after nodes fail or join, from the precomputed templates only.

No template search runs here: every new pipeline uses the plan's template for its node count.

After failures, each pipeline keeps its surviving nodes. A pipeline left below ``n0`` nodes borrows
the missing nodes from the largest pipeline when that one stays a template size, otherwise it merges
with the smallest pipeline it forms a template size with. If fewer than ``f + 1`` pipelines remain
while the survivors could hold more, the largest pipelines are split again. When no local repair
works (sizes missing from the template set), the survivors are split afresh, still in their order.
Within a pipeline, nodes keep their order or are sorted by the first layer they held, whichever
moves fewer layers; a worker that keeps its layers copies nothing.

When survivors drop below ``(f + 1) n0``, the plan keeps the largest fault tolerance still possible
(``floor(M / n0) - 1``, see :mod:`lightning_oobleck.planning.node_spec`) and says so in
``Plan.warnings``. Below ``n0`` survivors, or when every replica of a layer is lost, no pipeline can
continue and :class:`ReconfigurationError` says how to resume.

Joining nodes come with ids no plan used (:func:`reconfigure` takes them; :func:`after_joins` numbers
them from the plan's ``next_node_id``). They form new pipelines (``n0`` or more), or are added to the
smallest pipelines that grow into a template size, whichever the cost model predicts faster. Failures and
joins seen at once are one reconfiguration.

The result carries the copy list: for every layer a worker must newly hold, the surviving workers that
send it. A replica on the receiver's node sends it alone (a copy inside a node does not cross the network);
otherwise every replica sends a share, and the one that also describes the layer is the least loaded.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_oobleck.planning.node_spec import max_parts, split_into
from lightning_oobleck.planning.plan import LayerCopy, PipelineTemplate, Plan
from lightning_oobleck.planning.planner import PlannerInputs, PlanningError, assemble_plan
from lightning_oobleck.worker import Worker


class ReconfigurationError(ValueError):
    """Training cannot continue in place; the message says how to resume."""


@dataclass(frozen=True)
class Reconfiguration:
    """The new plan and the layer copies that turn the old layout into it."""

    plan: Plan
    copies: tuple[LayerCopy, ...]

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON schema plus ``copies``."""
        return {**self.plan.to_dict(), "copies": [asdict(c) for c in self.copies]}


def _holdings(plan: Plan) -> dict[Worker, range]:
    return {(p.nodes[s.node], s.device): s.layers for p in plan.pipelines for s in p.stages}


class _Layout:
    """Turns groups of node ids into pipelines, choosing node orders that move the fewest layers."""

    def __init__(self, plan: Plan, held: dict[Worker, range]) -> None:
        self.by_size = {t.num_nodes: t for t in plan.templates}
        self.sizes = sorted(self.by_size)
        self.n0 = plan.n0
        self.held = held
        self.unchanged = {p.nodes for p in plan.pipelines}
        self.first_layer: dict[int, int] = {}
        for (node, _), layers in held.items():
            self.first_layer[node] = min(self.first_layer.get(node, layers.start), layers.start)

    def moves(self, template: PipelineTemplate, nodes: Sequence[int]) -> int:
        """Layers the workers of ``nodes`` must newly hold under ``template`` (ranges: contiguous)."""
        total = 0
        for s in template.stages:
            held = self.held.get((nodes[s.node], s.device))
            kept = 0 if held is None else max(0, min(s.end_layer, held.stop) - max(s.first_layer, held.start))
            total += s.end_layer - s.first_layer - kept
        return total

    def order(self, nodes: Sequence[int]) -> tuple[int, ...]:
        """``nodes`` as given or sorted by the first layer they held (new nodes last): fewer moves wins."""
        if tuple(nodes) in self.unchanged:  # a whole pipeline of the plan: every worker keeps its layers
            return tuple(nodes)
        template = self.by_size[len(nodes)]
        as_given = self.moves(template, nodes)
        if as_given == 0:
            return tuple(nodes)
        by_layer = sorted(nodes, key=lambda n: (self.first_layer.get(n, float("inf")), nodes.index(n)))
        return tuple(by_layer if self.moves(template, by_layer) < as_given else nodes)

    def borrow(self, needy: list[int], donor: list[int], count: int) -> tuple[list[int], list[int]]:
        """Move ``count`` nodes from the head or the tail of ``donor``, whichever moves fewer layers."""

        def cost(option: tuple[list[int], list[int]]) -> int:
            a, b = option
            return self.moves(self.by_size[len(a)], self.order(a)) + self.moves(
                self.by_size[len(b)], self.order(b)
            )

        head = (needy + donor[:count], donor[count:])
        tail = (needy + donor[-count:], donor[:-count])
        return min((head, tail), key=cost)


def _repair(groups: list[list[int]], layout: _Layout, target: int) -> list[list[int]]:
    """Groups of template sizes covering the same nodes, with at least ``target`` groups if possible."""
    sizes, n0 = set(layout.sizes), layout.n0
    groups = [g for g in groups if g]
    while bad := [g for g in groups if len(g) not in sizes]:
        needy = min(bad, key=len)
        others = [g for g in groups if g is not needy]
        donor = max(others, key=len, default=None)
        partner = min((g for g in others if len(g) + len(needy) in sizes), key=len, default=None)
        if len(needy) < n0 and donor is not None and len(donor) - (n0 - len(needy)) in sizes:
            new_needy, new_donor = layout.borrow(needy, donor, n0 - len(needy))
            groups = [g for g in others if g is not donor] + [new_needy, new_donor]
        elif partner is not None:
            groups = [g for g in others if g is not partner] + [partner + needy]
        else:
            return _resplit(groups, layout, max_parts(layout.sizes, sum(map(len, groups))))
    while len(groups) < target:
        largest = max(groups, key=len)
        if max_parts(layout.sizes, len(largest)) < 2:
            return _resplit(groups, layout, target)
        a, _ = split_into(layout.sizes, len(largest), 2)
        groups = [g for g in groups if g is not largest] + [largest[:a], largest[a:]]
    return groups


def _fewest_parts(layout: _Layout, at_least: int, total: int) -> int:
    """The fewest pipelines, at least ``at_least``, that ``total`` nodes of template sizes can form."""
    for parts in range(at_least, max_parts(layout.sizes, total) + 1):
        try:
            split_into(layout.sizes, total, parts)
        except ValueError:
            continue
        return parts
    raise ReconfigurationError(f"{total} nodes cannot form {at_least} or more pipelines of template sizes")


def _resplit(groups: list[list[int]], layout: _Layout, parts: int) -> list[list[int]]:
    nodes = [n for g in groups for n in g]
    out, start = [], 0
    for size in split_into(layout.sizes, len(nodes), parts):
        out.append(nodes[start : start + size])
        start += size
    return out


def _copies(plan: Plan, new_plan: Plan, held: dict[Worker, range]) -> tuple[LayerCopy, ...]:
    holders: dict[int, list[Worker]] = {}
    starts = {t: [s.first_layer for s in t.stages] for t in plan.templates}

    def holders_of(layer: int) -> list[Worker]:
        """The live workers holding ``layer``, one per pipeline, in the plan's pipeline order."""
        if layer not in holders:
            found = []
            for p in plan.pipelines:
                worker = p.worker_of_stage(bisect.bisect_right(starts[p.template], layer) - 1)
                if worker in held:
                    found.append(worker)
            holders[layer] = found
        return holders[layer]

    load: dict[Worker, float] = defaultdict(float)  # shares of layers sent
    copies = []
    unchanged = {(p.template, p.nodes) for p in plan.pipelines}
    for p in new_plan.pipelines:
        if (p.template, p.nodes) in unchanged:
            continue
        for si, stage in enumerate(p.stages):
            node, device = p.worker_of_stage(si)
            kept = held.get((node, device))
            if kept is not None and kept.start <= stage.first_layer and stage.end_layer <= kept.stop:
                continue
            for layer in stage.layers:
                if kept is not None and layer in kept:
                    continue
                live = holders_of(layer)
                local = [w for w in live if w[0] == node]
                src = local[0] if local else min(live, key=lambda w: (load[w], w))
                replicas = (src,) if local else (src, *(w for w in live if w != src))
                for w in replicas:
                    load[w] += 1 / len(replicas)
                copies.append(LayerCopy(layer, node, src[0], device, src[1], replicas))
    return tuple(copies)


def _finish(
    plan: Plan, groups: list[list[int]], layout: _Layout, started: float, next_node_id: int
) -> Reconfiguration:
    inputs = _planner_inputs(plan)
    requested = inputs.fault_tolerance
    total = sum(map(len, groups))
    tolerance = min(requested, len(groups) - 1)
    warnings = []
    if tolerance < requested:
        warnings.append(
            f"only {total} nodes remain: {len(groups)} pipeline(s) of at least n0={layout.n0} nodes fit, so "
            f"the plan tolerates f={tolerance} failure(s) instead of {requested}; nodes that join restore "
            "it (`oobleck join` under SLURM, replace_failed_after_s locally)"
        )
    layouts = [(layout.by_size[len(g)], layout.order(g)) for g in groups]
    layouts.sort(key=lambda tn: (-tn[0].num_nodes, tn[1]))
    new_plan = assemble_plan(
        inputs,
        plan.templates,
        plan.n0,
        layouts,
        plan.global_batch_size,
        plan.microbatch_size,
        tolerance,
        started,
        next_node_id,
        warnings,
    )
    new_plan = replace(new_plan, tied_layers=plan.tied_layers)
    return Reconfiguration(new_plan, _copies(plan, new_plan, layout.held))


def copy_time_s(copies: Iterable[LayerCopy], inputs: PlannerInputs, link_share: float = 1.0) -> float:
    """The state copy of a reconfiguration: each node sends its share of its layers' parameters and
    optimizer state (a layer is striped over the replicas that send it) and receives what it newly holds,
    over its inter-node link at ``link_share`` of its bandwidth; the busiest node's time."""
    cost = inputs.cost()
    layer_bytes = [la.parameter_bytes * cost.state_factor for la in inputs.profile.layers]
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for c in copies:
        remote = [w.node for w in c.sources if w.node != c.to_node]
        for node in remote:
            sent[node] = sent.get(node, 0.0) + layer_bytes[c.layer] / len(c.sources)
        if remote:
            received[c.to_node] = received.get(c.to_node, 0.0) + layer_bytes[c.layer]
    busiest = max([*sent.values(), *received.values()], default=0.0)
    return busiest / (inputs.cluster.inter_node_bandwidth * link_share)


def _planner_inputs(plan: Plan) -> PlannerInputs:
    """The inputs the plan was made from; a plan without them (a hand-written layout) cannot be re-planned."""
    try:
        return PlannerInputs.from_plan(plan)
    except PlanningError as e:
        raise ReconfigurationError(
            f"{e}. A hand-written layout has no templates for other node counts, so training cannot "
            "continue in place after a failure: resume from the last checkpoint (Trainer.fit(ckpt_path=...)) "
            "and run a planner's plan (no `layout`, or `plan_path` from `oobleck plan --json`) to recover "
            "in place"
        ) from e


def _target(plan: Plan, layout: _Layout, total_nodes: int) -> int:
    requested = _planner_inputs(plan).fault_tolerance
    return min(requested + 1, max_parts(layout.sizes, total_nodes), plan.num_microbatches)


def after_failures(plan: Plan, failed: Iterable[int]) -> Reconfiguration:
    """The plan once the nodes ``failed`` are gone, and the copies that restore every layer."""
    return reconfigure(plan, failed=failed)


def after_joins(plan: Plan, count: int) -> Reconfiguration:
    """The plan once ``count`` new nodes (fresh ids from ``next_node_id``) join, and the copies that fill
    them (``oobleck replan --add``)."""
    if count < 1:
        raise ReconfigurationError(f"--add needs a positive number of nodes, got {count}")
    first_id = _next_node_id(plan)
    return reconfigure(plan, joined=range(first_id, first_id + count))


def reconfigure(
    plan: Plan, failed: Iterable[int] = (), joined: Iterable[int] = (), lengthen: bool = True
) -> Reconfiguration:
    """The plan once the nodes ``failed`` are gone and the nodes ``joined`` (new ids, in the order given)
    came, in one step, and the copies that fill every worker that newly holds a layer from a survivor.
    ``lengthen=False``: joiners that can form pipelines of their own do so, whatever is faster."""
    started = time.perf_counter()
    failed, joined = set(failed), list(dict.fromkeys(joined))
    known = set(plan.nodes)
    if unknown := sorted(failed - known):
        raise ReconfigurationError(f"node id(s) {unknown} are not in the plan; its nodes are {sorted(known)}")
    if taken := sorted(set(joined) & (known | failed)):
        raise ReconfigurationError(
            f"joining node id(s) {taken} are already in the plan: a node that comes back joins with a new id"
        )
    alive = known - failed
    if len(alive) < plan.n0:
        raise ReconfigurationError(
            f"only {len(alive)} node(s) survive but one pipeline needs n0={plan.n0}: no pipeline fits; "
            f"resume from the last checkpoint (Trainer.fit(ckpt_path=...)) on at least {plan.n0} nodes"
        )
    held = {w: r for w, r in _holdings(plan).items() if w[0] in alive}
    covered = {layer for layers in held.values() for layer in layers}
    if lost := sorted(set(range(plan.num_layers)) - covered):
        raise ReconfigurationError(
            f"every replica of layer {lost[0]} was on a failed node: training cannot continue in place; "
            "resume from the last checkpoint (Trainer.fit(ckpt_path=...)) on the remaining nodes"
        )
    layout = _Layout(plan, held)
    groups = [[n for n in p.nodes if n in alive] for p in plan.pipelines]
    if failed:
        groups = _repair(groups, layout, _target(plan, layout, len(alive)))
    next_id = max(_next_node_id(plan), max(joined, default=-1) + 1)
    target = _target(plan, layout, len(alive) + len(joined))
    options = _add(groups, joined, layout, plan.num_microbatches) if joined else [groups]
    if not lengthen:
        options = options[:1]
    results = [_finish(plan, _repair(g, layout, target), layout, started, next_id) for g in options]
    return min(results, key=lambda r: r.plan.iteration_time_s)


def _next_node_id(plan: Plan) -> int:
    return int(plan.extra.get("next_node_id", max(plan.nodes) + 1))


def _add(
    groups: list[list[int]], new: list[int], layout: _Layout, microbatches: int
) -> list[list[list[int]]]:
    """``groups`` with the nodes ``new``, both ways: as new pipelines where they form one (and a pipeline
    still gets a micro-batch), and added to the smallest pipelines that grow into a template size. The
    caller keeps the faster (a joiner that completes a shrunk pipeline often beats a pipeline of its own)."""
    options = []
    parts = min(max_parts(layout.sizes, len(new)), microbatches - len(groups))
    if parts > 0:
        options.append(groups + _resplit([new], layout, parts))
    grown = [list(g) for g in groups]
    for node in new:
        growable = [g for g in grown if len(g) + 1 in layout.sizes]
        if not growable:
            more = [*grown, [node]]
            grown = _resplit(more, layout, _fewest_parts(layout, len(grown), sum(map(len, more))))
            continue
        min(growable, key=len).append(node)
    return [*options, grown]
