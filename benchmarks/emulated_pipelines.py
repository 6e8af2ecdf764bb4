"""Measured 1F1B iteration time on emulated devices against the cost model's prediction.

Each layout runs in its own set of worker processes (gloo on CPU, one thread each) whose layers are
:class:`~lightning_oobleck.testing.EmulatedLayer`: every layer's forward, input gradient and weight gradient
sleep ``--layer-ms`` (``F = I = W``), so a process behaves like a device with known compute times however
few cores the machine has. The engine's training step (1F1B and the gradient sync) is timed, and compared
with the cost model (:class:`~lightning_oobleck.planning.cost.CostModel`) on the matching profile
(:func:`~lightning_oobleck.testing.emulated_profile`): the closed form ``sum_s t_s + (m - 1) max_s t_s`` per
pipeline, the slowest pipeline's; once with the cluster's default link latency, once with the latency of
a gloo transfer between two of these processes, measured first (ping-pong of one micro-batch's activation).

    python benchmarks/emulated_pipelines.py [--layer-ms 5] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import Tensor
from torch.distributed import TCPStore

from lightning_oobleck.execution import PipelineEngine, ProcessGroups
from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.lightning.plan_agreement import layout_plan
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.testing import DeviceTimes, emulated_layers, emulated_profile

LAYERS, WIDTH, MICRO = 8, 16, 2
LAYOUTS = {
    # name: (stage boundaries per pipeline, micro-batches per pipeline)
    "1 pipeline, 4 stages": ([[0, 2, 4, 6, 8]], [8]),
    "1 pipeline, 8 stages": ([list(range(9))], [8]),
    "pipelines of 3 and 5 stages": ([[0, 3, 6, 8], [0, 2, 4, 6, 7, 8]], [6, 10]),
}


def make_plan(layout: list[list[int]], microbatches: list[int]) -> Plan:
    config = OobleckConfig(
        global_batch_size=MICRO * sum(microbatches),
        microbatch_size=MICRO,
        fault_tolerance=len(layout) - 1,
        devices_per_node=1,
        layout=layout,
        microbatches=microbatches,
    )
    return layout_plan(config, LAYERS, sum(len(bounds) - 1 for bounds in layout))


def predicted_s(plan: Plan, times: DeviceTimes, latency_s: float | None = None) -> float:
    """The cost model's iteration time; ``latency_s``: the links' latency (default: the cluster's)."""
    cluster = ClusterSpec(num_nodes=len(plan.nodes))
    if latency_s is not None:
        cluster = replace(cluster, intra_node_latency_s=latency_s, inter_node_latency_s=latency_s)
    cost = CostModel(emulated_profile(LAYERS, WIDTH, times, MICRO), cluster)
    iterations = []
    for pipeline in plan.pipelines:
        stages = pipeline.template.stages
        stage_times = [
            cost.stage_time_s(s.first_layer, s.end_layer, k, len(stages)) for k, s in enumerate(stages)
        ]
        iterations.append(cost.pipeline_time_s(stage_times, pipeline.microbatches))
    return max(iterations)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def worker(index: int, port: int, name: str, times: DeviceTimes, steps: int, rounds: int, out: Any) -> None:
    """One worker of layout ``name``: the median seconds per training step, over ``rounds``."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    plan = make_plan(*LAYOUTS[name])
    groups = ProcessGroups(plan, plan.workers[index], store, 0)
    engine = PipelineEngine(lambda: emulated_layers(LAYERS, WIDTH, times), loss, groups, torch.device("cpu"))
    inputs = torch.randn(plan.global_batch_size, WIDTH)
    targets = torch.randn(plan.global_batch_size, WIDTH)

    def step() -> None:
        engine.module.zero_grad(set_to_none=True)
        engine.train_step(
            inputs[engine.batch_slice] if engine.is_first_stage else None,
            targets[engine.batch_slice] if engine.is_last_stage else None,
        )

    step()  # warm-up
    timings = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        timings.append((time.perf_counter() - start) / steps)
    groups.destroy()
    out.put((index, timings))


def ping_pong(index: int, port: int, messages: int, out: Any) -> None:
    """Rank 0 and 1 bounce one micro-batch's activation; rank 0 reports the one-way time."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=index, world_size=2)
    activation = torch.zeros(MICRO, WIDTH)
    first, second = (dist.send, dist.recv) if index == 0 else (dist.recv, dist.send)
    for _ in range(10):
        first(activation, 1 - index)
        second(activation, 1 - index)
    start = time.perf_counter()
    for _ in range(messages):
        first(activation, 1 - index)
        second(activation, 1 - index)
    out.put((index, (time.perf_counter() - start) / (2 * messages)))
    dist.destroy_process_group()


def spawn(target: Any, count: int, *args: Any) -> dict[int, Any]:
    """Run ``target(index, store_port, *args, queue)`` in ``count`` processes; their results by index."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, store.port, *args, out)) for i in range(count)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return results


def measure(name: str, times: DeviceTimes, steps: int, rounds: int) -> float:
    plan = make_plan(*LAYOUTS[name])
    return statistics.median(spawn(worker, len(plan.workers), name, times, steps, rounds)[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layer-ms", type=float, default=5.0, help="F = I = W of every layer")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = args.layer_ms / 1e3
    times = DeviceTimes(seconds, seconds, seconds)
    table = Table(
        title=f"1F1B on emulated devices: {LAYERS} layers, F = I = W = {args.layer_ms:g} ms per layer, "
        f"median over {args.rounds} rounds of {args.steps} steps"
    )
    latency = spawn(ping_pong, 2, 200)[0]
    columns = ("layout", "micro-batches", "processes", "measured ms", "predicted ms", "ratio")
    columns += (f"predicted ms, {latency * 1e6:.0f} µs links", "ratio ")
    for column in columns:
        table.add_column(column, justify="left" if column == "layout" else "right")
    for name, (layout, microbatches) in LAYOUTS.items():
        plan = make_plan(layout, microbatches)
        measured = measure(name, times, args.steps, args.rounds)
        predicted, calibrated = predicted_s(plan, times), predicted_s(plan, times, latency)
        table.add_row(
            name,
            " + ".join(map(str, microbatches)),
            str(len(plan.workers)),
            f"{measured * 1e3:.0f}",
            f"{predicted * 1e3:.0f}",
            f"{measured / predicted:.3f}",
            f"{calibrated * 1e3:.0f}",
            f"{measured / calibrated:.3f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
