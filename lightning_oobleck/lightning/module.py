"""The user contract: what a LightningModule adds so that the Oobleck strategy can cut it into stages.

A user mixes :class:`PipelineModule` into their LightningModule and implements two hooks::

    class MyGPT(PipelineModule, L.LightningModule):
        def configure_layers(self):            # the model as ordered layers
            return [Embedding(...), *[Block(...) for _ in range(12)], Head(...)]

        def compute_loss(self, output, target):  # mean loss of one micro-batch
            return F.cross_entropy(output.flatten(0, 1), target.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

The mixin supplies ``forward`` (the layers in order) and ``training_step``/``validation_step``/``test_step``
(``self.pipeline_loss(batch)`` logged as ``train_loss``/``val_loss``/``test_loss``), so the same module also
trains with any other strategy on one process. Under the Oobleck strategy ``configure_layers`` is called on
the meta device and each rank materialises only the layers it owns; they are attached as ``self.layers``
(an ``nn.ModuleDict`` keyed by the global layer index), so ``self.parameters()`` holds exactly the owned
parameters, named ``layers.<i>.<name>`` in every layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from lightning_oobleck.execution.checkpoint import refuse_sharded
from lightning_oobleck.execution.stage import (
    build_reference_model,
    declare_ties,
    find_ties,
    forward_layers,
    reset_parameters,
    resolve_layers,
    tie_parameters,
)
from lightning_oobleck.execution.tensor_parallel import TensorParallelPlan, declared_plan

_MINIMAL_EXAMPLE = """
    class MyModel(PipelineModule, L.LightningModule):
        def configure_layers(self):
            return [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)]

        def compute_loss(self, output, target):
            return nn.functional.cross_entropy(output, target)
"""


class MissingPipelineHookError(TypeError):
    """The LightningModule does not implement a hook the Oobleck strategy needs."""


class PipelineExecutor(ABC):
    """What runs a module's layers as a pipeline (the Oobleck strategy implements it)."""

    @abstractmethod
    def pipeline_loss(self, module: PipelineModule, batch: Any, train: bool) -> Tensor:
        """The global mean loss of ``batch`` (forward and backward when ``train``), the same on every rank."""


class PipelineModule:
    """Mixin for a LightningModule whose model is an ordered sequence of layers (see the module docstring)."""

    layers: nn.ModuleDict
    init_seed: int = 0
    """Seeds the initial weights: the same weights under every strategy and every layout."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``; a sharded checkpoint is refused with how to consolidate."""
        refuse_sharded(checkpoint_path, "load_from_checkpoint")
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]

    def configure_layers(self) -> Sequence[nn.Module]:
        """The model as ordered layers; layer ``i`` receives the output of layer ``i - 1``."""
        raise MissingPipelineHookError(
            f"{type(self).__name__} must implement configure_layers() returning the model as an ordered list "
            f"of layers, and compute_loss(output, target), for example:\n{_MINIMAL_EXAMPLE}"
        )

    def tied_parameters(self) -> Sequence[Sequence[str]]:
        """Parameters that must be one tensor although ``configure_layers`` builds them separately: groups of
        names ``"LAYER.NAME"`` (the layer's index, then the parameter's name in it), e.g.
        ``[("0.wte.weight", "5.lm_head.weight")]``. The lowest layer's initialisation gives the value.

        Not needed where two layers hold the same ``nn.Parameter`` object (``head.weight =
        embedding.weight`` in ``configure_layers``): such ties are found by themselves. Default: none."""
        return ()

    def compute_loss(self, output: Any, target: Any) -> Tensor:
        """The mean loss of one micro-batch from the last layer's ``output`` and its ``target``."""
        raise MissingPipelineHookError(
            f"{type(self).__name__} must implement compute_loss(output, target) returning the mean loss of a "
            f"micro-batch, for example:\n{_MINIMAL_EXAMPLE}"
        )

    def init_layer(self, layer: nn.Module, index: int) -> None:
        """Initialise layer ``index`` in place (the RNG is seeded for this layer around the call, so it
        gets the same weights in every layout and under every strategy, one device included).

        Default: ``reset_parameters()`` of the outermost submodules that define it. Override it for a
        model's own initialisation, e.g. ``layer.apply(self._init_weights)`` (``nn.init.normal_(std=0.02)``
        and friends): initialisation written inside ``configure_layers`` does not run, since the layers are
        built on the meta device."""
        reset_parameters(layer, index)

    def tensor_parallel_plan(self, index: int, layer: nn.Module) -> TensorParallelPlan | None:
        """How layer ``index`` splits over the devices of a stage at tensor parallelism ``t > 1``
        (``OobleckStrategy(tensor_parallel=...)``): the styles of ``torch.distributed.tensor.parallel`` by
        submodule name, e.g. ``{"attn.q_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel()}``;
        ``{}`` keeps the layer whole on every device; ``None``: it cannot be split, and the planner keeps
        ``t = 1``.

        Default: the layer's own ``tensor_parallel_plan()`` if it declares one (as the GPT example's layers
        and :func:`~lightning_oobleck.models.huggingface.causal_lm_layers`' do), else ``None``."""
        return declared_plan(index, layer)

    def split_batch(self, batch: Any) -> tuple[Any, ...]:
        """``(inputs, targets)`` or ``(inputs, targets, context)`` of a batch (default: the batch is a pair).

        ``inputs`` feed layer 0 and ``targets`` the loss; ``context`` is a dict of side inputs (e.g.
        ``attention_mask``, ``position_ids``) that every stage reads from its copy of the batch and hands
        to each layer whose ``forward`` has a parameter of that name. Each may be a tensor or a pytree of
        tensors with the samples along the first dimension. A dict batch takes one line::

            return batch["input_ids"], batch["labels"], {"attention_mask": batch["attention_mask"]}
        """
        try:
            inputs, targets = batch
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{type(self).__name__}.split_batch expects batches as (inputs, targets) pairs; override "
                "split_batch(self, batch) -> (inputs, targets) or (inputs, targets, context) for other "
                "batch structures"
            ) from e
        return inputs, targets

    # ---------------------------------------------------------------- Lightning hooks with defaults
    def configure_model(self) -> None:
        """Build every layer on this process unless a pipeline executor builds the owned ones itself."""
        if not hasattr(self, "layers") and self._executor() is None:
            self._build_all_layers()

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Like ``nn.Module.load_state_dict``; a module without layers yet builds them all first.

        That is how the weights trained by the workers reach the module in the launching process. The new
        layers take the loaded tensors as they are (dtype included: a ``64-true`` run returns float64).
        """
        if not hasattr(self, "layers") and any(k.startswith("layers.") for k in state_dict):
            self._build_all_layers()
            assign = True
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        if assign:  # assigning replaced each name's parameter: tied layers share one again
            tie_parameters({int(i): layer for i, layer in self.layers.items()}, find_ties(meta_layers(self)))
        return result

    def forward(self, inputs: Any, context: Mapping[str, Any] | None = None) -> Any:
        return forward_layers(self.layers.values(), inputs, context)

    def pipeline_loss(self, batch: Any) -> Tensor:
        """The mean loss of ``batch``: forward (and, under the Oobleck strategy in training, backward too)."""
        executor = self._executor()
        if executor is not None:
            return executor.pipeline_loss(self, batch, train=self.training)
        inputs, targets, context = batch_parts(self, batch)
        return self.compute_loss(self(inputs, context), targets)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(batch)
        # Already the global mean on every rank (the step commit summed it): no collective here, which
        # recovery could not interrupt if a peer died right after the commit.
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    # ---------------------------------------------------------------- internals
    def _build_all_layers(self) -> None:
        device = torch.get_default_device()
        self.layers = build_reference_model(
            layer_source(self), device, seed=self.init_seed, init=self.init_layer
        ).layers

    def _executor(self) -> PipelineExecutor | None:
        trainer = getattr(self, "_trainer", None)
        strategy = getattr(trainer, "strategy", None)
        return strategy if isinstance(strategy, PipelineExecutor) else None


def batch_parts(module: PipelineModule, batch: Any) -> tuple[Any, Any, Mapping[str, Any]]:
    """``module.split_batch(batch)`` as ``(inputs, targets, context)``."""
    parts = module.split_batch(batch)
    if not isinstance(parts, tuple) or len(parts) not in (2, 3):
        raise TypeError(
            f"{type(module).__name__}.split_batch returned {type(parts).__name__}"
            + (f" of {len(parts)}" if isinstance(parts, tuple) else "")
            + ": return (inputs, targets) or (inputs, targets, context)"
        )
    context = parts[2] if len(parts) == 3 else {}
    if not isinstance(context, Mapping) or not all(isinstance(k, str) for k in context):
        raise TypeError(
            f"{type(module).__name__}.split_batch returned a {type(context).__name__} context: make it a "
            "dict from the names layers take in forward() to tensors, e.g. {'attention_mask': mask}"
        )
    return parts[0], parts[1], context


def example_forward_args(module: PipelineModule) -> tuple[Any, Mapping[str, Any]]:
    """``(inputs, context)`` of the module's ``example_input_array``: Lightning's convention, a tuple is the
    positional arguments of ``forward(inputs, context)``; anything else is ``inputs``. Every tensor holds
    one or more samples along its first dimension."""
    example = getattr(module, "example_input_array", None)
    args = example if isinstance(example, tuple) else (example,)
    inputs, context = (*args, {})[:2] if len(args) in (1, 2) else (None, {})
    leaves = pytree.tree_leaves((inputs, context))
    usable = isinstance(context, Mapping) and bool(leaves)
    if not usable or not all(isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] > 0 for t in leaves):
        raise ValueError(
            "to plan, the strategy profiles every layer on one micro-batch: set self.example_input_array "
            "in your module's __init__ to the inputs of one or more samples, or to (inputs, context) when "
            "layers take side inputs, or give OobleckStrategy(profile_path=..., layout=..., plan_path=...)"
        )
    return inputs, context


def as_pipeline_module(module: object) -> PipelineModule:
    """``module`` itself if it declares its layers; otherwise an error that shows how to."""
    if not isinstance(module, PipelineModule):
        raise TypeError(
            f"{type(module).__name__} cannot be cut into pipeline stages: mix PipelineModule into it and "
            f"declare the model as ordered layers, for example:\n{_MINIMAL_EXAMPLE}"
        )
    return module


def layer_source(module: PipelineModule) -> Callable[[], Sequence[nn.Module]]:
    """The module's layers as every layout builds them: ``configure_layers``, ``tied_parameters`` tied."""

    def layers() -> Sequence[nn.Module]:
        built, ties = module.configure_layers(), module.tied_parameters()
        if not ties:
            return built
        return declare_ties(resolve_layers(built), ties)

    return layers


def meta_layers(module: PipelineModule) -> list[nn.Module]:
    """The module's layers built on the meta device: the model's structure, without memory."""
    return resolve_layers(layer_source(module))
