"""A token embedding tied to the LM head (the same ``nn.Parameter`` in two layers, as GPT-2 and nanoGPT write
it) trains under ``strategy="oobleck"`` on 4 real processes exactly as on one process, on layouts that put
the embedding and the head on different ranks of one pipeline and on one rank of another; and with each
stage split over the 2 processes of a node (the vocabulary split: the embedding by rows, the head by
columns), the uses on one stage or on two.

The tie's gradient on every rank that holds it is the single-process gradient, the sum of both uses; the
weights stay one tensor (equal on every holder, one entry in the final state); a sharded checkpoint written
on one layout resumes on another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from pipeline_testing import GLOBAL_BATCH, QUIET, layout_strategy
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck import consolidate_checkpoint
from lightning_oobleck.lightning import GlobalBatchSampler, OobleckStrategy, PipelineModule
from lightning_oobleck.lightning.callbacks import KillAt
from lightning_oobleck.lightning.module import meta_layers
from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.recovery import read_events

SEED, STEPS, VOCAB, WIDTH, LENGTH = 7, 4, 13, 8, 6
TIE, HEAD = "layers.0.wte.weight", "layers.3.lm.weight"


class Embed(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.wte = wte

    def forward(self, ids: Tensor) -> Tensor:
        return self.wte(ids)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


class Head(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.lm = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm.weight = wte.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.lm(self.norm(x))


class TiedLM(PipelineModule, L.LightningModule):
    def configure_layers(self) -> list[nn.Module]:
        wte = nn.Embedding(VOCAB, WIDTH)
        return [Embed(wte), Block(), Block(), Head(wte)]

    def compute_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class SplitTiedLM(TiedLM):
    """The tied model with its vocabulary split over a stage's devices: the embedding by rows (each device
    looks up its part of the vocabulary, the stage sums), the head by columns (each device scores its part,
    gathered): both split the one weight by its first dimension. The blocks stay whole."""

    def tensor_parallel_plan(self, index: int, layer: nn.Module) -> dict:
        if isinstance(layer, Embed):
            return {"wte": RowwiseParallel(input_layouts=Replicate())}
        if isinstance(layer, Head):
            return {"lm": ColwiseParallel(output_layouts=Replicate())}
        return {}


class TieGradients(L.Callback):
    """Saves, per rank, the tied weight's gradient of the first step."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 0:
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
            torch.save(
                {n: g for n, g in grads.items() if n in (TIE, HEAD)},
                self.out / f"grad{trainer.global_rank}.pt",
            )


def data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def kwargs(tmp_path: Path, steps: int = STEPS) -> dict:
    callbacks = [TieGradients(tmp_path)]
    return dict(QUIET, precision="64-true", max_steps=steps, callbacks=callbacks, default_root_dir=tmp_path)


def strategy(layout: list[list[int]], microbatches: list[int], tensor_parallel: int = 1) -> OobleckStrategy:
    """Nodes of ``tensor_parallel`` processes, each stage on all of them; f = 1 with two pipelines or more."""
    return layout_strategy(
        layout,
        microbatches,
        SEED,
        tensor_parallel=tensor_parallel,
        devices_per_node=tensor_parallel,
        fault_tolerance=min(1, len(layout) - 1),
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Tensor], Tensor]:
    out = tmp_path_factory.mktemp("reference")
    model = TiedLM()
    loader = DataLoader(data(), batch_sampler=GlobalBatchSampler(len(data()), GLOBAL_BATCH, seed=SEED))
    L.Trainer(devices=1, **kwargs(out)).fit(model, loader)
    grad = torch.load(out / "grad0.pt")
    assert set(grad) == {TIE}  # one parameter, named once
    return model.state_dict(), grad[TIE]


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True)


LAYOUTS = {
    # pipeline 0 holds both uses on one rank; pipeline 1 has the embedding on rank 1 and the head on rank 3
    "1+3": ([[0, 4], [0, 1, 3, 4]], [1, 3]),
    "2+1+1": ([[0, 2, 4], [0, 4], [0, 4]], [2, 1, 1]),
    # 2 nodes of 2 processes, each stage on both (its vocabulary split): both uses on one stage of each of two
    # pipelines (one parameter split once per stage), or one use on each stage of one pipeline
    "t=2, both uses on one stage": ([[0, 4], [0, 4]], [2, 2], 2),
    "t=2, one use per stage": ([[0, 2, 4]], [4], 2),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_tied_embedding_and_head_train_as_on_one_process(
    name: str, reference: tuple, tmp_path: Path
) -> None:
    ref_weights, ref_grad = reference
    model = SplitTiedLM()
    split = name.startswith("t=2")
    # split: Lightning's defaults on (summary, ModelCheckpoint, logger, progress bar), no gradient records (a
    # split gradient is one device's shard)
    options = (
        {"precision": "64-true", "max_steps": STEPS, "default_root_dir": tmp_path}
        if split
        else kwargs(tmp_path)
    )
    trainer = L.Trainer(devices=4, strategy=strategy(*LAYOUTS[name]), **options)
    trainer.fit(model, loader())
    weights = model.state_dict()
    assert weights.keys() == ref_weights.keys()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)
    assert (
        model.layers["0"].wte.weight is model.layers["3"].lm.weight
    )  # still one tensor in the user's module
    if split:  # the default ModelCheckpoint's file, written by the split stages, holds the trained weights
        [written] = (tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt")
        state = torch.load(consolidate_checkpoint(written, tmp_path / "one.ckpt"), weights_only=False)[
            "state_dict"
        ]
        for key, expected in ref_weights.items():
            torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-10, msg=key)
        return
    # the tie's first gradient on every holder is the single-process one: the sum of both uses
    holders = [torch.load(p) for p in sorted(tmp_path.glob("grad*.pt"))]
    grads = [g for held in holders for g in held.values()]
    assert len(grads) >= 3
    for g in grads:
        torch.testing.assert_close(g, ref_grad, rtol=0, atol=1e-12)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_recovery_at_t2_regroups_the_tie_to_the_weights_of_one_process(
    reference: tuple, tmp_path: Path
) -> None:
    """3 nodes of 2 processes, every stage split over its node: pipeline 0 has the embedding on node 0 and
    the head on node 1 (one use per stage), pipeline 1 both uses on node 2. A process of node 1 is
    SIGKILLed at step 2: node 1's shards of the head and the second block come from node 2's replica to
    node 0 (the two uses onto one stage, split alike) and the tie's gradient is summed over its new holders:
    the uninterrupted run's weights."""
    ref_weights, _ = reference
    model = SplitTiedLM()
    model.example_input_array = data().tensors[0][:1]  # profiled, so that the layout has templates to recover
    options = {**kwargs(tmp_path), "callbacks": [KillAt(3, 2)]}
    trainer = L.Trainer(devices=6, strategy=strategy([[0, 2, 4], [0, 4]], [2, 2], 2), **options)
    trainer.fit(model, loader())
    assert trainer.global_step == STEPS
    weights = model.state_dict()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)
    [recovery] = read_events(tmp_path / EVENTS_FILE)[1]
    assert recovery.removed == [[1, 0], [1, 1]] and recovery.tensor_parallel == 2
    assert recovery.copied_bytes > 0 and recovery.copy_senders == 2  # node 2's two devices, a shard each


def test_the_tie_gradient_is_the_sum_of_both_uses(reference: tuple) -> None:
    """The single-process gradient the pipelines reproduce is the embedding's contribution plus the head's,
    each non-zero (computed here with the head given its own copy of the weight)."""
    _, ref_grad = reference
    model = TiedLM()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as precision="64-true" initialises
    try:
        model.configure_model()
    finally:
        torch.set_default_dtype(default)
    tokens, targets = data()[GlobalBatchSampler(len(data()), GLOBAL_BATCH, seed=SEED).global_batch(0, 0)]
    embed, head = model.layers["0"].wte.weight, nn.Parameter(model.layers["3"].lm.weight.detach().clone())
    model.layers["3"].lm.weight = head
    model.compute_loss(model(tokens), targets).backward()
    assert embed.grad is not None and head.grad is not None
    assert embed.grad.abs().sum() > 0 and head.grad.abs().sum() > 0
    torch.testing.assert_close(embed.grad + head.grad, ref_grad, rtol=0, atol=1e-12)


@pytest.mark.timeout(120)
def test_a_checkpoint_holds_the_tie_once_and_resumes_on_another_layout(
    reference: tuple, tmp_path: Path
) -> None:
    """ModelCheckpoint after 2 steps under "1+3" (where pipeline 1's head rank holds the tie without its
    canonical layer), then fit(ckpt_path=...) under "2+1+1" to the end: the uninterrupted run's weights."""
    ref_weights, _ = reference
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = kwargs(tmp_path, steps=2) | {"enable_checkpointing": True, "callbacks": [saver]}
    L.Trainer(devices=4, strategy=strategy(*LAYOUTS["1+3"]), **first).fit(TiedLM(), loader())
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    saved = {
        key
        for shard in (checkpoint / "shards").iterdir()
        for key in FileSystemReader(str(shard)).read_metadata().state_dict_metadata
    }
    assert f"model.{TIE}" in saved and not any(HEAD in key for key in saved)
    model = TiedLM()
    trainer = L.Trainer(devices=4, strategy=strategy(*LAYOUTS["2+1+1"]), **kwargs(tmp_path / "resumed"))
    trainer.fit(model, loader(), ckpt_path=str(checkpoint))
    weights = model.state_dict()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)


class EmbeddingGroupLM(TiedLM):
    """Gives the embedding layer its own learning rate, chosen by name: where only the head holds the tie,
    the rule puts it in the other group."""

    def configure_optimizers(self) -> Any:
        embedding = [p for n, p in self.named_parameters() if n.startswith("layers.0.")]
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.0.")]
        return torch.optim.AdamW([{"params": embedding, "lr": 0.1}, {"params": rest, "lr": 0.05}])


@pytest.mark.timeout(120)
def test_a_tie_grouped_differently_where_only_the_head_holds_it_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tied parameter layers\.0\.wte\.weight .*would drift apart"):
        L.Trainer(devices=4, strategy=strategy(*LAYOUTS["1+3"]), **kwargs(tmp_path)).fit(
            EmbeddingGroupLM(), loader()
        )


class DeclaredTieLM(TiedLM):
    """The same model with the embedding and the head built with weights of their own, tied by name."""

    def configure_layers(self) -> list[nn.Module]:
        return [Embed(nn.Embedding(VOCAB, WIDTH)), Block(), Block(), Head(nn.Embedding(VOCAB, WIDTH))]

    def tied_parameters(self) -> list[tuple[str, str]]:
        return [("3.lm.weight", "0.wte.weight")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [1, 4])
def test_a_tie_declared_by_name_trains_as_the_shared_parameter(
    devices: int, reference: tuple, tmp_path: Path
) -> None:
    """``tied_parameters`` on one process (the single-device path) and on the "1+3" layout: the weights of
    the model that shares one ``nn.Parameter``."""
    ref_weights, _ = reference
    model = DeclaredTieLM()
    if devices == 1:
        sampler = GlobalBatchSampler(len(data()), GLOBAL_BATCH, seed=SEED)
        L.Trainer(devices=1, **kwargs(tmp_path)).fit(model, DataLoader(data(), batch_sampler=sampler))
    else:
        L.Trainer(devices=4, strategy=strategy(*LAYOUTS["1+3"]), **kwargs(tmp_path)).fit(model, loader())
    weights = model.state_dict()
    assert weights.keys() == ref_weights.keys()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)
    assert model.layers["0"].wte.weight is model.layers["3"].lm.weight


@pytest.mark.parametrize(
    ("ties", "message"),
    [
        ([("0.wte.weight",)], r"each tie is a sequence of two or more parameter names"),
        ([("0.wte.weight", "7.lm.weight")], r"'7.lm.weight': name a parameter 'LAYER.NAME'"),
        ([("0.wte.weight", "3.lm.bias")], r"layer 3 \(Head\) has no parameter 'lm.bias'; its parameters: "),
        ([("0.wte.weight", "1.fc.weight")], r"differ: only parameters of one shape and dtype"),
        ([("0.wte.weight", "3.lm.weight"), ("3.lm.weight", "0.wte.weight")], r"in two ties: merge them"),
    ],
)
def test_a_wrong_tie_declaration_is_refused_by_name(ties: list, message: str) -> None:
    class Wrong(DeclaredTieLM):
        def tied_parameters(self) -> list:
            return ties

    with pytest.raises(ValueError, match=message):
        meta_layers(Wrong())
