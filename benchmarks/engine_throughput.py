"""Engine throughput: the engine's data-parallel layout against PyTorch DDP on real compute.

Spawns ``--processes`` workers (one thread each, gloo on CPU) that run, in the same processes and
alternating rounds so both see the same machine load, the pure data-parallel plan (every pipeline one node
holding the whole model) and ``torch.nn.parallel.DDP`` with gradient accumulation over the same
micro-batches; then the cost of the abortable wait on one point-to-point message.

Pipelined plans are timed on emulated devices instead (``benchmarks/schedules.py``): real compute in several
processes on this machine's cores measures their contention, not the schedule.

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


# ----------------------------------------------------------------------------------------------- plan
def data_parallel_plan(profile: ModelProfile, processes: int) -> Plan:
    """``processes`` single-node pipelines holding the whole model, the micro-batches split evenly."""
    template = PipelineTemplate(
        1,
        1,
        (Stage(0, profile.num_layers, 0),),
        (sum(la.forward_s + la.backward_s for la in profile.layers),),
    )
    pipelines = tuple(Pipeline(template, (node,), MICROBATCHES // processes) for node in range(processes))
    return Plan(
        num_layers=profile.num_layers,
        gpus_per_node=1,
        fault_tolerance=processes - 1,
        n0=1,
        microbatch_size=MICROBATCH,
        global_batch_size=MICROBATCH * MICROBATCHES,
        templates=(template,),
        pipelines=pipelines,
        iteration_time_s=template.iteration_time_s(MICROBATCHES // processes),
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


def worker(index: int, port: int, plan: Plan, steps: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    size = MICROBATCH * MICROBATCHES
    groups = ProcessGroups(plan, plan.workers[index], store, 0)
    engine = PipelineEngine(model, gpt_loss, groups, CPU)
    opt = torch.optim.AdamW(engine.module.parameters())
    ddp = DistributedDataParallel(build_reference_model(model, CPU))
    ddp_opt = torch.optim.AdamW(ddp.parameters())
    runs = {
        "dp": engine_step(engine, opt, size),
        "ddp": ddp_step(ddp, ddp_opt, groups.rank, groups.world_size),
    }
    result: dict[str, list[float]] = {}
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
    parser.add_argument("--processes", type=int, default=3, help="workers (nodes), dividing 12 micro-batches")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (the fastest is reported)")
    args = parser.parse_args()
    if args.processes < 2 or MICROBATCHES % args.processes:
        parser.error(f"--processes must be at least 2 and divide {MICROBATCHES}")
    torch.set_num_threads(1)
    inputs, targets = batch(0, MICROBATCH)
    profile = profile_layers(
        model, inputs, CPU, warmup=3, repeat=10, loss_fn=gpt_loss, example_target=targets
    )
    plan = data_parallel_plan(profile, args.processes)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(i, store.port, plan, args.steps, args.rounds, out), daemon=True)
        for i in range(args.processes)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    report(results, args.processes)


def report(results: dict[int, dict[str, list[float]]], processes: int) -> None:
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
    for column in ("run", "samples/s"):
        table.add_column(column)
    measured = {name: size / step_s[name] for name in ("dp", "ddp")}
    table.add_row(f"oobleck engine, {processes} single-node pipelines", f"{measured['dp']:.1f}")
    table.add_row("PyTorch DDP, same processes and micro-batches", f"{measured['ddp']:.1f}")
    table.add_row("oobleck engine / DDP", f"{measured['dp'] / measured['ddp']:.3f}")
    console.print(table)
    overhead = Table(title="Waiting for one point-to-point message (ping-pong between ranks 0 and 1)")
    overhead.add_column("wait")
    overhead.add_column("µs per message")
    for name in ("plain wait", "abortable wait"):
        overhead.add_row(name, f"{step_s[name] * 1e6:.0f}")
    console.print(overhead)


if __name__ == "__main__":
    main()
