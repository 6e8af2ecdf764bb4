"""Lightning's model summary of a pipelined model: the whole model.

Lightning's ``ModelSummary`` callback (on by default) counts the parameters a process holds and runs
``example_input_array`` through its ``forward``. A worker of a pipeline holds some layers only: its forward
fails on any stage but the first, and its counts would be its own stage's. :func:`summarize_whole_model` makes
the callback summarise the whole model instead, built on the meta device (no memory), one row per layer (the
plan table printed at the start says which stage holds it), its FLOPs counted by a forward of
``example_input_array`` on the meta device (shapes only), as Lightning counts them on one device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    NOT_APPLICABLE,
    LayerSummary,
    get_human_readable_count,
)
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_oobleck.execution.stage import forward_layers
from lightning_oobleck.lightning._internals import RowsSummary, replace_model_summary
from lightning_oobleck.lightning.module import PipelineModule, example_forward_args, meta_layers


class PipelineSummary(RowsSummary):
    """The summary of ``module``'s whole model: rows ``layers.<i>`` (and their submodules down to
    ``max_depth``); totals over the whole model, a tied parameter counted once."""

    def __init__(self, module: PipelineModule, max_depth: int = 1) -> None:
        self._whole = nn.ModuleDict({str(i): layer for i, layer in enumerate(meta_layers(module))})
        self.depth = max_depth
        self._flops = _meta_flops(module, self._whole)
        super().__init__(module, max_depth)  # type: ignore[arg-type]

    @property
    def named_modules(self) -> list[tuple[str, nn.Module]]:
        if self.depth == 0:
            return []
        return [
            (name, m)
            for name, m in self._whole.named_modules(prefix="layers")
            if name != "layers" and (self.depth < 0 or name.count(".") <= self.depth)
        ]

    def summarize(self) -> dict[str, LayerSummary]:
        summary = {name: LayerSummary(m) for name, m in self.named_modules}
        for layer in summary.values():
            layer.detach_hook()
        return summary

    @property
    def total_parameters(self) -> int:
        return sum(p.numel() for p in self._whole.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self._whole.parameters() if p.requires_grad)

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for m in self._whole.modules()]  # as on one device: the layers' ModuleDict too
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_flops(self) -> int:
        return 0 if self._flops is None else self._flops.get_total_flops()

    def rows(self) -> list[tuple[str, list[str]]]:
        names = self.layer_names
        return [
            (" ", [str(i) for i in range(len(names))]),
            ("Name", names),
            ("Type", self.layer_types),
            ("Params", [get_human_readable_count(n) for n in self.param_nums]),
            ("Mode", ["train" if mode else "eval" for mode in self.training_modes]),
            ("FLOPs", self._layer_flops(names)),
        ]

    def _layer_flops(self, names: list[str]) -> list[str]:
        if self._flops is None:
            return [NOT_APPLICABLE] * len(names)
        counts = self._flops.get_flop_counts()
        return [
            get_human_readable_count(sum(counts.get(f"{_Whole.__name__}.{name}", {}).values()))
            for name in names
        ]


class _Whole(nn.Module):
    """The layers as one module whose forward runs them in order: FLOPs are counted per ``layers.<i>``."""

    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, inputs: Any, context: Mapping[str, Any]) -> Any:
        return forward_layers(self.layers.values(), inputs, context)


def _meta_flops(module: PipelineModule, layers: nn.ModuleDict) -> FlopCounterMode | None:
    """The FLOPs of the whole model's forward of ``example_input_array``, counted on the meta device; None
    where there is no example or the forward needs real values (a data-dependent shape)."""
    try:
        inputs, context = example_forward_args(module)
    except ValueError:
        return None
    meta = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, Tensor) else t, (inputs, context))
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            _Whole(layers)(*meta)
    except Exception:  # the summary's FLOPs stay n/a; the forward itself is the training's to run
        return None
    return counter


def summarize_whole_model(trainer: Trainer) -> None:
    """Make the trainer's model-summary callbacks (``ModelSummary``, ``RichModelSummary``) summarise the
    whole model instead of forwarding through this worker's layers."""

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary):
            replace_model_summary(callback, _whole_model)


def _whole_model(trainer: Trainer, module: LightningModule, *, max_depth: int) -> Any:
    return PipelineSummary(module, max_depth)  # type: ignore[arg-type]
