"""Hugging Face causal language models as pipeline layers, their blocks used as they are.

:func:`causal_lm_layers` turns a ``GPT2LMHeadModel`` or a Llama-family model (``LlamaForCausalLM``, and the
models written like it: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``) into
``[embeddings, block 0, ..., block n-1, head]``. Each block layer builds the causal mask from the
micro-batch's ``attention_mask`` and ``position_ids`` (context entries, see ``PipelineModule.split_batch``)
exactly as the model's own ``forward`` does, and a Llama block computes its rotary tables from the
positions, so nothing but the hidden states crosses a stage boundary. A tied LM head stays tied (the
strategy finds the shared parameter). Every layer initialises itself with the model's ``_init_weights``
(``reset_parameters``), so the default ``PipelineModule.init_layer`` gives the model's own initialisation.

Build the model from its config on the meta device (``configure_layers`` is called there), e.g.
``causal_lm_layers(AutoModelForCausalLM.from_config(config))``; nothing is downloaded.

Tensor parallelism: each layer's ``tensor_parallel_plan()`` is the model's own (``model.tp_plan``: Llama's
``base_model_tp_plan`` for the blocks, its vocabulary-split embedding and gathered LM head), translated to the
styles of ``torch.distributed.tensor.parallel``. A model whose config declares no plan (GPT-2: its
``Conv1D`` projections have none) gives ``None``: its stages run on one device each.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

_NO_CACHE = {
    "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None
}
"""``create_causal_mask``'s "no key-value cache" argument: ``past_key_values`` until transformers renamed it
``cache`` (5.17 has the old name, 5.24 the new)."""


_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
"""Hugging Face's tensor-parallel style names, as ``torch.distributed.tensor.parallel`` styles."""


class _ModelLayer(nn.Module):
    """A layer cut from a Hugging Face model: initialised by the model's ``_init_weights``, split by its
    tensor-parallel plan."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.__dict__["_model"] = model  # for its config and _init_weights; not a submodule

    def reset_parameters(self) -> None:
        self.apply(self._model._init_weights)

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle] | None:
        """The model's own plan (``model.tp_plan``) for this layer's submodules; ``None`` without one."""
        model = self._model
        if not getattr(model.config, "base_model_tp_plan", None):
            return None
        patterns = {re.compile(re.escape(k).replace(r"\*", r"\d+")): v for k, v in model.tp_plan.items()}
        theirs = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        plan = {}
        for name, module in self.named_modules():
            full = theirs.get(id(module))
            style = next((v for p, v in patterns.items() if full is not None and p.fullmatch(full)), None)
            if style is None:
                continue
            if style not in _STYLES:
                raise ValueError(
                    f"{type(model).__name__}'s tensor-parallel plan splits {full} as {style!r}, which "
                    f"causal_lm_layers does not translate (it knows {', '.join(_STYLES)}): plan with "
                    "tensor_parallel=1, or write the layer's plan in PipelineModule.tensor_parallel_plan"
                )
            plan[name] = _STYLES[style]()
        return plan


class Embeddings(_ModelLayer):
    """Token ids ``[b, t]`` -> hidden states ``[b, t, d]`` (adds learned positions if the model has them)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        base = model.base_model
        self.tokens: nn.Embedding = getattr(base, "wte", None) or base.embed_tokens
        self.positions: nn.Embedding | None = getattr(base, "wpe", None)
        self.dropout: nn.Module = getattr(base, "drop", nn.Identity())

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        hidden = self.tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(_positions(hidden, position_ids))
        return self.dropout(hidden)


class Block(_ModelLayer):
    """One decoder block ``[b, t, d] -> [b, t, d]``, given the micro-batch's mask and positions."""

    def __init__(self, model: PreTrainedModel, block: nn.Module) -> None:
        super().__init__(model)
        self.block = block
        rotary = getattr(model.base_model, "rotary_emb", None)
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None  # its own buffers, per layer

    def forward(
        self, hidden: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        positions = _positions(hidden, position_ids)
        mask = create_causal_mask(
            config=self._model.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=positions,
            **_NO_CACHE,
        )
        extra: dict[str, Any] = {}
        if self.rotary is not None:
            extra = {"position_ids": positions, "position_embeddings": self.rotary(hidden, positions)}
        return self.block(hidden, attention_mask=mask, **extra)


class Head(_ModelLayer):
    """Final norm and LM head: hidden states ``[b, t, d]`` -> logits ``[b, t, vocab]``."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        base = model.base_model
        self.norm: nn.Module = getattr(base, "ln_f", None) or base.norm
        self.lm_head: nn.Linear = model.get_output_embeddings()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))


def causal_lm_layers(model: PreTrainedModel) -> list[nn.Module]:
    """``model`` (GPT-2 or Llama-family causal LM) as ``[embeddings, *blocks, head]``."""
    base = model.base_model
    blocks = getattr(base, "h", None) or getattr(base, "layers", None)
    if blocks is None or model.get_output_embeddings() is None:
        raise TypeError(
            f"{type(model).__name__} is not a causal LM written like GPT2LMHeadModel or LlamaForCausalLM "
            "(decoder blocks in .h or .layers, an LM head): write its layers by hand (configure_layers)"
        )
    return [Embeddings(model), *(Block(model, block) for block in blocks), Head(model)]


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy of one micro-batch, ``-100`` labels ignored, summed and divided by the
    micro-batch's ``b * (t - 1)`` predicted positions: a normalisation that does not depend on how many
    tokens each micro-batch counts, so the pipelines' sum over micro-batches is the global batch's loss."""
    targets = labels[:, 1:].flatten()
    total = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets, ignore_index=-100, reduction="sum")
    return total / targets.numel()


def hf_parameter_names(model: PreTrainedModel, layers: list[nn.Module]) -> dict[str, str]:
    """``layers.<i>.<name>`` of :func:`causal_lm_layers` -> the parameter's name in ``model`` (to load the
    pipeline's weights into the Hugging Face model, or the reverse), module by module."""
    theirs = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    names = {}
    for i, layer in enumerate(layers):
        for prefix, module in layer.named_modules(remove_duplicate=False):
            if id(module) not in theirs:
                continue  # a copy the layer owns (a Llama block's rotary tables): no parameters
            for name, _ in module.named_parameters(recurse=False):
                ours = f"layers.{i}.{prefix}.{name}" if prefix else f"layers.{i}.{name}"
                names[ours] = f"{theirs[id(module)]}.{name}".lstrip(".")
    return names


def _positions(hidden: Tensor, position_ids: Tensor | None) -> Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
