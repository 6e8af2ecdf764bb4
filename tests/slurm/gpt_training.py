"""The real training the SLURM tests run (``examples/gpt/train.py``, tiny, float64) and its reference.

``python gpt_training.py OUT`` trains the same LightningModule in one process (``strategy="auto"``) on the
same global batches, in the same order, with the same seed and optimizer, and saves its weights to
``OUT`` (``torch.save`` of the state dict): what every Oobleck run of :func:`training_args` must end with,
lost nodes or not. A subprocess, so that the example's top-level imports (``data``, ``model``) stay out of
the test process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lightning_oobleck.execution import build_reference_model

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/gpt/train.py"
STEPS = 24
CRASH_AT_STEP = 6
OVERRIDES = (
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_blocks=2",
    "model.seq_len=32",
    "data.num_chars=40000",
    "strategy.global_batch_size=24",
    "strategy.microbatch_size=4",
    "trainer.limit_val_batches=0",
    "trainer.val_check_interval=1.0",
    "trainer.enable_progress_bar=false",
)
VAL_BATCHES = 2
"""Validation batches of ``--validate`` (validation during training stays off: ``limit_val_batches=0``)."""
EVENTS_FILE = "oobleck-events.jsonl"
CHECKPOINT = "final"


def training_args(out: Path) -> list[str]:
    """``examples/gpt/train.py``'s arguments: events in ``out``, final sharded checkpoint in ``out/final``."""
    return [
        "--max-steps", str(STEPS), "--precision", "64-true", "--save", str(out / CHECKPOINT),
        *OVERRIDES, f"trainer.default_root_dir={out}",
    ]  # fmt: skip


def held_training(directory: Path, pause_s: float, prelude: str = "", held: bool = True) -> tuple[Path, Path]:
    """``examples/gpt/train.py`` behind a script of ``directory``, returned with its hold file: after every
    optimizer step the training sleeps ``pause_s`` while the hold file exists (``held``: it does from the
    start). A test that crashes a node mid-run removes it after the crash: the 24 steps of the tiny model
    take about a second, less than a loaded machine may take to see a step and crash a node. ``prelude``:
    Python that each task runs first."""
    hold, script = directory / "hold", directory / "held_training.py"
    if held:
        hold.touch()
    script.write_text(
        "import os, runpy, sys, time\n"
        "from torch.optim.optimizer import register_optimizer_step_post_hook\n"
        f"{prelude}"
        f"def idle(*_):\n    time.sleep({pause_s} if os.path.exists({str(hold)!r}) else 0.0)\n"
        "register_optimizer_step_post_hook(idle)\n"
        f"sys.argv[0] = {str(EXAMPLE)!r}\n"
        f"sys.path.insert(0, {str(EXAMPLE.parent)!r})\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
    )
    return script, hold


def events(out: Path) -> list[dict[str, Any]]:
    """The run's step and recovery records so far (rank 0 of the current generation appends them)."""
    path = out / EVENTS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def full_model() -> torch.nn.Module:
    """The example's whole model in one process, float64, to load a run's sharded checkpoint into."""
    if str(EXAMPLE.parents[1]) not in sys.path:
        sys.path.append(str(EXAMPLE.parents[1]))  # as tests/recovery does: ``gpt`` is a namespace package
    from gpt import model as gpt_model

    cfg = OmegaConf.merge(
        OmegaConf.load(EXAMPLE.with_name("config.yaml")), OmegaConf.from_dotlist(list(OVERRIDES))
    )
    config = gpt_model.GPTConfig(**OmegaConf.to_container(cfg.model))  # type: ignore[arg-type]
    # Another seed than the runs': every weight must come from the checkpoint.
    return build_reference_model(lambda: gpt_model.gpt_layers(config), torch.device("cpu"), 1, torch.float64)


def _train_reference(out: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_oobleck.lightning.data import GlobalBatchSampler

    sys.path.insert(0, str(EXAMPLE.parent))
    import train as gpt_train
    from data import CharWindows, make_corpus

    _, cfg = gpt_train.parse_args(list(OVERRIDES))
    text = make_corpus(cfg.data.num_chars, cfg.data.seed)
    windows = CharWindows(text[: int(len(text) * (1 - cfg.data.val_fraction))], cfg.model.seq_len)
    sampler = GlobalBatchSampler(len(windows), cfg.strategy.global_batch_size, seed=cfg.strategy.seed)
    model = gpt_train.GPT(OmegaConf.to_container(cfg.model), OmegaConf.to_container(cfg.optim))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(windows, batch_sampler=sampler))
    torch.save(model.state_dict(), out / "reference.pt")
    # What a run's `--validate` must report: the example's validation loader, VAL_BATCHES batches.
    _, val_loader = gpt_train.loaders(cfg)
    trainer.limit_val_batches = VAL_BATCHES
    (validated,) = trainer.validate(model, val_loader, verbose=False)
    (out / "reference-val.json").write_text(json.dumps(validated))


if __name__ == "__main__":
    _train_reference(Path(sys.argv[1]))
