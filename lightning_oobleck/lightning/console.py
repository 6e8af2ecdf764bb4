"""One console for a run of many workers: what Lightning prints once under DDP is printed once here too, and
the strategy's own lines (the plan, where the run writes what).

Lightning prints its own messages on rank 0 only (``rank_zero_info``/``rank_zero_warn``), but Python warnings
raised by library code (a deprecation inside Lightning or torch) print in every process, and a worker knows
its rank only once the strategy set it. :func:`show_warnings_on_rank_zero` lets a worker print Python
warnings only while it is rank 0 (the rank of the current generation, so the new rank 0 takes over when the
old one is lost).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only
from rich.console import Console
from rich.table import Table

from lightning_oobleck.planning.plan import Plan

_INSTALLED = "_oobleck_rank_zero"


def show_warnings_on_rank_zero() -> None:
    """From now on this process prints Python warnings only while it is rank 0 (idempotent)."""
    shown = warnings.showwarning
    if getattr(shown, _INSTALLED, False):
        return

    def showwarning(*args: Any, **kwargs: Any) -> None:
        if rank_zero_only.rank == 0:
            shown(*args, **kwargs)

    setattr(showwarning, _INSTALLED, True)
    warnings.showwarning = showwarning


def print_start(plan: Plan, events: Path | None, profiles: Path | None) -> None:
    """What rank 0 prints when training starts: the plan, and where the run writes what (the events file
    lies in the run's log directory, beside the logs and the default checkpoints)."""
    console = Console()
    console.print(plan_table(plan))
    where = [f"logs, checkpoints and recovery events in {events.parent}"] if events is not None else []
    if profiles is not None:
        where.append(f"layer profiles in {profiles}")
    if where:
        console.print(f"oobleck: {'; '.join(where)}", highlight=False)


def plan_table(plan: Plan) -> Table:
    """The plan as a table: each pipeline's nodes, stages, micro-batches and samples of the global batch."""
    table = Table(
        title=f"Oobleck plan: {counted(len(plan.pipelines), 'pipeline')}, f={plan.fault_tolerance}, "
        f"global batch {plan.global_batch_size} = {plan.num_microbatches} x {plan.microbatch_size}"
    )
    for name in ("pipeline", "nodes", "stages: [first, end) layers", "micro-batches", "samples [first, end)"):
        table.add_column(name, justify="left" if name.startswith("stages") else "right")
    for i, p in enumerate(plan.pipelines):
        stages = " | ".join(f"{s.first_layer}-{s.end_layer}" for s in p.stages)
        samples = plan.microbatch_range(i)
        table.add_row(
            str(i),
            ", ".join(map(str, p.nodes)),
            stages,
            str(p.microbatches),
            f"{samples.start * plan.microbatch_size}-{samples.stop * plan.microbatch_size}",
        )
    return table


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
