"""Sharded checkpoints across layouts, with real gloo process groups and no Lightning.

The model is 6 independent ``nn.Linear`` layers trained by AdamW on a per-layer loss, so any subset of
layers on any rank evolves exactly as in one process holding them all: the reference is computed
locally and compared bit for bit. Layout A (save): 2 pipelines of 2 stages on 4 processes. Layout B
(load): 1 pipeline of 3 stages on 3 processes. Layout C (load): one process, all layers.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_oobleck.execution.checkpoint import (
    commit,
    layer_of,
    layer_writers,
    load_metadata,
    load_sharded,
    load_sharded_model,
    load_sharded_optimizers,
    partial_path,
    write_metadata,
    write_shard,
)
from lightning_oobleck.execution.stage import build_stage
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan, Stage
from lightning_oobleck.testing import PeakResidentMemory

NUM_LAYERS = 6
TRAIN_STEPS = 3
LAYOUT_A = [range(0, 3), range(3, 6), range(0, 2), range(2, 6)]  # rank -> layers; pipelines (0, 1), (2, 3)
PIPELINE_A = [0, 0, 1, 1]
LAYOUT_B = [range(0, 2), range(2, 3), range(3, 6)]
METADATA = {"global_step": TRAIN_STEPS, "epoch": 1, "loops": {"fit_loop": {"batch": 7}}, "data": (1, 3)}


def writer_pipeline(layer: int) -> int:
    """Who writes layer ``i``: pipeline ``i % 2`` (an arbitrary rule, to see each pipeline write)."""
    return layer % 2


class Shard(nn.Module):
    """The layers one rank holds, under their global names ``layers.<i>.weight``."""

    def __init__(self, layers: range, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for i in layers:
            torch.manual_seed(seed + 100 + i)
            self.layers[str(i)] = nn.Linear(3, 3, dtype=torch.float64)


def make_optimizer(shard: Shard, lr: float = 0.01) -> torch.optim.AdamW:
    weights = [m.weight for m in shard.layers.values()]
    biases = [m.bias for m in shard.layers.values()]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "lr": 2 * lr}], lr=lr, weight_decay=0.1)


def train(shard: Shard, optimizer: torch.optim.Optimizer, steps: int, first_step: int = 0) -> None:
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        for i, layer in shard.layers.items():
            x = torch.randn(
                4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 97 + int(i))
            )
            (layer(x) ** 2).sum().backward()
        optimizer.step()


def reference(layers: range, steps: int) -> tuple[Shard, torch.optim.AdamW]:
    shard = Shard(layers)
    optimizer = make_optimizer(shard)
    train(shard, optimizer, steps)
    return shard, optimizer


def assert_same_state(shard: Shard, optimizer: torch.optim.Optimizer, expected_steps: int) -> None:
    """Parameters, every optimizer state tensor and every param-group setting equal the reference's."""
    held = sorted(map(int, shard.layers))
    ref_shard, ref_opt = reference(range(held[0], held[-1] + 1), expected_steps)
    for name, tensor in shard.state_dict().items():
        assert torch.equal(tensor, ref_shard.state_dict()[name]), name
    ref_params = dict(ref_shard.named_parameters())
    for name, param in shard.named_parameters():
        state, ref_state = optimizer.state[param], ref_opt.state[ref_params[name]]
        assert state.keys() == ref_state.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in state:
            assert torch.equal(state[key], ref_state[key]), (name, key)
    for group, ref_group in zip(optimizer.param_groups, ref_opt.param_groups, strict=True):
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in ref_group.items() if k != "params"
        }


def run_ranks(fn, nprocs: int, *args, timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` forked processes joined by gloo; re-raise failures."""
    context = mp.start_processes(
        _rank_main, args=(fn, nprocs, *args), nprocs=nprocs, join=False, start_method="fork"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout_s} s")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def _rank_main(rank: int, fn, nprocs: int, rendezvous: Path, *args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=nprocs)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def save_layout_a(rank: int, out: Path) -> None:
    shard, optimizer = reference(LAYOUT_A[rank], TRAIN_STEPS)
    # The steps of the strategy's save (write, confirm, index, commit), with a collective of gloo's.
    path, name = out / "by-rule", f"rank{rank}"
    partial = partial_path(path, "test")
    written = write_shard(
        partial, shard, [optimizer], name, lambda layer: writer_pipeline(layer) == PIPELINE_A[rank]
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (name, written))
    if rank == 0:
        write_metadata(partial, METADATA, {layer: shard for shard, layers in everyone for layer in layers})
        commit(partial, path)
    dist.barrier()


def load_layout_b(rank: int, out: Path) -> None:
    shard = Shard(LAYOUT_B[rank], seed=999)  # other initial weights, other learning rate
    optimizer = make_optimizer(shard, lr=0.5)
    load_sharded_model(out / "by-rule", shard)  # as the strategy does: weights first, optimizers after setup
    load_sharded_optimizers(out / "by-rule", shard, [optimizer])
    assert_same_state(shard, optimizer, TRAIN_STEPS)
    train(shard, optimizer, 1, first_step=TRAIN_STEPS)  # the restored state trains on identically
    assert_same_state(shard, optimizer, TRAIN_STEPS + 1)


def stored_files(path: Path) -> dict[str, set[str]]:
    """Checkpoint key -> the shards that store it, from each shard's DCP metadata."""
    files: dict[str, set[str]] = {}
    for shard in sorted((path / "shards").iterdir()):
        for index in FileSystemReader(shard).read_metadata().storage_data:
            files.setdefault(index.fqn, set()).add(shard.name)
    return files


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    run_ranks(save_layout_a, 4, out / "rendezvous-a", out)
    return out


@pytest.mark.timeout(120)
def test_each_layer_is_stored_once_by_its_writer(saved: Path):
    files = stored_files(saved / "by-rule")
    ref_shard, _ = reference(range(NUM_LAYERS), TRAIN_STEPS)
    expected_model = {f"model.{k}" for k in ref_shard.state_dict()}
    expected_state = {
        f"optim.state.{n}.{s}" for n, _ in ref_shard.named_parameters() for s in ("step", "exp_avg")
    }
    assert expected_model <= files.keys() and expected_state <= files.keys()
    for key, where in files.items():
        assert len(where) == 1, f"{key} stored in {where}"
    writers = {
        layer: [r for r in range(4) if PIPELINE_A[r] == writer_pipeline(layer) and layer in LAYOUT_A[r]]
        for layer in range(NUM_LAYERS)
    }
    for layer in range(NUM_LAYERS):
        (writer,) = writers[layer]
        assert files[f"model.layers.{layer}.weight"] == {f"rank{writer}"}
    writing_ranks = {int(f.removeprefix("rank")) for where in files.values() for f in where}
    assert writing_ranks == {0, 1, 2, 3}  # both pipelines wrote, each its share
    index = json.loads((saved / "by-rule" / "index.json").read_text())["layers"]
    assert index == {str(layer): f"rank{writers[layer][0]}" for layer in range(NUM_LAYERS)}

    metadata = FileSystemReader(saved / "by-rule" / "shards" / "rank0").read_metadata()
    assert isinstance(
        metadata.state_dict_metadata["optim.param_groups.layers.0.bias.lr"], BytesStorageMetadata
    )
    # Committed: no partial directory is left beside the checkpoints.
    assert not list(saved.glob(".*partial*"))


@pytest.mark.timeout(120)
def test_load_into_three_stages_on_three_processes(saved: Path, tmp_path: Path):
    run_ranks(load_layout_b, 3, tmp_path / "rendezvous-b", saved)


@pytest.mark.timeout(60)
def test_load_into_one_process_holding_every_layer(saved: Path):
    shard = Shard(range(NUM_LAYERS), seed=999)
    optimizer = make_optimizer(shard, lr=0.5)
    assert load_sharded(saved / "by-rule", shard, [optimizer]) == METADATA
    assert_same_state(shard, optimizer, TRAIN_STEPS)
    assert load_metadata(saved / "by-rule") == METADATA


@pytest.mark.timeout(60)
def test_a_group_takes_the_saved_hyperparameters_as_torch_loads_them(saved: Path, tmp_path: Path):
    """A scheduler made since the save (``initial_lr``, as Lightning's learning-rate finder adds before it
    restores its checkpoint) and one saved but not made now: the groups end as torch's own
    ``Optimizer.load_state_dict`` leaves them, the saved group's hyper-parameters."""
    shard = Shard(range(NUM_LAYERS), seed=999)
    optimizer = make_optimizer(shard, lr=0.5)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # adds initial_lr = 0.5 and 1.0 to the groups
    load_sharded(saved / "by-rule", shard, [optimizer])
    assert_same_state(shard, optimizer, TRAIN_STEPS)  # no initial_lr: the saved groups had none

    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    write_shard(tmp_path / "with-initial-lr", shard, [optimizer], "s0")
    write_metadata(tmp_path / "with-initial-lr", METADATA, {layer: "s0" for layer in range(NUM_LAYERS)})
    fresh = Shard(range(NUM_LAYERS), seed=999)
    loaded, expected = make_optimizer(fresh), make_optimizer(Shard(range(NUM_LAYERS), seed=999))
    load_sharded(tmp_path / "with-initial-lr", fresh, [loaded])
    expected.load_state_dict(optimizer.state_dict())
    for group, want in zip(loaded.param_groups, expected.param_groups, strict=True):
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in want.items() if k != "params"
        }
        assert group["initial_lr"] in (0.01, 0.02)  # the saved value, from the first restore's lr


@pytest.mark.timeout(60)
def test_a_save_before_the_first_update_changes_nothing_and_resumes_as_a_fresh_optimizer(tmp_path: Path):
    """torch makes a fresh optimizer's state for its state dict by stepping it with zero gradients (Adam's
    step count 1): saved so, a run that checkpointed before its first update (Lightning's learning-rate
    finder does) would train otherwise than one that did not, and so would its resume."""
    shard = Shard(range(NUM_LAYERS))
    optimizer = make_optimizer(shard)
    write_shard(tmp_path / "fresh", shard, [optimizer], "s0")
    write_metadata(tmp_path / "fresh", METADATA, {layer: "s0" for layer in range(NUM_LAYERS)})
    assert not optimizer.state
    train(shard, optimizer, TRAIN_STEPS)
    assert_same_state(shard, optimizer, TRAIN_STEPS)

    resumed = Shard(range(NUM_LAYERS), seed=999)
    resumed_optimizer = make_optimizer(resumed, lr=0.5)
    load_sharded(tmp_path / "fresh", resumed, [resumed_optimizer])
    assert not resumed_optimizer.state
    train(resumed, resumed_optimizer, TRAIN_STEPS)
    assert_same_state(resumed, resumed_optimizer, TRAIN_STEPS)


def test_not_a_checkpoint_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not a sharded Oobleck checkpoint"):
        load_metadata(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no sharded Oobleck checkpoint"):
        load_sharded_model(tmp_path, Shard(range(2)))


def _template(bounds: list[int]) -> PipelineTemplate:
    stages = tuple(Stage(a, b, node=i) for i, (a, b) in enumerate(itertools.pairwise(bounds)))
    return PipelineTemplate(len(stages), 1, stages, (1.0,) * len(stages))


def test_layer_writers_write_each_layer_exactly_once():
    one, three = _template([0, 6]), _template([0, 2, 3, 6])
    plan = Plan(6, 1, 1, 1, 1, 4, (one, three), (Pipeline(three, (0, 1, 2), 2), Pipeline(one, (3,), 2)))
    writers = layer_writers(plan)
    written = {w: {i for i, writer in writers.items() if writer == w} for w in plan.workers}
    assert written == {(0, 0): {0, 1}, (1, 0): {2}, (2, 0): {3, 4, 5}, (3, 0): set()}


def test_layer_of_reads_the_global_index():
    assert layer_of("layers.7.attn.weight") == 7
    assert layer_of("optim.state.model.layers.12.mlp.layers.0.bias.exp_avg") == 12
    assert layer_of("model.head.weight") is None


@pytest.mark.skipif(not PeakResidentMemory.supported(), reason="needs Linux's peak resident memory reset")
def test_a_shard_goes_to_disk_without_a_copy_of_the_state(tmp_path: Path) -> None:
    """A worker's shard (48 MiB of weights and AdamW state here) is written from the tensors themselves: the
    process needs no second copy of its state on the way to disk (the survivors' checkpoint writes this way
    while the run has lost nodes and memory may be tight)."""
    module = build_stage(lambda: [nn.Linear(1024, 1024) for _ in range(4)], range(4), torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters())
    sum(p.sum() for p in module.parameters()).backward()
    optimizer.step()
    module.zero_grad(set_to_none=True)
    state = sum(3 * p.numel() * p.element_size() for p in module.parameters())
    write_shard(tmp_path / "first", module, [optimizer], "s0")  # code paths loaded once
    with PeakResidentMemory() as memory:
        write_shard(tmp_path / "second", module, [optimizer], "s0")
    assert memory.growth_bytes < state / 8, f"{memory.growth_bytes / 2**20:.1f} MiB for {state / 2**20:.0f}"
