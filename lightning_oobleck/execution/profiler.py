"""Measure each layer's cost for one micro-batch on the real device: the planner's input.

Layers are materialised one at a time (from the meta device when the model is a factory) and freed after
their measurement, so a model larger than the device can be profiled. Every layer runs forward and
backward for real, the backward as the executor splits it (the input's gradient, then the weights':
``I`` and ``W``, timed apart), warm-up then repetitions (the median is kept), timed on a GPU by CUDA events
around its kernels queued back to back (the device's time, not the Python launching them: :func:`timed`) and
by the wall clock elsewhere. Memory is counted, not estimated: parameter bytes, the bytes of the
layer's output (what crosses a stage boundary) and the bytes of the tensors autograd saves for the
backward (what each in-flight micro-batch keeps alive), found with ``saved_tensors_hooks``
(:class:`SavedTensorMeter`), and how far the layer's backward raises the bytes alive (its gradients, as in
every micro-batch but a step's first: the parameters' gradients already exist), run whole and split, and
what the split's ``I`` keeps for its ``W``, found by counting every tensor alive (:class:`LiveTensorMeter`,
untimed passes). Results are cached on disk under a key of everything that changes them.

At each tensor-parallel degree ``t`` asked for, every layer is split by its plan and profiled again as one
rank of a stage of ``t`` devices (:func:`~lightning_oobleck.execution.tensor_parallel.one_rank_of`): its own
compute on this device, its shard's bytes, and the size of each collective its forward and backward run
(which the cost model charges at the cluster's tensor-parallel bandwidth). A model with a layer that has no
plan is profiled at ``t = 1`` only, and its profile says which layer (``meta["tensor_parallel"]``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_oobleck.execution.backward import backward_input, backward_weight, split_parameters
from lightning_oobleck.execution.memory import LiveTensorMeter, SavedTensorMeter
from lightning_oobleck.execution.schedule import Context, LossFn
from lightning_oobleck.execution.stage import (
    LayerInit,
    LayerSource,
    build_stage,
    forward_layers,
    reset_parameters,
    resolve_layers,
)
from lightning_oobleck.execution.tensor_parallel import (
    CollectiveMeter,
    LayerPlans,
    declared_plan,
    local,
    one_rank_of,
    parallelize_stage,
)
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile

T = TypeVar("T")


def profile_layers(
    layers_or_factory: LayerSource,
    example_input: Any,
    device: torch.device,
    dtype: torch.dtype | None = None,
    warmup: int = 2,
    repeat: int = 5,
    cache_dir: str | Path | None = None,
    seed: int = 0,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
    init: LayerInit = reset_parameters,
    example_context: Context | None = None,
    tensor_parallel: Sequence[int] = (),
    tensor_parallel_plan: LayerPlans = declared_plan,
) -> ModelProfile:
    """Profile every layer for the micro-batch ``example_input`` (the first layer's input: a tensor or a
    pytree of tensors, ``[b, ...]`` each) with the side inputs ``example_context``.

    With ``loss_fn`` and ``example_target``, the loss counts as part of the last layer (its time, and
    the tensors it saves, which the last stage keeps per in-flight micro-batch); otherwise the last
    layer's backward starts from a gradient of ones.

    Under ``torch.autocast`` the layers run as they will in training under it (a mixed-precision run's
    ``precision.forward_context()``): its dtype is part of the profile's cache key and of its ``meta``.

    With ``cache_dir``, a profile measured earlier for the same layers (structure and parameter
    shapes), input shape and dtype, model dtype, autocast, device and torch version is returned from disk.

    ``tensor_parallel``: the degrees ``t > 1`` to profile too (:attr:`ModelProfile.sharded`), each layer split
    by ``tensor_parallel_plan``; it needs a process with no process group (see the module's docstring).
    """
    context = dict(example_context or {})
    autocast = _autocast(device)
    key = _cache_key(
        layers_or_factory,
        (example_input, context),
        device,
        dtype,
        autocast,
        warmup,
        repeat,
        loss_fn,
        example_target,
        sorted(set(tensor_parallel) - {1}),
    )
    cached = Path(cache_dir) / f"profile-{key[:20]}.json" if cache_dir is not None else None
    if cached is not None and cached.exists():
        return ModelProfile.load(cached)
    x = pytree.tree_map(lambda t: t.to(device), example_input)
    context = pytree.tree_map(lambda t: t.to(device), context)
    leaves = pytree.tree_leaves(example_input)
    target = None if example_target is None else pytree.tree_map(lambda t: t.to(device), example_target)
    measure = functools.partial(
        _profile_pass,
        layers_or_factory,
        x,
        context,
        device,
        dtype,
        seed,
        init,
        warmup,
        repeat,
        loss_fn,
        target,
    )
    layers, parameter_dtype = measure(None, tensor_parallel_plan)
    sharded: dict[int, tuple[LayerProfile, ...]] = {}
    degrees = sorted(set(tensor_parallel) - {1})
    unplanned = [
        f"layer {i} ({type(layer).__name__})"
        for i, layer in enumerate(resolve_layers(layers_or_factory))
        if tensor_parallel_plan(i, layer) is None
    ]
    for t in degrees if not unplanned else ():
        with one_rank_of(t, device.type) as mesh:
            sharded[t] = tuple(measure(mesh, tensor_parallel_plan)[0])
    dtype_name = str(parameter_dtype).removeprefix("torch.")
    result = ModelProfile(
        tuple(layers),
        microbatch_size=leaves[0].shape[0],
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        dtype=dtype_name,
        meta={
            "cache_key": key,
            "torch": torch.__version__,
            "input_shape": list(leaves[0].shape),
            "autocast": autocast,
            **(
                {"tensor_parallel": f"no tensor-parallel plan: {', '.join(unplanned)}"}
                if degrees and unplanned
                else {}
            ),
        },
        sharded=sharded,
    )
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        result.save(cached)
    return result


def _profile_pass(
    source: LayerSource,
    x: Any,
    context: Context,
    device: torch.device,
    dtype: torch.dtype | None,
    seed: int,
    init: LayerInit,
    warmup: int,
    repeat: int,
    loss_fn: LossFn | None,
    target: Any,
    mesh: DeviceMesh | None,
    plans: LayerPlans,
) -> tuple[list[LayerProfile], torch.dtype]:
    """Every layer profiled in turn, each fed the previous one's output; split over ``mesh`` when given."""
    layers = []
    last = len(resolve_layers(source)) - 1
    parameter_dtype = dtype or torch.get_default_dtype()
    for index in range(last + 1):
        # One layer on the device at a time: a model larger than the device can be profiled.
        stage = build_stage(source, [index], device, seed, dtype, init, tied_values=False)
        layer = stage.layer(index)
        if mesh is not None:
            parallelize_stage({index: layer}, mesh, plans)
        parameter_dtype = next((p.dtype for p in layer.parameters()), parameter_dtype)
        loss = None
        if index == last and loss_fn is not None and target is not None:
            loss = lambda out, target=target: loss_fn(out, target)  # noqa: E731
        profile, x = _profile_layer(
            layer,
            x,
            context,
            device,
            warmup,
            repeat,
            loss,
            input_grad=index > 0,
            collectives=mesh is not None,
        )
        layers.append(profile)
        del layer, stage
    return layers, parameter_dtype


def _cache_key(
    source: LayerSource,
    examples: Any,
    device: torch.device,
    dtype: torch.dtype | None,
    autocast: str | None,
    warmup: int,
    repeat: int,
    loss_fn: LossFn | None,
    example_target: Any,
    tensor_parallel: list[int],
) -> str:
    layers = resolve_layers(source)
    described = {
        "layers": [repr(layer) for layer in layers],
        "parameters": [
            [(n, list(p.shape), str(p.dtype)) for n, p in layer.named_parameters()] for layer in layers
        ],
        "input": _shapes(examples),
        "dtype": str(dtype),
        "autocast": autocast,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "repetitions": [warmup, repeat],
        "timed": ["forward", "input gradient", "weight gradient"],
        "memory": ["saved tensors", "backward peaks, whole and split", "kept from I to W"],
        "clock": "device, launches queued",
        "loss": None
        if loss_fn is None or example_target is None
        else [getattr(loss_fn, "__qualname__", repr(loss_fn)), _shapes(example_target)],
        **({"tensor_parallel": tensor_parallel} if tensor_parallel else {}),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _autocast(device: torch.device) -> str | None:
    """The dtype ``torch.autocast`` casts to on ``device`` now, ``None`` outside autocast."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")


def _shapes(tree: Any) -> str:
    """A pytree's structure with the shapes and dtypes of its tensors."""
    leaves, spec = pytree.tree_flatten(tree)
    shapes = [[list(t.shape), str(t.dtype)] if isinstance(t, Tensor) else repr(t) for t in leaves]
    return json.dumps([str(spec), shapes])


def _profile_layer(
    layer: nn.Module,
    x: Any,
    context: Context,
    device: torch.device,
    warmup: int,
    repeat: int,
    loss: Callable[[Any], Tensor] | None,
    input_grad: bool,
    collectives: bool = False,
) -> tuple[LayerProfile, Any]:
    """One layer's profile; ``input_grad``: whether its input needs a gradient (not the model's first layer,
    whose input is the data: its backward computes no input gradient in the pipeline either);
    ``collectives``: one more pass, untimed, records a split layer's collectives, forward and backward."""

    def forward() -> tuple[Any, list[Tensor], list[Tensor]]:
        inputs = pytree.tree_map(lambda t: t.detach().requires_grad_(input_grad and t.is_floating_point()), x)
        out = forward_layers([layer], inputs, context)
        leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, Tensor) and t.requires_grad]
        if loss is not None:
            return out, [loss(out)], leaves
        return out, [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad], leaves

    split, whole = split_parameters([layer])
    forward_s, input_s, weight_s = [], [], []
    for rep in range(warmup + repeat):
        with SavedTensorMeter(exclude=layer.parameters()) as meter:
            (out, roots, leaves), t_fwd = timed(forward, device, queued=True)
        saved_bytes = meter.live_bytes
        grads = [torch.ones_like(r) for r in roots]
        # as the executor splits a stage's backward (a layer with no input gradient: all of it in W)
        kept, t_in = timed(
            lambda roots=roots, grads=grads, leaves=leaves: backward_input(
                roots, grads, leaves, split, whole
            ),
            device,
            queued=True,
        )
        _, t_weight = timed(lambda kept=kept: backward_weight(kept), device, queued=True)
        layer.zero_grad(set_to_none=True)
        if rep >= warmup:
            forward_s.append(t_fwd)
            input_s.append(t_in)
            weight_s.append(t_weight)
    backward_peak, split_backward_peak, weight_kept = _backward_memory(forward, split, whole)
    layer.zero_grad(set_to_none=True)
    forward_meter, backward_meter = CollectiveMeter(), CollectiveMeter()
    if collectives:
        with forward_meter:
            out, roots, leaves = forward()
        with backward_meter:
            backward_weight(backward_input(roots, [torch.ones_like(r) for r in roots], leaves, split, whole))
        layer.zero_grad(set_to_none=True)
    sent = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    weight = statistics.median(weight_s)
    profile = LayerProfile(
        forward_s=statistics.median(forward_s),
        backward_s=statistics.median(input_s) + weight,
        weight_grad_s=weight,
        parameter_bytes=sum(local(p).numel() * p.element_size() for p in layer.parameters()),
        output_activation_bytes=sum(t.numel() * t.element_size() for t in sent),
        activation_bytes=saved_bytes,
        tensor_parallel_forward_bytes=tuple(forward_meter.sizes),
        tensor_parallel_backward_bytes=tuple(backward_meter.sizes),
        backward_peak_bytes=backward_peak,
        split_backward_peak_bytes=split_backward_peak,
        weight_gradient_kept_bytes=weight_kept,
    )
    return profile, pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)


def _backward_memory(
    forward: Callable[[], tuple[Any, list[Tensor], list[Tensor]]], split: list[Tensor], whole: list[Tensor]
) -> tuple[int, int, int]:
    """How far one micro-batch's backward raises the bytes alive, run whole and split (``I`` then ``W``), and
    what the split's ``I`` keeps for its ``W``; measured once the parameters have gradients (a step's first
    micro-batch makes them; every later one makes each anew and adds it)."""
    _, roots, _ = forward()
    torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])  # the gradients exist from here on
    rises, kept = [], 0
    for split_run in (False, True):
        with LiveTensorMeter() as meter:
            _, roots, leaves = forward()
            before = meter.live_bytes
            meter.reset_peak()
            grads = [torch.ones_like(r) for r in roots]
            if split_run:
                pending = backward_input(roots, grads, leaves, split, whole)
                sent = sum(t.grad.untyped_storage().nbytes() for t in leaves if t.grad is not None)
                kept = meter.live_bytes - before - sent
                backward_weight(pending)
            else:
                torch.autograd.backward(roots, grads)
            rises.append(meter.peak_bytes - before)
    return rises[0], rises[1], max(kept, 0)


def timed(fn: Callable[[], T], device: torch.device, queued: bool = False) -> tuple[T, float]:
    """Run ``fn`` and return its result and duration (CUDA events on a GPU, wall clock elsewhere).

    ``queued`` (a GPU only): the device's time alone. A sleep kernel keeps the GPU busy while ``fn``
    launches its kernels, which then run back to back: the Python that launches them (a meter's hooks,
    autograd's bookkeeping) is not counted, as it is not in a step whose launches run ahead of the GPU.
    The next call sleeps twice as long as these launches took, at most four times the device's time and 5 ms
    (launches that waited on the GPU took the sleep's time too)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        key = str(torch.device("cuda", torch.cuda.current_device()) if device.index is None else device)
        if queued:  # the lead is per device: the launches' and the kernels' speeds are the device's
            torch.cuda._sleep(int(_lead_s.get(key, 1e-3) * _sleep_cycles_per_s(key)))
        start.record()
        launch = time.perf_counter()
        result = fn()
        launch_s = time.perf_counter() - launch
        end.record()
        end.synchronize()
        device_s = start.elapsed_time(end) / 1000.0
        if queued:
            _lead_s[key] = min(2 * launch_s, 4 * device_s + 5e-3)
        return result, device_s
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


_lead_s: dict[str, float] = {}
"""Per GPU, how long :func:`timed` keeps it asleep ahead of a queued call's launches."""


@functools.cache
def _sleep_cycles_per_s(device: str) -> float:
    """The rate of ``torch.cuda._sleep``'s argument on a GPU (its clock cycles per second)."""
    cycles = 1 << 24
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)
