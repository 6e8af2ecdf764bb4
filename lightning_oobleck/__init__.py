"""lightning_oobleck: fault-tolerant heterogeneous pipeline training for PyTorch Lightning (Oobleck).

Importing the package registers the strategy name ``"oobleck"`` with Lightning's ``StrategyRegistry``, without
importing Lightning itself: if Lightning is loaded already the name is registered at once, otherwise as soon
as ``lightning.pytorch`` is imported. So the ``oobleck`` command, the coordinator and the SLURM rendezvous,
which import this package but not Lightning, start in a fraction of a second. ``OobleckStrategy`` and
``PipelineModule`` (and ``consolidate_checkpoint``) are loaded on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__all__ = ["OobleckStrategy", "PipelineModule", "consolidate_checkpoint"]
__version__ = "0.1.0"

_LIGHTNING = "lightning.pytorch"


def __getattr__(name: str) -> Any:
    if name == "consolidate_checkpoint":
        return importlib.import_module("lightning_oobleck.execution.checkpoint").consolidate_checkpoint
    if name in __all__:
        return getattr(importlib.import_module("lightning_oobleck.lightning"), name)
    raise AttributeError(f"module 'lightning_oobleck' has no attribute {name!r}")


def _register() -> None:
    importlib.import_module("lightning_oobleck.lightning")  # registers "oobleck" (idempotently)


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``lightning.pytorch`` is about to be imported, wraps its loader so that the
    strategy is registered right after the module ran."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)  # once, and so that the search below does not come back here
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class _ThenRegister(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _register()

        spec.loader = _ThenRegister()
        return spec


if _LIGHTNING in sys.modules:
    _register()
elif not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
