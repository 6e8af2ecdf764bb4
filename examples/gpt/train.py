"""Train a small GPT with ``Trainer(strategy="oobleck")``: 4 local CPU processes, out of the box.

    python examples/gpt/train.py                                  # config.yaml as it is
    python examples/gpt/train.py --devices 6 --fault-tolerance 2  # 3+ pipelines over 6 processes
    python examples/gpt/train.py --max-steps 50 --precision bf16-mixed strategy.microbatch_size=2
    python examples/gpt/train.py --accelerator gpu --devices 1 --fault-tolerance 0 --precision bf16-mixed
                                                                  # one GPU (delete config.yaml's memory cap)
    python examples/gpt/train.py --devices 6 --fault-tolerance 2 --kill-rank 0 --kill-at-step 30
                                                                  # SIGKILL rank 0 at step 30: it recovers
    python examples/gpt/train.py --devices 6 --fault-tolerance 2 --kill-rank 0 --kill-at-step 30 \
        --rejoin-after-s 2                                        # ... and a new node joins 2 s later

Settings come from ``--config`` (default: ``config.yaml`` beside this file), then ``key=value`` dot-list
overrides (``trainer.max_steps=100``, ``strategy.global_batch_size=64``), then the flags.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from data import CharWindows, make_corpus
from model import GPTConfig, gpt_layers, gpt_loss
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from lightning_oobleck.lightning import OobleckStrategy, PipelineModule
from lightning_oobleck.lightning.callbacks import KillAt, PlanSummary

DEFAULT_CONFIG = Path(__file__).with_name("config.yaml")


class GPT(PipelineModule, L.LightningModule):
    """The GPT of ``model.py`` as a LightningModule: its layers, its loss, AdamW with warm-up."""

    def __init__(self, model: dict[str, Any], optim: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(**model)
        # One sample of inputs: the strategy profiles each layer with a micro-batch of these before planning.
        self.example_input_array = torch.zeros(1, self.config.seq_len, dtype=torch.long)

    def configure_layers(self) -> list[nn.Module]:
        return gpt_layers(self.config)

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return gpt_loss(output, target)

    def configure_optimizers(self) -> Any:
        optim = self.hparams["optim"]
        optimizer = torch.optim.AdamW(self.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
        warmup = max(1, optim["warmup_steps"])
        total = max(warmup + 1, self.trainer.max_steps)

        def schedule(step: int) -> float:  # linear warm-up, then cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SaveAtEnd(L.Callback):
    """Save a sharded checkpoint when training ends, while the strategy's process groups still exist."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)  # collective: every rank writes its layers' shards


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, DictConfig]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="YAML file (default: %(default)s)"
    )
    parser.add_argument("--accelerator", help="cpu (the default here: 4 processes on one machine) or gpu")
    parser.add_argument("--devices", type=int, help="local processes (trainer.devices)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (trainer.max_steps)")
    parser.add_argument("--precision", help="32-true, 64-true or bf16-mixed (trainer.precision)")
    parser.add_argument(
        "--fault-tolerance", type=int, help="node failures to survive (strategy.fault_tolerance)"
    )
    parser.add_argument("--kill-rank", type=int, help="make this rank fail during training (a demo)")
    parser.add_argument("--kill-at-step", type=int, default=10, help="when --kill-rank fires")
    parser.add_argument(
        "--kill-by",
        choices=["sigkill", "exception"],
        default="sigkill",
        help="how --kill-rank fails: a SIGKILL (a crash) or an exception (a bug, out of memory)",
    )
    parser.add_argument(
        "--rejoin-after-s",
        type=float,
        help="start a new node this long after a node died: it joins (strategy.replace_failed_after_s)",
    )
    parser.add_argument(
        "--save", type=Path, help="after training, save a sharded checkpoint to this directory (all ranks)"
    )
    parser.add_argument(
        "--validate",
        type=Path,
        help="after training, validate in the same processes and write the metrics (JSON) to this file",
    )
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. strategy.microbatch_size=2")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))
    flags = {
        "trainer.accelerator": args.accelerator,
        "trainer.devices": args.devices,
        "trainer.max_steps": args.max_steps,
        "trainer.precision": args.precision,
        "strategy.fault_tolerance": args.fault_tolerance,
        "strategy.replace_failed_after_s": args.rejoin_after_s,
    }
    for key, value in flags.items():
        if value is not None:
            OmegaConf.update(cfg, key, value)
    assert isinstance(cfg, DictConfig)
    return args, cfg


def loaders(cfg: DictConfig) -> tuple[DataLoader, DataLoader]:
    text = make_corpus(cfg.data.num_chars, cfg.data.seed)
    split = int(len(text) * (1 - cfg.data.val_fraction))
    batch = cfg.strategy.global_batch_size
    train = CharWindows(text[:split], cfg.model.seq_len)
    val = CharWindows(text[split:], cfg.model.seq_len)
    workers = cfg.data.get("num_workers", 0)
    return (
        DataLoader(train, batch_size=batch, shuffle=True, num_workers=workers),
        DataLoader(val, batch_size=batch, num_workers=workers),
    )


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    callbacks: list[L.Callback] = [PlanSummary()]
    if args.kill_rank is not None:
        callbacks.append(KillAt(args.kill_rank, args.kill_at_step, args.kill_by))
    if args.save is not None:
        callbacks.append(SaveAtEnd(args.save))
    trainer_cfg = OmegaConf.to_container(cfg.trainer)
    assert isinstance(trainer_cfg, dict)
    model = GPT(
        OmegaConf.to_container(cfg.model),  # type: ignore[arg-type]
        OmegaConf.to_container(cfg.optim),  # type: ignore[arg-type]
    )
    trainer = L.Trainer(
        strategy=OobleckStrategy.from_config(cfg.strategy),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **trainer_cfg,
    )
    train_loader, val_loader = loaders(cfg)
    trainer.fit(model, train_loader, val_loader)
    metrics = {k: f"{float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items())}
    if trainer.is_global_zero:
        Console().print(f"done: {trainer.global_step} steps, {metrics}")
    if args.validate is not None:  # a second entry point in the same processes (under SLURM: the same tasks)
        (validated,) = trainer.validate(model, val_loader, verbose=False)
        if trainer.is_global_zero:
            args.validate.write_text(json.dumps(validated))


if __name__ == "__main__":
    main()
