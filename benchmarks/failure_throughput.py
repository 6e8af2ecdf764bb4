"""Throughput after node failures under re-instantiation, rerouting and auto, on emulated devices.

Plans of ``--pipelines`` pipelines of 4 stages (8 emulated layers, 2 a stage, ``F = I = W = --layer-ms``
per layer, ``--microbatches`` micro-batches per pipeline), made by the planner from the emulated layers'
profile in which each layer holds ``--layer-state-gb`` of parameters and optimizer state (the emulated
layers are tiny; the size only sets the predicted state copy). For each plan, one failure (a middle stage of
pipeline 0) and two (that and a last stage of pipeline 1, at once) are recovered from by:

* ``reinstantiate``: the pipelines rebuilt from the templates (Oobleck), the layers a worker newly holds
  copied (predicted from the profile's sizes and the links, :func:`copy_time_s`);
* ``reroute``: the damaged pipelines keep their surviving stages, the lost stages' micro-batches run on the
  other pipelines' replicas, in their bubbles (ReCycle); nothing is copied;
* ``auto``: what :func:`choose_recovery` picks, from the cost model's event simulation of both steps and
  the copy, over ``--horizon-s`` (the expected time to the next failure).

Every layout runs in the same worker processes (gloo on CPU, one per device; workers of lost nodes sit the
layouts after the failure out), one layout after the other, each a generation of its own. The table gives
per row the measured and predicted step, the throughput against the failure-free plan's next to the ideal
``(N - k) / N``, and the samples trained before the next failure (measured step, predicted copy), with the
policy that trains the most by measurement and the one ``auto`` picked. The measured step ends with the step
commit, as the strategy runs it; the *staggered* step, predicted (:func:`predict_staggered_step_s`) and
measured, does not wait for it: each worker starts its next step once its own layers' gradients are reduced,
what ReCycle's staggered optimizer allows. Last, the commit's time alone. ``--plot PATH``: the timeline of a
rerouted step (one failure, the first plan), rerouted micro-batches hatched.

``--sweep M ...`` runs nothing: the cost model's throughput after one failure under both policies, for each
schedule, ``--pipelines`` and micro-batches per pipeline in ``M``: where rerouting can win, and by how much.

``--third-way GB_S ...`` runs nothing either: Odyssey's third way (reroute at once, re-instantiate once a
background copy has caught up), predicted on the 64-node x 8-GPU job of ``planner_latency.py --rerouting`` for
each link bandwidth in ``GB_S``: the seconds of training it wins per failure with a copy free to ignore the
steps it spans and with an exact one, which carries each step's gradients of the moved layers too; and the
most a staggered optimizer that keeps the step commit would save there.

    python benchmarks/failure_throughput.py [--pipelines 4 6] [--microbatches 4] [--layer-ms 5]
        [--schedule zb-h1] [--layer-state-gb 2] [--horizon-s 60] [--steps 4] [--plot PATH]
    python benchmarks/failure_throughput.py --sweep 1 2 3 4 8 [--pipelines 4 5 6]
    python benchmarks/failure_throughput.py --third-way 0.1 0.3 0.5 1 2 5 10 25
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from planner_latency import rerouting_plan  # benchmarks/ is the script's directory
from rich.console import Console
from rich.table import Table
from schedules import COLORS, draw_actions, loss, spawn
from torch.distributed import TCPStore

from lightning_oobleck.execution import PipelineEngine, ProcessGroups
from lightning_oobleck.planning import ClusterSpec, Plan, make_plan
from lightning_oobleck.planning.planner import PlannerInputs
from lightning_oobleck.planning.reconfigure import after_failures, copy_time_s
from lightning_oobleck.planning.rerouting import (
    choose_recovery,
    predict_staggered_step_s,
    predict_step_s,
    reroute,
)
from lightning_oobleck.planning.schedules import Timing
from lightning_oobleck.testing import DeviceTimes, emulated_layers, emulated_profile
from lightning_oobleck.worker import Worker

LAYERS, WIDTH, MICRO, STAGES = 8, 16, 2, 4
COMMITS = 20
"""Step commits timed alone after the steps: the one all-reduce (of the gradient norm, the loss and the
shared flags) that every worker waits for before its next step."""
POLICIES = ("reinstantiate", "reroute")


def failure_free_plan(pipelines: int, args: argparse.Namespace) -> Plan:
    """The planner's plan of ``pipelines`` pipelines of 4 stages, f = pipelines - 1."""
    times = DeviceTimes(args.layer_ms / 1e3, args.layer_ms / 1e3, args.layer_ms / 1e3)
    profile = emulated_profile(LAYERS, WIDTH, times, MICRO)
    state = int(args.layer_state_gb * 1e9)
    profile = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(la, parameter_bytes=state) for la in profile.layers)
    )
    cluster = ClusterSpec(
        num_nodes=STAGES * pipelines, gpus_per_node=1, device_memory_bytes=12 * state
    )  # two layers' state fit on a device, three do not
    plan = make_plan(
        profile,
        cluster,
        fault_tolerance=pipelines - 1,
        global_batch_size=MICRO * args.microbatches * pipelines,
        schedule=args.schedule,
    )
    shape = [len(p.stages) for p in plan.pipelines]
    if shape != [STAGES] * pipelines:
        raise SystemExit(f"the planner made pipelines of {shape} stages, not {pipelines} of {STAGES}")
    return plan


def timed(
    engine: PipelineEngine,
    batch: tuple[Any, Any],
    steps: int,
    commit: bool,
    trace: list[Timing] | None = None,
) -> float:
    """Seconds per step over ``steps`` steps after a warm-up one (then one more, traced into ``trace``); with
    ``commit`` each step ends with the step commit (as the strategy runs it), else the next step starts as
    soon as this worker's own layers' gradients are reduced (what a staggered optimizer would allow)."""
    for step in range(steps + 2):
        if step == 1:
            dist.barrier()
            start = time.perf_counter()
        if step == steps + 1:
            elapsed = time.perf_counter() - start
            engine.trace = trace
        engine.module.zero_grad(set_to_none=True)
        engine.train_step(*batch)
        if commit:
            engine.commit(None)
    engine.trace = None
    dist.barrier()
    return elapsed / steps


def worker(index: int, port: int, job: dict[str, Any], out: Any) -> None:
    """Worker ``index`` of the failure-free plan: for each layout it is part of, the seconds per step (after
    one warm-up step), and the actions of one more step for the traced layout."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    times: DeviceTimes = job["times"]
    me: Worker = job["workers"][index]
    results: dict[str, Any] = {}
    for generation, (key, plan) in enumerate(job["layouts"], start=1):
        if me not in plan.workers:
            continue
        groups = ProcessGroups(plan, me, store, generation)
        engine = PipelineEngine(
            lambda: emulated_layers(LAYERS, WIDTH, times), loss, groups, torch.device("cpu")
        )
        size = plan.global_batch_size
        inputs, targets = torch.randn(size, WIDTH), torch.randn(size, WIDTH)
        mine = torch.cat([torch.arange(r.start, r.stop) for r in engine.samples])
        trace: list[Timing] = []

        batch = (
            inputs[mine] if engine.is_first_stage else None,
            targets[mine] if engine.is_last_stage else None,
        )
        step_s = timed(
            engine, batch, job["steps"], commit=True, trace=trace if key == job["traced"] else None
        )
        staggered_s = timed(engine, batch, job["steps"], commit=False)
        dist.barrier()
        commits = time.perf_counter()
        for _ in range(COMMITS):
            engine.commit(None)
        commit_s = (time.perf_counter() - commits) / COMMITS
        results[key] = {
            "step_s": step_s,
            "staggered_s": staggered_s,
            "commit_s": commit_s,
            "trace": trace,
            "pipeline": engine.role.pipeline,
        }
        groups.destroy()
    out.put((index, results))


def plot(results: dict[int, Any], plan: Plan, key: str, path: str) -> None:
    """Each worker's actions in the traced rerouted step; micro-batches of another pipeline hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [(i, r[key]) for i, r in sorted(results.items()) if key in r]
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.32 * len(rows)))
    owns = [plan.microbatch_range(result["pipeline"]) for _, result in rows]
    end = draw_actions(
        ax,
        [result["trace"] for _, result in rows],
        [f"worker {i}" for i, _ in rows],
        lambda row, t: t.action.microbatch not in owns[row],
    )
    ax.set_title(
        f"{key}: a rerouted step, {end:.0f} ms (hatched: micro-batches rerouted from another pipeline)"
    )
    ax.legend(
        handles=[Patch(color=c, label=op.value) for op, c in COLORS.items()], loc="upper right", ncols=4
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pipelines", type=int, nargs="+", default=[4, 6])
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per pipeline")
    parser.add_argument("--layer-ms", type=float, default=5.0, help="F = I = W of each emulated layer")
    parser.add_argument("--schedule", default="zb-h1", choices=["1f1b", "zb-h1"])
    parser.add_argument(
        "--layer-state-gb", type=float, default=2.0, help="parameters + optimizer state a layer"
    )
    parser.add_argument("--horizon-s", type=float, default=60.0, help="expected time to the next failure")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--plot", help="write the timeline of a rerouted step (PNG) here")
    parser.add_argument("--sweep", type=int, nargs="+", help="micro-batches per pipeline: predictions only")
    parser.add_argument(
        "--third-way", type=float, nargs="+", help="link bandwidths (GB/s): Odyssey's third way, predicted"
    )
    args = parser.parse_args()
    console = Console(width=200)
    if args.sweep:
        sweep(args, console)
        return
    if args.third_way:
        third_way(args, console)
        return
    table = Table(
        title=f"Throughput after failures: 4-stage pipelines of {args.microbatches} micro-batches, "
        f"{args.schedule}, "
        f"F = I = W = {2 * args.layer_ms:g} ms per stage, {args.layer_state_gb:g} GB of state per layer, "
        f"next failure in {args.horizon_s:g} s; mean of {args.steps} steps"
    )
    for column in (
        "pipelines",
        "failed",
        "policy",
        "predicted ms",
        "measured ms",
        "measured / predicted",
        "staggered ms predicted",
        "staggered ms measured",
        "throughput / before",
        "ideal (N-k)/N",
        "copy s (predicted)",
        "samples to next failure",
        "best measured",
        "auto picks",
    ):
        table.add_column(column, justify="left" if column in ("policy", "failed") else "right")
    times = DeviceTimes(args.layer_ms / 1e3, args.layer_ms / 1e3, args.layer_ms / 1e3)
    commit_ms: dict[int, float] = {}
    for k, pipelines in enumerate(args.pipelines):
        plan = failure_free_plan(pipelines, args)
        scenarios = {
            1: [plan.pipelines[0].nodes[1]],
            2: [plan.pipelines[0].nodes[1], plan.pipelines[1].nodes[-1]],
        }
        layouts: list[tuple[str, Plan]] = [("before", plan)]
        copies: dict[str, float] = {}
        picks: dict[int, str] = {}
        for count, failed in scenarios.items():
            again = after_failures(plan, failed)
            copies[f"reinstantiate {count}"] = copy_time_s(again.copies, PlannerInputs.from_plan(plan))
            layouts += [(f"reinstantiate {count}", again.plan), (f"reroute {count}", reroute(plan, failed))]
            picks[count] = choose_recovery(plan, failed, "auto", args.horizon_s).policy
        traced = "reroute 1" if args.plot and k == 0 else ""
        job = {
            "times": times,
            "workers": plan.workers,
            "layouts": layouts,
            "steps": args.steps,
            "traced": traced,
        }
        results = spawn(worker, len(plan.workers), job)
        commit_ms[pipelines] = max(r["before"]["commit_s"] for r in results.values()) * 1e3
        measured, staggered = (
            {key: results[0 if key == "before" else _first(results, key)][key][what] for key, _ in layouts}
            for what in ("step_s", "staggered_s")
        )
        by_key = dict(layouts)
        before = measured["before"]
        table.add_row(
            str(pipelines),
            "none",
            "",
            f"{predict_step_s(plan) * 1e3:.0f}",
            f"{before * 1e3:.0f}",
            f"{before / predict_step_s(plan):.2f}",
            f"{predict_staggered_step_s(plan) * 1e3:.0f}",
            f"{staggered['before'] * 1e3:.0f}",
            "1.00",
            "1.00",
            "",
            "",
            "",
            "",
        )
        for count, failed in scenarios.items():
            samples = {
                policy: plan.global_batch_size
                * max(args.horizon_s - copies.get(f"{policy} {count}", 0.0), 0.0)
                / measured[f"{policy} {count}"]
                for policy in POLICIES
            }
            best = max(samples, key=samples.__getitem__)
            for policy in POLICIES:
                key = f"{policy} {count}"
                predicted = predict_step_s(by_key[key])
                table.add_row(
                    "",
                    f"{count}: {', '.join(map(str, failed))}",
                    policy,
                    f"{predicted * 1e3:.0f}",
                    f"{measured[key] * 1e3:.0f}",
                    f"{measured[key] / predicted:.2f}",
                    f"{predict_staggered_step_s(by_key[key]) * 1e3:.0f}",
                    f"{staggered[key] * 1e3:.0f}",
                    f"{before / measured[key]:.2f}",
                    f"{(len(plan.nodes) - count) / len(plan.nodes):.2f}",
                    f"{copies.get(key, 0.0):.2f}",
                    f"{samples[policy]:.4g}",
                    "yes" if policy == best else "",
                    "yes" if policy == picks[count] else "",
                )
        if traced:
            plot(results, by_key[traced], traced, args.plot)
    console.print(table)
    console.print(
        "The step commit (one all-reduce of the squared gradient norm and the loss over every worker, timed "
        "alone after the steps, the slowest worker's mean): "
        + ", ".join(f"{n} pipelines {ms:.2f} ms" for n, ms in commit_ms.items())
        + ". The staggered columns: steps that do not wait for it, each worker starting its next step once "
        "its own layers' gradients are reduced (ReCycle's staggered optimizer); they save the commit's "
        "latency and the skew of the workers' ends."
    )


def sweep(args: argparse.Namespace, console: Console) -> None:
    """The cost model's throughput after losing a middle stage of pipeline 0, against before, per policy, with
    the commit's barrier (as the strategy runs) and staggered (:func:`predict_staggered_step_s`)."""
    table = Table(title="Predicted throughput after one failure / before (cost model, no processes)")
    for column in (
        "schedule",
        "micro-batches",
        "pipelines",
        "reinstantiate",
        "reroute",
        "ratio",
        "staggered: reinstantiate",
        "reroute",
        "ratio",
        "ideal",
    ):
        table.add_column(column, justify="right")
    for schedule in ("1f1b", "zb-h1"):
        for m in args.sweep:
            for pipelines in args.pipelines:
                plan = failure_free_plan(
                    pipelines, argparse.Namespace(**{**vars(args), "microbatches": m, "schedule": schedule})
                )
                failed = [plan.pipelines[0].nodes[1]]
                layouts = (plan, after_failures(plan, failed).plan, reroute(plan, failed))
                row = [schedule, str(m), str(pipelines)]
                for predict in (predict_step_s, predict_staggered_step_s):
                    before, again, rerouted = (predict(layout) for layout in layouts)
                    row += [f"{before / again:.3f}", f"{before / rerouted:.3f}", f"{again / rerouted:.3f}"]
                table.add_row(*row, f"{(len(plan.nodes) - 1) / len(plan.nodes):.3f}")
    console.print(table)


def third_way(args: argparse.Namespace, console: Console) -> None:
    """Odyssey's third way (reroute at once, re-instantiate once a background copy has caught up) against
    re-instantiating at once, on the 64-node x 8-GPU job of ``oobleck simulate``'s example (the plan of
    ``planner_latency.py --rerouting``) after losing node 2, per link bandwidth; and the most that a
    staggered optimizer which keeps the step commit could save there."""
    plan = rerouting_plan()
    failed = [2]
    again = after_failures(plan, failed)
    reinstantiated, rerouted = choose_recovery(plan, failed, "reroute").candidates
    t_a, t_b = reinstantiated.step_s, rerouted.step_s
    inputs = PlannerInputs.from_plan(plan)
    cost = inputs.cost()
    table = Table(
        title=f"Odyssey's third way on 64 nodes x 8 GPUs, node 2 lost: re-instantiated {t_a:.2f} s/step, "
        f"rerouted {t_b:.2f} s/step; gain = seconds of training won per failure against re-instantiating at "
        "once (cost model, no processes)"
    )
    for column in (
        "link GB/s",
        "copy s",
        "catch-up s/step",
        "free copy: steps rerouted",
        "gain s",
        "exact copy: steps rerouted",
        "gain s",
    ):
        table.add_column(column, justify="right")
    for gb_s in args.third_way:
        copy_s = copy_time_s(again.copies, inputs, gb_s * 1e9 / inputs.cluster.inter_node_bandwidth)
        # Each rerouted step changes the state being copied: an exact copy also carries that step's
        # gradients of the moved layers, striped like the copy, parameter_bytes a layer of its state's
        # parameter_bytes * state_factor.
        catch_up_s = copy_s / cost.state_factor
        free = math.ceil(copy_s / t_b)
        exact = math.ceil(copy_s / (t_b - catch_up_s)) if catch_up_s < t_b else None
        table.add_row(
            f"{gb_s:g}",
            f"{copy_s:.1f}",
            f"{catch_up_s:.2f}",
            str(free),
            f"{copy_s - free * (t_b - t_a):.1f}",
            "never done" if exact is None else str(exact),
            "" if exact is None else f"{copy_s - exact * (t_b - t_a):.1f}",
        )
    console.print(table)
    stage_bytes = [
        sum(inputs.profile.layers[layer].parameter_bytes for layer in stage.layers) / plan.tensor_parallel
        for pipeline in plan.pipelines
        for stage in pipeline.stages
    ]
    step_s = predict_step_s(plan)
    optimizer_s = float(cost.optimizer_step_s(max(stage_bytes)))
    console.print(
        f"A staggered optimizer that keeps the commit (each worker updates once its layers' gradients are "
        f"reduced, then waits for the commit) takes at most the largest stage's optimizer step off a step: "
        f"{optimizer_s * 1e3:.1f} ms of {step_s:.2f} s ({optimizer_s / step_s:.3%}), and an exact rollback "
        "needs a copy of the same state made before every update."
    )


def _first(results: dict[int, Any], key: str) -> int:
    return min(i for i, r in results.items() if key in r)


if __name__ == "__main__":
    main()
