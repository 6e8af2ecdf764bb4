"""Global batches cut into per-pipeline shares, with a resumable position.

Every optimizer step consumes one *global batch* of ``global_batch_size`` samples, the same on every rank:
batch ``k`` of epoch ``e`` is ``perm_e[k*B:(k+1)*B]``, where ``perm_e`` is a permutation drawn from
``seed + e`` (or the identity without shuffling). Each rank loads only the samples of its pipeline's
micro-batches (:meth:`Plan.microbatch_range`), so every sample of a global batch is used exactly once. The
first stage uses them as inputs and the last stage as targets.

The position (epoch, step) is state: :meth:`GlobalBatchSampler.state_dict` is saved in Lightning's
checkpoints (through :class:`PipelineDataLoader`), and after a reconfiguration :meth:`set_share` re-cuts the
same global batch for the new pipelines. Every batch is recorded with the layout it was cut for
(:meth:`GlobalBatchSampler.is_stale`): batches a loader prefetched (``num_workers``, ``prefetch_factor``)
before a reconfiguration are recognised and cut again (:meth:`GlobalBatchSampler.indices`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from lightning_oobleck.process import die_with_parent


@dataclass(frozen=True)
class DataPosition:
    """The next global batch to train on: batch ``step`` of epoch ``epoch``."""

    epoch: int = 0
    step: int = 0


class GlobalBatchSampler(Sampler[list[int]]):
    """A batch sampler yielding, per global batch, the sample indices of this rank's share.

    All ranks yield the same number of batches per epoch (``num_samples // global_batch_size``; a partial
    last batch is dropped, because a step's batch size is fixed). With ``share=None`` it yields whole global
    batches, which is what a single-process reference run uses.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        share: range | Sequence[range] | None = None,
        layout: int = 0,
    ) -> None:
        if global_batch_size < 1 or num_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}: "
                "lower global_batch_size or use more data"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.share = self._checked_share(range(global_batch_size) if share is None else share)
        self.layout = layout
        """The layout (the plan's generation) :attr:`share` belongs to."""
        self.position = DataPosition()
        self._permutation: tuple[int, torch.Tensor] | None = None
        self._cut: dict[DataPosition, int] = {}
        """The layout each batch handed out was cut for (only batches from the current epoch)."""

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def left_out(self) -> int:
        """The samples of an epoch after its last whole global batch, which no step takes."""
        return self.num_samples - len(self) * self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.position.epoch, self.position.step
        self._cut = {p: layout for p, layout in self._cut.items() if p.epoch == epoch}
        for step in range(start, len(self)):
            self._cut[DataPosition(epoch, step)] = self.layout
            yield self.indices(epoch, step)

    def indices(self, epoch: int, step: int) -> list[int]:
        """This rank's share of global batch ``step`` of ``epoch`` under the current layout."""
        batch = self.global_batch(epoch, step)
        return [i for part in self.share for i in batch[part.start : part.stop]]

    def is_stale(self, epoch: int, step: int) -> bool:
        """Whether the batch handed out for ``(epoch, step)`` was cut for another layout than the current."""
        return self._cut.get(DataPosition(epoch, step)) != self.layout

    @property
    def sampler(self) -> GlobalBatchSampler:
        """Itself: Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler`` at every epoch start."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start: a new epoch starts at 0, a resumed one where it was."""
        if epoch != self.position.epoch:
            self.position = DataPosition(epoch, 0)

    def set_share(self, share: range | Sequence[range], layout: int) -> None:
        """Take the sample offsets ``share`` of every global batch from now on: the share of this rank's
        pipeline under the plan of generation ``layout`` (after a plan change), and on a rerouted plan the
        shares of the micro-batches rerouted to it (``PipelineEngine.samples``)."""
        self.share = self._checked_share(share)
        self.layout = layout

    def advance(self, epoch: int, completed_steps: int) -> None:
        """Record that ``completed_steps`` global batches of ``epoch`` were trained on."""
        self.position = DataPosition(epoch, completed_steps)

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """The sample indices of global batch ``step`` of ``epoch``, identical on every rank."""
        if not 0 <= step < len(self):
            raise IndexError(f"epoch has {len(self)} global batches, asked for {step}")
        start = step * self.global_batch_size
        return self._epoch_order(epoch)[start : start + self.global_batch_size].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.position.epoch, "step": self.position.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"the checkpoint's data order was drawn with seed={state['seed']}, this run has "
                f"seed={self.seed}: "
                "resume with the same seed"
            )
        self.position = DataPosition(int(state["epoch"]), int(state["step"]))

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._permutation is None or self._permutation[0] != epoch:
            if self.shuffle:
                order = torch.randperm(
                    self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch)
                )
            else:
                order = torch.arange(self.num_samples)
            self._permutation = (epoch, order)
        return self._permutation[1]

    def _checked_share(self, share: range | Sequence[range]) -> tuple[range, ...]:
        parts = (share,) if isinstance(share, range) else tuple(share)
        for part in parts:
            if part.step != 1 or not 0 <= part.start < part.stop <= self.global_batch_size:
                raise ValueError(f"share {part} is not a slice of a global batch of {self.global_batch_size}")
        return parts


class PipelineDataLoader(DataLoader):
    """A DataLoader over a :class:`GlobalBatchSampler` whose position Lightning saves and restores."""

    batch_sampler: GlobalBatchSampler

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)


class _DieWithParent:
    """A loader worker's ``worker_init_fn``: the worker exits when the training process that started it
    dies (SIGKILL included), then the user's ``worker_init_fn`` runs."""

    def __init__(self, parent: int, user_init: Callable[[int], None] | None) -> None:
        self.parent = parent
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        die_with_parent()
        if os.getppid() != self.parent:  # the training process died before the call took effect
            os._exit(0)
        if self.user_init is not None:
            self.user_init(worker_id)


def wrap_dataloader(loader: DataLoader, sampler: GlobalBatchSampler) -> PipelineDataLoader:
    """The user's loader (dataset, collate, workers) with ``sampler`` choosing the samples.

    Loader workers are forked by this process itself (unless the loader names a start method): a training
    process may itself come from a fork server, whose start method loader workers would otherwise inherit,
    and then their parent would be a fork server that outlives the training process. Each worker dies with
    its training process.
    """
    workers = loader.num_workers > 0
    context = loader.multiprocessing_context
    if workers and context is None and sys.platform.startswith("linux"):
        context = "fork"
    return PipelineDataLoader(
        loader.dataset,
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=_DieWithParent(os.getpid(), loader.worker_init_fn)
        if workers
        else loader.worker_init_fn,
        multiprocessing_context=context,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )
