"""Recovery time: in-process Oobleck recovery against restarting Lightning DDP from a checkpoint.

Both runs train the example GPT (``examples/gpt``, small settings) on the same CPU processes and lose
the same rank to a real SIGKILL at the same step:

* ``strategy="oobleck"``, three times: on the planner's pipelines (a failure copies layers to the nodes that
  take over), on the same pipelines with ``recovery_policy="reroute"`` (the damaged pipeline keeps its
  surviving stages, the lost stage's micro-batches run on the other pipelines' replicas: nothing to copy,
  slower steps after it) and on pure data parallelism (every worker holds the whole model: nothing to
  copy). The survivors recover inside the same ``Trainer.fit``; the time from the kill
  to the end of the first step after it, and the recovery's phases, come from the run's event file;
* ``strategy="ddp"`` with ``ModelCheckpoint(every_n_train_steps=1)``: Lightning's launcher stops every
  process, then a new ``python`` process resumes with ``ckpt_path=last.ckpt`` on the survivors (a fresh
  interpreter: what a requeued or resubmitted job pays); the time runs from the kill to the end of the
  first step of the resumed run.

It also reports the throughput (samples/s) after losing 1 of N nodes against (N-1)/N of the throughput
before, and how much state the recovery copied and how fast. Each configuration runs in its own ``python``
process. ``--d-model``/``--blocks``/``--seq-len`` size the GPT (the tiny default copies a few MB); a model
whose lost stage holds GBs runs the pipelines alone (``--layouts pipelines --no-ddp``: every data-parallel
or DDP worker would hold the whole model).

    python benchmarks/recovery.py [--devices 6] [--steps 30] [--kill-at-step 10] [--kill-rank 1]
    python benchmarks/recovery.py --d-model 1536 --blocks 8 --seq-len 8 --layouts pipelines --no-ddp \
        --steps 8 --kill-at-step 4
"""

from __future__ import annotations

import argparse
import json
import math
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
from lightning_oobleck.recovery import PHASES, read_events
from lightning_oobleck.recovery.agent import known_coordinators
from lightning_oobleck.testing import Fault, FaultPoint, FaultTarget, arm

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "gpt"
MODEL = {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_heads": 4, "n_blocks": 4}
OPTIM = {"lr": 3e-3, "weight_decay": 0.01, "warmup_steps": 5}
GLOBAL_BATCH, MICRO = 24, 2
LAYOUTS = ("pipelines", "rerouted", "data-parallel")
"""The oobleck runs: the planner's pipelines (re-instantiated after the failure), the same pipelines with
``recovery_policy="reroute"`` (nothing copied), and pure data parallelism."""

sys.path.insert(0, str(EXAMPLES))
from data import CharWindows, make_corpus  # noqa: E402 (examples/gpt)
from train import GPT  # noqa: E402


class Clock(L.Callback):
    """Records each step's end (global rank 0) and SIGKILLs ``kill_rank`` at step ``kill_at_step``."""

    def __init__(self, out: Path, name: str, kill_rank: int, kill_at_step: int) -> None:
        self.out, self.name, self.kill_rank, self.kill_at_step = out, name, kill_rank, kill_at_step

    def on_train_start(self, trainer: L.Trainer, *rest: Any) -> None:
        if trainer.is_global_zero and isinstance(trainer.strategy, OobleckStrategy):
            stages = [len(p.template.stages) for p in trainer.strategy.plan.pipelines]
            (self.out / "stages").write_text(json.dumps(stages))

    def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
        if trainer.global_step == self.kill_at_step and launch_rank(trainer) == self.kill_rank:
            (self.out / "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
        if trainer.is_global_zero:
            with open(self.out / f"{self.name}-steps.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "time": time.time()}) + "\n")


class CoordinatorClock(Clock):
    """A :class:`Clock` that loses the coordinator's node at ``kill_at_step``: the job's coordinator (which
    the local launcher counts as node 0's, as SLURM's batch host is) at the step's start, then the worker of
    ``kill_rank`` (node 0's) in its first forward, both through the package's fault points. Waits first for
    the coordinator's standby (started within about a second of the start)."""

    def on_train_start(self, trainer: L.Trainer, *rest: Any) -> None:
        super().on_train_start(trainer, *rest)
        if launch_rank(trainer) == self.kill_rank:
            step = self.kill_at_step
            arm(Fault(FaultPoint.STEP, step=step, target=FaultTarget.COORDINATOR), report=self._killed)
            arm(Fault(FaultPoint.FORWARD, step=step))

    def _killed(self, fault: Fault) -> None:
        (self.out / "killed_at").write_text(str(time.time()))

    def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
        deadline = time.monotonic() + 30
        while trainer.global_step == self.kill_at_step and len(known_coordinators()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("no standby coordinator followed the job's coordinator within 30 s")
            time.sleep(0.05)


def launch_rank(trainer: L.Trainer) -> int:
    """The rank the process was started as (Oobleck renumbers ranks after a recovery)."""
    if isinstance(trainer.strategy, OobleckStrategy):
        node, device = trainer.strategy.worker
        return node * trainer.strategy.config.devices_per_node + device
    return trainer.global_rank


def train(args: argparse.Namespace, clock_type: type[Clock] = Clock) -> None:
    """One fit in its own process: ``--strategy`` one of ``LAYOUTS`` or ddp, optional kill and resume;
    ``args.rejoin_after_s``, if there: a new node replaces the dead one that long after its death."""
    out = Path(args.out)
    if getattr(args, "kill_coordinator", False):
        clock_type = CoordinatorClock
    clock = clock_type(out, args.strategy, args.kill_rank, args.kill_at_step)
    model = model_of(args)
    text = make_corpus(200_000, 0)
    data = CharWindows(text, model["seq_len"])
    if args.strategy in LAYOUTS:
        # "pipelines": the planner's layout when a device holds only part of the model (3.5 MB for the
        # default GPT, in proportion for others); "data-parallel": when a device holds the whole model, the
        # planner makes one-stage pipelines: nothing to copy.
        split = args.strategy != "data-parallel"
        memory = 3.5e6 * parameters(model) / parameters(MODEL) if split else 1e12
        strategy: Any = OobleckStrategy(
            global_batch_size=GLOBAL_BATCH,
            microbatch_size=MICRO,
            fault_tolerance=2,
            start_method="forkserver",
            replace_failed_after_s=getattr(args, "rejoin_after_s", None),
            planner={"cluster": {"device_memory_bytes": memory}},
            recovery_policy="reroute" if args.strategy == "rerouted" else "reinstantiate",
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
    trainer.fit(GPT(model, OPTIM), loader, ckpt_path=args.resume)


def model_of(args: argparse.Namespace) -> dict[str, int]:
    """The GPT's size: :data:`MODEL` with the command line's ``--d-model``, ``--blocks``, ``--seq-len``."""
    return {**MODEL, "d_model": args.d_model, "n_blocks": args.blocks, "seq_len": args.seq_len}


def parameters(model: dict[str, int]) -> int:
    with torch.device("meta"):
        return sum(p.numel() for layer in GPT(model, OPTIM).configure_layers() for p in layer.parameters())


def run(
    args: argparse.Namespace,
    strategy: str,
    out: Path,
    devices: int,
    kill: tuple[int, int],
    resume: str | None,
    coordinator: bool = False,
) -> int:
    command = [
        sys.executable,
        __file__,
        "--train",
        f"--strategy={strategy}",
        f"--out={out}",
        f"--devices={devices}",
        f"--steps={args.steps}",
        f"--d-model={args.d_model}",
        f"--blocks={args.blocks}",
        f"--seq-len={args.seq_len}",
        f"--kill-rank={kill[0]}",
        f"--kill-at-step={kill[1]}",
        *([f"--resume={resume}"] if resume else []),
        *(["--kill-coordinator"] if coordinator else []),
    ]
    with open(out / f"{strategy}-{'resume' if resume else 'run'}.log", "wb") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode


def steps_of(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def throughput(steps: list[dict[str, float]], first: int, last: int) -> float:
    """Samples/s over the steps ``first < step <= last`` (by their end times)."""
    times = {int(s["step"]): s["time"] for s in steps}
    return (last - first) * GLOBAL_BATCH / (times[last] - times[first])


def failure_parser(doc: str | None, steps: int) -> argparse.ArgumentParser:
    """The options of a benchmark that kills a rank (and of its ``--train`` child processes)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=6)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=10)
    parser.add_argument("--d-model", type=int, default=MODEL["d_model"], help="the GPT's width")
    parser.add_argument("--blocks", type=int, default=MODEL["n_blocks"], help="the GPT's transformer blocks")
    parser.add_argument("--seq-len", type=int, default=MODEL["seq_len"], help="tokens per sample")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = failure_parser(__doc__, steps=30)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP restart baseline")
    parser.add_argument(
        "--no-coordinator",
        action="store_true",
        help="skip the loss of the coordinator's node (two more runs)",
    )
    parser.add_argument("--kill-coordinator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args)
        return
    if not args.no_coordinator:
        coordinator_table(args)

    n, k_step = args.devices, args.kill_at_step
    kill = (args.kill_rank, k_step)
    oobleck: dict[str, dict[str, Any]] = {}
    ddp_total: float | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            out = Path(tmp) / layout
            out.mkdir()
            run(args, layout, out, n, kill, None)
            killed = float((out / "killed_at").read_text())
            _, recoveries = read_events(out / EVENTS_FILE)
            steps = steps_of(out / f"{layout}-steps.jsonl")
            # rank 0 may record the end of the step before the kill after the victim started the next one
            first = min(s["time"] for s in steps if s["step"] > k_step)
            oobleck[layout] = {"killed": killed, "event": recoveries[0], "steps": steps, "first": first}

        if not args.no_ddp:
            ddp = Path(tmp) / "ddp"
            ddp.mkdir()
            run(args, "ddp", ddp, n, kill, None)
            ddp_killed = float((ddp / "killed_at").read_text())
            ddp_down = time.time()  # the failed run's processes are gone when run() returns
            (ddp / "killed_at").unlink()
            run(args, "ddp", ddp, n - 1, (-1, -1), str(ddp / "ckpt" / "last.ckpt"))
            ddp_steps = steps_of(ddp / "ddp-steps.jsonl")
            ddp_total = min(s["time"] for s in ddp_steps if s["time"] > ddp_down) - ddp_killed
            ddp_teardown = ddp_down - ddp_killed

    console = Console()
    table = Table(
        title=f"Recovery after SIGKILL of rank {args.kill_rank} at step {k_step} ({n} CPU processes)"
    )
    table.add_column("", justify="left")
    for layout in oobleck:
        table.add_column(f"oobleck, {layout}", justify="right")
    if ddp_total is not None:
        table.add_column("DDP restart from checkpoint", justify="right")
    rows: dict[str, list[str]] = {"detection": [], **{f"  {p}": [] for p in PHASES[1:-1]}}
    rows["  state copied (GB, GB/s)"] = []
    rows["kill -> training resumed"] = []
    rows.update({"failed run torn down": [], "kill -> first step completed after it": [], "speed-up": []})
    for run_ in oobleck.values():
        event, killed = run_["event"], run_["killed"]
        phases = event.durations()
        rows["detection"].append(f"{((event.detected_at or killed) - killed) * 1e3:.0f} ms")
        for phase in PHASES[1:-1]:
            rows[f"  {phase}"].append(f"{phases.get(phase, 0.0) * 1e3:.0f} ms")
        speed = event.copy_gb_per_s()
        rows["  state copied (GB, GB/s)"].append(
            f"{event.copied_bytes / 1e9:.3f}" + (f", {speed:.2f}" if speed is not None else "")
        )
        total = run_["first"] - killed
        rows["kill -> training resumed"].append(f"{(event.resumed_at or killed) - killed:.2f} s")
        rows["failed run torn down"].append("")
        rows["kill -> first step completed after it"].append(f"{total:.2f} s")
        rows["speed-up"].append(f"{ddp_total / total:.1f}x" if ddp_total is not None else "")
    if ddp_total is not None:
        rows["failed run torn down"].append(f"{ddp_teardown:.2f} s")
        rows["detection"].append("(launcher stops all)")
        rows["kill -> first step completed after it"].append(f"{ddp_total:.2f} s")
        rows["speed-up"].append("1x")
    for name, cells in rows.items():
        if any(cells):
            table.add_row(name, *(cells + [""] * (len(table.columns) - 1 - len(cells))))
    console.print(table)

    table = Table(title=f"Throughput after losing 1 of {n} nodes (oobleck)")
    table.add_column("layout")
    for column in ("before (samples/s)", "after (samples/s)", "after / before", f"({n}-1)/{n}"):
        table.add_column(column, justify="right")
    for layout, run_ in oobleck.items():
        steps = run_["steps"]
        resumed = max(int(s["step"]) for s in steps if s["time"] <= run_["first"])
        before = throughput(steps, 2, k_step - 1)
        after = throughput(steps, resumed + 1, args.steps)
        table.add_row(layout, f"{before:.0f}", f"{after:.0f}", f"{after / before:.2f}", f"{(n - 1) / n:.2f}")
    console.print(table)


def coordinator_table(args: argparse.Namespace) -> None:
    """Node 0 lost at the same step, twice, on the planner's pipelines: as a worker node, and as the
    coordinator's node (the coordinator's process killed with it): the second costs the standby's takeover
    and the wait for node 0's workers to reconnect, which they do not."""
    k_step = args.kill_at_step
    totals: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, coordinator in (("a worker node", False), ("the coordinator's node", True)):
            out = Path(tmp) / name.replace(" ", "-").replace("'", "")
            out.mkdir()
            run(args, "pipelines", out, args.devices, (0, k_step), None, coordinator=coordinator)
            killed = float((out / "killed_at").read_text())
            steps = steps_of(out / "pipelines-steps.jsonl")
            records = [json.loads(line) for line in (out / EVENTS_FILE).read_text().splitlines()]
            (recovery,) = [r for r in records if r["kind"] == "recovery"]
            failovers = [r for r in records if r["kind"] == "failover"]
            totals[name] = {
                "failover": failovers[0]["took_over_at"] - killed if failovers else math.nan,
                "detected": recovery["detected_at"] - killed,
                "recovered": recovery["durations"].get("total", math.nan),
                "first": min(s["time"] for s in steps if s["step"] > k_step) - killed,
            }
    title = (
        f"Losing node 0 at step {k_step}: a worker node, or the coordinator's ({args.devices} CPU processes)"
    )
    table = Table(title=title)
    table.add_column("")
    for name in totals:
        table.add_column(name, justify="right")
    rows = (
        ("standby took over", "failover"),
        ("node 0's loss detected", "detected"),
        ("  recovered (agreement to resume)", "recovered"),
        ("kill -> first step completed after it", "first"),
    )
    for label, key in rows:
        table.add_row(label, *["" if math.isnan(v[key]) else f"{v[key]:.3f} s" for v in totals.values()])
    worker, coordinator = (v["first"] for v in totals.values())
    table.add_row("ratio", "1x", f"{coordinator / worker:.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
