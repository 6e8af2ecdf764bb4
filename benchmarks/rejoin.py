"""Rejoin: a node that comes back joins the running training, against restarting the job from a checkpoint.

The example GPT (``examples/gpt``, the settings of ``benchmarks/recovery.py``) trains on N CPU processes,
each its own node, on the planner's pipelines (f = 2). Rank ``--kill-rank`` is SIGKILLed at step
``--kill-at-step``; the survivors recover in place; ``--rejoin-after-s`` later the launcher starts a new
node (``replace_failed_after_s``), which joins at a step boundary. From the joiner's own records and the
run's event file:

* the joiner's time from its process start to the end of the first step it takes part in, by phase:
  start-up (imports done, Lightning set up, registered), the wait for the step boundary (pending), the
  agreement, the new generation's process groups, the state copy (layers, optimizer state and the members'
  position), and the first step;
* against restarting: Lightning DDP resumed from its last checkpoint on N processes (the node back), from
  the launch of the new processes to the end of their first step (a fresh interpreter, as a resubmitted job);
* the throughput before the failure, after it (N-1 nodes) and after the rejoin (N again), in one run.

    python benchmarks/rejoin.py [--devices 6] [--steps 80] [--kill-at-step 10] [--rejoin-after-s 1]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from recovery import Clock, failure_parser, steps_of, throughput, train
from recovery import run as run_ddp
from rich.console import Console
from rich.table import Table

from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.recovery import read_events


class JoinerClock(Clock):
    """:class:`Clock`, and in the process that joined: when it started, registered and was admitted."""

    def on_train_start(self, trainer: L.Trainer, *rest: Any) -> None:
        super().on_train_start(trainer, *rest)
        strategy = trainer.strategy
        admission = strategy.admission
        if admission is None:
            return
        event = admission.event
        record = {
            "started": process_start(),
            "registered": strategy.registered_at,
            **{f"{phase}_at": getattr(event, f"{phase}_at") for phase in ("detected", "agreed", "replanned")},
            **{f"{phase}_at": getattr(event, f"{phase}_at") for phase in ("rebuilt", "state_copied")},
            "generation": event.generation,
            "setup_done": time.time(),
        }
        (self.out / "joiner.json").write_text(json.dumps(record))


def process_start() -> float:
    """This process's start (wall clock), from ``/proc``."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return boot + ticks / 100.0


def main() -> None:
    parser = failure_parser(__doc__, steps=80)
    parser.add_argument("--rejoin-after-s", type=float, default=1.0)
    args = parser.parse_args()
    if args.train:
        args.strategy, args.resume = "pipelines", None
        train(args, JoinerClock)
        return
    n, k_step = args.devices, args.kill_at_step
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "oobleck"
        out.mkdir()
        command = [
            sys.executable,
            __file__,
            "--train",
            f"--out={out}",
            f"--devices={n}",
            f"--steps={args.steps}",
        ]
        command += [
            f"--kill-rank={args.kill_rank}",
            f"--kill-at-step={k_step}",
            f"--rejoin-after-s={args.rejoin_after_s}",
        ]
        with open(out / "run.log", "wb") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=True)
        joiner = json.loads((out / "joiner.json").read_text())
        _, recoveries = read_events(out / EVENTS_FILE)
        failure, join = recoveries[0], next(e for e in recoveries if e.added)
        steps = steps_of(out / "pipelines-steps.jsonl")
        first_joined = min(s["time"] for s in steps if s["time"] > join.resumed_at)
        killed = float((out / "killed_at").read_text())

        ddp = Path(tmp) / "ddp"
        ddp.mkdir()
        run_ddp("ddp", ddp, n, 3, (-1, -1), None)  # a checkpoint to restart from
        (ddp / "ddp-steps.jsonl").unlink()
        restart_launched = time.time()
        run_ddp("ddp", ddp, n, 5, (-1, -1), str(ddp / "ckpt" / "last.ckpt"))
        restart_first = min(s["time"] for s in steps_of(ddp / "ddp-steps.jsonl"))

    console = Console()
    table = Table(
        title=f"A new node joins {n - 1} survivors ({n} CPU processes, one per node; "
        f"it starts {args.rejoin_after_s:g} s after the failure)"
    )
    table.add_column("phase", justify="left")
    table.add_column("oobleck rejoin", justify="right")
    table.add_column("DDP restart from checkpoint, node back", justify="right")
    marks = [
        ("start-up (imports, Lightning, register)", joiner["started"], joiner["registered"]),
        ("pending: wait for a step boundary", joiner["registered"], joiner["detected_at"]),
        ("agreement", joiner["detected_at"], joiner["agreed_at"]),
        ("replan + process groups", joiner["agreed_at"], joiner["rebuilt_at"]),
        ("state copy (layers, optimizer, position)", joiner["rebuilt_at"], joiner["state_copied_at"]),
        ("to the end of its first step", joiner["state_copied_at"], first_joined),
    ]
    for name, start, end in marks:
        table.add_row(name, f"{(end - start) * 1e3:.0f} ms", "")
    table.add_row(
        "process start -> first step with the node",
        f"{first_joined - joiner['started']:.2f} s",
        f"{restart_first - restart_launched:.2f} s",
    )
    table.add_row(
        "the members' pause (admission -> first step)",
        f"{first_joined - join.detected_at:.2f} s",
        "(all restart)",
    )
    console.print(table)

    table = Table(title="Throughput (samples/s), one run")
    for column in (
        "before the failure",
        "after it (N-1 nodes)",
        "after the rejoin (N nodes)",
        "rejoin / before",
    ):
        table.add_column(column, justify="right")
    failure_first = min(s["step"] for s in steps if s["time"] > failure.resumed_at)
    join_first = min(s["step"] for s in steps if s["time"] > join.resumed_at)
    last_before_join = max(s["step"] for s in steps if s["time"] <= join.detected_at)
    before = throughput(steps, 2, k_step - 1)
    shrunk = throughput(steps, failure_first, last_before_join)
    grown = throughput(steps, join_first, args.steps)
    table.add_row(f"{before:.0f}", f"{shrunk:.0f}", f"{grown:.0f}", f"{grown / before:.2f}")
    console.print(table)
    console.print(
        f"failure at step {k_step}, detected after {failure.detected_at - killed:.2f} s; "
        f"generations {[e.generation for e in recoveries]}"
    )


if __name__ == "__main__":
    main()
