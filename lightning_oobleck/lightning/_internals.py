"""Every use of Lightning's private API, in one place: the seam a Lightning upgrade is checked against.

The strategy needs a few things Lightning has no public API for: to put a joiner's state where a resumed
checkpoint's would be, to take over the loop's per-batch SIGTERM broadcast (its own collective would
interleave with the pipeline's), to re-run a batch's transfer after a recovery, to set a logger's version,
to launch and report workers as Lightning's own launchers do. Each is one function or name here, with what
it reaches; all were checked on Lightning :data:`CHECKED_ON`. ``tests/lightning/test_internals.py`` checks
every entry of :data:`ACCESSES` against the installed Lightning and fails naming the access an upgrade
moved. Nothing else in the package imports a private Lightning name or reads a private Lightning attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from lightning.fabric.strategies.launchers.multiprocessing import (
    _check_bad_cuda_fork as check_bad_cuda_fork,
)
from lightning.fabric.strategies.launchers.multiprocessing import (
    _check_missing_main_guard as check_missing_main_guard,
)
from lightning.fabric.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing as disable_module_memory_sharing,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import (
    _init_optimizers_and_lr_schedulers as init_optimizers_and_lr_schedulers,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot as GlobalStateSnapshot
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.data import _is_dataloader_shuffled as is_dataloader_shuffled
from lightning.pytorch.utilities.exceptions import _TunerExitException as TunerExit
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

CHECKED_ON = "2.6.6"
"""The Lightning release every access below was read against."""

__all__ = [
    "ACCESSES",
    "CHECKED_ON",
    "GlobalStateSnapshot",
    "Launcher",
    "RowsSummary",
    "TunerExit",
    "batch_to_device",
    "check_bad_cuda_fork",
    "check_missing_main_guard",
    "disable_module_memory_sharing",
    "dump_checkpoint",
    "init_optimizers_and_lr_schedulers",
    "is_dataloader_shuffled",
    "logged_results",
    "loop_data_source",
    "mark_sigterm_received",
    "optimizers_to_device",
    "replace_model_summary",
    "resume_from",
    "route_sigterm_check",
    "set_logger_version",
    "set_num_threads_if_needed",
    "validation_data_ready",
]


def logged_results(trainer: Trainer) -> Any:
    """The values ``self.log`` collected in the running loop (``trainer._results``): the strategy weighs them
    by each pipeline's share of the batch before Lightning reduces them."""
    return trainer._results


def loop_data_source(loop: Any) -> Any:
    """A fit/validate/test loop's data source (``loop._data_source``), to read the loader's batch size before
    Lightning's setup; ``None`` where the loop has none."""
    return getattr(loop, "_data_source", None)


def route_sigterm_check(trainer: Trainer, check: Callable[[], None]) -> None:
    """Replace the training loop's per-batch SIGTERM broadcast (``epoch_loop._broadcast_sigterm_tensor``, a
    collective on the default group) with ``check``: the step's commit carries the flag instead."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check  # type: ignore[method-assign]


def mark_sigterm_received(trainer: Trainer) -> None:
    """Tell Lightning's signal handling that SIGTERM arrived (``_signal_connector.received_sigterm``), as its
    own handler would, so that the loop ends the run as after a SIGTERM."""
    trainer._signal_connector.received_sigterm = True


def resume_from(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Make the fit resume from ``checkpoint``'s loop state as ``fit(ckpt_path=...)`` would
    (``_checkpoint_connector._loaded_checkpoint``): a joiner takes the members' place in the step."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def dump_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """Lightning's checkpoint entries now (``_checkpoint_connector.dump_checkpoint``), optimizer state
    included: what ``trainer.save_checkpoint`` would write, without writing it."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def validation_data_ready(trainer: Trainer) -> bool:
    """Whether the fit's validation loaders are set up (``val_loop._combined_loader``)."""
    return trainer.fit_loop.epoch_loop.val_loop._combined_loader is not None


def batch_to_device(trainer: Trainer, batch: Any, dataloader_idx: int) -> Any:
    """What Lightning does to a batch between its loader and the step: the module's
    ``on_before_batch_transfer`` (``LightningModule._on_before_batch_transfer``) then the strategy's
    ``batch_to_device`` hook (``call._call_strategy_hook``), for a batch re-read after a recovery."""
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
    return call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=dataloader_idx)


def set_logger_version(logger: CSVLogger | TensorBoardLogger, version: int | str) -> None:
    """Fix a logger's version (``logger._version``) to the one the run agreed on."""
    logger._version = version


def replace_model_summary(callback: ModelSummary, summarize: Callable[..., Any]) -> None:
    """Make a ``ModelSummary`` callback build its summary with ``summarize(trainer, module, max_depth=...)``
    (its ``_summary`` method, at its ``_max_depth``)."""
    callback._summary = partial(summarize, max_depth=callback._max_depth)  # type: ignore[method-assign]


class RowsSummary(Summary):
    """Lightning's ``model_summary.ModelSummary`` whose table rows come from :meth:`rows` (its private
    ``_get_summary_data``)."""

    def rows(self) -> list[tuple[str, list[str]]]:
        """The table's columns: ``(header, one value per row)``."""
        return super()._get_summary_data()

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self.rows()


ACCESSES: dict[str, Callable[[], object]] = {
    "trainer._results": lambda: Trainer._results,
    "loop._data_source": lambda: Trainer().fit_loop._data_source,
    "trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor": (
        lambda: Trainer().fit_loop.epoch_loop._broadcast_sigterm_tensor
    ),
    "trainer._signal_connector.received_sigterm": lambda: Trainer()._signal_connector.received_sigterm,
    "trainer._checkpoint_connector._loaded_checkpoint": (
        lambda: Trainer()._checkpoint_connector._loaded_checkpoint
    ),
    "trainer._checkpoint_connector.dump_checkpoint": lambda: Trainer()._checkpoint_connector.dump_checkpoint,
    "val_loop._combined_loader": lambda: Trainer().fit_loop.epoch_loop.val_loop._combined_loader,
    "LightningModule._on_before_batch_transfer": lambda: LightningModule._on_before_batch_transfer,
    "call._call_strategy_hook": lambda: call._call_strategy_hook,
    "CSVLogger._version": lambda: CSVLogger(".")._version,
    # constructing one needs tensorboard, which is optional: its version property must read the attribute
    "TensorBoardLogger._version": lambda: _reads(TensorBoardLogger, "version", "_version"),
    "ModelSummary._summary": lambda: ModelSummary._summary,
    "ModelSummary._max_depth": lambda: ModelSummary()._max_depth,
    "model_summary.ModelSummary._get_summary_data": lambda: Summary._get_summary_data,
}
"""Each private attribute this module reads or writes, and how to reach it on the installed Lightning (the
private names imported above are checked by this module's import itself)."""


def _reads(cls: type, name: str, attribute: str) -> None:
    """Raise ``AttributeError`` unless ``cls.name``'s code reads ``attribute``."""
    member = getattr(cls, name)
    code = (member.fget if isinstance(member, property) else member).__code__
    if attribute not in code.co_names:
        raise AttributeError(f"{cls.__name__}.{name} no longer reads {attribute}")
