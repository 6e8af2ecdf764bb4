"""What a worker hands back to the supervisor when it finishes, and how the supervisor restores it.

Workers write files into a launch directory instead of a shared queue: a worker SIGKILLed while writing
to a ``multiprocessing`` queue can leave its lock held and block everyone, while a file is either
atomically in place (``os.replace``) or absent. Per rank ``r``:

* ``weights-r.pt``: the worker's ``strategy.lightning_module_state_dict()`` (for Oobleck, the layers it owns,
  under their global names) when fitting; written first;
* ``result-r.pt``: a :class:`WorkerResult`; its presence means the worker finished;
* ``error-r.txt``: the traceback if the worker's function raised, and ``error-r.pt`` the exception itself.

The supervisor takes the run's result from the lowest finished rank and each weight from the lowest
finished rank that holds it (:func:`collect_layers`), like Lightning's
``_MultiProcessingLauncher._recover_results_in_main_process`` but from any survivor instead of rank 0.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.callbacks import LearningRateFinder, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerState
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

if TYPE_CHECKING:
    import lightning.pytorch as pl


@dataclass(frozen=True)
class WorkerResult:
    """The part of a finished worker's Trainer that the caller's Trainer gets back."""

    rank: int
    value: Any
    """The launched function's return value, on CPU."""
    tuner_exit: bool = False
    """The function ended with Lightning's exit of a tuner run (``Tuner.lr_find``), to be raised again in the
    caller's Trainer once the results are back, as Lightning ends such a run."""
    trainer_state: TrainerState | None = None
    fit_loop_state: dict[str, Any] | None = None
    """``trainer.fit_loop.state_dict()``: progress, so ``global_step`` and ``current_epoch`` come back."""
    callback_metrics: dict[str, torch.Tensor] | None = None
    callback_states: dict[str, dict[str, Any]] | None = None
    """Each callback's ``state_dict()`` by its ``state_key``, as a checkpoint holds them: the best
    checkpoints' paths and scores, early stopping's epoch, the user's own callbacks' state."""
    lr_finders: tuple[Any, ...] = ()
    """Each ``LearningRateFinder``'s result (``optimal_lr``: what ``Tuner.lr_find`` returns), in order."""
    learning_rates: dict[str, Any] | None = None
    """The module's learning rate by name (``lr``, ``learning_rate``; an attribute or a hyperparameter),
    which the learning-rate finder sets to its suggestion."""


LEARNING_RATES = ("lr", "learning_rate")
"""The names Lightning's learning-rate finder looks for (and sets) on a module or in its hparams."""


def result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result-{rank}.pt"


def weights_path(workdir: Path, rank: int) -> Path:
    return workdir / f"weights-{rank}.pt"


def error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error-{rank}.txt"


def exception_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error-{rank}.pt"


def _save_atomically(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_worker_result(
    workdir: Path, rank: int, value: Any, trainer: pl.Trainer | None, tuner_exit: bool = False
) -> None:
    """Worker side, after the function returned: weights (when fitting), then the result marking success."""
    if trainer is None:
        _save_atomically(WorkerResult(rank, move_data_to_device(value, "cpu")), result_path(workdir, rank))
        return
    fitting = trainer.state.fn == TrainerFn.FITTING
    # Every rank computes its state dict: a strategy may need collectives for it, as in Lightning's launcher.
    state_dict = trainer.strategy.lightning_module_state_dict()
    if fitting:
        _save_atomically(move_data_to_device(state_dict, "cpu"), weights_path(workdir, rank))
    result = WorkerResult(
        rank=rank,
        value=move_data_to_device(value, "cpu"),
        tuner_exit=tuner_exit,
        trainer_state=trainer.state,
        fit_loop_state=trainer.fit_loop.state_dict() if fitting else None,
        callback_metrics=move_data_to_device(dict(trainer.callback_metrics), "cpu"),
        callback_states=_callback_states(trainer),
        lr_finders=tuple(c.optimal_lr for c in trainer.callbacks if isinstance(c, LearningRateFinder)),
        learning_rates=_learning_rates(trainer.lightning_module),
    )
    _save_atomically(result, result_path(workdir, rank))


def _callback_states(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """Each callback's state on CPU; one that cannot be pickled stays behind with a warning (a finished
    training must not fail over it)."""
    states = {}
    for callback in trainer.callbacks:
        state = move_data_to_device(callback.state_dict(), "cpu")
        try:
            pickle.dumps(state)
        except Exception as e:
            warnings.warn(
                f"the state of callback {callback.state_key} does not come back to the caller's Trainer: its "
                f"state_dict() cannot be pickled ({e})",
                stacklevel=1,
            )
            continue
        states[callback.state_key] = state
    return states


def _learning_rates(module: pl.LightningModule) -> dict[str, Any]:
    return {
        name: lightning_getattr(module, name) for name in LEARNING_RATES if lightning_hasattr(module, name)
    }


def write_worker_error(workdir: Path, rank: int, error: BaseException) -> None:
    """Record the exception that ended ``rank``: its traceback as text, and the exception itself when it
    can be pickled (so that the caller can raise the user's own exception)."""
    text = "".join(traceback.format_exception(error))
    with contextlib.suppress(Exception):  # an exception that cannot be pickled is known by its text
        _save_atomically(error, exception_path(workdir, rank))
    path = error_path(workdir, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_result(workdir: Path, rank: int) -> WorkerResult | None:
    """The result of ``rank`` if it finished (our own temporary files: full unpickling is safe)."""
    path = result_path(workdir, rank)
    return torch.load(path, weights_only=False) if path.exists() else None


def read_error(workdir: Path, rank: int) -> str | None:
    path = error_path(workdir, rank)
    return path.read_text() if path.exists() else None


def read_exception(workdir: Path, rank: int) -> BaseException | None:
    """The exception that ended ``rank``, if it could be pickled."""
    path = exception_path(workdir, rank)
    try:
        return torch.load(path, weights_only=False) if path.exists() else None
    except Exception:  # its class cannot be imported here
        return None


def collect_layers(workdir: Path, ranks: Iterable[int]) -> dict[str, torch.Tensor]:
    """Merge the weight files of ``ranks``: each entry from the first rank (in the given order) that has it.

    With Oobleck every rank holds only its own layers under global names (``layers.7.attn.weight``); the
    union over the survivors is the whole model, each layer taken from one surviving replica.
    """
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        path = weights_path(workdir, rank)
        if path.exists():
            for name, tensor in torch.load(path, weights_only=True).items():
                merged.setdefault(name, tensor)
    return merged


def restore_in_main_process(
    trainer: pl.Trainer, result: WorkerResult, weights: dict[str, torch.Tensor]
) -> None:
    """Give the caller's Trainer the survivor's state, metrics, loop progress, callbacks' state and the
    merged weights."""
    states = result.callback_states or {}
    for callback in trainer.callbacks:
        if (state := states.get(callback.state_key)) is None:
            continue
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            # The directory was resolved in the workers' setup; the caller's callback never ran one, and
            # loads the rest of its state only for the directory it was saved for.
            callback.dirpath = state.get("dirpath")
        try:
            callback.load_state_dict(state)
        except Exception as e:  # a code path one device never runs must not fail a finished training
            warnings.warn(
                f"the state of callback {callback.state_key} did not load into the caller's Trainer "
                f"({type(e).__name__}: {e}); the training itself finished",
                stacklevel=1,
            )
    finders = [callback for callback in trainer.callbacks if isinstance(callback, LearningRateFinder)]
    for finder, found in zip(finders, result.lr_finders, strict=False):
        finder.optimal_lr = found
    module = trainer.lightning_module
    for name, rate in (result.learning_rates or {}).items():
        if lightning_hasattr(module, name):
            lightning_setattr(module, name, rate)
    if weights:
        incompatible = trainer.lightning_module.load_state_dict(weights, strict=False)
        if incompatible.missing_keys or incompatible.unexpected_keys:
            raise RuntimeError(
                f"the finished workers' weights do not fit the model in the launching process: missing "
                f"{incompatible.missing_keys[:3]}, unexpected {incompatible.unexpected_keys[:3]}; the "
                "strategy's lightning_module_state_dict() must return every layer a worker owns, under the "
                "LightningModule's own parameter names"
            )
    if result.fit_loop_state is not None:
        trainer.fit_loop.load_state_dict(result.fit_loop_state)
    if result.trainer_state is not None:
        trainer.state = result.trainer_state
    if result.callback_metrics:
        trainer.callback_metrics.update(result.callback_metrics)
