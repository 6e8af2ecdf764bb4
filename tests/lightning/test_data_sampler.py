"""Global batches: every sample once per step, deterministic order, resumable and re-sliceable position."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck.lightning.data import (
    DataPosition,
    GlobalBatchSampler,
    wrap_dataloader,
)

NUM_SAMPLES, BATCH, MICRO = 50, 12, 2


def shares(microbatches: list[int]) -> list[range]:
    """The sample ranges of pipelines with these micro-batch counts (consecutive, as in Plan)."""
    out, start = [], 0
    for m in microbatches:
        out.append(range(start * MICRO, (start + m) * MICRO))
        start += m
    return out


def test_shares_cover_every_sample_of_a_global_batch_exactly_once() -> None:
    samplers = [GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=3, share=s) for s in shares([1, 3, 2])]
    whole = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=3)
    per_rank = [list(s) for s in samplers]
    assert {len(batches) for batches in per_rank} == {NUM_SAMPLES // BATCH}
    for step, global_batch in enumerate(whole):
        joined = [i for batches in per_rank for i in batches[step]]
        assert joined == global_batch
        assert len(set(joined)) == BATCH
    seen = [i for batch in whole for i in batch]
    assert len(seen) == len(set(seen)) == (NUM_SAMPLES // BATCH) * BATCH


def test_order_is_deterministic_from_the_seed_and_changes_with_the_epoch() -> None:
    a, b = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=7), GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=7)
    assert list(a) == list(b)
    assert list(a) != list(GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=8))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert next(iter(GlobalBatchSampler(NUM_SAMPLES, BATCH, shuffle=False))) == list(range(BATCH))


def test_resumes_from_its_state_without_loss_or_repetition() -> None:
    full = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=1)
    full.set_epoch(2)
    expected = list(full)
    first = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=1)
    first.set_epoch(2)
    first.advance(2, 1)
    resumed = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=1)
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(2)  # Lightning calls set_epoch with the resumed epoch: the position is kept
    assert resumed.position == DataPosition(2, 1)
    assert list(resumed) == expected[1:]
    resumed.set_epoch(3)
    assert resumed.position == DataPosition(3, 0)


def test_after_a_plan_change_the_same_global_batch_is_resliced() -> None:
    old = [GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=5, share=s) for s in shares([2, 2, 2])]
    for sampler in old:
        sampler.advance(0, 2)
    new_shares = shares([4, 2])
    survivors = old[:2]
    for sampler, share in zip(survivors, new_shares, strict=True):
        sampler.set_share(share, layout=1)
    batches = [next(iter(s)) for s in survivors]
    assert [i for b in batches for i in b] == survivors[0].global_batch(0, 2)


def test_batches_prefetched_before_a_plan_change_are_recognised_as_stale() -> None:
    """A loader with workers has taken indices for batches 0-2 when the plan changes after step 0: those
    batches were cut for the old layout; the sampler says so and cuts them again for the new one."""
    sampler = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=5, share=range(0, 4))
    prefetched = iter(sampler)
    handed_out = [next(prefetched) for _ in range(3)]
    assert not any(sampler.is_stale(0, step) for step in range(3))
    sampler.set_share(range(4, 12), layout=1)
    assert all(sampler.is_stale(0, step) for step in range(3))
    assert sampler.indices(0, 2) == sampler.global_batch(0, 2)[4:12] != handed_out[2]
    assert sampler.is_stale(0, 3)  # not handed out yet: nothing says what it was cut for
    assert next(prefetched) == sampler.global_batch(0, 3)[4:12] and not sampler.is_stale(0, 3)


def test_loader_keeps_the_users_collate_and_saves_the_position() -> None:
    data = TensorDataset(torch.arange(NUM_SAMPLES).float(), torch.arange(NUM_SAMPLES))
    user = DataLoader(data, batch_size=5, collate_fn=lambda items: [y for _, y in items])
    sampler = GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=0, share=range(4, 8))
    loader = wrap_dataloader(user, sampler)
    batches = list(loader)
    assert batches[0] == [torch.tensor(i) for i in sampler.global_batch(0, 0)[4:8]]
    sampler.advance(0, 3)
    assert loader.state_dict() == {"epoch": 0, "step": 3, "seed": 0}
    sampler.advance(0, len(sampler))
    _set_sampler_epoch(loader, 1)  # what Lightning's fit loop calls at each epoch start
    assert len(list(loader)) == len(sampler)


def test_bad_sizes_and_seeds_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(4, BATCH)
    with pytest.raises(ValueError, match="not a slice"):
        GlobalBatchSampler(NUM_SAMPLES, BATCH, share=range(10, 14))
    with pytest.raises(ValueError, match="resume with the same seed"):
        GlobalBatchSampler(NUM_SAMPLES, BATCH, seed=1).load_state_dict({"epoch": 0, "step": 0, "seed": 2})
