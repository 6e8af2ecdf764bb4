"""Sharded checkpoints that load into any layout, written without collectives and committed atomically.

A checkpoint is a directory:

* ``shards/<node>.<device>/``: one ``torch.distributed.checkpoint`` (DCP) checkpoint per writing worker,
  written by that worker alone: the layers it writes under their global names (``model.layers.7.attn.weight``)
  and their optimizer state keyed by the same names (``optim.state.layers.7.attn.weight.exp_avg``,
  ``optim.param_groups.layers.7.attn.weight.lr``: torch's *flattened* optimizer state dict, made for
  pipeline parallelism). A layer replicated over several pipelines is written by one worker only
  (``is_writer_for_layer``);
* ``index.json``: the shard that holds each layer;
* ``lightning.pt``: Lightning's other checkpoint entries (global step, epoch, loops, LR schedulers,
  callbacks, data position...), a normal ``torch.save`` file;
* ``profile.json``: the layer profile the run's plan was made from (when the planner made it), to plan a
  resume the same way (``OobleckStrategy(profile_path=...)``).

Because names are global, loading is layout-free: each worker reads exactly the layers it owns now (another
node count, other stage boundaries, or one process holding everything) and their optimizer state.

A stage split over ``t`` devices (tensor parallelism) writes one shard together, named after its first
device: DCP over the stage's group, each device writing its own part of every split tensor and the first the
shard's metadata (the one collective of a save, inside one node). Loading reads, for each tensor, the parts
that overlap what the loading worker holds: a checkpoint written at one ``t`` loads at any other, ``t = 1``
included, and the other way.

Writing needs no collective, so a peer lost during a save cannot leave a worker blocked inside DCP. Every
worker writes its shard into the same temporary sibling directory (:func:`partial_path`); the caller
confirms with its own collective that every shard is written, writes the index and metadata, and moves the
directory into place with :func:`commit`: a checkpoint path never holds a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_oobleck.execution.stage import StageModule, Tie
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.worker import Worker

METADATA_FILE = "lightning.pt"
INDEX_FILE = "index.json"
PROFILE_FILE = "profile.json"
PROFILE_KEY = "oobleck_profile"
"""The metadata entry holding the layer profile, written out as ``PROFILE_FILE`` too."""
SHARDS_DIR = "shards"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The global layer index in a state-dict key (``layers.7.attn.weight`` -> 7), ``None`` outside layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def tie_aliases(ties: Iterable[Tie]) -> dict[str, str]:
    """A tied parameter's other names (``layers.11.lm_head.weight``) -> the name it is checkpointed under."""
    return {f"layers.{i}.{name}": tie.name for tie in ties for i, name in tie.members[1:]}


def _canonical_names(module: nn.Module) -> Callable[[str], str]:
    """Maps a state-dict key of ``module`` to the key it is checkpointed under: a tied parameter's other
    names (``layers.11.lm_head.weight``, and its optimizer entries) become its canonical one."""
    aliases = tie_aliases(module.ties if isinstance(module, StageModule) else ())
    if not aliases:
        return lambda key: key
    pattern = re.compile(r"(?:^|(?<=\.))(" + "|".join(map(re.escape, aliases)) + r")(?=\.|$)")
    return lambda key: pattern.sub(lambda m: aliases[m.group(1)], key)


def shard_name(worker: Worker) -> str:
    """The shard directory of worker ``(node, device)``."""
    return f"{worker[0]}.{worker[1]}"


def layer_writers(plan: Plan) -> dict[int, Worker]:
    """Who writes each layer under ``plan``: its replica in the lowest-numbered pipeline holding it."""
    return {layer: plan.layer_owners(layer)[0] for layer in range(plan.num_layers)}


def partial_path(path: str | Path, attempt: str) -> Path:
    """Where the shards of checkpoint ``path`` are written before :func:`commit` (a hidden sibling)."""
    path = Path(path)
    return path.parent / f".{path.name}.partial-{attempt}"


def write_shard(
    directory: str | Path,
    module: nn.Module,
    optimizers: Iterable[Optimizer],
    name: str,
    is_writer_for_layer: Callable[[int], bool] = lambda layer: True,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """Write this worker's layers (and their optimizer state) as shard ``name`` of ``directory``.

    Needs no other process, except for a stage split over several devices: its ``group`` writes the shard
    together (every device of it calls this). Returns the layers written. ``module``'s parameters must all be
    named ``...layers.<global index>...`` (the engine's stage module); ``optimizers`` must hold only them.
    """
    optimizers = list(optimizers)
    state = {"model": get_model_state_dict(module, options=_OPTIONS)}
    if optimizers:
        state["optim"] = _optimizer_state_dict(module, optimizers)
    outside = [key for entries in state.values() for key in entries if layer_of(key) is None]
    if outside:
        raise ValueError(
            f"checkpoint entries {outside[:3]} belong to no layer: a sharded checkpoint holds the pipeline's "
            "layers only (module parameters named layers.<index>.*)"
        )
    canonical = _canonical_names(module)
    state = {
        part: {
            k: v
            for k, v in entries.items()
            if canonical(k) == k and is_writer_for_layer(layer_of(k))  # type: ignore[arg-type]
        }
        for part, entries in state.items()
    }
    written = sorted({layer_of(k) for entries in state.values() for k in entries})  # type: ignore[type-var]
    shard = Path(directory) / SHARDS_DIR / name
    if group is not None:
        dcp.save(state, checkpoint_id=shard, process_group=group)
        return written  # type: ignore[return-value]
    with _one_process():
        dcp.save(state, checkpoint_id=shard, no_dist=True)
    return written  # type: ignore[return-value]


def write_metadata(
    directory: str | Path,
    metadata: Mapping[str, Any],
    shards: Mapping[int, str],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Write Lightning's entries and the index (``shards[layer]`` = the shard holding that layer;
    ``aliases``: a tied parameter's other names -> the name it is stored under, see :func:`tie_aliases`)."""
    directory = Path(directory)
    torch.save(dict(metadata), directory / METADATA_FILE)
    index: dict[str, Any] = {"layers": {str(layer): shards[layer] for layer in sorted(shards)}}
    if aliases:
        index["aliases"] = dict(aliases)
    (directory / INDEX_FILE).write_text(json.dumps(index))
    if (profile := metadata.get(PROFILE_KEY)) is not None:
        (directory / PROFILE_FILE).write_text(json.dumps(profile, indent=1))


def missing_shards(directory: str | Path, shards: Iterable[str]) -> list[str]:
    """The ``shards`` that ``directory`` does not hold complete (DCP writes a shard's ``.metadata`` last)."""
    return sorted(name for name in shards if not (Path(directory) / SHARDS_DIR / name / ".metadata").exists())


def commit(partial: str | Path, path: str | Path) -> None:
    """Move the finished checkpoint ``partial`` to ``path``, replacing what is there; then delete the
    leftovers of earlier, abandoned attempts at ``path``. Idempotent: a no-op once ``partial`` is gone."""
    partial, path = Path(partial), Path(path)
    if partial.exists():
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            partial.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(path)
    discard(path)


def discard(path: str | Path) -> None:
    """Delete every unfinished attempt at checkpoint ``path`` (:func:`partial_path`), leaving ``path``."""
    path = Path(path)
    for attempt in path.parent.glob(f".{path.name}.partial-*"):
        shutil.rmtree(attempt, ignore_errors=True)


def load_sharded(path: str | Path, module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> dict[str, Any]:
    """Load the layers ``module`` holds now, then the optimizers' state; return Lightning's metadata.

    A strategy that must load weights before its optimizers exist (Lightning restores the model before
    ``setup`` creates optimizers) calls :func:`load_sharded_model` and later :func:`load_sharded_optimizers`.
    """
    load_sharded_model(path, module)
    optimizers = list(optimizers)
    if optimizers:
        load_sharded_optimizers(path, module, optimizers)
    return load_metadata(path)


def load_sharded_model(path: str | Path, module: nn.Module) -> None:
    """Fill ``module``'s parameters and buffers from the checkpoint by their global names."""
    state = get_model_state_dict(module, options=_OPTIONS)
    _load_by_layer(path, "model", state, _canonical_names(module))
    set_model_state_dict(module, state, options=_OPTIONS)


def load_sharded_optimizers(path: str | Path, module: nn.Module, optimizers: Iterable[Optimizer]) -> None:
    """Restore each optimizer's state and hyper-parameters for the parameters it holds now.

    As torch's ``Optimizer.load_state_dict``: a parameter group takes the saved group's hyper-parameters
    (those it has and the checkpoint does not, an LR scheduler's ``initial_lr`` added since the save as
    Lightning's learning-rate finder adds it before it restores its checkpoint, are dropped; the saved ones
    it lacks are added), and a parameter saved without state (its optimizer had not stepped) has none."""
    optimizers = list(optimizers)
    hyperparameters, stateful = _saved_optimizer_entries(path)
    canonical = _canonical_names(module)
    names = {param: canonical(name) for name, param in module.named_parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if (wanted := hyperparameters.get(names[group["params"][0]])) is None:
                continue  # its parameters are not in the checkpoint: the load says so
            for extra in set(group) - wanted - {"params"}:
                del group[extra]
            for missing in wanted - set(group):
                group[missing] = None  # a placeholder the load replaces
    state = get_optimizer_state_dict(module, optimizers, options=_OPTIONS)
    stateless = [param for param, name in names.items() if name in hyperparameters and name not in stateful]
    saved = _without_state_of(state, module, stateless)
    _load_by_layer(path, "optim", saved, canonical)
    # torch loads the state it made for the template where nothing was saved; then it is forgotten
    set_optimizer_state_dict(module, optimizers, {**state, **saved}, options=_OPTIONS)
    _forget_state(optimizers, stateless)


def _optimizer_state_dict(module: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
    """torch's flattened state dict of ``optimizers``, without its side effect on one that has not stepped:
    torch makes the state of such an optimizer with a step of zero gradients (Adam's step count 1, its
    moments zero), and a run that saved before its first update would then train otherwise than one that
    did not. Its state stays empty, and the dict holds its hyper-parameters only, as ``state_dict()`` does."""
    fresh = [optimizer for optimizer in optimizers if not optimizer.state]
    state = get_optimizer_state_dict(module, optimizers, options=_OPTIONS)
    params = [param for optimizer in fresh for group in optimizer.param_groups for param in group["params"]]
    _forget_state(fresh, params)
    return _without_state_of(state, module, params)


def _saved_optimizer_entries(path: str | Path) -> tuple[dict[str, set[str]], set[str]]:
    """From the shards' metadata: each saved parameter's hyper-parameter names, and the parameters saved
    with optimizer state."""
    hyperparameters: dict[str, set[str]] = {}
    stateful: set[str] = set()
    for shard in sorted((Path(path) / SHARDS_DIR).iterdir()):
        for key in FileSystemReader(shard).read_metadata().state_dict_metadata:
            if key.startswith("optim.param_groups."):
                name, hyperparameter = key.removeprefix("optim.param_groups.").rsplit(".", 1)
                hyperparameters.setdefault(name, set()).add(hyperparameter)
            elif key.startswith("optim.state."):
                stateful.add(key.removeprefix("optim.state.").rsplit(".", 1)[0])
    return hyperparameters, stateful


def _forget_state(optimizers: list[Optimizer], params: list[nn.Parameter]) -> None:
    for optimizer in optimizers:
        for param in params:
            optimizer.state.pop(param, None)


def _without_state_of(state: dict[str, Any], module: nn.Module, params: list[nn.Parameter]) -> dict[str, Any]:
    """``state`` (flattened) without the optimizer state of ``params``, under any of their names."""
    ids = {id(param) for param in params}
    named = module.named_parameters(remove_duplicate=False)
    prefixes = tuple(f"state.{name}." for name, param in named if id(param) in ids)
    return {key: value for key, value in state.items() if not (prefixes and key.startswith(prefixes))}


def load_metadata(path: str | Path) -> dict[str, Any]:
    """Lightning's entries of a sharded checkpoint (a file we wrote: full unpickling, as Lightning does)."""
    file = Path(path) / METADATA_FILE
    if not file.exists():
        raise FileNotFoundError(
            f"{path} is not a sharded Oobleck checkpoint ({METADATA_FILE} is missing): pass the checkpoint "
            "directory written by trainer.save_checkpoint / ModelCheckpoint with strategy='oobleck'"
        )
    return torch.load(file, weights_only=False)


def _load_by_layer(
    path: str | Path, part: str, state: dict[str, Any], canonical: Callable[[str], str]
) -> None:
    """Load ``state``'s entries in place, each from the shard the index names for its layer (a tied
    parameter's entries from its canonical name's)."""
    index_file = Path(path) / INDEX_FILE
    if not index_file.exists():
        raise FileNotFoundError(
            f"{path} holds no sharded Oobleck checkpoint ({INDEX_FILE} is missing): pass a checkpoint "
            "directory written by trainer.save_checkpoint / ModelCheckpoint with strategy='oobleck'"
        )
    shards = json.loads(index_file.read_text())["layers"]
    wanted: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        saved = canonical(key)
        layer = layer_of(saved)
        if str(layer) not in shards:
            raise KeyError(f"the checkpoint at {path} holds no layer {layer} (needed for {key!r})")
        wanted.setdefault(shards[str(layer)], {})[saved] = value
    for shard, entries in wanted.items():
        with _one_process():
            dcp.load({part: entries}, checkpoint_id=Path(path) / SHARDS_DIR / shard, no_dist=True)
    loaded = {saved: value for entries in wanted.values() for saved, value in entries.items()}
    for key in state:
        state[key] = loaded[canonical(key)]


def consolidate_checkpoint(path: str | Path, output: str | Path) -> Path:
    """Turn the sharded checkpoint ``path`` into one plain Lightning checkpoint file ``output``: every layer's
    weights under the names a ``PipelineModule`` has on one device (``state_dict``, a tied parameter under
    each of its names) and Lightning's entries (epoch, global step, hyper-parameters, callbacks...).

    For evaluation, export and serving with any strategy (``MyModel.load_from_checkpoint(output)``,
    ``trainer.validate(model, ckpt_path=output)``), like Lightning's FSDP ``consolidate_checkpoint``. It
    holds no optimizer state (that is stored per layer, under the layout's names): resume training from
    the sharded checkpoint, which loads into any layout. Returns ``output``.
    """
    path, output = Path(path), Path(output)
    metadata = load_metadata(path)
    index = json.loads((path / INDEX_FILE).read_text())
    layers: dict[str, str] = index["layers"]
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(set(layers.values())):
        model = _stored_model(path / SHARDS_DIR / shard)
        state_dict.update({k: v for k, v in model.items() if layers.get(str(layer_of(k))) == shard})
    missing = sorted(set(map(int, layers)) - {layer_of(k) for k in state_dict})
    if missing:
        raise ValueError(f"the checkpoint at {path} lists layers {missing} but its shards do not hold them")
    for alias, name in index.get("aliases", {}).items():
        state_dict[alias] = state_dict[name]
    checkpoint = {k: v for k, v in metadata.items() if k not in ("optimizer_states", PROFILE_KEY)}
    checkpoint["state_dict"] = dict(sorted(state_dict.items(), key=lambda kv: (layer_of(kv[0]), kv[0])))
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, output)
    return output


def _stored_model(shard: Path) -> dict[str, torch.Tensor]:
    """Every model entry a shard holds (its parameters and buffers), read from the shard's own metadata."""
    stored = FileSystemReader(shard).read_metadata().state_dict_metadata
    entries = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with _one_process():
        dcp.load({"model": entries}, checkpoint_id=shard, no_dist=True)
    return entries


def refuse_sharded(path: str | Path, where: str) -> None:
    """Raise when ``path`` is a sharded checkpoint, which ``where`` cannot load: say how to consolidate it."""
    if Path(path).is_dir() and (Path(path) / INDEX_FILE).exists():
        raise ValueError(
            f"{path} is a sharded checkpoint of the oobleck strategy, which {where} cannot load: load it "
            f"with strategy='oobleck', or consolidate it first: `oobleck consolidate {path} model.ckpt` (or "
            "lightning_oobleck.consolidate_checkpoint)"
        )


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes a single process: here that is the intent (one shard per worker)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
