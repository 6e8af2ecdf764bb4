"""Engine throughput: a heterogeneous plan against its prediction, data parallel against PyTorch DDP.

Spawns ``--processes`` workers (one thread each, gloo on CPU) that run, in the same processes:

1. a heterogeneous plan (one single-node pipeline holding the whole model plus one pipeline of the
   remaining nodes, layers split by the measured profile, micro-batches split to balance the
   pipelines), timed against the 1F1B prediction from the profile
   (``PipelineTemplate.iteration_time_s``; compute only, no gradient sync or optimizer step);
2. the pure data-parallel plan (every pipeline one node) and ``torch.nn.parallel.DDP`` with gradient
   accumulation over the same micro-batches, alternating rounds so both see the same machine load.

    python benchmarks/engine_throughput.py [--processes 3] [--steps 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed import TCPStore
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt.model import GPTConfig, gpt_layers, gpt_loss

from lightning_oobleck.execution import (
    PipelineEngine,
    ProcessGroups,
    build_reference_model,
    profile_layers,
)
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan, Stage
from lightning_oobleck.planning.profile import ModelProfile

CONFIG = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_blocks=6)
MICROBATCH = 4
MICROBATCHES = 12
CPU = torch.device("cpu")


def model() -> list[torch.nn.Module]:
    return gpt_layers(CONFIG)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, CONFIG.vocab_size, (size, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------------------------------------- plans
def stage_times(profile: ModelProfile, bounds: list[tuple[int, int]]) -> tuple[float, ...]:
    return tuple(sum(la.forward_s + la.backward_s for la in profile.layers[a:b]) for a, b in bounds)


def template(profile: ModelProfile, nodes: int) -> PipelineTemplate:
    """The ``nodes``-stage split of the layers with the lowest slowest-stage time (exhaustive)."""
    n = profile.num_layers
    best = min(
        ([0, *cuts, n] for cuts in itertools.combinations(range(1, n), nodes - 1)),
        key=lambda edges: max(stage_times(profile, list(itertools.pairwise(edges)))),
    )
    bounds = list(itertools.pairwise(best))
    stages = tuple(Stage(a, b, node) for node, (a, b) in enumerate(bounds))
    return PipelineTemplate(nodes, 1, stages, stage_times(profile, bounds))


def make_plan(profile: ModelProfile, templates: list[PipelineTemplate]) -> Plan:
    """Instantiate ``templates`` on consecutive nodes with the micro-batch split minimising the slowest."""
    splits = (
        ms
        for ms in itertools.product(range(1, MICROBATCHES + 1), repeat=len(templates))
        if sum(ms) == MICROBATCHES
    )
    best = min(splits, key=lambda ms: max(t.iteration_time_s(m) for t, m in zip(templates, ms, strict=True)))
    starts = itertools.accumulate([0, *(t.num_nodes for t in templates)])
    pipelines = tuple(
        Pipeline(t, tuple(range(s, s + t.num_nodes)), m)
        for t, s, m in zip(templates, starts, best, strict=False)
    )
    return Plan(
        num_layers=profile.num_layers,
        gpus_per_node=1,
        fault_tolerance=len(pipelines) - 1,
        n0=1,
        microbatch_size=MICROBATCH,
        global_batch_size=MICROBATCH * MICROBATCHES,
        templates=tuple({t.num_nodes: t for t in templates}.values()),
        pipelines=pipelines,
        iteration_time_s=max(p.iteration_time_s() for p in pipelines),
    )


# --------------------------------------------------------------------------------------------- worker
def timed_steps(step: Any, steps: int) -> float:
    """Seconds per step of ``steps`` steps, all ranks started together and finished together."""
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def engine_step(engine: PipelineEngine, opt: torch.optim.Optimizer, size: int) -> Any:
    def step(i: int) -> None:
        inputs, targets = batch(i, size)
        engine.train_step(
            inputs[engine.batch_slice] if engine.is_first_stage else None,
            targets[engine.batch_slice] if engine.is_last_stage else None,
        )
        opt.step()
        opt.zero_grad()

    return step


def ddp_step(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, rank: int, world: int) -> Any:
    per_rank = MICROBATCHES // world

    def step(i: int) -> None:
        inputs, targets = batch(i, MICROBATCH * MICROBATCHES)
        share = slice(rank * per_rank * MICROBATCH, (rank + 1) * per_rank * MICROBATCH)
        for k, (x, y) in enumerate(
            zip(inputs[share].split(MICROBATCH), targets[share].split(MICROBATCH), strict=True)
        ):
            with ddp.no_sync() if k < per_rank - 1 else nullcontext():
                (gpt_loss(ddp(x), y) * (MICROBATCH / (MICROBATCH * MICROBATCHES) * world)).backward()
        opt.step()
        opt.zero_grad()

    return step


def worker(index: int, port: int, plans: dict[str, Plan], steps: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    size = MICROBATCH * MICROBATCHES
    result: dict[str, list[float]] = {}

    groups = ProcessGroups(plans["hetero"], plans["hetero"].workers[index], store, 0)
    engine = PipelineEngine(model, gpt_loss, groups, CPU)
    opt = torch.optim.AdamW(engine.module.parameters())
    timed_steps(engine_step(engine, opt, size), 1)  # warm-up
    result["hetero"] = [timed_steps(engine_step(engine, opt, size), steps) for _ in range(rounds)]
    groups.destroy()

    groups = ProcessGroups(plans["dp"], plans["dp"].workers[index], store, 1)
    engine = PipelineEngine(model, gpt_loss, groups, CPU)
    opt = torch.optim.AdamW(engine.module.parameters())
    ddp = DistributedDataParallel(build_reference_model(model, CPU))
    ddp_opt = torch.optim.AdamW(ddp.parameters())
    runs = {
        "dp": engine_step(engine, opt, size),
        "ddp": ddp_step(ddp, ddp_opt, groups.rank, groups.world_size),
    }
    for name, step in runs.items():
        timed_steps(step, 1)  # warm-up
        result[name] = []
    for _ in range(rounds):
        for name, step in runs.items():
            result[name].append(timed_steps(step, steps))
    del ddp
    result.update(waiter_overhead(groups))
    groups.destroy()
    out.put((index, result))


def waiter_overhead(groups: ProcessGroups, messages: int = 300) -> dict[str, list[float]]:
    """Seconds per ping-pong message between ranks 0 and 1: plain ``Work.wait()`` vs the abortable wait."""
    if groups.rank > 1:
        return {}
    peer, abort = 1 - groups.rank, threading.Event()
    buf = torch.zeros(MICROBATCH * CONFIG.seq_len * CONFIG.d_model)  # one activation
    waits = {
        "plain wait": lambda work: work.wait(),
        "abortable wait": lambda work: groups.waiter.wait([work], abort),
    }
    timings: dict[str, list[float]] = {}
    for name, wait in itertools.chain.from_iterable(itertools.repeat(list(waits.items()), 3)):
        start = time.perf_counter()
        for i in range(messages):
            if (i + groups.rank) % 2 == 0:
                wait(dist.isend(buf, peer))
            else:
                wait(dist.irecv(buf, peer))
        timings.setdefault(name, []).append((time.perf_counter() - start) / messages)
    return timings


# ----------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=3, help="workers (nodes), at least 3")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (the fastest is reported)")
    args = parser.parse_args()
    if args.processes < 3:
        parser.error("a heterogeneous plan needs at least 3 processes")
    torch.set_num_threads(1)
    inputs, targets = batch(0, MICROBATCH)
    profile = profile_layers(
        model, inputs, CPU, warmup=3, repeat=10, loss_fn=gpt_loss, example_target=targets
    )
    plans = {
        "hetero": make_plan(profile, [template(profile, 1), template(profile, args.processes - 1)]),
        "dp": make_plan(profile, [template(profile, 1)] * args.processes),
    }
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(i, store.port, plans, args.steps, args.rounds, out), daemon=True)
        for i in range(args.processes)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    report(plans, results, args.processes)


def report(plans: dict[str, Plan], results: dict[int, dict[str, list[float]]], processes: int) -> None:
    size = MICROBATCH * MICROBATCHES
    # every rank times the same barrier-to-barrier interval: the slowest rank of a round is its time, and
    # the best round is the one least disturbed by other load on the machine
    step_s = {
        name: min(
            max(r[name][k] for r in results.values() if name in r) for k in range(len(results[0][name]))
        )
        for name in results[0]
    }
    console = Console(width=160)
    load = os.getloadavg()[0]
    table = Table(
        title=f"Engine throughput: GPT {CONFIG}, b={MICROBATCH}, B={size}, {processes} processes, "
        f"{len(os.sched_getaffinity(0))} cores, load average {load:.1f}"
    )
    for column in ("plan", "measured samples/s", "predicted samples/s", "measured / predicted"):
        table.add_column(column)
    measured = {name: size / s for name, s in step_s.items()}
    predicted = {name: size / plans[name].iteration_time_s for name in plans}
    for name, title in (("hetero", "heterogeneous"), ("dp", "data parallel")):
        layout = " + ".join(
            f"{[(s.first_layer, s.end_layer) for s in p.stages]} x{p.microbatches}mb"
            for p in plans[name].pipelines
        )
        ratio = measured[name] / predicted[name]
        table.add_row(f"{title}: {layout}", f"{measured[name]:.1f}", f"{predicted[name]:.1f}", f"{ratio:.3f}")
    relative = (measured["hetero"] / measured["dp"]) / (predicted["hetero"] / predicted["dp"])
    table.add_row("heterogeneous relative to data parallel", "", "", f"{relative:.3f}")
    table.add_row("PyTorch DDP, same processes and micro-batches", f"{measured['ddp']:.1f}", "", "")
    table.add_row("data parallel: oobleck engine / DDP", "", "", f"{measured['dp'] / measured['ddp']:.3f}")
    console.print(table)
    overhead = Table(title="Waiting for one point-to-point message (ping-pong between ranks 0 and 1)")
    overhead.add_column("wait")
    overhead.add_column("µs per message")
    for name in ("plain wait", "abortable wait"):
        overhead.add_row(name, f"{step_s[name] * 1e6:.0f}")
    console.print(overhead)


if __name__ == "__main__":
    main()
