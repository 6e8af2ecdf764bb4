"""Gradient clipping by the norm of the whole model, as a precision plugin of the run's own kind.

Lightning clips with ``precision_plugin.clip_grad_by_norm(optimizer, clip_val)`` over the parameters this
process holds; under the oobleck strategy the norm must cover every layer once, whatever the layout. The
step's commit already summed the squared norm over every worker, so the plugin only scales.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import cache

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override


class GlobalNormClipping(Precision):
    """Mixed into the run's precision plugin class (:func:`with_global_norm_clipping`)."""

    global_norm_sq: Callable[[], float]
    """The squared gradient norm of the whole model for the step being applied."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``torch.nn.utils.clip_grad_norm_(max_norm=clip_val)`` with the norm of the whole model."""
        coef = min(1.0, clip_val / (math.sqrt(self.global_norm_sq()) + 1e-6))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(coef)


@cache
def _clipping_class(cls: type[Precision]) -> type[Precision]:
    return type(f"GlobalNormClipping{cls.__name__}", (GlobalNormClipping, cls), {})


def with_global_norm_clipping(plugin: Precision, global_norm_sq: Callable[[], float]) -> Precision:
    """A copy of ``plugin`` whose class also derives from :class:`GlobalNormClipping` (the user's plugin
    object is left as it is); everything else it does is unchanged."""
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    clipping = copy.copy(plugin)
    clipping.__class__ = _clipping_class(type(plugin))
    clipping.global_norm_sq = global_norm_sq  # type: ignore[attr-defined]
    return clipping
