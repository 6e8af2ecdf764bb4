"""Train a Hugging Face GPT-2 (tied embeddings) or Llama (rotary positions) with ``strategy="oobleck"``.

    pip install 'lightning-oobleck[hf]'
    python examples/hf/train.py --model gpt2                          # 4 local CPU processes
    python examples/hf/train.py --model llama --kill-rank 0 --kill-at-step 6   # SIGKILL rank 0: it recovers
    python examples/hf/train.py --model llama --blocks 1 --devices-per-node 2 --tensor-parallel auto \
        --device-memory-mb 1.6 --kill-rank 1 --kill-at-step 6   # a block too large for a device: split

The model is built from its config (nothing is downloaded) and cut into ``[embeddings, blocks..., head]``
by ``causal_lm_layers``: the blocks are the ``transformers`` modules themselves, initialised by the model's
own ``_init_weights``. Batches are dicts, left-padded: ``attention_mask`` and ``position_ids`` reach every
block from the data on its own stage, and padded positions are not counted in the loss (label -100).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from rich.console import Console
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig

from lightning_oobleck.lightning import OobleckStrategy, PipelineModule
from lightning_oobleck.lightning.callbacks import KillAt, PlanSummary
from lightning_oobleck.models.huggingface import causal_lm_layers, causal_lm_loss

VOCAB, SEQ = 64, 32


def model_config(name: str, layers: int = 4, width: int = 64) -> PretrainedConfig:
    """A small GPT-2 (tied LM head, learned positions) or Llama (rotary, grouped-query attention)."""
    if name == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


class CausalLM(PipelineModule, L.LightningModule):
    """Any Hugging Face causal LM config, trained as pipeline stages."""

    def __init__(self, config: PretrainedConfig, lr: float = 3e-3) -> None:
        super().__init__()
        self.config, self.lr = config, lr
        ids = torch.zeros(1, SEQ, dtype=torch.long)  # one sample, to profile the layers before planning
        self.example_input_array = (ids, {"attention_mask": torch.ones_like(ids), "position_ids": ids})

    def configure_layers(self) -> list[nn.Module]:
        return causal_lm_layers(AutoModelForCausalLM.from_config(self.config))

    def split_batch(self, batch: dict[str, Tensor]) -> tuple[Any, ...]:
        context = {"attention_mask": batch["attention_mask"], "position_ids": batch["position_ids"]}
        return batch["input_ids"], batch["labels"], context

    def compute_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return causal_lm_loss(logits, labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class Counting(Dataset):
    """Left-padded sequences that count up by a per-sample stride (mod the vocabulary): learnable, and of
    varying length, so masks and positions matter."""

    def __init__(self, samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(SEQ // 2, SEQ + 1, (samples,), generator=g)
        self.starts = torch.randint(1, VOCAB, (samples,), generator=g)
        self.strides = torch.randint(1, 4, (samples,), generator=g)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        pad = SEQ - int(self.lengths[i])
        tokens = 1 + (self.starts[i] + self.strides[i] * torch.arange(SEQ)) % (VOCAB - 1)
        mask = (torch.arange(SEQ) >= pad).long()
        return {
            "input_ids": tokens * mask,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(0) - 1).clamp(min=0),
            "labels": torch.where(mask.bool(), tokens, -100),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--blocks", type=int, default=4, help="decoder layers")
    parser.add_argument("--devices", type=int, default=4, help="local processes")
    parser.add_argument("--devices-per-node", type=int, default=1, help="processes a node loses together")
    parser.add_argument(
        "--tensor-parallel",
        default="1",
        help="devices of a node each stage runs on (its layers split by the model's own plan), or auto",
    )
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--fault-tolerance", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument(
        "--device-memory-mb",
        type=float,
        help="pretend each process is a device with this much memory, so the planner must cut the model "
        "into 2-stage pipelines (default: 4 for gpt2, 3 for llama; on real devices: 0, their own memory)",
    )
    parser.add_argument("--kill-rank", type=int, help="make this rank fail during training (a drill)")
    parser.add_argument("--kill-at-step", type=int, default=10, help="when --kill-rank fires")
    parser.add_argument(
        "--kill-by",
        choices=["sigkill", "exception"],
        default="sigkill",
        help="how --kill-rank fails: a SIGKILL (a crash) or an exception (a bug, out of memory)",
    )
    args = parser.parse_args(argv)
    memory_mb = (
        {"gpt2": 4.0, "llama": 3.0}[args.model] if args.device_memory_mb is None else args.device_memory_mb
    )

    strategy = OobleckStrategy(
        devices_per_node=args.devices_per_node,
        tensor_parallel="auto" if args.tensor_parallel == "auto" else int(args.tensor_parallel),
        fault_tolerance=args.fault_tolerance,
        global_batch_size=args.global_batch,
        microbatch_size=args.microbatch,
        planner={"cluster": {"device_memory_bytes": memory_mb * 1e6}} if memory_mb else {},
    )
    callbacks: list[L.Callback] = [PlanSummary()]
    if args.kill_rank is not None:
        callbacks.append(KillAt(args.kill_rank, args.kill_at_step, args.kill_by))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=5,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    train = DataLoader(Counting(512, seed=1), batch_size=args.global_batch, shuffle=True)
    val = DataLoader(Counting(64, seed=2), batch_size=args.global_batch)
    trainer.fit(CausalLM(model_config(args.model, args.blocks)), train, val)
    metrics = {k: f"{float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items())}
    if trainer.is_global_zero:
        Console().print(f"done: {trainer.global_step} steps, {metrics}")


if __name__ == "__main__":
    main()
