"""Move layers and their optimizer state to the workers that newly hold them after a reconfiguration.

Given the copy list of :func:`~lightning_oobleck.planning.reconfigure.after_failures` (for every layer a
worker must newly hold, a surviving worker that held it, already spread over the replicas), every
source sends, point to point on the *new* generation's default group, one message per receiving worker:
the layers' parameters and buffers and the per-parameter optimizer state, keyed by global names
(``layers.7.attn.weight``; a tied parameter by its canonical name). The message is serialised with
``torch.save``, so any optimizer's state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``, SGD's momentum...)
passes unchanged. Layers a worker
keeps stay the very same tensors. Every wait is bounded and abortable (the generation's
:class:`~lightning_oobleck.execution.comm.CommWaiter`): a failure during the copy raises
:class:`~lightning_oobleck.execution.errors.PeerFailure` and leaves the worker's old state untouched.
"""

from __future__ import annotations

import io
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.planning.plan import LayerCopy
from lightning_oobleck.worker import Worker

ParamState = dict[str, dict[str, Any]]
"""Optimizer state per parameter, keyed by the parameter's global name (``layers.<i>.<name>``)."""

LayerBuilder = Callable[[Iterable[int]], StageModule]
"""Materialises the given layers (e.g. ``build_stage`` bound to the model, device, seed and dtype)."""


def state_by_name(optimizer: torch.optim.Optimizer, module: StageModule) -> ParamState:
    """The optimizer's per-parameter state keyed by the global names of ``module``'s parameters."""
    names = {id(p): name for p, name in module.global_names().items()}
    foreign = [p for p in optimizer.state if id(p) not in names]
    if foreign:
        raise ValueError(
            f"the optimizer holds state for {len(foreign)} parameter(s) outside the stage module: recovery "
            "can only move the state of the pipeline's layers; optimise the stage module's parameters only"
        )
    return {names[id(p)]: state for p, state in optimizer.state.items()}


def load_state_by_name(optimizer: torch.optim.Optimizer, module: StageModule, state: ParamState) -> None:
    """Put ``state`` into ``optimizer`` for ``module``'s parameters of the same global names.

    State tensors shaped like their parameter move to its device; the rest (e.g. AdamW's ``step``)
    stays where the optimizer keeps it.
    """
    for p, name in module.global_names().items():
        if name in state:
            optimizer.state[p] = {
                k: v.to(p.device) if isinstance(v, Tensor) and v.shape == p.shape else v
                for k, v in state[name].items()
            }


def _pack(module: StageModule, state: ParamState, layers: list[int]) -> bytes:
    names = module.global_names()
    sent = {names[p] for i in layers for p in module.layer(i).parameters()}
    payload = {
        "layers": {i: module.layer(i).state_dict() for i in layers},
        "optim": {name: s for name, s in state.items() if name in sent},
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _unpack(data: Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)


def _exchange(
    groups: ProcessGroups, sends: dict[Worker, Tensor], receives: dict[Worker, Tensor], abort: threading.Event
) -> None:
    """Send ``sends[peer]`` to each peer and receive ``receives[peer]`` from each, as one batch; bounded and
    abortable like every wait of the generation."""
    world = groups.world
    ops = [dist.P2POp(dist.isend, t, groups.rank_of(peer), group=world) for peer, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, groups.rank_of(peer), group=world) for peer, t in receives.items()]
    if not ops:
        return
    with groups.waiter.issuing():
        works = dist.batch_isend_irecv(ops)
    groups.waiter.wait(works, abort)


def transfer_state(
    module: StageModule,
    state: ParamState,
    copies: Iterable[LayerCopy],
    groups: ProcessGroups,
    build_layers: LayerBuilder,
    abort: threading.Event,
    device: torch.device | None = None,
) -> tuple[StageModule, ParamState]:
    """This worker's module and optimizer state under ``groups.plan``, filled from surviving replicas.

    ``module``/``state``: what this worker holds under the previous plan (the layers it keeps are
    reused as they are; a joiner holds none). Collective over every worker of the new generation: each
    sends what the copy list asks of it and receives what it newly holds. ``device``: where the layers
    live (by default, where ``module``'s do). Raises ``PeerFailure`` on abort or a lost peer.
    """
    me = groups.worker
    new_layers = list(groups.plan.role(*me).layers)
    outgoing: dict[Worker, list[int]] = defaultdict(list)
    incoming: dict[Worker, list[int]] = defaultdict(list)
    for c in copies:
        if (c.from_node, c.from_device) == me:
            outgoing[(c.to_node, c.to_device)].append(c.layer)
        if (c.to_node, c.to_device) == me:
            incoming[(c.from_node, c.from_device)].append(c.layer)
    missing = set(new_layers) - set(module.layer_indices) - {i for ls in incoming.values() for i in ls}
    if missing:
        raise ValueError(f"the copy list gives worker {me} no source for layers {sorted(missing)}")

    device = device or next(iter(module.parameters())).device
    payloads = {
        peer: torch.frombuffer(bytearray(_pack(module, state, sorted(layers))), dtype=torch.uint8).to(device)
        for peer, layers in sorted(outgoing.items())
    }
    # Each exchange is one batch of point-to-point operations: NCCL then runs a worker's sends and receives
    # together, so two workers that copy to each other cannot both wait in a send (gloo does not need it).
    sizes = {peer: torch.zeros(1, dtype=torch.int64, device=device) for peer in sorted(incoming)}
    sent_sizes = {
        peer: torch.tensor([t.numel()], dtype=torch.int64, device=device) for peer, t in payloads.items()
    }
    _exchange(groups, sent_sizes, sizes, abort)
    buffers = {
        peer: torch.empty(int(t.item()), dtype=torch.uint8, device=device) for peer, t in sizes.items()
    }
    _exchange(groups, payloads, buffers, abort)

    received = [_unpack(t) for t in buffers.values()]
    fresh = build_layers(sorted(i for payload in received for i in payload["layers"]))
    with torch.no_grad():
        for payload in received:
            for i, layer_state in payload["layers"].items():
                fresh.layer(i).load_state_dict(layer_state)
    layers = {i: module.layer(i) for i in new_layers if i in module.layer_indices}
    layers.update({i: fresh.layer(i) for i in fresh.layer_indices})
    ties = sorted(set(module.ties) | set(fresh.ties), key=lambda tie: tie.members)
    new_module = StageModule(layers, ties)  # a tie's members held here are one parameter again
    names = set(new_module.global_names().values())
    new_state = {name: s for name, s in state.items() if name in names}
    for payload in received:
        new_state.update(payload["optim"])
    return new_module, new_state
