"""What structured activations and side inputs cost against plain tensors, on a pipeline of emulated devices.

``--stages`` processes (gloo on CPU, one thread each) run one pipeline of ``--stages`` stages, 2 layers each,
through the engine's 1F1B step. Each layer sleeps ``--layer-ms`` (an emulated device: real compute in many
processes on 2 cores would measure contention) and then does a light tensor operation. Three models of
the same shape, timed in alternating rounds in the same processes:

* ``plain``: layers pass one tensor ``[b, t, d]``;
* ``pytree``: layers pass ``{"hidden": [b, t, d], "mask": bool [b, t], "ids": int [b, t]}``;
* ``context``: layers pass one tensor and take ``attention_mask`` and ``position_ids`` from the context.

With ``--layer-ms 0`` the step is all transfers and bookkeeping. ``--kinds plain`` times the plain path
alone, which also runs on the engine from before structured activations (2d6c51c), for a comparison in
alternating runs:

    python benchmarks/structured_activations.py [--stages 4] [--layer-ms 2] [--steps 5] [--rounds 5]
    git worktree add /tmp/before 2d6c51c
    PYTHONPATH=/tmp/before python benchmarks/structured_activations.py --kinds plain
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn
from torch.distributed import TCPStore

from lightning_oobleck.execution import PipelineEngine, ProcessGroups
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan, Stage

MICRO, MICROBATCHES, LENGTH, WIDTH = 4, 8, 128, 256
CPU = torch.device("cpu")
KINDS = ("plain", "pytree", "context")


class Emulated(nn.Module):
    """Sleeps ``seconds`` (the device's compute), then a light affine map of the hidden states."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)

    def hidden(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x * self.scale


class Plain(Emulated):
    def forward(self, x: Tensor) -> Tensor:
        return self.hidden(x)


class Tree(Emulated):
    def forward(self, x: Tensor | dict[str, Tensor]) -> dict[str, Tensor]:
        if isinstance(x, Tensor):  # the first layer makes the pytree
            x = {"hidden": x, "mask": x[..., 0] > 0, "ids": torch.arange(x.shape[1]).expand(x.shape[:2])}
        return {**x, "hidden": self.hidden(x["hidden"])}


class Context(Emulated):
    def forward(self, x: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        return self.hidden(x) + (attention_mask * position_ids).unsqueeze(-1) * 0


def model(kind: str, layers: int, seconds: float) -> list[nn.Module]:
    cls = dict(zip(KINDS, (Plain, Tree, Context), strict=True))[kind]
    return [cls(seconds) for _ in range(layers)]


def loss(output: Any, target: Tensor) -> Tensor:
    hidden = output["hidden"] if isinstance(output, dict) else output
    return (hidden - target).square().mean()


def plan(stages: int) -> Plan:
    layout = tuple(Stage(2 * s, 2 * s + 2, s) for s in range(stages))
    template = PipelineTemplate(stages, 1, layout, (0.0,) * stages)
    return Plan(
        num_layers=2 * stages,
        gpus_per_node=1,
        fault_tolerance=0,
        n0=stages,
        microbatch_size=MICRO,
        global_batch_size=MICRO * MICROBATCHES,
        templates=(template,),
        pipelines=(Pipeline(template, tuple(range(stages)), MICROBATCHES),),
    )


def worker(
    index: int, port: int, stages: int, seconds: float, steps: int, rounds: int, kinds: list[str], out: Any
) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    the_plan = plan(stages)
    groups = ProcessGroups(the_plan, the_plan.workers[index], store, 0)
    size = MICRO * MICROBATCHES
    inputs, targets = torch.randn(size, LENGTH, WIDTH), torch.randn(size, LENGTH, WIDTH)
    context = {
        "attention_mask": torch.ones(size, LENGTH, dtype=torch.long),
        "position_ids": torch.arange(LENGTH).expand(size, LENGTH).clone(),
    }
    runs = {}
    for kind in kinds:
        engine = PipelineEngine(lambda kind=kind: model(kind, 2 * stages, seconds), loss, groups, CPU)
        side = context if kind == "context" else None
        runs[kind] = lambda engine=engine, side=side: engine.train_step(
            inputs, targets, *([side] if side else [])
        )
    timings: dict[str, list[float]] = {kind: [] for kind in runs}
    for step in runs.values():
        step()  # warm-up
    for _ in range(rounds):
        for kind, step in runs.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            timings[kind].append((time.perf_counter() - start) / steps)
    groups.destroy()
    out.put((index, timings))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--layer-ms", type=float, nargs="+", default=[2.0, 0.0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=["plain", "pytree", "context"], choices=KINDS)
    args = parser.parse_args()
    table = Table(
        title=f"1 pipeline of {args.stages} emulated stages, {MICROBATCHES} micro-batches of "
        f"[{MICRO}, {LENGTH}, {WIDTH}] float32: median step time over {args.rounds} rounds"
    )
    for name in ("layer ms", "activations", "step ms", "vs plain", "per micro-batch vs plain (us)"):
        table.add_column(name, justify="right")
    ctx = mp.get_context("spawn")
    for layer_ms in args.layer_ms:
        store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
        )
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=worker,
                args=(i, store.port, args.stages, layer_ms / 1e3, args.steps, args.rounds, args.kinds, out),
            )
            for i in range(args.stages)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
        step = {kind: statistics.median(results[0][kind]) for kind in args.kinds}
        for kind, seconds in step.items():
            extra = (seconds - step["plain"]) / MICROBATCHES * 1e6
            table.add_row(
                f"{layer_ms:g}",
                kind,
                f"{seconds * 1e3:.1f}",
                f"{seconds / step['plain']:.3f}",
                "-" if kind == "plain" else f"{extra:+.0f}",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
