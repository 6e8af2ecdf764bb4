"""``oobleck simulate``: what a job achieves under failures, per recovery policy, on the real planner.

Reads a :class:`~lightning_oobleck.simulation.config.SimulateConfig` (YAML and ``--set`` overrides), makes
the job's plan and the trace, replays the trace under each policy and prints one row per policy (``--json``:
the numbers; ``--plot PATH``: throughput over time, one line per policy, the events marked).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lightning_oobleck.cli.plan import add_job_arguments, job_overrides, job_profile
from lightning_oobleck.config import load_config
from lightning_oobleck.simulation.config import HOUR_S, SimulateConfig
from lightning_oobleck.simulation.simulator import PolicyResult, simulate
from lightning_oobleck.simulation.trace import Trace


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``oobleck simulate`` to the ``oobleck`` command."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a job under failures: oobleck against checkpoint-restart and replica groups",
        description="Replay a failure trace (generated or from a file) against a job planned by the real "
        "planner, once per recovery policy, and compare what each trains.",
    )
    parser.add_argument("--config", help="YAML file with a SimulateConfig (job, trace, horizon_h, policies)")
    add_job_arguments(parser, prefix="job.")
    parser.add_argument("--horizon-h", type=float, help="simulated hours (horizon_h)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any setting, e.g. trace.kind=mttf"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", help="write throughput over time (PNG) here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = list(args.set) + job_overrides(args, prefix="job.")
    if args.horizon_h is not None:
        overrides.append(f"horizon_h={args.horizon_h}")
    config = load_config(SimulateConfig, args.config, overrides)
    console = Console(stderr=args.json)
    if not console.is_terminal:
        console.width = 160  # a file or a pipe: keep the table's rows whole
    started = time.perf_counter()
    plan = config.job.make_plan(job_profile(config.job, args.layers))
    trace = config.make_trace()
    total = len(trace.events) * len(config.policies)
    with Progress(console=console, transient=True, disable=total < 200) as progress:
        task = progress.add_task("simulating", total=total)
        results = simulate(plan, trace, config.policies, config.costs, lambda: progress.advance(task))
    wall_s = time.perf_counter() - started
    if args.plot:
        plot(results, trace, args.plot)
    if args.json:
        print(json.dumps({"trace": _trace_summary(trace), "results": [_row(r) for r in results]}, indent=2))
        return 0
    console.print(_table(results, trace, config))
    per_event = wall_s / max(total, 1)
    console.print(
        f"{len(plan.nodes)} nodes x {plan.gpus_per_node} GPUs, {len(plan.pipelines)} pipelines, f="
        f"{plan.fault_tolerance}, iteration {plan.iteration_time_s:.3f} s; {trace.failures} failures in "
        f"{trace.horizon_s / HOUR_S:g} h; simulated in {wall_s:.2f} s ({per_event * 1e3:.1f} ms per event)"
    )
    for r in results:
        if r.coordinator_failures:
            survived = r.coordinator_failures - r.coordinator_restarts
            console.print(
                f"{r.coordinator_failures} failure(s) hit the machine of the coordinator and the store "
                f"(SLURM's batch host at first): {survived} taken over by its standby, "
                f"{r.coordinator_restarts} charged a restart from the last checkpoint (the standby lost at "
                "once, or not running yet)"
            )
    return 0


def _row(r: PolicyResult) -> dict[str, Any]:
    return {
        "policy": r.policy,
        "samples_per_s": r.samples_per_s,
        "effective_ratio": r.effective_ratio,
        "samples": r.samples,
        "failure_free_samples": r.failure_free_samples,
        "recovery_h": r.recovery_s / HOUR_S,
        "lost_h": r.lost_s / HOUR_S,
        "events": r.events,
        "final_pipelines": r.final_pipelines,
        "coordinator_failures": r.coordinator_failures,
        "coordinator_restarts": r.coordinator_restarts,
        "replan_s_mean": sum(r.replan_s) / len(r.replan_s) if r.replan_s else 0.0,
        "replan_s_max": max(r.replan_s, default=0.0),
    }


def _trace_summary(trace: Trace) -> dict[str, Any]:
    returns = sum(e.kind == "return" for e in trace.events)
    return {
        "nodes": trace.num_nodes,
        "horizon_h": trace.horizon_s / HOUR_S,
        "failures": trace.failures,
        "returns": returns,
    }


def _table(results: list[PolicyResult], trace: Trace, config: SimulateConfig) -> Table:
    table = Table(
        title=f"{trace.num_nodes} nodes, {trace.failures} failures in {trace.horizon_s / HOUR_S:g} h "
        f"({config.trace.kind} trace)"
    )
    columns = ("policy", "samples/s", "vs failure-free", "samples", "recovering (h)", "lost work (h)")
    for column in (*columns, "events", "final pipelines", "re-plan (ms, mean / max)"):
        table.add_column(
            column, justify="left" if column == "policy" else "right", no_wrap=column == "policy"
        )
    for r in results:
        row = _row(r)
        table.add_row(
            r.policy,
            f"{r.samples_per_s:.2f}",
            f"{r.effective_ratio:.3f}",
            f"{r.samples:,}",
            f"{row['recovery_h']:.2f}",
            f"{row['lost_h']:.2f}",
            str(r.events),
            str(r.final_pipelines),
            f"{row['replan_s_mean'] * 1e3:.1f} / {row['replan_s_max'] * 1e3:.1f}",
        )
    return table


def binned_rate(result: PolicyResult, edges: np.ndarray) -> np.ndarray:
    """Mean samples/s of ``result`` in each interval between ``edges`` (checkpoint writes and recoveries
    averaged in, so that short pauses show as dips, not as lines to zero)."""
    trained = np.zeros(len(edges) - 1)
    for s in result.segments:
        overlap = np.minimum(edges[1:], s.end_s) - np.maximum(edges[:-1], s.start_s)
        trained += np.clip(overlap, 0.0, None) * s.samples_per_s
    return trained / np.diff(edges)


def plot(results: list[PolicyResult], trace: Trace, path: str, bins: int = 400) -> None:
    """Throughput over time (mean per bin), one line per policy, failures (red) and returns (green)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    edges = np.linspace(0.0, trace.horizon_s, bins + 1)
    for r in results:
        ax.stairs(
            binned_rate(r, edges), edges / HOUR_S, label=f"{r.policy} ({r.samples_per_s:.2f} samples/s)"
        )
    for e in trace.events:
        if e.time_s < trace.horizon_s:
            ax.axvline(
                e.time_s / HOUR_S, color="tab:red" if e.kind == "fail" else "tab:green", alpha=0.25, lw=0.8
            )
    ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{trace.num_nodes} nodes, {trace.failures} failures (red), returns (green)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
