"""``oobleck timeline RUN.jsonl [-o out.png]``: throughput over time with failures and recoveries.

Reads an event file written by :class:`~lightning_oobleck.recovery.events.EventLog` and draws samples/s
per step against time since the first step, a marker where each failure was detected (and where it
happened, when known), one where training resumed, and the recovery interval shaded between them.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from lightning_oobleck.recovery.events import RecoveryEvent, read_events


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "timeline",
        help="plot throughput over time with failure and recovery markers",
        description="Plot samples/s over time from an oobleck event file (JSONL), with failure markers.",
    )
    parser.add_argument("events", type=Path, metavar="RUN.jsonl", help="event file written during training")
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default: RUN.png beside the input)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_oobleck.cli import CliError

    if not args.events.is_file():
        raise CliError(f"no event file at {args.events}: pass the JSONL file the training run wrote")
    steps, recoveries = read_events(args.events)
    if len(steps) < 2:
        raise CliError(f"{args.events} has {len(steps)} step records: at least 2 are needed for a throughput")
    output = args.output or args.events.with_suffix(".png")
    draw_timeline(steps, recoveries, output, title=args.events.name)
    count = f"{len(recoveries)} recover{'y' if len(recoveries) == 1 else 'ies'}"
    print(f"wrote {output} ({len(steps)} steps, {count})")
    return 0


def _around(steps: list[dict[str, Any]], start: float, end: float, window: int = 5) -> tuple[float, float]:
    """Mean throughput over the ``window`` steps before ``start`` and after ``end``; the step redone after a
    recovery, whose duration holds the failure and the recovery, counts for neither."""

    def rate(chosen: list[dict[str, Any]]) -> float:
        return sum(s["samples"] for s in chosen) / max(sum(s["duration_s"] for s in chosen), 1e-9)

    after = [s for s in steps if s["time"] > end]
    return rate([s for s in steps if s["time"] <= start][-window:]), rate(after[1 : window + 1] or after)


def recovery_label(event: RecoveryEvent, steps: list[dict[str, Any]], start: float) -> str:
    """What the timeline writes beside a recovery that began at ``start``: the generation, the nodes lost
    and joined, the way chosen and the candidates it was chosen from (their predictions), the time it took
    and the throughput before and after."""
    lost = sorted({n for n, _ in event.removed})
    joined = sorted({n for n, _ in event.added})
    before, after = _around(steps, start, event.resumed_at)
    return "\n".join(
        [f"generation {event.generation}"]
        + [f"lost node {', '.join(map(str, lost))}"] * bool(lost)
        + [f"node {', '.join(map(str, joined))} joined"] * bool(joined)
        + [f"by {event.recovery_policy}" + " of:" * bool(event.candidates)] * bool(event.recovery_policy)
        + [f"  {candidate}" for candidate in event.candidates]
        + [f"in {event.resumed_at - start:.2f} s; {before:.0f} -> {after:.0f} samples/s"]
    )


def draw_timeline(
    steps: list[dict[str, Any]], recoveries: list[RecoveryEvent], output: Path, title: str = ""
) -> None:
    """Write the throughput timeline PNG (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0]["time"]
    # Throughput between consecutive step ends (so time lost to a recovery shows as a dip), from step 2 on.
    times = [s["time"] - t0 for s in steps[1:]]
    rates = [s["samples"] / max(s["time"] - p["time"], 1e-9) for p, s in itertools.pairwise(steps)]

    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=120)
    ax.plot(times, rates, color="tab:blue", marker=".", linewidth=1.2, label="throughput")
    labelled: set[str] = set()

    def mark(at: float, color: str, style: str, label: str) -> None:
        """A vertical line; each kind named once in the legend."""
        ax.axvline(at - t0, color=color, linestyle=style, label=None if label in labelled else label)
        labelled.add(label)

    for event in recoveries:
        joined = sorted({n for n, _ in event.added})
        if event.failed_at is not None:
            mark(event.failed_at, "black", ":", "failure")
        if event.detected_at is not None:  # a pure join's "detection" is the members' admission request
            if event.removed:
                mark(event.detected_at, "tab:red", "--", "failure detected")
            else:
                mark(event.detected_at, "tab:purple", "--", "admission asked")
        if event.resumed_at is not None:
            if joined:
                mark(event.resumed_at, "tab:purple", "-", "node(s) joined")
            else:
                mark(event.resumed_at, "tab:green", "-", "resumed")
            start = event.failed_at if event.failed_at is not None else event.detected_at
            if start is not None:
                ax.axvspan(start - t0, event.resumed_at - t0, color="tab:orange", alpha=0.25)
                # past the middle, the text goes left of the line: the candidates' lines are long
                right = event.resumed_at - t0 < times[-1] / 2
                ax.annotate(
                    recovery_label(event, steps, start),
                    xy=(event.resumed_at - t0, max(rates)),
                    xytext=(4 if right else -4, -4),
                    textcoords="offset points",
                    ha="left" if right else "right",
                    multialignment="left",
                    va="top",
                    fontsize=7,
                    bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "none"},
                )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0, top=max(rates) * 1.15)
    ax.set_title(f"throughput and recoveries: {title}" if title else "throughput and recoveries")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
