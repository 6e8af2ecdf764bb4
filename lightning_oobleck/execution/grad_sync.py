"""Sum every layer's gradient over the pipelines holding a replica of it.

Layers of one stage that share the same set of owners (one worker per pipeline) form one bucket: their
gradients are copied into one flat buffer and all-reduced in the group of exactly those owners. The
loss of each micro-batch is already scaled by ``b / B``, so the sum is the gradient of the global mean
loss. Buckets are issued in increasing layer order on every rank, a global order, so ranks that share
several groups can never wait on each other in a cycle (this matters for NCCL, which serialises them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.stage import StageModule


@dataclass
class _Bucket:
    group: dist.ProcessGroup
    params: list[nn.Parameter]
    flat: torch.Tensor


class GradientSync:
    """The gradient buckets of one stage under one plan; :meth:`start` then :meth:`finish` per step."""

    def __init__(self, module: StageModule, groups: ProcessGroups) -> None:
        self.groups = groups
        by_key: dict[tuple[tuple[tuple[int, int], ...], torch.dtype, torch.device], list[nn.Parameter]] = {}
        for index in module.layer_indices:
            owners = groups.plan.layer_owners(index)
            for p in module.layer(index).parameters():
                if p.requires_grad and len(owners) > 1:
                    by_key.setdefault((owners, p.dtype, p.device), []).append(p)
        self.buckets = [
            _Bucket(
                groups.grad_group(owners),
                params,
                torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device),
            )
            for (owners, dtype, device), params in by_key.items()
        ]
        self._works: list[dist.Work] = []

    def start(self) -> None:
        """Launch every bucket's all-reduce asynchronously (after the stage's last backward)."""
        for bucket in self.buckets:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in bucket.params]
            torch.cat([g.reshape(-1) for g in grads], out=bucket.flat)
            self._works.append(dist.all_reduce(bucket.flat, group=bucket.group, async_op=True))

    def finish(self, abort: threading.Event) -> None:
        """Wait (abortably) for the all-reduces and write the sums back into ``.grad``."""
        works, self._works = self._works, []
        self.groups.waiter.wait(works, abort)
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                summed = bucket.flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
