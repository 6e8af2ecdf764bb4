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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.p2p import Inbox, Outbox, TensorMeta

LossFn = Callable[[Tensor, Tensor], Tensor]


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

    module: nn.Module
    num_stages: int
    stage: int
    prev_rank: int | None
    next_rank: int | None
    device: torch.device
    waiter: CommWaiter
    abort: threading.Event


class _Step:
    """The state of one step of one stage: inboxes, outboxes and stashed micro-batches."""

    def __init__(
        self,
        ctx: StageContext,
        inputs: Sequence[Tensor] | None,
        targets: Sequence[Tensor] | None,
        microbatches: int,
        loss_fn: LossFn,
        loss_scale: float,
    ) -> None:
        self.ctx = ctx
        self.inputs = inputs
        self.targets = targets
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.loss_sum: Tensor | None = None
        self.stash: deque[tuple[Tensor, Tensor]] = deque()
        prev, nxt = ctx.prev_rank, ctx.next_rank
        self.acts_in = None if prev is None else Inbox(prev, microbatches, ctx.device, ctx.waiter, ctx.abort)
        self.acts_out = None if nxt is None else Outbox(nxt, ctx.device, ctx.waiter, ctx.abort, header=True)
        self.grads_out = (
            None if prev is None else Outbox(prev, ctx.device, ctx.waiter, ctx.abort, header=False)
        )
        self.grads_in: Inbox | None = None

    def stage_input(self, i: int, train: bool) -> Tensor:
        if self.acts_in is None:
            assert self.inputs is not None
            return self.inputs[i]
        x = self.acts_in.get()
        assert self.acts_in.meta is not None
        if train and self.acts_in.meta.requires_grad:
            x.requires_grad_(True)
        return x

    def forward(self, i: int, train: bool) -> None:
        x = self.stage_input(i, train)
        y = self.ctx.module(x)
        if self.acts_out is None:
            assert self.targets is not None
            loss = self.loss_fn(y, self.targets[i]) * self.loss_scale
            self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
            y = loss
        else:
            if not isinstance(y, Tensor):
                layer = self.ctx.module.layer_indices[-1]
                raise TypeError(
                    f"layer {layer} returned a {type(y).__name__}, but its output goes to the next stage, "
                    "which takes one tensor: structured outputs (tuples, dicts, model output objects) cannot "
                    f"cross a stage boundary yet. Return the hidden states from layer {layer} (wrap a block "
                    "that returns a tuple in an nn.Module whose forward returns block(x)[0])"
                )
            send_grad = train and y.requires_grad
            self.acts_out.send(y, requires_grad=send_grad)
            if send_grad and self.grads_in is None:
                self.grads_in = self._gradient_inbox(self.acts_out.peer, y)
        if train:
            self.stash.append((x, y))

    def _gradient_inbox(self, peer: int, activation: Tensor) -> Inbox:
        """Gradients of the activations sent to ``peer``: same shape and dtype, no header needed."""
        meta = TensorMeta(tuple(activation.shape), activation.dtype, False)
        return Inbox(
            peer, self.microbatches, self.ctx.device, self.ctx.waiter, self.ctx.abort, meta, prefetch=False
        )

    def backward(self) -> None:
        x, y = self.stash.popleft()
        if self.acts_out is None:
            y.backward()
        elif y.requires_grad:
            assert self.grads_in is not None
            torch.autograd.backward(y, self.grads_in.get())
        if self.grads_out is not None and x.requires_grad:
            assert x.grad is not None
            self.grads_out.send(x.grad)

    def wait_sends(self) -> None:
        for box in (self.acts_out, self.grads_out):
            if box is not None:
                box.wait()


def run_train(
    ctx: StageContext,
    inputs: Sequence[Tensor] | None,
    targets: Sequence[Tensor] | None,
    microbatches: int,
    loss_fn: LossFn,
    loss_scale: float,
    before_last_backward: Callable[[], None],
    after_last_backward: Callable[[], None],
) -> Tensor | None:
    """Forward and backward every micro-batch in 1F1B order; return the scaled loss sum (last stage).

    The callbacks bracket the stage's last backward: the gradient sync starts inside it, bucket by
    bucket, and overlaps the rest of it, the earlier stages' backward and this stage's pending sends.
    """
    step = _Step(ctx, inputs, targets, microbatches, loss_fn, loss_scale)
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
    inputs: Sequence[Tensor] | None,
    targets: Sequence[Tensor] | None,
    microbatches: int,
    loss_fn: LossFn,
    loss_scale: float,
) -> Tensor | None:
    """Forward every micro-batch without autograd; return the scaled loss sum (last stage)."""
    step = _Step(ctx, inputs, targets, microbatches, loss_fn, loss_scale)
    with torch.no_grad():
        for i in range(microbatches):
            step.forward(i, train=False)
    step.wait_sends()
    return step.loss_sum
