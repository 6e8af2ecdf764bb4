"""Emulated devices: layers whose forward, input gradient and weight gradient each take a set wall time.

A pipeline's timing depends on its schedule and on how long each stage computes. Measured with real
compute on a machine with fewer cores than processes (8 workers on 2 cores), it shows contention, not the
schedule. An :class:`EmulatedLayer` instead *sleeps* for its compute, releasing the core, on tiny tensors:
any number of worker processes then behave like devices whose compute times are known, and the measured
iteration time can be checked against the cost model's prediction for the same times
(:func:`emulated_profile`).

The forward sleeps ``forward_s``. The backward is two autograd nodes: the input's gradient (sleeps
``input_grad_s``) and the weight's (sleeps ``weight_grad_s``), so a schedule that splits the backward can
run them apart. The arithmetic is real (``y = x + bias``: the gradients are exact) so training on emulated
layers can also be checked for equal weights.

    layers = emulated_layers(8, width=16, times=DeviceTimes(0.01, 0.01, 0.01))
    profile = emulated_profile(8, width=16, times=DeviceTimes(0.01, 0.01, 0.01), microbatch_size=4)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_oobleck.planning.profile import DTYPE_BYTES, LayerProfile, ModelProfile


@dataclass(frozen=True)
class DeviceTimes:
    """Seconds an emulated layer takes per micro-batch for each part of its work."""

    forward_s: float
    input_grad_s: float
    weight_grad_s: float

    def __post_init__(self) -> None:
        if min(self.forward_s, self.input_grad_s, self.weight_grad_s) < 0:
            raise ValueError(f"emulated compute times must be >= 0, got {self}")

    @property
    def backward_s(self) -> float:
        return self.input_grad_s + self.weight_grad_s


class _Timed(torch.autograd.Function):
    """The identity, whose forward sleeps ``forward_s`` and whose backward sleeps ``backward_s``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        if forward_s > 0:
            time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedLayer(nn.Module):
    """``y = x + bias`` over the last dimension (``width``), taking ``times`` to compute."""

    def __init__(self, width: int, times: DeviceTimes) -> None:
        super().__init__()
        self.times = times
        self.bias = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.bias, std=0.1)

    def forward(self, x: Tensor) -> Tensor:
        t = self.times
        return _Timed.apply(x, t.forward_s, t.input_grad_s) + _Timed.apply(self.bias, 0.0, t.weight_grad_s)


def emulated_layers(count: int, width: int, times: DeviceTimes) -> list[nn.Module]:
    """``count`` emulated layers of ``width`` features, each taking ``times``."""
    return [EmulatedLayer(width, times) for _ in range(count)]


def emulated_profile(
    count: int,
    width: int,
    times: DeviceTimes,
    microbatch_size: int,
    sequence: int = 1,
    dtype: str = "float32",
) -> ModelProfile:
    """The profile of :func:`emulated_layers` for micro-batches of ``[microbatch_size, sequence, width]``:
    the configured times (the first layer, fed the data, computes no input gradient), and the layers' real
    sizes."""
    element = DTYPE_BYTES[dtype]
    output = microbatch_size * sequence * width * element
    layer = LayerProfile(
        forward_s=times.forward_s,
        backward_s=times.backward_s,
        parameter_bytes=width * element,
        output_activation_bytes=output,
        activation_bytes=0,
        weight_grad_s=times.weight_grad_s,
        backward_peak_bytes=0,  # emulated layers model time; their tensors are a few bytes
        split_backward_peak_bytes=0,
        weight_gradient_kept_bytes=0,
    )
    # the first layer's input is the data, which needs no gradient: its backward is the weight's alone
    first = replace(layer, backward_s=times.weight_grad_s)
    return ModelProfile((first,) + (layer,) * (count - 1), microbatch_size, device="emulated", dtype=dtype)


class EmulatedSplitLayer(nn.Module):
    """An emulated layer that splits over a stage's devices as a Megatron pair does: a column-parallel
    product to ``rank`` features, then a row-parallel one back to ``width``, whose all-reduces are real (the
    output's forward, the input's gradient backward); its sleeps are ``times`` divided by the number of
    devices it is split over (a device computing ``1/t`` of the layer).

    ``dtensor=True`` splits it through DTensor (``ColwiseParallel`` / ``RowwiseParallel``), as a model's
    layers are, host work included. ``dtensor=False`` keeps its weights whole and runs the pair's two
    all-reduces itself (torch's functional collectives on the stage's group): the same messages without
    DTensor's dispatch, so a measurement sees the sleeps and the collectives alone (its numbers then differ
    from the layer's at ``t = 1``: only its timing is the model's)."""

    def __init__(self, width: int, times: DeviceTimes, rank: int = 8, dtensor: bool = True) -> None:
        super().__init__()
        self.times = times
        self.dtensor = dtensor
        self.up = nn.Linear(width, rank, bias=False)
        self.down = nn.Linear(rank, width, bias=False)
        self.bias = nn.Parameter(torch.empty(width))
        self.group: Any = None
        """The stage's devices when split by hand (:class:`_StageGroup`)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.up.weight, std=0.1)
        nn.init.normal_(self.down.weight, std=0.1)
        nn.init.normal_(self.bias, std=0.1)

    def tensor_parallel_plan(self) -> Any:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()} if self.dtensor else _StageGroup()

    def forward(self, x: Tensor) -> Tensor:
        weight = self.up.weight
        if self.group is not None:
            t = torch.distributed.get_world_size(self.group)
        else:
            t = weight.device_mesh.size() if hasattr(weight, "device_mesh") else 1
        times = self.times
        x = _Timed.apply(x, times.forward_s / t, times.input_grad_s / t)
        if self.group is None:
            product = self.down(self.up(x))
        else:  # Megatron's f (the input's gradient summed backward) and g (the output summed forward)
            product = _SumForward.apply(self.down(self.up(_SumBackward.apply(x, self.group))), self.group)
        return x + product + _Timed.apply(self.bias, 0.0, times.weight_grad_s / t)


def _all_reduce(tensor: Tensor, group: Any) -> Tensor:
    return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))


class _SumForward(torch.autograd.Function):
    """The sum over the stage's devices forward, the identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """The identity forward, the sum of the gradient over the stage's devices backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad.contiguous(), ctx.group), None


class _StageGroup(ParallelStyle):
    """Gives an :class:`EmulatedSplitLayer` split by hand its stage's group, and splits nothing."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.group = device_mesh.get_group()
        return module
