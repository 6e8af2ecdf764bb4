"""A stage's layers split over its ``t`` devices (tensor parallelism), through DTensor.

A layer's *tensor-parallel plan* maps the names of its submodules to the styles of
``torch.distributed.tensor.parallel`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``...), as
``parallelize_module`` takes them: Megatron-LM's split is a column-parallel product followed by a row-parallel
one (attention's QKV then its output projection, the MLP's two products), so the activations between layers
stay whole and identical on the stage's devices. An empty plan keeps the layer whole on every device (a layer
with nothing worth splitting); no plan at all means the layer cannot run at ``t > 1``.

The stage's devices each hold one shard of every split parameter (a ``DTensor``) and a whole copy of the
others, and each sends its copy of a stage's output to its counterpart in the next stage (the device of the
same rank): one message per micro-batch and device, as at ``t = 1``. This module is the only one that knows
DTensor: the gradient sync, the gradient norm and the optimizer see local shards through :func:`local`.

Profiling at ``t`` (:func:`one_rank_of`) runs one rank of a split layer alone, on the real device, its
collectives answered by torch's *fake* process group (``torch.testing._internal.distributed.fake_pg``, the
package's one use of a torch-internal module: it hallucinates every collective's result), while
:class:`CollectiveMeter` records each collective's size for the cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_oobleck.execution.stage import find_ties, tie_parameters

if TYPE_CHECKING:
    from lightning_oobleck.execution.process_groups import ProcessGroups

TensorParallelPlan = Mapping[str, ParallelStyle] | ParallelStyle
"""Submodule names of one layer (relative to it, ``"attn.q_proj"``) to the style that splits them, or one
style for the layer itself (a layer that is a single ``nn.Linear``)."""

LayerPlans = Callable[[int, nn.Module], TensorParallelPlan | None]
"""The tensor-parallel plan of layer ``index`` (``None``: it has none and cannot be split)."""


def declared_plan(index: int, layer: nn.Module) -> TensorParallelPlan | None:
    """The default :data:`LayerPlans`: the layer's own ``tensor_parallel_plan()``, if it declares one."""
    declare = getattr(layer, "tensor_parallel_plan", None)
    return declare() if callable(declare) else None


def parallelize_stage(layers: Mapping[int, nn.Module], mesh: DeviceMesh, plans: LayerPlans | None) -> None:
    """Split every layer of a stage over ``mesh`` (its devices) by its plan, in place.

    A parameter the stage's layers share (a tied embedding and head on one stage) stays one parameter: each
    layer's plan splits its own use, so every use must be split alike (refused by name otherwise), and the
    uses are made one split parameter again afterwards."""
    shared = find_ties(layers)
    for index, layer in layers.items():
        plan = plans(index, layer) if plans is not None else None
        if plan is None:
            raise ValueError(
                f"layer {index} ({type(layer).__name__}) has no tensor-parallel plan, so it cannot be "
                f"split over the {mesh.size()} devices of its stage: declare one "
                "(PipelineModule.tensor_parallel_plan: the styles of torch.distributed.tensor.parallel by "
                "submodule name; {} keeps the layer whole) or plan with tensor_parallel=1"
            )
        if isinstance(plan, ParallelStyle) or plan:
            parallelize_module(layer, mesh, plan if isinstance(plan, ParallelStyle) else dict(plan))
    for tie in shared:
        splits = {
            f"layers.{i}.{name}": p.placements if isinstance(p, DTensor) else "whole"
            for i, name in tie.members
            for p in [layers[i].get_parameter(name)]
        }
        if len(set(splits.values())) > 1:
            uses = ", ".join(f"{name} as {split}" for name, split in splits.items())
            raise ValueError(
                f"one parameter is used by several layers of a stage, whose tensor-parallel plans split it "
                f"differently ({uses}): give every use of a tied parameter the same split (e.g. a vocabulary-"
                "split embedding, RowwiseParallel, with a ColwiseParallel head), or keep all of them whole"
            )
    tie_parameters(layers, shared)


def local_grad(param: Tensor) -> Tensor | None:
    """This device's part of ``param``'s gradient, split as the parameter is: some backwards (an
    embedding's) give every device the whole gradient (``Replicate``), which is cut to this device's shard
    first (in place in ``param.grad``; a ``Partial`` one is summed over the stage, a collective of it). Done
    where the gradient is read (gradient sync, norm), not in a gradient hook: ``Module.to`` swaps a split
    parameter's tensors and drops its hooks."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return None if grad is None else local(grad)


def check_split_for(module: nn.Module, groups: ProcessGroups) -> None:
    """Refuse a module whose split parameters belong to another generation's devices than ``groups``'s (a
    split layer runs its collectives on the mesh it was split over: a new generation splits it anew)."""
    mesh = groups.tensor_mesh()
    stale = [n for n, p in module.named_parameters() if isinstance(p, DTensor) and p.device_mesh != mesh]
    if stale:
        raise ValueError(
            f"parameters {stale[:3]} are split over another generation's devices than generation "
            f"{groups.generation}'s: split the layers anew for it (transfer_state does)"
        )


def local(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this device holds: a DTensor's local shard (same storage), else the tensor. A
    collective's result not yet read (an ``AsyncCollectiveTensor``: what a split layer's ``to_local()``
    returns after its all-reduce) is waited for, giving the buffer it wrote (it has no storage of its own)."""
    held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return held.trigger_wait() if isinstance(held, AsyncCollectiveTensor) else held


def like(param: Tensor, value: Tensor) -> Tensor:
    """``value``, a local tensor, as ``param`` holds its values: a DTensor of ``param``'s placements and whole
    shape (given, not inferred from ``value``: a dimension that does not divide by the devices, such as a
    vocabulary of 13 over 2, leaves shards of unequal sizes)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value


def whole_values(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor gathered whole (a collective over its mesh, in ``state``'s order)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def is_split(param: Tensor) -> bool:
    """Whether each device of the stage holds a different part of ``param`` (a shard, not a copy)."""
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


@contextmanager
def one_rank_of(tensor_parallel: int, device_type: str) -> Iterator[DeviceMesh]:
    """A mesh of ``tensor_parallel`` devices of which this process is the first and only real one: the other
    ranks and every collective are hallucinated (numbers computed under it are not the model's), so one
    process can run, time and measure one rank of a split layer. Needs a process with no process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError(
            "profiling at tensor parallelism runs one rank alone in a world of its own: call it in a process "
            "with no process group (before the run's groups exist)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tensor_parallel)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("profiled",))
    finally:
        dist.destroy_process_group()


class CollectiveMeter(TorchDispatchMode):
    """Records the collectives run under it as the all-reduces they cost as much as (:attr:`sizes`, bytes):
    an all-reduce of ``n`` bytes as ``n``; an all-gather into ``n`` bytes, or a reduce-scatter of ``n``, as
    ``n / 2`` (a ring moves ``(t - 1) / t`` of ``n`` once, an all-reduce twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        namespace, _, op = func._schema.name.partition("::")
        if namespace == "_c10d_functional":
            first = args[0]
            nbytes = first.numel() * first.element_size()
            if op in ("all_reduce", "all_reduce_"):
                self.sizes.append(nbytes)
            elif op == "all_gather_into_tensor":
                self.sizes.append(nbytes * args[1] // 2)
            elif op == "reduce_scatter_tensor":
                self.sizes.append(nbytes // 2)
        return out
