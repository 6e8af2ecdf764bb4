"""Lightning's model summary of a pipelined model: the whole model.

Lightning's ``ModelSummary`` callback (on by default) counts the parameters a process holds and runs
``example_input_array`` through its ``forward``. A worker of a pipeline holds some layers only: its forward
fails on any stage but the first, and its counts would be its own stage's. :func:`summarize_whole_model` makes
the callback summarise the whole model instead, built on the meta device (no memory, no forward), one row per
layer (the plan table printed at the start says which stage holds it).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    NOT_APPLICABLE,
    LayerSummary,
    get_human_readable_count,
)
from torch import nn

from lightning_oobleck.lightning._internals import RowsSummary, replace_model_summary
from lightning_oobleck.lightning.module import PipelineModule, meta_layers


class PipelineSummary(RowsSummary):
    """The summary of ``module``'s whole model: rows ``layers.<i>`` (and their submodules down to
    ``max_depth``); totals over the whole model, a tied parameter counted once."""

    def __init__(self, module: PipelineModule, max_depth: int = 1) -> None:
        self._whole = nn.ModuleDict({str(i): layer for i, layer in enumerate(meta_layers(module))})
        self.depth = max_depth
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
        modes = [m.training for m in self._whole.modules()][1:]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_flops(self) -> int:
        return 0

    def rows(self) -> list[tuple[str, list[str]]]:
        names = self.layer_names
        return [
            (" ", [str(i) for i in range(len(names))]),
            ("Name", names),
            ("Type", self.layer_types),
            ("Params", [get_human_readable_count(n) for n in self.param_nums]),
            ("Mode", ["train" if mode else "eval" for mode in self.training_modes]),
            ("FLOPs", [NOT_APPLICABLE] * len(names)),  # measured by a forward, which a worker cannot run
        ]


def summarize_whole_model(trainer: Trainer) -> None:
    """Make the trainer's model-summary callbacks (``ModelSummary``, ``RichModelSummary``) summarise the
    whole model instead of forwarding through this worker's layers."""

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary):
            replace_model_summary(callback, _whole_model)


def _whole_model(trainer: Trainer, module: LightningModule, *, max_depth: int) -> Any:
    return PipelineSummary(module, max_depth)  # type: ignore[arg-type]
