"""Planner latency against the Oobleck paper's Table 3, plus a 1,024-node scale row.

Run: ``python benchmarks/planner_latency.py``. Each cell times ``make_plan`` (node specification,
every template, instantiation with f = 1, batch distribution) on a synthetic GPT profile, best of
three runs, and prints it beside the paper's planning time for the same grid (its Table 3, from
the SOSP'23 Oobleck paper via the course presentation in the project's reference material).

A second table plans the largest cell and a 70B-class model (80 layers, hidden 8192, sequence 4096, 16
nodes of 8 x 80 GB, recomputing activations where a split would not fit otherwise) under each schedule, at
``t = 1`` and with ``tensor_parallel="auto"`` (every degree planned, the fastest kept), and with
``schedule="auto"`` (both schedules planned).

``--rerouting``: instead, what a rerouting costs on a recovery's critical path, per worker, on the 64-node x
8-GPU job of ``oobleck simulate``'s example (docs/planning.md: 48 layers of hidden 4096, f = 2, global batch
1024 of micro-batches of 1; 16 pipelines of 32 stages): ``choose_recovery`` (both ways predicted, the
rerouted step merged and simulated) after losing a middle node of pipeline 0, then a worker's training lists
under the chosen plan (from the same merge) and its validation, and the evaluation lists, which the engine
makes at the first evaluation step. A second table: ``choose_recovery(policy="auto")`` for a lost middle node
of the 2,048-node x 8-GPU job of ``benchmarks/simulate_table2.py --scale`` (171 pipelines of 88-96 stages),
beside the state copy it would save.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_oobleck.config import load_config
from lightning_oobleck.planning import ClusterSpec, ModelProfile, Plan, make_plan, synthetic_gpt_profile
from lightning_oobleck.planning.config import PlannerConfig
from lightning_oobleck.planning.rerouting import affected, choose_recovery, step_actions
from lightning_oobleck.planning.schedules import validate

NODES = (8, 16, 24)
GPUS = (1, 4, 8)
LAYERS = (24, 32, 64, 96)
PAPER_S = {
    (8, 1): (0.28, 0.71, 9.65, 68.50),
    (8, 4): (0.41, 1.15, 11.58, 74.56),
    (8, 8): (0.54, 1.50, 20.98, 109.76),
    (16, 1): (3.37, 7.45, 66.35, 540.36),
    (16, 4): (4.56, 10.41, 108.10, 649.67),
    (16, 8): (4.90, 11.78, 176.04, 1213.63),
    (24, 1): (11.35, 30.11, 262.47, 1477.54),
    (24, 4): (14.78, 45.80, 472.53, 2153.84),
    (24, 8): (15.59, 49.25, 520.08, 3297.92),
}
"""The paper's Table 3: planning seconds per (nodes, GPUs per node), for 24 / 32 / 64 / 96 layers."""
REROUTING_JOB = {
    "cluster.num_nodes": 64,
    "cluster.gpus_per_node": 8,
    "model.layers": 48,
    "model.hidden": 4096,
    "fault_tolerance": 2,
    "global_batch": 1024,
    "microbatch": 1,
}
"""The job of ``oobleck simulate``'s example (docs/planning.md), as ``oobleck plan`` configures it."""
MODELS = {24: (1024, 2048), 32: (2560, 2048), 64: (2560, 1024), 96: (2560, 1024)}
"""(hidden, sequence length) per layer count: GPT-3 Medium, GPT-3 2.7B, and deeper 2.7B-wide models."""
A40 = {"device_memory_bytes": 48e9, "intra_node_bandwidth": 100e9, "inter_node_bandwidth": 25e9}


def timed_plan(
    nodes: int,
    gpus: int,
    layers: int,
    fault_tolerance: int,
    global_batch: int,
    repeats: int,
    **options: Any,
) -> Plan:
    hidden, seq_len = MODELS[layers]
    profile = synthetic_gpt_profile(layers, hidden, seq_len, 1)
    cluster = ClusterSpec(nodes, gpus, **A40)
    return best_of(repeats, profile, cluster, fault_tolerance, global_batch, **options)


def best_of(
    repeats: int, profile: ModelProfile, cluster: ClusterSpec, f: int, global_batch: int, **options: Any
) -> Plan:
    runs = [
        make_plan(profile, cluster, fault_tolerance=f, global_batch_size=global_batch, **options)
        for _ in range(repeats)
    ]
    return min(runs, key=lambda p: p.planning_s)


def settings_table(repeats: int) -> Table:
    """Planning time and the plan's prediction per schedule and tensor-parallel setting."""
    table = Table(title="Planning at each schedule and tensor-parallel setting (best of 3)")
    for name in ("model", "schedule", "tensor_parallel", "planning (s)", "chose", "iteration (s)"):
        table.add_column(name, justify="right")
    largest = (synthetic_gpt_profile(96, *MODELS[96], 1), ClusterSpec(24, 8, **A40), False)
    llama70 = (synthetic_gpt_profile(80, 8192, 4096, 1), ClusterSpec(16, 8, device_memory_bytes=80e9), "auto")
    for model, (profile, cluster, recompute) in {"Table 3's largest": largest, "70B-class": llama70}.items():
        for schedule in ("1f1b", "zb-h1", "auto"):
            for tensor_parallel in (1, "auto"):
                plan = best_of(
                    repeats,
                    profile,
                    cluster,
                    1,
                    1024,
                    schedule=schedule,
                    tensor_parallel=tensor_parallel,
                    activation_checkpointing=recompute,
                )
                table.add_row(
                    model,
                    schedule,
                    str(tensor_parallel),
                    f"{plan.planning_s:.3f}",
                    f"{plan.schedule}, t = {plan.tensor_parallel}",
                    f"{plan.iteration_time_s:.3f}",
                )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rerouting", action="store_true", help="only rerouting's cost on the recovery path")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 110))
    if args.rerouting:
        console.print(rerouting_table())
        console.print(scale_choice_table())
        return
    table = Table(title="Planning latency (s): ours / paper (Table 3), f = 1, global batch 1024")
    table.add_column("nodes", justify="right")
    table.add_column("GPUs/node", justify="right")
    for layers in LAYERS:
        table.add_column(f"{layers} layers", justify="right")
    slowest = 0.0
    for nodes in NODES:
        for gpus in GPUS:
            cells = []
            for layers, paper in zip(LAYERS, PAPER_S[(nodes, gpus)], strict=True):
                plan = timed_plan(nodes, gpus, layers, 1, 1024, args.repeats)
                slowest = max(slowest, plan.planning_s)
                cells.append(f"{plan.planning_s:.3f} / {paper:,.2f}")
            table.add_row(str(nodes), str(gpus), *cells)
    console.print(table)
    console.print(f"slowest cell: {slowest:.3f} s (goal < 1 s; the paper's slowest: 3,297.92 s)")
    console.print(settings_table(args.repeats))

    started = time.perf_counter()
    plan = timed_plan(1024, 8, 96, 4, 8192, 1)
    wall = time.perf_counter() - started
    scale = Table(title="Scale: 1,024 nodes x 8 GPUs, 96 layers, f = 4, global batch 8192 (goal < 5 s)")
    for name in ("templates", "pipelines", "n0", "iteration (s)", "planning (s)"):
        scale.add_column(name, justify="right")
    scale.add_row(
        str(len(plan.templates)),
        str(len(plan.pipelines)),
        str(plan.n0),
        f"{plan.iteration_time_s:.3f}",
        f"{plan.planning_s:.3f} (wall {wall:.3f})",
    )
    console.print(scale)


def rerouting_plan() -> Plan:
    """The planner's plan of :data:`REROUTING_JOB` (the 64-node x 8-GPU job of docs/planning.md)."""
    job = load_config(PlannerConfig, None, [f"{key}={value}" for key, value in REROUTING_JOB.items()])
    return job.make_plan(job.load_profile())


def rerouting_table() -> Table:
    """Seconds of CPU a rerouting adds to a recovery on every worker, step by step (see the module's doc)."""
    plan = rerouting_plan()
    failed = [plan.pipelines[0].nodes[len(plan.pipelines[0].nodes) // 2]]
    timings: list[tuple[str, float]] = []

    def timed(name: str, work: Any) -> Any:
        started = time.perf_counter()
        result = work()
        timings.append((name, time.perf_counter() - started))
        return result

    choice = timed(
        "choose_recovery, policy reroute (both ways predicted)",
        lambda: choose_recovery(plan, failed, "reroute"),
    )
    if choice.policy != "reroute":
        raise SystemExit(f"the recovery did not reroute: {'; '.join(map(str, choice.candidates))}")
    rerouted = choice.reconfiguration.plan
    touched = affected(rerouted)
    worker = rerouted.pipelines[1].workers_of_stage(1)[0]
    buckets = {worker: [tuple(rerouted.role(*worker).layers)]}
    train, limits = timed(
        "a worker's training lists (the choice's merge)",
        lambda: step_actions(rerouted, 0, buckets, True, touched),
    )
    timed("its validation (its list and its pairs)", lambda: validate(train, limits, {worker: 1}, worker))
    recovery_s = sum(seconds for _, seconds in timings)
    evaluation, _ = timed(
        "evaluation lists (at the first evaluation step)",
        lambda: step_actions(rerouted, 0, None, False, touched),
    )
    timed("its validation", lambda: validate(evaluation, worker=worker))
    shape = f"{len(plan.pipelines)} pipelines of {len(plan.pipelines[0].stages)} stages"
    table = Table(
        title=f"Rerouting on the recovery path: 64 nodes x 8 GPUs, {shape}, "
        f"{plan.pipelines[0].microbatches} micro-batches each; {choice.policy} chosen "
        f"({len(touched)} pipelines touched)"
    )
    table.add_column("step")
    table.add_column("s", justify="right")
    for name, seconds in timings:
        table.add_row(name, f"{seconds:.2f}")
    table.add_row("the recovery's critical path (the first three)", f"{recovery_s:.2f}")
    return table


def scale_choice_table() -> Table:
    """``recovery_policy="auto"``'s choice (made on every worker) on the 16,384-GPU job, beside the copy."""
    cluster = ClusterSpec(num_nodes=2048, gpus_per_node=8, device_memory_bytes=80e9)
    profile = synthetic_gpt_profile(96, 8192, 2048, 1, 4e14)
    plan = make_plan(
        profile, cluster, fault_tolerance=2, global_batch_size=4096, activation_checkpointing="auto"
    )
    failed = [plan.pipelines[0].nodes[len(plan.pipelines[0].nodes) // 2]]
    started = time.perf_counter()
    choice = choose_recovery(plan, failed, "auto")
    choose_s = time.perf_counter() - started
    table = Table(
        title=f"auto's choice at 2,048 nodes x 8 GPUs ({len(plan.pipelines)} pipelines): "
        f"{choose_s:.2f} s, {choice.policy} chosen"
    )
    for column in ("way", "step (s)", "copy (s)", "samples in 3600 s"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for c in choice.candidates:
        if c.infeasible:
            table.add_row(c.policy, "impossible", "", c.infeasible)
        else:
            table.add_row(c.policy, f"{c.step_s:.3f}", f"{c.transition_s:.2f}", f"{c.samples:.4g}")
    return table


if __name__ == "__main__":
    main()
