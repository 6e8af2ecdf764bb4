"""A small nanoGPT-style language model, written as an ordered list of layers.

``gpt_layers(config)`` returns ``[Embedding, Block, ..., Block, Head]``: each layer takes one tensor and
returns one tensor, which is all the pipeline engine needs to cut the model into stages. The head has
its own weight (no tying with the embedding), so every layer can live on a different worker.

Each layer declares how it splits over the devices of a stage (``tensor_parallel_plan``, Megatron-LM's
split): the embedding by vocabulary, a block's QKV and first MLP products by columns (whole heads per device:
the QKV rows are laid out head by head) and their output products by rows, the head's logits by vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_blocks: int = 4
    mlp_ratio: int = 4


class Embedding(nn.Module):
    """Token ids ``[batch, seq]`` to token + position embeddings ``[batch, seq, d_model]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Embedding(config.seq_len, config.d_model)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return {
            "tokens": RowwiseParallel(input_layouts=Replicate())
        }  # each device its part of the vocabulary


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.d_model // config.n_heads
        self.ln1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.out = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def attention(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # rows of qkv head by head (q, k, v of head 0, then of head 1...): a device holding some rows holds
        # whole heads, so the same code runs split over a stage's devices (fewer heads each)
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return {
            "qkv": ColwiseParallel(),
            "proj": RowwiseParallel(),
            "fc": ColwiseParallel(),
            "out": RowwiseParallel(),
        }

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final layer norm and the language-model head: ``[batch, seq, d_model]`` to logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln(x))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return {"lm_head": ColwiseParallel(output_layouts=Replicate())}  # logits gathered for the loss


def gpt_layers(config: GPTConfig) -> list[nn.Module]:
    """The model as pipeline layers: embedding, ``n_blocks`` blocks, head."""
    return [Embedding(config), *(Block(config) for _ in range(config.n_blocks)), Head(config)]


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy over every position of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
