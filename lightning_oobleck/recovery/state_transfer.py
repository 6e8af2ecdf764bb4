"""Move layers and their optimizer state to the workers that newly hold them after a reconfiguration.

Given the copy list of :func:`~lightning_oobleck.planning.reconfigure.reconfigure` (for every layer a
worker must newly hold, the surviving replicas that send it), the state moves as tensors, point to point
on the *new* generation's world group, in three exchanges:

1. **Sizes**, then 2. **headers**: the first source of each layer describes it to its receiver once: the
   shape and dtype of every parameter, buffer and per-parameter optimizer state tensor, and the values of
   the state no plan can infer (AdamW's ``step``, any non-tensor entry of any optimizer). A small message
   per pair of workers: no tensor data is serialised.
3. **Streams**: every tensor of the copy, in the header's order, viewed as bytes, is cut into chunks of at
   most ``bucket_bytes``: a slice of one large tensor is sent from and received into that tensor itself;
   small tensors are packed into one flat bucket. The chunks of a layer are striped over its sources by
   bytes (each replica sends a share, so no single sender is the limit). Every worker computes the same
   chunks from the header and the copy list, so no other metadata moves; round ``k`` exchanges each pair's
   ``k``-th chunk as one batch, and the next round is issued before the previous one is unpacked (packing,
   sending and unpacking overlap; at most two rounds, i.e. two buckets per peer and direction, are in
   flight). With NCCL the tensors stay on the device.

Received layers are allocated empty (materialised from the meta device, never initialised) and written
once. Layers a worker keeps stay the very same tensors, except at tensor parallelism ``t > 1``: each device
of a stage copies the shards of its own tensor rank, between counterparts
(:meth:`LayerCopy.at_tensor_rank`), and the layers it keeps are split anew over the new generation's devices
(their shards copied locally into layers built for the new mesh: a split layer belongs to the mesh it was
split over). Every wait is bounded and abortable (the
generation's :class:`~lightning_oobleck.execution.comm.CommWaiter`): a failure during the copy raises
:class:`~lightning_oobleck.execution.errors.PeerFailure` and leaves the worker's old state untouched, since
the copy writes only into tensors it allocated.
"""

from __future__ import annotations

import io
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import StageModule, Tie
from lightning_oobleck.execution.tensor_parallel import (
    LayerPlans,
    declared_plan,
    like,
    local,
    parallelize_stage,
)
from lightning_oobleck.planning.plan import LayerCopy
from lightning_oobleck.worker import Worker

ParamState = dict[str, dict[str, Any]]
"""Optimizer state per parameter, keyed by the parameter's global name (``layers.<i>.<name>``)."""

LayerBuilder = Callable[[Iterable[int]], StageModule]
"""Allocates the given layers without initialising them (``build_stage`` with ``init=None``, bound to the
model, device and dtype): the copy writes every value."""

BUCKET_BYTES = 64 << 20
"""The largest message of a state copy: small tensors are packed into buckets of at most this size, large
ones sent in slices of it (``benchmarks/state_copy.py`` measures it on gloo; NCCL is untested)."""

PACKED_FRACTION = 16
"""Tensors under ``bucket_bytes / PACKED_FRACTION`` are packed into buckets (a copy on each side, fewer
messages); larger ones are sent from and received into the tensor itself."""


@dataclass(frozen=True)
class CopyStats:
    """What one worker's state copy moved."""

    received_bytes: int = 0
    sent_bytes: int = 0
    sources: int = 0
    """Workers this one received from."""


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

    State tensors shaped like their parameter move to its device (a no-op for copied state, which is
    received there); the rest (e.g. AdamW's ``step``) stays where the optimizer keeps it.
    """
    for p, name in module.global_names().items():
        if name in state:
            optimizer.state[p] = {
                k: v.to(p.device) if isinstance(v, Tensor) and v.shape == p.shape else v
                for k, v in state[name].items()
            }


# ---------------------------------------------------------------------------------------------- entries


class _Spec(NamedTuple):
    """One tensor of a copy: ``(global name, optimizer state key or None)``, its shape and dtype."""

    name: str
    key: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype


def _streamed(value: Any, parameter: Tensor) -> bool:
    """Whether an optimizer state entry moves as a tensor stream (else by value in the header): a tensor of
    one or more dimensions where its parameter lives (AdamW's moments; not its 0-d ``step`` on the CPU)."""
    return isinstance(value, Tensor) and value.dim() > 0 and local(value).device == local(parameter).device


def _owned(layer: int, name: str, ties: Sequence[Tie], wanted: Sequence[int]) -> bool:
    """Whether the parameter of global name ``name`` in ``layer`` is sent with ``layer`` to a receiver that
    newly holds the layers ``wanted``: a tied parameter goes once, with the lowest of them that holds it."""
    tie = next((t for t in ties if t.name == name), None)
    return tie is None or layer == min(i for i in tie.layers if i in wanted)


def _layer_tensors(
    module: StageModule, state: ParamState, layer: int, wanted: Sequence[int]
) -> Iterator[tuple[_Spec, Tensor | None, Any]]:
    """The tensors ``module`` sends of ``layer`` (its parameters once, by global name; every buffer; the
    optimizer state), in the order every worker lists them: ``(spec, tensor, None)`` for a streamed tensor,
    ``(spec, None, value)`` for a state entry sent by value in the header."""
    names = module.global_names()
    prefix = f"layers.{layer}."
    for p in module.layer(layer).parameters():
        name = names[p]
        if not _owned(layer, name, module.ties, wanted):
            continue
        shard = local(p.detach())  # at t > 1, this device's shard
        yield _Spec(name, None, tuple(shard.shape), p.dtype), shard, None
        for key, value in sorted(state.get(name, {}).items()):
            if _streamed(value, p):
                yield _Spec(name, key, tuple(local(value).shape), value.dtype), local(value), None
            else:
                yield _Spec(name, key, (), torch.uint8), None, value
    for buffer_name, buffer in module.layer(layer).named_buffers():
        yield _Spec(prefix + buffer_name, None, tuple(buffer.shape), buffer.dtype), buffer, None


def _as_bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s storage as a flat uint8 tensor (a view: writing it writes ``tensor``)."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"a state copy moves contiguous tensors only, got one of shape {tuple(tensor.shape)} and strides "
            f"{tensor.stride()}: make the layer's parameters and buffers contiguous"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------------- chunks


@dataclass
class _Chunk:
    """One message of a copy: byte ranges ``(tensor index, start, stop)`` of the streamed tensors of one
    receiving worker, sent by ``source``."""

    source: Worker
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    nbytes: int = 0


def _chunks(sizes: Sequence[int], sources: Sequence[Worker], bucket_bytes: int, rotate: int) -> list[_Chunk]:
    """Cut one layer's streamed tensors (``sizes`` in bytes, in order) into chunks of at most
    ``bucket_bytes`` (tensors under ``bucket_bytes / PACKED_FRACTION`` packed together, larger ones sent
    from where they are, in slices where they exceed a bucket) and give each to the source with
    the fewest bytes so far (ties broken by ``rotate``, so that replicas share a run of one-chunk layers)."""
    chunks: list[_Chunk] = []
    current = _Chunk(sources[0])
    for index, size in enumerate(sizes):
        if current.nbytes and (
            current.nbytes + size > bucket_bytes or size >= bucket_bytes // PACKED_FRACTION
        ):
            chunks.append(current)
            current = _Chunk(sources[0])
        if size < bucket_bytes // PACKED_FRACTION:
            current.pieces.append((index, 0, size))
            current.nbytes += size
            continue
        for start in range(0, size, bucket_bytes):
            stop = min(start + bucket_bytes, size)
            chunks.append(_Chunk(sources[0], [(index, start, stop)], stop - start))
    if current.nbytes:
        chunks.append(current)
    load = {w: 0 for w in sources}
    order = {w: (i - rotate) % len(sources) for i, w in enumerate(sources)}
    for chunk in chunks:
        chunk.source = min(sources, key=lambda w: (load[w], order[w]))
        load[chunk.source] += chunk.nbytes
    return chunks


@dataclass
class _Stream:
    """The chunks one pair of workers exchanges, in order, over the streamed tensors of the receiver."""

    tensors: list[Tensor]
    chunks: list[_Chunk]


def _streams(
    me: Worker,
    receiver: Worker,
    copies: Sequence[LayerCopy],
    tensors_of: Callable[[int], list[Tensor]],
    bucket_bytes: int,
) -> dict[Worker, _Stream]:
    """The streams between ``receiver`` and each of its sources that ``me`` is part of, keyed by the peer:
    ``tensors_of(layer)``: the streamed tensors of that layer on ``me`` (the sources' or the receiver's)."""
    streams: dict[Worker, _Stream] = {}
    for copy in sorted(copies, key=lambda c: c.layer):
        if me != receiver and me not in copy.sources:
            continue
        tensors = tensors_of(copy.layer)
        sizes = [t.numel() * t.element_size() for t in tensors]
        bases: dict[Worker, int] = {}  # where this layer's tensors start in each peer's stream
        for chunk in _chunks(sizes, copy.sources, bucket_bytes, copy.layer):
            peer = chunk.source if me == receiver else receiver
            if me not in (receiver, chunk.source):
                continue
            stream = streams.setdefault(peer, _Stream([], []))
            if peer not in bases:
                bases[peer] = len(stream.tensors)
                stream.tensors.extend(tensors)
            base = bases[peer]
            stream.chunks.append(
                _Chunk(chunk.source, [(base + i, a, b) for i, a, b in chunk.pieces], chunk.nbytes)
            )
    return streams


# --------------------------------------------------------------------------------------------- exchanges


def _exchange(
    groups: ProcessGroups, sends: dict[Worker, Tensor], receives: dict[Worker, Tensor]
) -> list[dist.Work]:
    """Issue ``sends[peer]`` to each peer and ``receives[peer]`` from each as one batch (NCCL then runs a
    worker's sends and receives together, so two workers that copy to each other never both wait in a
    send); the works to wait for."""
    world = groups.world
    ops = [dist.P2POp(dist.isend, t, groups.rank_of(peer), group=world) for peer, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, t, groups.rank_of(peer), group=world) for peer, t in receives.items()]
    if not ops:
        return []
    with groups.waiter.issuing():
        return dist.batch_isend_irecv(ops)


def _swap_messages(
    groups: ProcessGroups,
    messages: dict[Worker, bytes],
    peers: Iterable[Worker],
    device: torch.device,
    abort: threading.Event,
) -> dict[Worker, bytes]:
    """Send each small message of ``messages`` to its peer and receive one from each of ``peers``."""
    sizes = {peer: torch.zeros(1, dtype=torch.int64, device=device) for peer in sorted(peers)}
    sent = {peer: torch.tensor([len(m)], dtype=torch.int64, device=device) for peer, m in messages.items()}
    groups.waiter.wait(_exchange(groups, sent, sizes), abort)
    payloads = {
        peer: torch.frombuffer(bytearray(m), dtype=torch.uint8).to(device) for peer, m in messages.items()
    }
    received = {
        peer: torch.empty(int(t.item()), dtype=torch.uint8, device=device) for peer, t in sizes.items()
    }
    groups.waiter.wait(_exchange(groups, payloads, received), abort)
    return {peer: t.cpu().numpy().tobytes() for peer, t in received.items()}


def _pack(stream: _Stream, chunk: _Chunk) -> Tensor:
    pieces = [_as_bytes(stream.tensors[i])[a:b] for i, a, b in chunk.pieces]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _unpack(stream: _Stream, chunk: _Chunk, message: Tensor) -> None:
    if len(chunk.pieces) == 1:
        return  # received in place
    offset = 0
    for i, a, b in chunk.pieces:
        _as_bytes(stream.tensors[i])[a:b].copy_(message[offset : offset + b - a])
        offset += b - a


def _receive_buffer(stream: _Stream, chunk: _Chunk, device: torch.device) -> Tensor:
    if len(chunk.pieces) == 1:
        i, a, b = chunk.pieces[0]
        return _as_bytes(stream.tensors[i])[a:b]
    return torch.empty(chunk.nbytes, dtype=torch.uint8, device=device)


def _run_streams(
    groups: ProcessGroups,
    outgoing: dict[Worker, _Stream],
    incoming: dict[Worker, _Stream],
    device: torch.device,
    abort: threading.Event,
) -> None:
    """Exchange every stream's chunks, round by round, two rounds in flight."""
    rounds = max((len(s.chunks) for s in [*outgoing.values(), *incoming.values()]), default=0)
    in_flight: deque[tuple[list[dist.Work], list[Tensor], list[tuple[_Stream, _Chunk, Tensor]]]] = deque()
    for k in range(rounds):
        sends = {peer: _pack(s, s.chunks[k]) for peer, s in sorted(outgoing.items()) if k < len(s.chunks)}
        receives = {
            peer: (s, s.chunks[k], _receive_buffer(s, s.chunks[k], device))
            for peer, s in sorted(incoming.items())
            if k < len(s.chunks)
        }
        works = _exchange(groups, sends, {peer: r[2] for peer, r in receives.items()})
        faults.reach(faults.FaultPoint.COPY_CHUNK, groups.worker)
        in_flight.append((works, list(sends.values()), list(receives.values())))
        if len(in_flight) == 2:
            _finish_round(groups, *in_flight.popleft(), abort)
    while in_flight:
        _finish_round(groups, *in_flight.popleft(), abort)


def _finish_round(
    groups: ProcessGroups,
    works: list[dist.Work],
    sent: list[Tensor],
    receives: list[tuple[_Stream, _Chunk, Tensor]],
    abort: threading.Event,
) -> None:
    """Wait for one round; then its packed buckets (``sent``) may go and its received ones are unpacked."""
    groups.waiter.wait(works, abort)
    for stream, chunk, message in receives:
        _unpack(stream, chunk, message)


# ------------------------------------------------------------------------------------------------- copy


def _header(module: StageModule, state: ParamState, layers: Sequence[int], wanted: Sequence[int]) -> bytes:
    described = {  # plain tuples: the receiver loads it with weights_only
        layer: [(*spec, value) for spec, _, value in _layer_tensors(module, state, layer, wanted)]
        for layer in layers
    }
    buffer = io.BytesIO()
    torch.save(described, buffer)
    return buffer.getvalue()


def _allocate(
    described: dict[int, list[tuple[_Spec, Any]]], build_layers: LayerBuilder, device: torch.device
) -> tuple[StageModule, ParamState, dict[int, list[Tensor]]]:
    """The received layers allocated empty, their optimizer state allocated or set from the header, and
    each layer's streamed tensors in header order (where the stream writes)."""
    fresh = build_layers(sorted(described))
    names = {name: p for p, name in fresh.global_names().items()}
    state: ParamState = {}
    tensors: dict[int, list[Tensor]] = {}
    for layer, specs in described.items():
        tensors[layer] = []
        for spec, value in specs:
            if spec.key is None:
                target = names.get(spec.name)
                if target is None:
                    target = _buffer_as_sent(
                        fresh.layer(layer), spec.name.removeprefix(f"layers.{layer}."), spec
                    )
                shard = None if target is None else local(target.detach())
                if shard is None or tuple(shard.shape) != spec.shape or shard.dtype != spec.dtype:
                    got = "none" if shard is None else f"{tuple(shard.shape)} {shard.dtype}"
                    raise ValueError(
                        f"the state copy sends {spec.name} as {spec.shape} {spec.dtype}, but the layer built "
                        f"here has {got}: every process must build the model with the same code and precision"
                    )
                tensors[layer].append(shard)
            elif value is None:
                param = names[spec.name]
                target = torch.empty(spec.shape, dtype=spec.dtype, device=local(param).device)
                state.setdefault(spec.name, {})[spec.key] = like(param, target)
                tensors[layer].append(target)
            else:
                state.setdefault(spec.name, {})[spec.key] = value
    return fresh, state, tensors


def _split_anew(
    module: StageModule, state: ParamState, kept: Sequence[int], build: LayerBuilder
) -> tuple[dict[int, nn.Module], ParamState]:
    """The kept layers ``kept`` split over the new generation's devices: layers built for its mesh, each shard
    and buffer copied in from the old layer (this device's own, no communication), and their optimizer state
    holding the same local tensors under the new mesh."""
    built = build(kept)
    old_names = module.global_names()
    new_names = {name: p for p, name in built.global_names().items()}
    moved: ParamState = {}
    with torch.no_grad():
        for index in kept:
            old, new = module.layer(index), built.layer(index)
            for p in old.parameters():
                name = old_names[p]
                target = new_names[name]
                local(target).copy_(local(p))
                moved[name] = {
                    k: like(target, local(v)) if isinstance(v, Tensor) and v.dim() > 0 else v
                    for k, v in state.get(name, {}).items()
                }
            for name, buffer in old.named_buffers():
                new.get_buffer(name).copy_(buffer)
    return {i: built.layer(i) for i in kept}, {name: s for name, s in moved.items() if s}


def _buffer_as_sent(layer: nn.Module, name: str, spec: _Spec) -> Tensor | None:
    """The layer's buffer ``name``, allocated again in the dtype it was sent in where the one built here has
    another: a buffer a model keeps in a dtype of its own (rotary frequencies in float32 under float64
    weights) may have been cast by this worker's build; the copy gives it the replicas' dtype."""
    try:
        buffer = layer.get_buffer(name)
    except AttributeError:
        return None
    if buffer.dtype == spec.dtype or tuple(buffer.shape) != spec.shape:
        return buffer
    owner, _, attribute = name.rpartition(".")  # assigning a tensor to a buffer's name keeps it a buffer
    setattr(
        layer.get_submodule(owner), attribute, torch.empty(spec.shape, dtype=spec.dtype, device=buffer.device)
    )
    return layer.get_buffer(name)


def transfer_state(
    module: StageModule,
    state: ParamState,
    copies: Iterable[LayerCopy],
    groups: ProcessGroups,
    build_layers: LayerBuilder,
    abort: threading.Event,
    device: torch.device | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    tensor_parallel_plan: LayerPlans = declared_plan,
) -> tuple[StageModule, ParamState, CopyStats]:
    """This worker's module and optimizer state under ``groups.plan``, filled from surviving replicas, and
    what its copy moved.

    ``module``/``state``: what this worker holds under the previous plan (the layers it keeps are
    reused as they are; a joiner holds none). Collective over every worker of the new generation: each
    sends its share of what the copy list asks of it and receives what it newly holds. ``device``: where
    the layers live (by default, where ``module``'s do). ``tensor_parallel_plan``: how layers split at
    tensor parallelism ``t > 1`` (the model's). Raises ``PeerFailure`` on abort or a lost peer.
    """
    me = groups.worker
    copies = [c.at_tensor_rank(groups.tensor_rank) for c in copies]
    incoming = [c for c in copies if c.receiver == me]
    new_layers = list(groups.plan.role(*me).layers)
    missing = set(new_layers) - set(module.layer_indices) - {c.layer for c in incoming}
    if missing:
        raise ValueError(f"the copy list gives worker {me} no source for layers {sorted(missing)}")
    wanted: dict[Worker, list[int]] = defaultdict(list)
    for c in copies:
        wanted[c.receiver].append(c.layer)
    device = device or local(next(iter(module.parameters()))).device

    def build(indices: Iterable[int]) -> StageModule:
        """The layers allocated empty, split over the new generation's stage devices at ``t > 1``."""
        built = build_layers(indices)
        if groups.tensor_group is not None:
            split = {i: built.layer(i) for i in built.layer_indices}
            parallelize_stage(split, groups.tensor_mesh(device.type), tensor_parallel_plan)
        return built

    described: dict[Worker, list[int]] = defaultdict(list)  # receiver -> layers this worker describes
    for c in copies:
        if c.sources[0] == me:
            described[c.receiver].append(c.layer)
    headers = _swap_messages(
        groups,
        {
            peer: _header(module, state, sorted(layers), wanted[peer])
            for peer, layers in sorted(described.items())
        },
        {c.sources[0] for c in incoming},
        device,
        abort,
    )
    received: dict[int, list[tuple[_Spec, Any]]] = {}
    for message in headers.values():
        loaded = torch.load(io.BytesIO(message), map_location="cpu", weights_only=True)
        received.update({layer: [(_Spec(*t[:4]), t[4]) for t in specs] for layer, specs in loaded.items()})
    fresh, fresh_state, fresh_tensors = _allocate(received, build, device)

    def sent_tensors(receiver: Worker, layer: int) -> list[Tensor]:
        return [t for _, t, _ in _layer_tensors(module, state, layer, wanted[receiver]) if t is not None]

    outgoing: dict[Worker, _Stream] = {}
    for receiver in sorted(wanted):
        ours = [c for c in copies if c.receiver == receiver and me in c.sources]
        if ours and receiver != me:
            outgoing.update(_streams(me, receiver, ours, partial(sent_tensors, receiver), bucket_bytes))
    incoming_streams = _streams(me, me, incoming, lambda layer: fresh_tensors[layer], bucket_bytes)
    _run_streams(groups, outgoing, incoming_streams, device, abort)

    layers = {i: module.layer(i) for i in new_layers if i in module.layer_indices}
    kept_state: ParamState = {}
    if groups.tensor_group is not None and layers:
        layers, kept_state = _split_anew(module, state, sorted(layers), build)
    layers.update({i: fresh.layer(i) for i in fresh.layer_indices})
    ties = sorted(set(module.ties) | set(fresh.ties), key=lambda tie: tie.members)
    new_module = StageModule(layers, ties)  # a tie's members held here are one parameter again
    names = set(new_module.global_names().values())
    new_state = {name: s for name, s in state.items() if name in names}
    new_state.update(kept_state)
    new_state.update(fresh_state)
    stats = CopyStats(
        received_bytes=sum(c.nbytes for s in incoming_streams.values() for c in s.chunks),
        sent_bytes=sum(c.nbytes for s in outgoing.values() for c in s.chunks),
        sources=len(incoming_streams),
    )
    return new_module, new_state, stats
