"""Build the layers one worker owns, with global names and seed-determined initial weights.

The model is an ordered sequence of layers (``nn.Module``; each takes the previous one's output, a tensor or a
pytree of tensors, and may name side inputs of the micro-batch as ``forward`` parameters), or a factory
returning one; a factory is called on the meta device, so no rank materialises layers it does
not own. An owned layer is moved to the device and initialised by a :data:`LayerInit` under a seed derived
from ``(seed, layer index)``: every layout, and the single-process reference (:func:`build_reference_model`),
gets identical weights for layer ``i``. The default, :func:`reset_parameters`, calls ``reset_parameters()``
on the outermost submodules that define it (a module that defines it initialises its whole subtree, the way
it wants: its children are not reset after it); a model with its own initialisation (Hugging Face's
``_init_weights``, ``nn.init.normal_(std=0.02)``) passes its own, e.g. ``lambda layer, i:
layer.apply(model._init_weights)``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

LayerSource = Sequence[nn.Module] | Callable[[], Sequence[nn.Module]]
"""The model: its layers in order, or a factory returning them (called on the meta device)."""

LayerInit = Callable[[nn.Module, int], None]
"""Initialises every parameter (and floating buffer) of layer ``index`` in place, from the global RNG (which
is seeded per layer around the call)."""


def reset_parameters(layer: nn.Module, index: int) -> None:
    """The default :data:`LayerInit`: ``reset_parameters()`` of the outermost submodules that define it."""
    pending = [layer]
    while pending:
        module = pending.pop()
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            pending.extend(reversed(list(module.children())))


class StageModule(nn.Module):
    """Some consecutive layers of the model, named by their global index (``layers.7.attn.weight``)."""

    def __init__(self, layers: Mapping[int, nn.Module], ties: Sequence[Tie] = ()) -> None:
        super().__init__()
        self.layer_indices = tuple(sorted(layers))
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_indices})
        self.ties = tie_parameters(layers, ties)
        """The model's ties that touch these layers; the members held here are one ``nn.Parameter``."""
        self.recompute = False
        """Activation recomputation: under autograd, each layer keeps only its input and runs its forward
        again in the backward (``torch.utils.checkpoint``, non-reentrant; the RNG state is replayed)."""

    def forward(
        self, x: Any, context: Mapping[str, Any] | None = None, layers: Sequence[int] | None = None
    ) -> Any:
        """``x`` through the held layers, or through ``layers`` of them (a rerouted micro-batch's part)."""
        chosen = self.layers.values() if layers is None else [self.layer(i) for i in layers]
        return forward_layers(chosen, x, context, self.recompute and torch.is_grad_enabled())

    def layer(self, index: int) -> nn.Module:
        return self.layers[str(index)]

    def tied(self) -> dict[nn.Parameter, Tie]:
        """The tied parameters held here and their tie."""
        held = self.layer_indices
        return {self.layer(i).get_parameter(n): t for t in self.ties for i, n in t.members if i in held}

    def global_names(self) -> dict[nn.Parameter, str]:
        """Each parameter held here once, by its global name (a tied one by its tie's canonical name, even
        where its canonical layer is held elsewhere)."""
        tied = self.tied()
        return {p: tied[p].name if p in tied else name for name, p in self.named_parameters()}


def forward_layers(
    layers: Iterable[nn.Module], x: Any, context: Mapping[str, Any] | None = None, recompute: bool = False
) -> Any:
    """The layers in order: each receives the previous one's output as it was returned, and the entries of
    ``context`` that its ``forward`` names as parameters (keyword arguments)."""
    context = context or {}
    for layer in layers:
        kwargs = {name: context[name] for name in context_parameters(type(layer)) if name in context}
        x = checkpoint(layer, x, use_reentrant=False, **kwargs) if recompute else layer(x, **kwargs)
    return x


@functools.cache
def context_parameters(layer_type: type[nn.Module]) -> frozenset[str]:
    """The names a layer type's ``forward`` takes besides its first argument (where context entries go;
    ``**kwargs`` takes none)."""
    parameters = list(inspect.signature(layer_type.forward).parameters.values())[2:]  # self, the input
    return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def layer_seed(seed: int, layer: int) -> int:
    """The RNG seed that initialises layer ``layer`` of a model seeded with ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{layer}".encode()).digest()[:8], "little")


def resolve_layers(source: LayerSource) -> list[nn.Module]:
    """The model's layers as a list; a factory is called under ``torch.device("meta")``. Refuses anything
    that is not a sequence of modules."""
    if callable(source) and not isinstance(source, nn.Module):
        with torch.device("meta"):
            source = source()
    if isinstance(source, nn.Module) and not isinstance(source, nn.Sequential | nn.ModuleList):
        raise TypeError(
            f"the model must be an ordered sequence of layers, got a single {type(source).__name__}; "
            "pass a list of nn.Module (or nn.Sequential / nn.ModuleList, or a factory returning one), "
            "each taking the previous layer's output"
        )
    if not isinstance(source, Iterable) or isinstance(source, Tensor | str | bytes):
        raise TypeError(
            f"the model must be an ordered sequence of nn.Module layers, got {type(source).__name__}"
        )
    layers = list(source)
    bad = [i for i, layer in enumerate(layers) if not isinstance(layer, nn.Module)]
    if not layers or bad:
        raise TypeError(
            "the model must be a non-empty sequence of nn.Module layers"
            + (f"; items {bad} are {type(layers[bad[0]]).__name__}" if bad else "")
        )
    return layers


@dataclass(frozen=True)
class Tie:
    """One parameter shared by several layers (a tied embedding and LM head): every ``(layer, name)`` that
    holds it, in layer order. The first is its canonical name, which checkpoints and state copies use, and
    whose layer's initialisation gives its initial value."""

    members: tuple[tuple[int, str], ...]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.members}))

    @property
    def name(self) -> str:
        layer, name = self.members[0]
        return f"layers.{layer}.{name}"


def find_ties(layers: Sequence[nn.Module] | Mapping[int, nn.Module]) -> tuple[Tie, ...]:
    """The parameters that more than one layer holds (the same ``nn.Parameter`` object), in order of their
    first holder; a mapping names the layers by their index in the model."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for i, layer in layers.items() if isinstance(layers, Mapping) else enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            holders.setdefault(id(p), []).append((i, name))
    return tuple(Tie(tuple(m)) for m in holders.values() if len({layer for layer, _ in m}) > 1)


def declare_ties(layers: Sequence[nn.Module], groups: Sequence[Sequence[str]]) -> Sequence[nn.Module]:
    """Make each group of parameters one ``nn.Parameter`` (that of the group's lowest layer), for layers built
    separately that must share a weight. A parameter is named ``"LAYER.NAME"``: the layer's index, then the
    parameter's name in that layer (``"0.wte.weight"``). :func:`find_ties` then finds them like any tie."""
    held: set[str] = set()
    for group in groups:
        if isinstance(group, str) or len(group) < 2:
            raise ValueError(
                f"tied_parameters() gave {group!r}: each tie is a sequence of two or more parameter names, "
                "e.g. [('0.wte.weight', '5.lm_head.weight')]"
            )
        members = sorted((_split_name(name, len(layers)), name) for name in group)
        params = [_declared_parameter(layers, index, name, full) for (index, name), full in members]
        (_, first), shared = members[0], params[0]
        for ((index, name), full), p in zip(members[1:], params[1:], strict=True):
            if p.shape != shared.shape or p.dtype != shared.dtype:
                raise ValueError(
                    f"tied parameters {first} ({tuple(shared.shape)}, {shared.dtype}) and {full} "
                    f"({tuple(p.shape)}, {p.dtype}) differ: only parameters of one shape and dtype can be "
                    "one tensor (a transposed use belongs in the layer's forward)"
                )
            _set_parameter(layers[index], name, shared)
        for _, full in members:
            if full in held:
                raise ValueError(f"tied_parameters() names {full} in two ties: merge them into one")
            held.add(full)
    return layers


def _split_name(full: str, count: int) -> tuple[int, str]:
    index, _, name = full.partition(".")
    if not index.isdigit() or not name or not int(index) < count:
        raise ValueError(
            f"tied_parameters() names {full!r}: name a parameter 'LAYER.NAME', the index of one of the "
            f"{count} layers configure_layers() returns, then the parameter's name in that layer"
        )
    return int(index), name


def _declared_parameter(layers: Sequence[nn.Module], index: int, name: str, full: str) -> nn.Parameter:
    try:
        return layers[index].get_parameter(name)
    except AttributeError:
        names = [n for n, _ in layers[index].named_parameters()]
        raise ValueError(
            f"tied_parameters() names {full!r}, but layer {index} ({type(layers[index]).__name__}) has no "
            f"parameter {name!r}; its parameters: {names}"
        ) from None


def tie_parameters(layers: Mapping[int, nn.Module], ties: Sequence[Tie]) -> tuple[Tie, ...]:
    """Make the members of each tie held in ``layers`` one ``nn.Parameter`` (the first held member's);
    returns the ties that touch ``layers``."""
    touching = tuple(t for t in ties if set(t.layers) & set(layers))
    for tie in touching:
        held = [(i, name) for i, name in tie.members if i in layers]
        shared = layers[held[0][0]].get_parameter(held[0][1])
        for i, name in held[1:]:
            _set_parameter(layers[i], name, shared)
    return touching


def _set_parameter(layer: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(layer.get_submodule(owner), attribute, value)


def build_stage(
    source: LayerSource,
    layers: Iterable[int],
    device: torch.device,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    init: LayerInit | None = reset_parameters,
    tied_values: bool = True,
) -> StageModule:
    """Materialise and initialise (``init``, seeded per layer) only ``layers`` of the model on ``device``.

    A tied parameter starts from the value its canonical layer's initialisation gives it, on every stage
    that holds it (the canonical layer is built for the copy where it is held elsewhere).
    ``tied_values=False`` skips that copy, for a caller that needs the layers' shapes and speed but not
    their values (profiling: only the layers asked for then exist). ``init=None`` allocates the layers
    without writing any value (a state copy writes them all)."""
    all_layers = resolve_layers(source)
    wanted = list(layers)
    missing = [i for i in wanted if not 0 <= i < len(all_layers)]
    if missing:
        raise ValueError(f"layers {missing} do not exist: the model has {len(all_layers)} layers")
    all_ties = find_ties(all_layers)
    ties = [t for t in all_ties if set(t.layers) & set(wanted)]
    canonical = {t.members[0][0] for t in ties}
    # Canonical layers last: where the layers given share one Parameter, its last initialisation stays.
    order = sorted(wanted, key=lambda i: i in canonical)
    copies = {(i, name) for tie in ties for i, name in tie.members[1:]}  # their value is the canonical one
    built = {
        i: _materialise(all_layers[i], i, device, seed, dtype, init, {n for j, n in copies if j == i})
        for i in order
    }
    for tie in ties:
        (first, name), (layer, held) = tie.members[0], next(m for m in tie.members if m[0] in built)
        if first not in built and tied_values and init is not None:
            value = _materialise(all_layers[first], first, device, seed, dtype, init, set()).get_parameter(
                name
            )
            with torch.no_grad():
                built[layer].get_parameter(held).copy_(value)
    return StageModule(built, all_ties)


def build_reference_model(
    source: LayerSource,
    device: torch.device,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    init: LayerInit = reset_parameters,
) -> StageModule:
    """The whole model in one process, with exactly the weights any layout gives each layer."""
    return build_stage(source, range(len(resolve_layers(source))), device, seed, dtype, init)


def _materialise(
    layer: nn.Module,
    index: int,
    device: torch.device,
    seed: int,
    dtype: torch.dtype | None,
    init: LayerInit | None,
    tied_copies: set[str],
) -> nn.Module:
    on_meta = any(t.is_meta for t in chain(layer.parameters(), layer.buffers()))
    if init is None:
        layer = layer.to_empty(device=device) if on_meta else layer.to(device)
        return layer if dtype is None else layer.to(dtype)
    if on_meta:
        integer = [n for n, b in layer.named_buffers() if not b.is_floating_point()]
        if integer:
            raise ValueError(
                f"layer {index} has non-floating buffers {integer} built on the meta device; their values "
                "cannot be re-created: compute them in forward() or build the layers off the meta device"
            )
        layer = layer.to_empty(device=device)
    else:
        layer = layer.to(device)
    if dtype is not None:
        layer = layer.to(dtype)
    # Poison every value the initialisation must write, so a value nobody initialises is detected.
    checked = list(layer.named_parameters()) + (list(layer.named_buffers()) if on_meta else [])
    checked = [(n, t) for n, t in checked if t.is_floating_point() and n not in tied_copies]
    with torch.no_grad():
        for _, t in checked:
            t.fill_(float("nan"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(layer_seed(seed, index))
            init(layer, index)
    uncovered = [n for n, t in checked if torch.isnan(t).any()]
    if uncovered:
        how = (
            "any submodule's reset_parameters(); define reset_parameters() on the module that owns them, or "
            "initialise the layer your way in PipelineModule.init_layer(layer, index)"
            if init is reset_parameters
            else f"{getattr(init, '__qualname__', init)}"
        )
        raise ValueError(f"layer {index} ({type(layer).__name__}): {uncovered} are not initialised by {how}")
    return layer
