"""Sum every layer's gradient over the pipelines holding a replica of it, and every tied parameter's over all
the workers holding any of its layers (one all-reduce per tie, in the same step).

Parameters of one stage whose layers share the same set of owners (one worker per pipeline) are
bucketed into flat buffers (at most ``bucket_cap_bytes`` each) and all-reduced in the group of exactly
those owners. At tensor parallelism ``t > 1`` a device sums its own shards (or copies) with the devices of
the same tensor rank in the other pipelines, which hold the same shards. The loss of each micro-batch is
already scaled by ``b / B``, so the sum is the gradient of the global mean loss.

Overlap: during the stage's last gradient action (``B`` or ``W``), a bucket is all-reduced as soon as
every one of its parameters has its final gradient (``register_post_accumulate_grad_hook``), while
autograd goes on with earlier layers, and while earlier stages are still in their backward. Buckets are
filled in backward order (last layer first) and issued strictly in that order on every rank, a global
order, so ranks sharing several groups never wait on each other in a cycle (NCCL runs them one after
another).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_oobleck.execution import faults
from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.execution.tensor_parallel import like, local, local_grad

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
"""Bucket size cap, as DDP's default."""


@dataclass
class _Bucket:
    group: dist.ProcessGroup
    params: list[nn.Parameter]
    flat: torch.Tensor
    layers: tuple[int, ...]
    ready: int = 0


class GradientSync:
    """The gradient buckets of one stage under one plan.

    Per step (the executor, :func:`~lightning_oobleck.execution.schedule.run_actions`): :meth:`arm` before
    the stage's last gradient action, :meth:`reduce` for each ``REDUCE`` action, :meth:`flush` at the end
    of the list, :meth:`finish` to wait and write the sums back into ``.grad``. :meth:`close` removes the
    hooks (before a new plan). :attr:`bucket_layers` tells the schedule each bucket's layers.
    """

    def __init__(
        self, module: StageModule, groups: ProcessGroups, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    ) -> None:
        self.groups = groups
        self.buckets: list[_Bucket] = []
        open_buckets: dict[tuple[object, ...], _Bucket] = {}
        sizes: dict[int, int] = {}
        layers: dict[int, list[int]] = {}
        tied = {id(p) for p in module.tied()}
        rank = groups.tensor_rank
        for index in reversed(module.layer_indices):
            owners = groups.plan.layer_owners(index, rank)
            group = groups.grad_group(owners)
            if group is None:
                continue
            layer = module.layer(index)
            for p in reversed([p for p in layer.parameters() if p.requires_grad and id(p) not in tied]):
                key = (owners, p.dtype, p.device)
                bucket = open_buckets.get(key)
                nbytes = local(p).numel() * p.element_size()
                if bucket is None or sizes[id(bucket)] + nbytes > bucket_cap_bytes:
                    bucket = open_buckets[key] = _Bucket(group, [], torch.empty(0), ())
                    sizes[id(bucket)] = 0
                    layers[id(bucket)] = []
                    self.buckets.append(bucket)
                if index not in layers[id(bucket)]:
                    layers[id(bucket)].append(index)
                bucket.params.append(p)
                sizes[id(bucket)] += nbytes
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_gradient(b))
            for bucket in self.buckets
            for p in bucket.params
        ]
        # Ties last, in the model's order on every rank (their owners sit on different stages, whose
        # backwards end at different times): :meth:`flush` issues them after the stage's last backward.
        for p, tie in module.tied().items():
            group = groups.grad_group(groups.plan.tie_owners(tie.layers, rank))
            if group is not None and p.requires_grad:
                held = tuple(i for i in tie.layers if i in module.layer_indices)
                self.buckets.append(_Bucket(group, [p], torch.empty(0), held))
        for bucket in self.buckets:
            bucket.layers = bucket.layers or tuple(layers[id(bucket)])
            p = bucket.params[0]
            size = sum(local(q).numel() for q in bucket.params)
            bucket.flat = torch.zeros(size, dtype=p.dtype, device=local(p).device)
        self._armed = False
        self._next = 0
        self._works: list[dist.Work] = []

    @property
    def bucket_layers(self) -> list[tuple[int, ...]]:
        """Each bucket's layers, in issue order."""
        return [bucket.layers for bucket in self.buckets]

    def arm(self) -> None:
        """The next gradient action is the stage's last: start buckets as their gradients become final."""
        for bucket in self.buckets:
            bucket.ready = 0
        self._next = 0
        self._armed = True

    def _on_gradient(self, bucket: _Bucket) -> None:
        if not self._armed:
            return
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(
            self.buckets[self._next].params
        ):
            self._issue(self.buckets[self._next])

    def _issue(self, bucket: _Bucket) -> None:
        grads = [torch.zeros_like(local(p)) if p.grad is None else local_grad(p) for p in bucket.params]
        torch.cat([g.reshape(-1) for g in grads], out=bucket.flat)
        with self.groups.waiter.issuing():
            self._works.append(dist.all_reduce(bucket.flat, group=bucket.group, async_op=True))
        self._next += 1
        faults.reach(faults.FaultPoint.REDUCE)

    def reduce(self, bucket: int) -> None:
        """Issue bucket ``bucket`` (and those before it) if their gradients did not already."""
        while self._next <= bucket:
            self._issue(self.buckets[self._next])

    def flush(self) -> None:
        """At the end of the list: issue the buckets not started yet."""
        self._armed = False
        self.reduce(len(self.buckets) - 1)

    def finish(self, abort: threading.Event) -> None:
        """Wait (abortably) for the all-reduces and write the sums back into ``.grad``."""
        works, self._works = self._works, []
        self.groups.waiter.wait(works, abort)
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                shard = local(p)
                summed = bucket.flat[offset : offset + shard.numel()].view_as(shard)
                offset += shard.numel()
                if p.grad is None:
                    p.grad = like(p, summed.clone())
                else:
                    local(p.grad).copy_(summed)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
