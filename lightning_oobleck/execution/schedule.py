"""1F1B schedule of one stage of one pipeline, written here rather than with torch.distributed.pipelining.

``torch.distributed.pipelining`` waits on its transfers with a plain blocking ``Work.wait()`` deep inside
the schedule, so a rank blocked on a live but silent peer could not be interrupted by recovery; it also
wants a group per pipeline and the same micro-batch count on all of them. Here every pipeline runs its
own micro-batch count, transfers are point to point on the default group, and every wait goes through
the generation's :class:`~lightning_oobleck.execution.comm.CommWaiter`.

Stage ``s`` of ``S`` with ``m`` micro-batches runs ``w = min(S - s - 1, m)`` warm-up forwards, then
``m - w`` (forward, backward) pairs, then ``w`` cool-down backwards; at most ``w + 1`` micro-batches are
in flight on the stage.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.p2p import Inbox, Outbox, TensorMeta, flatten
from lightning_oobleck.execution.stage import StageModule

LossFn = Callable[[Any, Any], Tensor]
Context = Mapping[str, Any]
"""Side inputs of one micro-batch (``attention_mask``, ``position_ids``...), read from the data on every stage
and handed to each layer whose ``forward`` takes a parameter of that name."""


def one_f_one_b(num_stages: int, stage: int, microbatches: int) -> Iterator[tuple[str, int]]:
    """The actions ``("F", i)`` / ``("B", i)`` of ``stage`` in 1F1B order."""
    warmup = min(num_stages - stage - 1, microbatches)
    for i in range(warmup):
        yield "F", i
    for i in range(microbatches - warmup):
        yield "F", warmup + i
        yield "B", i
    for i in range(microbatches - warmup, microbatches):
        yield "B", i


@dataclass
class StageContext:
    """Where a stage sits in its pipeline and how it talks to its neighbours during one step."""

    module: StageModule
    num_stages: int
    stage: int
    prev_rank: int | None
    next_rank: int | None
    device: torch.device
    waiter: CommWaiter
    abort: threading.Event


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
    leaves that carry one back (or the loss), and their metadata as sent."""

    inputs: list[Tensor]
    outputs: list[Tensor]
    sent: list[TensorMeta]


class _Step:
    """The state of one step of one stage: inboxes, outboxes and micro-batches in flight."""

    def __init__(
        self,
        ctx: StageContext,
        data: Sequence[Microbatch],
        loss_fn: LossFn,
        loss_scale: float,
    ) -> None:
        self.ctx = ctx
        self.data = data
        self.microbatches = len(data)
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.loss_sum: Tensor | None = None
        self.in_flight: deque[_InFlight] = deque()
        prev, nxt = ctx.prev_rank, ctx.next_rank
        args = (ctx.device, ctx.waiter, ctx.abort)
        self.acts_in = None if prev is None else Inbox(prev, self.microbatches, *args, header=True)
        self.acts_out = None if nxt is None else Outbox(nxt, *args, header=True)
        self.grads_out = None if prev is None else Outbox(prev, *args, header=False)
        self.grads_in = None if nxt is None else Inbox(nxt, self.microbatches, *args, header=False)

    def stage_input(self, i: int, train: bool) -> tuple[Any, list[Tensor]]:
        """Micro-batch ``i``'s input and its leaves that carry a gradient back to the previous stage."""
        if self.acts_in is None:
            return self.data[i].inputs, []
        x, metas = self.acts_in.get()
        leaves = flatten(x)[0]
        wants_grad = [t for t, m in zip(leaves, metas, strict=True) if train and m.requires_grad]
        for t in wants_grad:
            t.requires_grad_(True)
        return x, wants_grad

    def forward(self, i: int, train: bool) -> None:
        x, x_grad = self.stage_input(i, train)
        y = self.ctx.module(x, self.data[i].context)
        if self.acts_out is None:
            loss = self.loss_fn(y, self.data[i].targets) * self.loss_scale
            self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
            y_grad, sent = [loss], []
        else:
            leaves, spec = flatten(y)
            self._check_sendable(leaves)
            grads = [train and t.requires_grad for t in leaves]
            self.acts_out.send(leaves, spec, grads)
            y_grad = [t for t, g in zip(leaves, grads, strict=True) if g]
            sent = [TensorMeta.of(t, False) for t in y_grad]
        if train:
            self.in_flight.append(_InFlight(x_grad, y_grad, sent))

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

    def backward(self) -> None:
        done = self.in_flight.popleft()
        if self.acts_out is None:
            torch.autograd.backward(done.outputs)
        elif done.outputs:
            assert self.grads_in is not None
            grads, _ = self.grads_in.get(done.sent)
            torch.autograd.backward(done.outputs, grads)
        if self.grads_out is not None and done.inputs:
            self.grads_out.send([t.grad if t.grad is not None else torch.zeros_like(t) for t in done.inputs])

    def wait_sends(self) -> None:
        for box in (self.acts_out, self.grads_out):
            if box is not None:
                box.wait()


def run_train(
    ctx: StageContext,
    data: Sequence[Microbatch],
    loss_fn: LossFn,
    loss_scale: float,
    before_last_backward: Callable[[], None],
    after_last_backward: Callable[[], None],
) -> Tensor | None:
    """Forward and backward every micro-batch in 1F1B order; return the scaled loss sum (last stage).

    The callbacks bracket the stage's last backward: the gradient sync starts inside it, bucket by
    bucket, and overlaps the rest of it, the earlier stages' backward and this stage's pending sends.
    """
    step = _Step(ctx, data, loss_fn, loss_scale)
    microbatches = len(data)
    for action, i in one_f_one_b(ctx.num_stages, ctx.stage, microbatches):
        if action == "F":
            step.forward(i, train=True)
        else:
            if i == microbatches - 1:
                before_last_backward()
            step.backward()
    after_last_backward()
    step.wait_sends()
    return step.loss_sum


def run_eval(
    ctx: StageContext,
    data: Sequence[Microbatch],
    loss_fn: LossFn,
    loss_scale: float,
) -> Tensor | None:
    """Forward every micro-batch without autograd; return the scaled loss sum (last stage)."""
    step = _Step(ctx, data, loss_fn, loss_scale)
    with torch.no_grad():
        for i in range(len(data)):
            step.forward(i, train=False)
    step.wait_sends()
    return step.loss_sum
