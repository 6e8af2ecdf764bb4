"""Sharded checkpoints that load into any layout: ``torch.distributed.checkpoint`` keyed by global names.

A checkpoint is a directory:

* DCP shards (``*.distcp`` plus ``.metadata``): each rank's owned layers under their global names
  (``model.layers.7.attn.weight``) and their optimizer state keyed by the same names
  (``optim.state.layers.7.attn.weight.exp_avg``, ``optim.param_groups.layers.7.attn.weight.lr``: torch's
  *flattened* optimizer state dict, made for pipeline parallelism). A layer replicated over several
  pipelines is written by one rank only (``is_writer_for_layer``; DCP also drops identical duplicates);
* ``lightning.pt``: Lightning's other checkpoint entries (global step, epoch, loops, LR schedulers,
  callbacks, data position...), written by rank 0 of the group as a normal ``torch.save`` file.

Because names are global, loading is layout-free: each rank asks DCP for exactly the layers it owns now
(another node count, other stage boundaries, or one process holding everything) and their optimizer
state. Optimizers must hold only parameters of the module they are saved with.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_oobleck.planning.plan import Plan

METADATA_FILE = "lightning.pt"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The global layer index in a state-dict key (``layers.7.attn.weight`` -> 7), ``None`` outside layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def lowest_pipeline_writes(plan: Plan, worker: tuple[int, int]) -> Callable[[int], bool]:
    """``is_writer_for_layer`` for ``worker`` under ``plan``: each layer is written by its replica in the
    lowest-numbered pipeline holding it, so exactly one worker writes each layer."""
    written = {layer for layer in range(plan.num_layers) if plan.layer_owners(layer)[0] == worker}
    return written.__contains__


def save_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: Iterable[Optimizer],
    metadata: Mapping[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    is_writer_for_layer: Callable[[int], bool] | None = None,
) -> None:
    """Collective over ``process_group``: write this rank's share of a checkpoint into directory ``path``.

    Args:
        module: this rank's layers, named ``...layers.<global index>...`` (the engine's module).
        optimizers: optimizers over parameters of ``module`` only.
        metadata: Lightning's non-tensor entries; rank 0 of the group writes them.
        is_writer_for_layer: whether this rank writes layer ``i`` (e.g. "lowest pipeline holding it");
            ``None`` lets every holder offer it and DCP keep one copy. Entries outside any layer are
            offered by every rank (they must be identical) and stored once by DCP.
    """
    optimizers = list(optimizers)
    state = {"model": get_model_state_dict(module, options=_OPTIONS)}
    if optimizers:
        state["optim"] = get_optimizer_state_dict(module, optimizers, options=_OPTIONS)
    if is_writer_for_layer is not None:
        state = {part: _written(entries, is_writer_for_layer) for part, entries in state.items()}
    dcp.save(state, checkpoint_id=Path(path), process_group=process_group, no_dist=not dist.is_initialized())
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        torch.save(dict(metadata), Path(path) / METADATA_FILE)


def load_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: Iterable[Optimizer] = (),
    *,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Collective over ``process_group``: load the layers ``module`` holds now, then the optimizers' state.

    Returns Lightning's metadata. A strategy that must load weights before its optimizers exist (Lightning
    restores the model before ``setup`` creates optimizers) calls :func:`load_sharded_model` and later
    :func:`load_sharded_optimizers`.
    """
    load_sharded_model(path, module, process_group=process_group)
    optimizers = list(optimizers)
    if optimizers:
        load_sharded_optimizers(path, module, optimizers, process_group=process_group)
    return load_metadata(path)


def load_sharded_model(
    path: str | Path, module: nn.Module, *, process_group: dist.ProcessGroup | None = None
) -> None:
    """Collective: fill ``module``'s parameters and buffers from the checkpoint by their global names."""
    state = {"model": get_model_state_dict(module, options=_OPTIONS)}
    _dcp_load(state, path, process_group)
    set_model_state_dict(module, state["model"], options=_OPTIONS)


def load_sharded_optimizers(
    path: str | Path,
    module: nn.Module,
    optimizers: Iterable[Optimizer],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Collective: restore each optimizer's state and hyper-parameters for the parameters it holds now."""
    optimizers = list(optimizers)
    state = {"optim": get_optimizer_state_dict(module, optimizers, options=_OPTIONS)}
    _dcp_load(state, path, process_group)
    set_optimizer_state_dict(module, optimizers, state["optim"], options=_OPTIONS)


def load_metadata(path: str | Path) -> dict[str, Any]:
    """Lightning's entries of a sharded checkpoint (a file we wrote: full unpickling, as Lightning does)."""
    file = Path(path) / METADATA_FILE
    if not file.exists():
        raise FileNotFoundError(
            f"{path} is not a sharded Oobleck checkpoint ({METADATA_FILE} is missing): pass the checkpoint "
            "directory written by trainer.save_checkpoint / ModelCheckpoint with strategy='oobleck'"
        )
    return torch.load(file, weights_only=False)


def _written(entries: dict[str, Any], is_writer_for_layer: Callable[[int], bool]) -> dict[str, Any]:
    kept = {}
    for name, value in entries.items():
        layer = layer_of(name)
        if layer is None or is_writer_for_layer(layer):
            kept[name] = value
    return kept


def _dcp_load(state: dict[str, Any], path: str | Path, process_group: dist.ProcessGroup | None) -> None:
    if not (Path(path) / ".metadata").exists():
        raise FileNotFoundError(f"{path} holds no sharded checkpoint (no DCP .metadata file)")
    dcp.load(state, checkpoint_id=Path(path), process_group=process_group, no_dist=not dist.is_initialized())
