"""``oobleck plan`` and ``oobleck replan``: size a cluster, and see the plan after failures or joins.

``oobleck plan`` prints the templates (stages per node) and the pipelines (nodes, micro-batches,
predicted time) of the fastest plan with at least ``f + 1`` pipelines; ``--json`` prints the plan's
JSON (the schema in docs/planning.md), which ``oobleck replan --plan`` reads back with ``--fail`` or
``--add``; ``--fail`` with ``--policy reroute`` or ``auto`` shows the rerouted plan or the choice, each way's
predicted step and copy. Bad input exits with status 2 and one line naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lightning_oobleck.cli import CliError
from lightning_oobleck.config import load_config
from lightning_oobleck.planning.config import PlannerConfig
from lightning_oobleck.planning.layout import layout_plan
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import with_templates
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.reconfigure import Reconfiguration, after_joins
from lightning_oobleck.planning.rerouting import RECOVERY_POLICIES, choose_recovery
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES

_FLAG_KEYS = {
    "layers": "model.layers",
    "nodes": "cluster.num_nodes",
    "gpus_per_node": "cluster.gpus_per_node",
    "fault_tolerance": "fault_tolerance",
    "global_batch": "global_batch",
    "microbatch": "microbatch",
    "profile": "profile",
    "activation_checkpointing": "activation_checkpointing",
    "schedule": "schedule",
    "tensor_parallel": "tensor_parallel",
}
"""Command-line flags and the configuration keys they override."""


def add_job_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The job's flags (model, cluster, f, batch, schedule), each overriding its configuration key under
    ``prefix`` (see :func:`job_overrides`)."""
    parser.add_argument("--layers", type=int, help=f"layers of the synthetic GPT ({prefix}model.layers)")
    parser.add_argument("--nodes", type=int, help=f"nodes in the cluster ({prefix}cluster.num_nodes)")
    parser.add_argument("--gpus-per-node", type=int, help=f"GPUs per node ({prefix}cluster.gpus_per_node)")
    parser.add_argument("--fault-tolerance", type=int, help="simultaneous node failures to survive (f)")
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step (B)")
    parser.add_argument("--microbatch", type=int, help="samples per micro-batch (b)")
    parser.add_argument("--profile", help="measured layer profile JSON (replaces the synthetic model)")
    parser.add_argument(
        "--activation-checkpointing",
        choices=["false", "true", "auto"],
        help="recompute activations: never, on every stage, or where a split would not fit otherwise",
    )
    parser.add_argument(
        "--schedule",
        choices=[*SCHEDULE_NAMES, "auto"],
        help="the pipeline schedule the plan runs; auto: the faster predicted (default 1f1b)",
    )
    parser.add_argument(
        "--tensor-parallel",
        choices=["auto", "1", "2", "4", "8"],
        help="GPUs of a node each stage runs on, its layers split over them; auto: the fastest (default 1)",
    )


def job_overrides(args: argparse.Namespace, prefix: str = "") -> list[str]:
    """``--set`` overrides for the job's flags that were given (:func:`add_job_arguments`)."""
    return [
        f"{prefix}{key}={getattr(args, flag)}"
        for flag, key in _FLAG_KEYS.items()
        if getattr(args, flag) is not None
    ]


def job_profile(config: PlannerConfig, layers: int | None) -> ModelProfile:
    """The job's profile; ``--layers`` (``layers``) must agree with a measured one."""
    profile = config.load_profile()
    if layers is not None and profile.num_layers != layers:
        raise CliError(f"--layers {layers} but the profile has {profile.num_layers} layers: drop --layers")
    return profile


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``oobleck plan`` and ``oobleck replan`` to the ``oobleck`` command."""
    plan = subparsers.add_parser(
        "plan", help="plan pipelines for a cluster", description="Plan pipelines with the f+1 guarantee."
    )
    add_job_arguments(plan)
    plan.add_argument("--config", help="YAML file with planner settings (PlannerConfig)")
    plan.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting, e.g. cluster.device_memory_bytes=80e9",
    )
    plan.add_argument(
        "--layout",
        help="your own stage boundaries per pipeline, e.g. '0,3,6;0,6' (OobleckStrategy(layout=...)): kept "
        "as written, with the planner's templates for other node counts so that it recovers in place",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=run_plan)

    replan = subparsers.add_parser(
        "replan", help="the plan after node failures or joins", description="Replan from a plan's JSON."
    )
    replan.add_argument("--plan", required=True, help="plan JSON written by `oobleck plan --json`")
    change = replan.add_mutually_exclusive_group(required=True)
    change.add_argument("--fail", help="comma-separated ids of failed nodes, e.g. 3,7")
    change.add_argument("--add", type=int, help="number of nodes joining (they get fresh ids)")
    replan.add_argument(
        "--policy",
        choices=RECOVERY_POLICIES,
        default="reinstantiate",
        help="with --fail: re-instantiate, reroute (ReCycle) or the better predicted (recovery_policy)",
    )
    replan.add_argument(
        "--failure-interval-s",
        type=float,
        default=3600.0,
        help="with --policy auto: the expected time to the next failure (failure_interval_s)",
    )
    replan.add_argument("--json", action="store_true", help="print the new plan and its copies as JSON")
    replan.set_defaults(func=run_replan)


def run_plan(args: argparse.Namespace) -> int:
    config = load_config(PlannerConfig, args.config, list(args.set) + job_overrides(args))
    profile = job_profile(config, args.layers)
    if args.layout is None:
        plan = config.make_plan(profile)
    else:
        hand = layout_plan(
            _parse_layout(args.layout),
            profile.num_layers,
            gpus_per_node=config.cluster.gpus_per_node,
            fault_tolerance=config.fault_tolerance,
            global_batch_size=config.global_batch,
            microbatch_size=config.microbatch,
            schedule=config.schedule,
            recompute=config.activation_checkpointing is True,
        )
        if len(hand.nodes) != config.cluster.num_nodes:
            raise CliError(f"--layout uses {len(hand.nodes)} nodes but --nodes is {config.cluster.num_nodes}")
        plan = with_templates(hand, config.inputs(profile))
    _print(plan.to_dict(), plan, args.json)
    return 0


def _parse_layout(text: str) -> list[list[int]]:
    try:
        return [[int(x) for x in pipeline.split(",")] for pipeline in text.split(";")]
    except ValueError as e:
        raise CliError(
            f"--layout takes boundaries like '0,3,6;0,6' (';' between pipelines), got {text!r}"
        ) from e


def run_replan(args: argparse.Namespace) -> int:
    if not Path(args.plan).is_file():
        raise CliError(f"plan file {args.plan} not found: write one with `oobleck plan --json > PLAN.json`")
    plan = Plan.load(args.plan)
    if args.fail is not None:
        try:
            failed = [int(x) for x in args.fail.split(",") if x.strip()]
        except ValueError as e:
            raise CliError(f"--fail takes comma-separated node ids such as 3,7, got {args.fail!r}") from e
        choice = choose_recovery(plan, failed, args.policy, args.failure_interval_s)
        result = choice.reconfiguration
        _print({**result.to_dict(), "recovery": choice.to_dict()}, result.plan, args.json, result)
        if not args.json:
            Console().print(f"recovered by {choice.policy}: " + "; ".join(map(str, choice.candidates)))
        return 0
    if args.policy != "reinstantiate":
        raise CliError("--policy chooses how failures are recovered from: give it with --fail, not --add")
    result = after_joins(plan, args.add)
    _print(result.to_dict(), result.plan, args.json, result)
    return 0


def _print(data: dict, plan: Plan, as_json: bool, result: Reconfiguration | None = None) -> None:
    if as_json:
        print(json.dumps(data, indent=2))
        return
    console = Console()
    console.print(_templates_table(plan))
    console.print(_pipelines_table(plan))
    if result is not None:
        console.print(_copies_table(result))
    console.print(
        f"n0={plan.n0}  f={plan.fault_tolerance}  pipelines={len(plan.pipelines)}  "
        f"micro-batches={plan.num_microbatches}  schedule {plan.schedule}  "
        f"tensor parallel {plan.tensor_parallel}  iteration {plan.iteration_time_s:.3f} s  "
        f"planned in {plan.planning_s:.3f} s"
    )
    for choice in plan.choices():
        console.print(choice)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")


def _templates_table(plan: Plan) -> Table:
    t = plan.tensor_parallel
    table = Table(title="Pipeline templates" + (f" (each stage on {t} GPUs of a node)" if t > 1 else ""))
    table.add_column("nodes", justify="right")
    per = "GPU" if t == 1 else f"{t} GPUs"
    table.add_column(f"stages: [first, end) layers per {per}, by node (*: recomputes activations)")
    table.add_column("micro-batches", justify="right")
    table.add_column("iteration (s)", justify="right")
    table.add_column("compute / tensor-parallel / bubble", justify="right")
    for t in plan.templates:
        by_node = [
            " ".join(
                f"{s.first_layer}-{s.end_layer}{'*' if s.recompute else ''}" for s in t.stages if s.node == n
            )
            for n in range(t.num_nodes)
        ]
        m = t.microbatches or len(t.stages)
        split = " / ".join(f"{share:.0%}" for share in t.time_split(m))
        table.add_row(str(t.num_nodes), " | ".join(by_node), str(m), f"{t.iteration_time_s(m):.3f}", split)
    return table


def _pipelines_table(plan: Plan) -> Table:
    table = Table(title="Pipelines")
    for name in ("#", "template nodes", "cluster nodes", "micro-batches", "predicted (s)"):
        table.add_column(name, justify="right" if name != "cluster nodes" else "left")
    helpers = {(r.pipeline, r.stage): r.helpers for r in plan.reroutes}
    for i, p in enumerate(plan.pipelines):
        nodes = [
            f"{n} (lost: pipelines {', '.join(map(str, helpers[(i, s)]))})" if (i, s) in helpers else str(n)
            for s, n in ((s, p.worker_of_stage(s).node) for s in range(len(p.stages)))
        ]
        table.add_row(
            str(i),
            str(p.template.num_nodes),
            ", ".join(dict.fromkeys(nodes)),
            str(p.microbatches),
            f"{p.iteration_time_s():.3f}",
        )
    return table


def _copies_table(result: Reconfiguration, shown: int = 20) -> Table:
    """The first ``shown`` copies; the JSON output has them all."""
    table = Table(title=f"Layer copies ({len(result.copies)}, first {min(shown, len(result.copies))} shown)")
    for name in ("layer", "to node:gpu", "from node:gpu (striped over)"):
        table.add_column(name, justify="right")
    for c in result.copies[:shown]:
        sources = ", ".join(f"{w.node}:{w.device}" for w in c.sources)
        table.add_row(str(c.layer), f"{c.to_node}:{c.to_device}", sources)
    return table
