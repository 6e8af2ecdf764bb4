"""Split backward: the gradient of a stage's input first (``I``), its parameters' gradients later (``W``).

``I`` back-propagates from the stage's outputs to its inputs only, keeping the autograd graph, and records
the gradient flowing into every *boundary* node: a node on the path to the inputs from which a
parameter is reached by nodes off that path (a linear layer's matrix product: its input-gradient output
is needed now, its weight-gradient output later). ``W`` restarts autograd at those nodes with the recorded
gradients and runs only the parameters' side of the graph, so nothing of ``I``'s work is done twice, and
the parameters' gradients accumulate into ``.grad`` as in a whole backward (post-accumulate hooks fire).

A parameter used at two depths of the input path (a weight shared by two layers of one stage) is reached
from a boundary node through the input path below it: restarting there would run that path again, so such
a parameter gets its gradient in ``I``, as in a whole backward.

A layer opts out with ``split_backward = False`` (an attribute of the layer module, e.g. one whose custom
autograd function computes both gradients in one node, or that recomputes its forward in the backward):
its parameters then get their gradients in ``I``, as in a whole backward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def splits_backward(layer: nn.Module) -> bool:
    """Whether ``layer``'s parameters may get their gradients in a ``W`` after its ``I``."""
    return bool(getattr(layer, "split_backward", True))


def split_parameters(layers: Iterable[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The parameters of ``layers`` whose gradients a ``W`` may compute after an ``I``, and the others."""
    split: list[nn.Parameter] = []
    whole: list[nn.Parameter] = []
    for layer in layers:
        (split if splits_backward(layer) else whole).extend(layer.parameters())
    return split, whole


@dataclass
class _Group:
    """Parameters and the boundary nodes their gradients flow from; ``W`` runs one backward per group, so
    that autograd does not follow one group's boundary nodes down the input path to another's."""

    nodes: list[Node]
    params: list[nn.Parameter]
    grads: list[tuple[Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class WeightGradient:
    """What ``I`` keeps for ``W``: the parameter groups and the gradients that flowed into their boundary
    nodes; or, without inputs to differentiate (a pipeline's first stage, where ``I`` has nothing to do),
    the outputs and their gradients, for ``W`` to run the whole backward."""

    groups: list[_Group]
    outputs: list[Tensor] = field(default_factory=list)
    output_grads: list[Tensor] | None = None
    params: list[nn.Parameter] = field(default_factory=list)


def _reverse_edges(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For each node reachable from ``roots``, the nodes whose backward feeds into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _closure(
    starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the outputs without entering ``stop``; the ``stop`` nodes met."""
    reached, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


def _nested(nodes: Sequence[Node], input_side: set[Node]) -> bool:
    """Whether one of ``nodes`` lies below another on the input path."""
    if len(nodes) < 2:
        return False
    group = set(nodes)
    for start in nodes:
        seen, queue = {start}, deque([start])
        while queue:
            for child, _ in queue.popleft().next_functions:
                if child is None or child in seen or child not in input_side:
                    continue
                if child in group:
                    return True
                seen.add(child)
                queue.append(child)
    return False


def _groups(
    params: Sequence[nn.Parameter], parents: dict[Node, list[Node]], input_side: set[Node]
) -> tuple[list[_Group], list[nn.Parameter]]:
    """Parameters grouped by shared boundary nodes, the group of the last parameter first; and the
    parameters of nested groups, which cannot be split (see the module's docstring)."""
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}
    for p in reversed(params):
        met = _closure([get_gradient_edge(p).node], parents, input_side)[1]
        if not met:
            continue  # not part of this micro-batch's graph
        joined = list({id(owner[n]): owner[n] for n in met if n in owner}.values())
        group = joined[0] if joined else _Group([], [])
        if not joined:
            groups.append(group)
        for other in joined[1:]:
            group.nodes += other.nodes
            group.params += other.params
            groups.remove(other)
        group.params.append(p)
        group.nodes += [n for n in met if n not in owner]
        for n in group.nodes:
            owner[n] = group
    split, unsplit = [], []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        if _nested(group.nodes, input_side):
            unsplit += group.params
        else:
            split.append(group)
    return split, unsplit


def backward_input(
    outputs: Sequence[Tensor],
    output_grads: Sequence[Tensor] | None,
    inputs: Sequence[Tensor],
    params: Sequence[nn.Parameter],
    whole: Sequence[nn.Parameter] = (),
) -> WeightGradient:
    """``I``: accumulate the gradients of ``inputs`` (leaves) and of the opted-out ``whole`` parameters;
    return what :func:`backward_weight` needs to give ``params`` theirs."""
    split = [p for p in params if p.requires_grad]
    whole = [p for p in whole if p.requires_grad]
    grads = None if output_grads is None else list(output_grads)
    if not outputs:
        return WeightGradient([])
    if not inputs:
        return WeightGradient([], list(outputs), grads, split + whole)
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    parents = _reverse_edges(roots)
    input_side, _ = _closure([get_gradient_edge(t).node for t in inputs], parents, set())
    groups, unsplit = _groups(split, parents, input_side)
    whole += unsplit

    def keep(group: _Group, k: int):
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            group.grads[k] = grad_outputs

        return hook

    handles = [node.register_prehook(keep(g, k)) for g in groups for k, node in enumerate(g.nodes)]
    try:
        torch.autograd.backward(list(outputs), grads, retain_graph=True, inputs=list(inputs) + whole)
    finally:
        for handle in handles:
            handle.remove()
    return WeightGradient(groups)


def backward_weight(kept: WeightGradient) -> None:
    """``W``: accumulate the gradients of the parameters :func:`backward_input` left out."""
    if kept.outputs:
        if kept.params:
            torch.autograd.backward(kept.outputs, kept.output_grads, inputs=kept.params)
        return
    for group in kept.groups:
        roots, grads = [], []
        for node, node_grads in zip(group.nodes, group.grads, strict=True):
            for k, g in enumerate(node_grads or ()):
                if g is not None:
                    roots.append(GradientEdge(node, k))
                    grads.append(g)
        if roots:
            torch.autograd.backward(roots, grads, inputs=group.params)
