"""1F1B against ZB-H1 on emulated devices: measured iteration times, the event simulation, the theory.

Every worker process (gloo on CPU, one thread) runs a stage of emulated layers
(:class:`~lightning_oobleck.testing.EmulatedLayer`), whose forward, input gradient and weight gradient
each sleep a set time on tiny tensors: 8 processes on 2 cores then behave like 8 devices with known compute
times, so the measured times show the schedules, not the machine. The same processes run both schedules,
alternating round by round (the two see the same load). The prediction is the cost model's event
simulation of the same action lists (:meth:`~lightning_oobleck.planning.cost.CostModel.simulated_time_s`),
with links as slow as a gloo transfer between two of these processes (measured first, by ping-pong), from
the configured times and from the emulated layers' profile as the profiler measures it (what the planner
would see).

1. ``--stage-ms`` per stage (``F = I = W``), 8 stages of one layer, ``m`` = ``--microbatches``: measured,
   simulated, and the theory (1F1B ``(m + S - 1)(F + I + W)``, ZB-H1 ``(3m + S - 1) F``; Qi et al.).
2. The layouts of the tests (8 layers of ``--layer-ms``): one pipeline of 4 stages, one of 8, and two
   heterogeneous pipelines of 3 and 5 stages running 6 and 10 micro-batches.
3. ``--plot PATH``: both schedules' timelines on 8 stages at the smallest ``m``, per worker, from the
   executor's own timestamps of every action.

    python benchmarks/schedules.py [--stage-ms 20] [--microbatches 8 16 32] [--layer-ms 5] [--plot PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import Tensor
from torch.distributed import TCPStore

from lightning_oobleck.execution import PipelineEngine, ProcessGroups, profile_layers
from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.lightning.plan_agreement import layout_plan
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES, Op, Timing
from lightning_oobleck.testing import DeviceTimes, emulated_layers, emulated_profile

LAYERS, WIDTH, MICRO = 8, 16, 2
LAYOUTS = {
    # name: (stage boundaries per pipeline, micro-batches per pipeline)
    "1 pipeline, 4 stages": ([[0, 2, 4, 6, 8]], [8]),
    "1 pipeline, 8 stages": ([list(range(9))], [8]),
    "pipelines of 3 and 5 stages": ([[0, 3, 6, 8], [0, 2, 4, 6, 7, 8]], [6, 10]),
}
COLORS = {Op.F: "tab:blue", Op.I: "tab:orange", Op.W: "tab:green", Op.B: "tab:red"}


def make_plan(layout: list[list[int]], microbatches: list[int], schedule: str) -> Plan:
    config = OobleckConfig(
        global_batch_size=MICRO * sum(microbatches),
        microbatch_size=MICRO,
        fault_tolerance=len(layout) - 1,
        devices_per_node=1,
        layout=layout,
        microbatches=microbatches,
        schedule=schedule,
    )
    return layout_plan(config, LAYERS, sum(len(bounds) - 1 for bounds in layout))


def simulated_s(plan: Plan, profile: ModelProfile, latency_s: float) -> float:
    """The cost model's event simulation of ``plan`` (its slowest pipeline), links of ``latency_s``."""
    cluster = ClusterSpec(
        num_nodes=len(plan.nodes), intra_node_latency_s=latency_s, inter_node_latency_s=latency_s
    )
    cost = CostModel(profile, cluster, schedule=plan.schedule)
    return max(cost.simulated_time_s(p.template, p.microbatches) for p in plan.pipelines)


def profiles(times: DeviceTimes) -> dict[str, ModelProfile]:
    """The emulated layers' profile as configured, and as the profiler measures them (a sleep overshoots,
    and a layer's Python and autograd work adds to it)."""
    measured = profile_layers(
        lambda: emulated_layers(LAYERS, WIDTH, times),
        torch.zeros(MICRO, WIDTH),
        torch.device("cpu"),
        repeat=9,
    )
    return {"configured": emulated_profile(LAYERS, WIDTH, times, MICRO), "profiled": measured}


def theory_s(schedule: str, stages: int, microbatches: int, t: float) -> float:
    """Qi et al.'s iteration times with ``F = I = W = t`` per stage and free transfers."""
    if schedule == "1f1b":
        return (microbatches + stages - 1) * 3 * t
    return (3 * microbatches + stages - 1) * t


def loss(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def worker(index: int, port: int, job: dict[str, Any], out: Any) -> None:
    """One worker of ``job``: per schedule, the seconds per training step of each round (rounds alternate
    schedules, each a generation of its own), and with ``job["trace"]`` the actions of one more step
    (``time.perf_counter``: one clock for all processes)."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    times: DeviceTimes = job["times"]
    plans = {s: make_plan(job["layout"], job["microbatches"], s) for s in SCHEDULE_NAMES}
    generation = 0

    def groups_for(schedule: str) -> ProcessGroups:
        nonlocal generation
        generation += 1
        return ProcessGroups(plans[schedule], plans[schedule].workers[index], store, generation)

    engine = PipelineEngine(
        lambda: emulated_layers(LAYERS, WIDTH, times), loss, groups_for("1f1b"), torch.device("cpu")
    )
    size = engine.plan.global_batch_size
    inputs, targets = torch.randn(size, WIDTH), torch.randn(size, WIDTH)

    def run(schedule: str, steps: int, trace: list[Timing] | None = None) -> float:
        """Switch to ``schedule`` (a new generation), warm up, then time ``steps`` steps."""
        engine.groups.destroy()
        engine.reconfigure(groups_for(schedule), engine.module)
        engine.trace = None
        for repeat in range(steps + 1):
            if repeat == 1:
                dist.barrier()
                start = time.perf_counter()
                engine.trace = trace
            engine.module.zero_grad(set_to_none=True)
            engine.train_step(
                inputs[engine.batch_slice] if engine.is_first_stage else None,
                targets[engine.batch_slice] if engine.is_last_stage else None,
            )
        dist.barrier()
        return (time.perf_counter() - start) / steps

    timings: dict[str, list[float]] = {s: [] for s in SCHEDULE_NAMES}
    for _ in range(job["rounds"]):
        for schedule in SCHEDULE_NAMES:
            timings[schedule].append(run(schedule, job["steps"]))
    traces: dict[str, list[Timing]] = {s: [] for s in SCHEDULE_NAMES}
    if job["trace"]:
        for schedule in SCHEDULE_NAMES:
            run(schedule, 1, traces[schedule])
    engine.groups.destroy()
    out.put((index, {"timings": timings, "traces": traces}))


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
    results = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return results


def measure(
    layout: list[list[int]],
    microbatches: list[int],
    times: DeviceTimes,
    args: argparse.Namespace,
    trace: bool,
) -> dict[int, Any]:
    job = {
        "layout": layout,
        "microbatches": microbatches,
        "times": times,
        "steps": args.steps,
        "rounds": args.rounds,
        "trace": trace,
    }
    workers = sum(len(bounds) - 1 for bounds in layout)
    return spawn(worker, workers, job)


def median_step_s(results: dict[int, Any], schedule: str) -> float:
    return statistics.median(results[0]["timings"][schedule])


def new_table(
    ms: float, title: str, columns: tuple[str, ...], after: tuple[str, ...] = ()
) -> tuple[DeviceTimes, dict[str, ModelProfile], Table]:
    """Devices of ``F = I = W = ms``, their profiles, and a table with ``columns``, the prediction from the
    profiled layers, then ``after``."""
    times = DeviceTimes(ms / 1e3, ms / 1e3, ms / 1e3)
    table = Table(title=title)
    for column in (*columns, "simulated ms, profiled", "measured / simulated ", *after):
        table.add_column(column, justify="left" if column == "layout" else "right")
    return times, profiles(times), table


def against_simulation(
    measured: float, plan: Plan, predictions: dict[str, ModelProfile], latency_s: float
) -> list[str]:
    """Simulated ms and measured / simulated, from the configured and from the profiled times."""
    cells = []
    for profile in predictions.values():
        simulated = simulated_s(plan, profile, latency_s)
        cells += [f"{simulated * 1e3:.0f}", f"{measured / simulated:.3f}"]
    return cells


def plot(results: dict[int, Any], microbatches: int, path: str) -> None:
    """Each schedule's actions per worker (rows) over time, from the executor's timestamps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = len(results)
    fig, axes = plt.subplots(
        len(SCHEDULE_NAMES), 1, sharex=True, figsize=(14, 1.2 + 0.45 * stages * len(SCHEDULE_NAMES))
    )
    for ax, schedule in zip(axes, SCHEDULE_NAMES, strict=True):
        traces = [result["traces"][schedule] for _, result in sorted(results.items())]
        end = draw_actions(ax, traces, [f"stage {s}" for s in range(stages)])
        ax.set_title(f"{schedule}: {stages} stages, {microbatches} micro-batches, step {end:.0f} ms")
    axes[0].legend(
        handles=[Patch(color=c, label=op.value) for op, c in COLORS.items()], loc="upper right", ncols=4
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def draw_actions(
    ax: Any,
    traces: list[list[Timing]],
    labels: list[str],
    hatched: Callable[[int, Timing], bool] | None = None,
) -> float:
    """Each trace's compute actions as bars on one row of ``ax`` (ms from the earliest start), those for
    which ``hatched(row, timing)`` holds hatched; returns where the last one ends."""
    origin = min(t.start for trace in traces for t in trace)
    end = 0.0
    for row, trace in enumerate(traces):
        for t in trace:
            if t.action.op in COLORS:
                ax.barh(
                    row,
                    (t.end - t.start) * 1e3,
                    left=(t.start - origin) * 1e3,
                    height=0.8,
                    color=COLORS[t.action.op],
                    hatch="///" if hatched is not None and hatched(row, t) else None,
                    edgecolor="white",
                    linewidth=0.3,
                )
                end = max(end, (t.end - origin) * 1e3)
    ax.set_yticks(range(len(traces)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    return end


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage-ms", type=float, default=20.0, help="F = I = W of each of the 8 stages")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--layer-ms", type=float, default=5.0, help="F = I = W per layer in the layouts")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", help="write the timeline plot (PNG) here")
    parser.add_argument("--skip-layouts", action="store_true", help="only the 8-stage table")
    args = parser.parse_args()
    console = Console(width=190)
    latency = spawn(ping_pong, 2, 200)[0]
    console.print(f"gloo link latency here (ping-pong): {latency * 1e6:.0f} µs")

    times, predictions, table = new_table(
        args.stage_ms,
        f"8 emulated stages, F = I = W = {args.stage_ms:g} ms per stage: median over {args.rounds} "
        f"rounds of {args.steps} steps; simulated from the configured times and from the profiled layers",
        ("m", "schedule", "measured ms", "theory ms", "simulated ms", "measured / simulated"),
        ("ZB-H1 / 1F1B measured", "ZB-H1 / 1F1B theory"),
    )
    stages = list(range(LAYERS + 1))
    for k, m in enumerate(args.microbatches):
        results = measure([stages], [m], times, args, trace=args.plot is not None and k == 0)
        measured = {s: median_step_s(results, s) for s in SCHEDULE_NAMES}
        for schedule in SCHEDULE_NAMES:
            plan = make_plan([stages], [m], schedule)
            zb, t = schedule == "zb-h1", times.forward_s
            table.add_row(
                str(m),
                schedule,
                f"{measured[schedule] * 1e3:.0f}",
                f"{theory_s(schedule, LAYERS, m, t) * 1e3:.0f}",
                *against_simulation(measured[schedule], plan, predictions, latency),
                f"{measured['zb-h1'] / measured['1f1b']:.3f}" if zb else "",
                f"{theory_s('zb-h1', LAYERS, m, t) / theory_s('1f1b', LAYERS, m, t):.3f}" if zb else "",
            )
        if args.plot is not None and k == 0:
            plot(results, m, args.plot)
    console.print(table)
    if args.skip_layouts:
        return

    times, predictions, table = new_table(
        args.layer_ms,
        f"The tests' layouts: {LAYERS} emulated layers, F = I = W = {args.layer_ms:g} ms per layer, "
        f"median over {args.rounds} rounds of {args.steps} steps",
        ("layout", "micro-batches", "schedule", "measured ms", "simulated ms", "measured / simulated"),
    )
    for name, (layout, microbatches) in LAYOUTS.items():
        results = measure(layout, microbatches, times, args, trace=False)
        for schedule in SCHEDULE_NAMES:
            measured = median_step_s(results, schedule)
            plan = make_plan(layout, microbatches, schedule)
            table.add_row(
                name,
                " + ".join(map(str, microbatches)),
                schedule,
                f"{measured * 1e3:.0f}",
                *against_simulation(measured, plan, predictions, latency),
            )
    console.print(table)


if __name__ == "__main__":
    main()
