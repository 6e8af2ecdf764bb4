"""Recovery time: in-process Oobleck recovery against restarting Lightning DDP from a checkpoint.

Both runs train the example GPT (``examples/gpt``, small settings) on the same CPU processes and lose
the same rank to a real SIGKILL at the same step:

* ``strategy="oobleck"``: the survivors recover inside the same ``Trainer.fit``; the time from the kill
  to the end of the first step after it, and the recovery's phases, come from the run's event file;
* ``strategy="ddp"`` with ``ModelCheckpoint(every_n_train_steps=1)``: Lightning's launcher stops every
  process, then a new ``python`` process resumes with ``ckpt_path=last.ckpt`` on the survivors (a fresh
  interpreter: what a requeued or resubmitted job pays); the time runs from the kill to the end of the
  first step of the resumed run.

It also reports the throughput (samples/s) after losing 1 of N nodes against (N-1)/N of the throughput
before. Each configuration runs in its own ``python`` process.

    python benchmarks/recovery.py [--devices 6] [--steps 30] [--kill-at-step 10] [--kill-rank 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from lightning_oobleck.lightning import OobleckStrategy
from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.recovery import read_events

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "gpt"
MODEL = {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_heads": 4, "n_blocks": 4}
OPTIM = {"lr": 3e-3, "weight_decay": 0.01, "warmup_steps": 5}
GLOBAL_BATCH, MICRO = 24, 2

sys.path.insert(0, str(EXAMPLES))
from data import CharWindows, make_corpus  # noqa: E402 (examples/gpt)
from train import GPT  # noqa: E402


class Clock(L.Callback):
    """Records each step's end (global rank 0) and SIGKILLs ``kill_rank`` at step ``kill_at_step``."""

    def __init__(self, out: Path, name: str, kill_rank: int, kill_at_step: int) -> None:
        self.out, self.name, self.kill_rank, self.kill_at_step = out, name, kill_rank, kill_at_step

    def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
        if trainer.global_step == self.kill_at_step and launch_rank(trainer) == self.kill_rank:
            (self.out / "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
        if trainer.is_global_zero:
            with open(self.out / f"{self.name}-steps.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "time": time.time()}) + "\n")


def launch_rank(trainer: L.Trainer) -> int:
    """The rank the process was started as (Oobleck renumbers ranks after a recovery)."""
    if isinstance(trainer.strategy, OobleckStrategy):
        node, device = trainer.strategy._environment().worker
        return node * trainer.strategy.config.devices_per_node + device
    return trainer.global_rank


def train(args: argparse.Namespace) -> None:
    """One fit (run in its own process): ``--strategy`` oobleck or ddp, optional kill and resume."""
    out = Path(args.out)
    clock = Clock(out, args.strategy, args.kill_rank, args.kill_at_step)
    text = make_corpus(200_000, 0)
    data = CharWindows(text, MODEL["seq_len"])
    if args.strategy == "oobleck":
        strategy: Any = OobleckStrategy(
            global_batch_size=GLOBAL_BATCH,
            microbatch_size=MICRO,
            fault_tolerance=2,
            start_method="forkserver",
            planner={"cluster": {"device_memory_bytes": 3.5e6}},
        )
        loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)
        callbacks: list[L.Callback] = [clock]
    else:
        strategy = DDPStrategy(start_method="fork")
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // args.devices, shuffle=True)
        callbacks = [clock, ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_last=True)]
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.strategy == "ddp",
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(GPT(MODEL, OPTIM), loader, ckpt_path=args.resume)


def run(strategy: str, out: Path, devices: int, steps: int, kill: tuple[int, int], resume: str | None) -> int:
    command = [
        sys.executable,
        __file__,
        "--train",
        f"--strategy={strategy}",
        f"--out={out}",
        f"--devices={devices}",
        f"--steps={steps}",
        f"--kill-rank={kill[0]}",
        f"--kill-at-step={kill[1]}",
        *([f"--resume={resume}"] if resume else []),
    ]
    with open(out / f"{strategy}-{'resume' if resume else 'run'}.log", "wb") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode


def steps_of(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def throughput(steps: list[dict[str, float]], first: int, last: int) -> float:
    """Samples/s over the steps ``first < step <= last`` (by their end times)."""
    times = {int(s["step"]): s["time"] for s in steps}
    return (last - first) * GLOBAL_BATCH / (times[last] - times[first])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=10)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args)
        return

    n, k_step = args.devices, args.kill_at_step
    kill = (args.kill_rank, k_step)
    with tempfile.TemporaryDirectory() as tmp:
        oob, ddp = Path(tmp) / "oobleck", Path(tmp) / "ddp"
        oob.mkdir(), ddp.mkdir()
        run("oobleck", oob, n, args.steps, kill, None)
        oob_killed = float((oob / "killed_at").read_text())
        _, recoveries = read_events(oob / EVENTS_FILE)
        oob_steps = steps_of(oob / "oobleck-steps.jsonl")
        oob_first = min(s["time"] for s in oob_steps if s["time"] > oob_killed)

        run("ddp", ddp, n, args.steps, kill, None)
        ddp_killed = float((ddp / "killed_at").read_text())
        ddp_down = time.time()  # the failed run's processes are gone when run() returns
        (ddp / "killed_at").unlink()
        run("ddp", ddp, n - 1, args.steps, (-1, -1), str(ddp / "ckpt" / "last.ckpt"))
        ddp_steps = steps_of(ddp / "ddp-steps.jsonl")
        ddp_first = min(s["time"] for s in ddp_steps if s["time"] > ddp_down)

    event = recoveries[0]
    phases = event.durations()
    console = Console()
    table = Table(
        title=f"Recovery after SIGKILL of rank {args.kill_rank} at step {k_step} ({n} CPU processes)"
    )
    table.add_column("", justify="left")
    table.add_column("oobleck (in-process)", justify="right")
    table.add_column("DDP restart from checkpoint", justify="right")
    detect = (event.detected_at or oob_killed) - oob_killed
    table.add_row("detection", f"{detect * 1e3:.0f} ms", "(launcher stops all)")
    for phase in ("agreed", "replanned", "rebuilt", "state_copied"):
        table.add_row(f"  {phase}", f"{phases.get(phase, 0.0) * 1e3:.0f} ms", "")
    table.add_row("failed run torn down", "", f"{ddp_down - ddp_killed:.2f} s")
    table.add_row(
        "kill -> first step completed after it",
        f"{oob_first - oob_killed:.2f} s",
        f"{ddp_first - ddp_killed:.2f} s",
    )
    table.add_row("speed-up", f"{(ddp_first - ddp_killed) / (oob_first - oob_killed):.1f}x", "1x")
    console.print(table)

    resumed = max(int(s["step"]) for s in oob_steps if s["time"] <= oob_first)
    before = throughput(oob_steps, 2, k_step - 1)
    after = throughput(oob_steps, resumed + 1, args.steps)
    lost = len({w[0] for w in event.removed})
    nodes = n  # one device per node
    table = Table(title=f"Throughput after losing {lost} of {nodes} nodes (oobleck)")
    for column in ("before (samples/s)", "after (samples/s)", "after / before", f"({nodes}-{lost})/{nodes}"):
        table.add_column(column, justify="right")
    table.add_row(f"{before:.0f}", f"{after:.0f}", f"{after / before:.2f}", f"{(nodes - lost) / nodes:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
