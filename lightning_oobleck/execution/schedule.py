"""The executor: runs one worker's action list for a step (:mod:`lightning_oobleck.planning.schedules`).

Any list the validator accepts runs here, whatever schedule made it: ``F`` forwards a micro-batch (its
input comes from the data on a pipeline's first stage, else from the activation ``RECV`` before it);
``B`` back-propagates it whole, ``I`` only to its input (:mod:`lightning_oobleck.execution.backward`), ``W``
then to its parameters; ``SEND`` posts an asynchronous send of an activation (after ``F``) or an input
gradient (after ``I``/``B``); ``RECV`` takes what a peer sent; ``REDUCE`` issues one gradient bucket's
all-reduce. The bucketed gradient sync starts during the list's last gradient action: a bucket is issued
as soon as its parameters' gradients are final (post-accumulate hooks), and its ``REDUCE`` at the latest.

``torch.distributed.pipelining`` waits on its transfers with a plain blocking ``Work.wait()`` deep inside
the schedule, so a rank blocked on a live but silent peer could not be interrupted by recovery; here every
wait goes through the generation's :class:`~lightning_oobleck.execution.comm.CommWaiter`, and every
pipeline runs its own micro-batch count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.backward import (
    WeightGradient,
    backward_input,
    backward_weight,
    split_parameters,
)
from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.grad_sync import GradientSync
from lightning_oobleck.execution.p2p import Inbox, Outbox, TensorMeta, flatten
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.planning.schedules import GRADIENT_OPS, Action, Op, Payload, Timing, Worker

LossFn = Callable[[Any, Any], Tensor]
Context = Mapping[str, Any]
"""Side inputs of one micro-batch (``attention_mask``, ``position_ids``...), read from the data on every stage
and handed to each layer whose ``forward`` takes a parameter of that name."""


@dataclass
class StageContext:
    """What a worker's executor needs for one generation: its layers, its device, how to reach peers."""

    module: StageModule
    device: torch.device
    group: dist.ProcessGroup
    """The generation's world group, over which peers are reached (ranks: :attr:`rank_of`)."""
    waiter: CommWaiter
    abort: threading.Event
    rank_of: Callable[[Worker], int]
    num_layers: int
    """The model's layers: the action that runs the last one computes its micro-batch's loss."""


@dataclass
class Microbatch:
    """What the data gives one micro-batch: ``inputs`` (first stage), ``targets`` (last stage) and the
    ``context`` every stage reads."""

    inputs: Any
    targets: Any
    context: Context


@dataclass
class _InFlight:
    """A forwarded micro-batch awaiting its backward: the input leaves that need a gradient, the output
    leaves that carry one back (or the loss), their metadata as sent, the gradients received for them,
    and, between ``I`` and ``W``, what ``W`` needs."""

    inputs: list[Tensor]
    outputs: list[Tensor]
    sent: list[TensorMeta]
    output_grads: list[Tensor] | None = None
    weight: WeightGradient | None = None


_Stream = tuple[Worker, Payload, int]
"""The transfers of one kind with one peer on one channel (:attr:`Action.channel`, the message tag)."""


class _Step:
    """The state of one step of one worker: inboxes, outboxes and micro-batches in flight."""

    def __init__(
        self,
        ctx: StageContext,
        actions: Sequence[Action],
        data: Mapping[int, Microbatch],
        loss_fn: LossFn,
        loss_scale: float,
        train: bool,
    ) -> None:
        self.ctx = ctx
        self.data = data
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.train = train
        self.loss_sum: Tensor | None = None
        self.received: dict[tuple[Payload, int], Any] = {}
        self.in_flight: dict[int, _InFlight] = {}
        self.to_send: dict[tuple[Payload, int], tuple[list[Tensor], Any, list[bool]]] = {}
        self.layers_of: dict[int, tuple[int, ...]] = {}  # the layers each micro-batch's forward ran
        counts: dict[_Stream, int] = {}
        for a in actions:
            if a.op is Op.RECV:
                assert a.peer is not None and a.payload is not None
                counts[(a.peer, a.payload, a.channel)] = counts.get((a.peer, a.payload, a.channel), 0) + 1
        args = (ctx.device, ctx.waiter, ctx.abort)
        self.inboxes = {
            (peer, payload, channel): Inbox(
                ctx.rank_of(peer), ctx.group, n, *args, header=payload is Payload.ACTIVATION, tag=channel
            )
            for (peer, payload, channel), n in counts.items()
        }
        self.outboxes: dict[_Stream, Outbox] = {}
        for a in actions:
            key = (a.peer, a.payload, a.channel)
            if a.op is Op.SEND and key not in self.outboxes:
                assert a.peer is not None and a.payload is not None
                header = a.payload is Payload.ACTIVATION
                self.outboxes[key] = Outbox(  # type: ignore[index]
                    ctx.rank_of(a.peer), ctx.group, *args, header=header, tag=a.channel
                )
        self._params: dict[tuple[int, ...], tuple[list[nn.Parameter], list[nn.Parameter]]] = {}

    def params(self, layers: tuple[int, ...]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The parameters of ``layers`` whose gradients a ``W`` may compute after an ``I``, and the others."""
        if layers not in self._params:
            module = self.ctx.module
            split, whole = split_parameters(module.layer(i) for i in layers)
            if module.recompute:  # recomputation runs inside the backward: it cannot be split
                split, whole = [], split + whole
            self._params[layers] = (split, whole)
        return self._params[layers]

    def recv(self, a: Action) -> None:
        assert a.peer is not None and a.payload is not None
        inbox = self.inboxes[(a.peer, a.payload, a.channel)]
        if a.payload is Payload.ACTIVATION:
            self.received[(a.payload, a.microbatch)] = inbox.get()
        else:
            self.in_flight[a.microbatch].output_grads = inbox.get(self.in_flight[a.microbatch].sent)[0]

    def forward(self, mb: int, layers: tuple[int, ...]) -> None:
        """``F`` of micro-batch ``mb`` through ``layers`` (the action's: the stage's, or a part of them for a
        rerouted micro-batch); the one through the model's last layer computes the loss."""
        last = layers[-1] == self.ctx.num_layers - 1
        self.layers_of[mb] = layers
        if (Payload.ACTIVATION, mb) in self.received:
            x, metas = self.received.pop((Payload.ACTIVATION, mb))
            leaves = flatten(x)[0]
            x_grad = [t for t, m in zip(leaves, metas, strict=True) if self.train and m.requires_grad]
            for t in x_grad:
                t.requires_grad_(True)
        else:
            x, x_grad = self.data[mb].inputs, []
        y = self.ctx.module(x, self.data[mb].context, layers)
        if last:
            loss = self.loss_fn(y, self.data[mb].targets) * self.loss_scale
            self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
            y_grad, sent = [loss], []
        else:
            leaves, spec = flatten(y)
            self._check_sendable(leaves)
            grads = [self.train and t.requires_grad for t in leaves]
            self.to_send[(Payload.ACTIVATION, mb)] = (leaves, spec, grads)
            y_grad = [t for t, g in zip(leaves, grads, strict=True) if g]
            sent = [TensorMeta.of(t, False) for t in y_grad]
        if self.train:
            self.in_flight[mb] = _InFlight(x_grad, y_grad, sent)

    def _check_sendable(self, leaves: list[Any]) -> None:
        bad = [type(t).__name__ for t in leaves if not isinstance(t, Tensor)]
        if bad:
            layer = self.ctx.module.layer_indices[-1]
            raise TypeError(
                f"layer {layer} returned {bad[0]} values inside its output, which goes to the next stage: "
                "only tensors (in tuples, lists or dicts) cross a stage boundary. Return tensors from layer "
                f"{layer} (a constant belongs in the next layer's constructor; a per-batch value in the "
                "batch's context, see PipelineModule.split_batch)"
            )

    def backward(self, mb: int, op: Op) -> None:
        """``B`` (whole), ``I`` (to the input) or ``W`` (to the parameters) of micro-batch ``mb``."""
        state = self.in_flight[mb]
        if op is Op.W:
            assert state.weight is not None
            backward_weight(state.weight)
            del self.in_flight[mb]
            return
        if state.outputs:
            grads = state.output_grads
            if op is Op.B:
                torch.autograd.backward(state.outputs, grads)
            else:
                split, whole = self.params(self.layers_of[mb])
                state.weight = backward_input(state.outputs, grads, state.inputs, split, whole)
        elif op is Op.I:
            state.weight = WeightGradient([])
        if state.inputs:
            grads_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in state.inputs]
            self.to_send[(Payload.GRADIENT, mb)] = (grads_in, None, [])
        if op is Op.B:
            del self.in_flight[mb]

    def send(self, a: Action) -> None:
        assert a.payload is not None
        leaves, spec, grads = self.to_send.pop((a.payload, a.microbatch), ([], None, []))
        self.outboxes[(a.peer, a.payload, a.channel)].send(leaves, spec, grads)  # type: ignore[index]

    def wait_sends(self) -> None:
        for box in self.outboxes.values():
            box.wait()


_FAULT_POINTS = {
    Op.F: faults.FaultPoint.FORWARD,
    Op.B: faults.FaultPoint.BACKWARD,
    Op.I: faults.FaultPoint.INPUT_GRAD,
    Op.W: faults.FaultPoint.WEIGHT_GRAD,
}


def run_actions(
    ctx: StageContext,
    actions: Sequence[Action],
    data: Mapping[int, Microbatch],
    loss_fn: LossFn,
    loss_scale: float,
    sync: GradientSync | None,
    trace: list[Timing] | None = None,
) -> Tensor | None:
    """Run ``actions`` (a validated list) over ``data`` (by global micro-batch index); return the scaled loss
    sum (last stage). With ``sync`` it is a training step, else a forward-only one without autograd.
    ``trace``: append every action's start and end (``time.perf_counter``)."""
    train = sync is not None
    last_gradient = max((k for k, a in enumerate(actions) if a.op in GRADIENT_OPS), default=-1)
    step = _Step(ctx, actions, data, loss_fn, loss_scale, train)
    with torch.set_grad_enabled(train):
        for k, a in enumerate(actions):
            start = time.perf_counter() if trace is not None else 0.0
            if k == last_gradient:
                assert sync is not None
                sync.arm()
            if train and (point := _FAULT_POINTS.get(a.op)) is not None:
                faults.reach(point)
            if a.op is Op.F:
                step.forward(a.microbatch, a.layers)
            elif a.op in (Op.B, Op.I, Op.W):
                step.backward(a.microbatch, a.op)
            elif a.op is Op.RECV:
                step.recv(a)
            elif a.op is Op.SEND:
                step.send(a)
            else:
                assert sync is not None
                sync.reduce(a.bucket)
            if trace is not None:
                trace.append(Timing(a, start, time.perf_counter()))
    if sync is not None:
        sync.flush()
    step.wait_sends()
    return step.loss_sum
