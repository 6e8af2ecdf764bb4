"""Layers that pass dicts and tuples of tensors (float with gradients, bool masks, int ids) and take side
inputs by name (``attention_mask``, ``position_ids``) from dict batches train, under ``strategy="oobleck"`` on
4 real processes, exactly as on one process; shapes change from one micro-batch to the next.

Every stage boundary of both layouts is crossed by a pytree; a float leaf passes through a layer untouched
(its gradient still flows back), and the embedding trims each micro-batch to its longest sample, so the
sequence length varies per micro-batch and per pipeline.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from pipeline_testing import GLOBAL_BATCH, QUIET, layout_strategy
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_oobleck.lightning import GlobalBatchSampler, PipelineModule

SEED, STEPS, VOCAB, LENGTH, WIDTH = 5, 4, 11, 9, 6


class Embed(nn.Module):
    """Token ids -> ``{"hidden", "skip", "mask", "ids"}``, cut to the longest sample of the micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        length = int(attention_mask.sum(1).max())
        ids = input_ids[:, :length]
        hidden = self.tokens(ids)
        return {"hidden": hidden, "skip": hidden * 0.5, "mask": attention_mask[:, :length].bool(), "ids": ids}


class Mix(nn.Module):
    """A causal mixing block with learned positions; takes a dict or a tuple, returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.positions = nn.Embedding(LENGTH, WIDTH)

    def forward(self, x: Any, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        hidden, skip, mask, ids = (x["hidden"], x["skip"], x["mask"], x["ids"]) if isinstance(x, dict) else x
        h = torch.tanh(self.fc(hidden) + self.positions(position_ids[:, : hidden.shape[1]]))
        h = h * mask.unsqueeze(-1)
        h = h + h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype).unsqueeze(-1)
        return h, skip, mask, ids


class ToDict(nn.Module):
    """Passes the skip tensor through untouched and repacks the rest as a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(WIDTH))

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)

    def forward(self, x: tuple[Tensor, ...]) -> dict[str, Tensor]:
        hidden, skip, mask, ids = x
        return {"hidden": hidden * self.scale, "skip": skip, "mask": mask, "ids": ids}


class Head(nn.Module):
    """Masked mean over positions (odd token ids count twice) plus the skip -> class logits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 3)

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        weight = (x["mask"] * (1 + x["ids"] % 2)).unsqueeze(-1).to(x["hidden"].dtype)
        pooled = ((x["hidden"] + x["skip"]) * weight).sum(1) / weight.sum(1)
        return self.fc(pooled)


class MaskedSeqNet(PipelineModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        ids = torch.zeros(1, LENGTH, dtype=torch.long)
        self.example_input_array = (ids, {"attention_mask": torch.ones_like(ids), "position_ids": ids})

    def configure_layers(self) -> list[nn.Module]:
        return [Embed(), Mix(), Mix(), ToDict(), Head()]

    def split_batch(self, batch: dict[str, Tensor]) -> tuple[Any, ...]:
        return batch["input_ids"], batch["labels"], {k: batch[k] for k in ("attention_mask", "position_ids")}

    def compute_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def samples(n: int, seed: int) -> list[dict[str, Tensor]]:
    """Dict samples, right-padded to ``LENGTH`` with random true lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, LENGTH + 1, (), generator=g))
        mask = (torch.arange(LENGTH) < length).long()
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g) * mask
        label = torch.randint(0, 3, (), generator=g)
        out.append(
            {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(LENGTH), "labels": label}
        )
    return out


def kwargs() -> dict:
    return dict(QUIET, precision="64-true", max_steps=STEPS)


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Tensor], float]:
    data = samples(32, seed=1)
    model = MaskedSeqNet()
    trainer = L.Trainer(devices=1, limit_val_batches=2, **kwargs())
    loader = DataLoader(data, batch_sampler=GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED))
    trainer.fit(model, loader, DataLoader(samples(16, seed=2), batch_size=GLOBAL_BATCH))
    return model.state_dict(), float(trainer.callback_metrics["val_loss"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout,microbatches",
    [([[0, 5], [0, 1, 3, 5]], [1, 3]), ([[0, 4, 5], [0, 5], [0, 5]], [2, 1, 1])],
    ids=["1+3", "2+1+1"],
)
def test_pytree_activations_and_side_inputs_train_as_on_one_process(
    layout: list[list[int]], microbatches: list[int], reference: tuple
) -> None:
    # the micro-batches really differ in length (else the headers per transfer prove nothing)
    lengths = {int(s["attention_mask"].sum()) for s in samples(32, seed=1)}
    assert len(lengths) > 3
    ref_weights, ref_val = reference
    strategy = layout_strategy(layout, microbatches, SEED)
    model = MaskedSeqNet()
    trainer = L.Trainer(devices=4, strategy=strategy, limit_val_batches=2, **kwargs())
    trainer.fit(
        model,
        DataLoader(samples(32, seed=1), batch_size=GLOBAL_BATCH, shuffle=True),
        DataLoader(samples(16, seed=2), batch_size=GLOBAL_BATCH),
    )
    assert trainer.global_step == STEPS
    weights = model.state_dict()
    assert weights.keys() == ref_weights.keys()
    for key, expected in ref_weights.items():
        torch.testing.assert_close(weights[key], expected, rtol=0, atol=1e-10, msg=key)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(ref_val, rel=0, abs=1e-10)
