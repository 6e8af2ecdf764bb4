"""Failure traces: when which nodes of a job are lost and when they come back.

A trace names physical nodes ``0..num_nodes-1`` (machines, not the plan's node ids: a machine that comes
back joins a training under a new id). It comes from a file (JSON, :meth:`Trace.save`) or a generator:

* :func:`fixed_interval_trace`: one node removed every ``interval_s``, none returning (the Oobleck paper's
  Table 2 setup);
* :func:`poisson_trace`: every live node fails at a constant rate (a Poisson process per node), optionally
  taking its whole rack with it, and comes back after an exponentially distributed repair time;
* :func:`mttf_trace`: the same, from a whole job's mean time to failure (the rate per node is
  ``1 / (MTTF * nodes)``).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

EventKind = Literal["fail", "return"]
DAY_S = 86_400.0


@dataclass(frozen=True)
class NodeEvent:
    """At ``time_s``, the machines ``nodes`` are lost (``fail``) or available again (``return``)."""

    time_s: float
    kind: EventKind
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """The node events of a job of ``num_nodes`` machines over ``horizon_s`` seconds, in time order."""

    num_nodes: int
    horizon_s: float
    events: tuple[NodeEvent, ...]

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.horizon_s <= 0:
            raise ValueError(
                f"a trace needs nodes and a positive horizon, got {self.num_nodes}, {self.horizon_s}"
            )
        down: set[int] = set()
        last = 0.0
        for e in self.events:
            if e.time_s < last:
                raise ValueError(f"trace events must be in time order: {e} comes after t={last}")
            last = e.time_s
            if bad := [n for n in e.nodes if not 0 <= n < self.num_nodes]:
                raise ValueError(
                    f"event at t={e.time_s:g} names node(s) {bad} outside 0..{self.num_nodes - 1}"
                )
            if e.kind == "fail":
                if again := sorted(set(e.nodes) & down):
                    raise ValueError(f"node(s) {again} fail at t={e.time_s:g} while already down")
                down |= set(e.nodes)
            elif e.kind == "return":
                if up := sorted(set(e.nodes) - down):
                    raise ValueError(f"node(s) {up} return at t={e.time_s:g} without having failed")
                down -= set(e.nodes)
            else:
                raise ValueError(f"unknown event kind {e.kind!r}: use 'fail' or 'return'")

    @property
    def failures(self) -> int:
        return sum(e.kind == "fail" for e in self.events)

    @property
    def mean_repair_s(self) -> float | None:
        """The mean time from a node's failure to its return, over the nodes that return (``None``: none
        do)."""
        failed_at: dict[int, float] = {}
        repairs: list[float] = []
        for e in self.events:
            for node in e.nodes:
                if e.kind == "fail":
                    failed_at[node] = e.time_s
                else:
                    repairs.append(e.time_s - failed_at.pop(node))
        return sum(repairs) / len(repairs) if repairs else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_nodes": self.num_nodes,
            "horizon_s": self.horizon_s,
            "events": [asdict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        events = tuple(
            NodeEvent(float(e["time_s"]), e["kind"], tuple(int(n) for n in e["nodes"])) for e in d["events"]
        )
        return cls(int(d["num_nodes"]), float(d["horizon_s"]), events)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the trace {path}: {e}; write it with Trace.save") from e


def fixed_interval_trace(
    num_nodes: int, removals: int, interval_s: float, horizon_s: float | None = None, seed: int = 0
) -> Trace:
    """``removals`` nodes lost one at a time, the first after ``interval_s`` and every ``interval_s`` after
    it, none returning; the horizon defaults to one interval after the last removal."""
    if not 0 <= removals <= num_nodes:
        raise ValueError(f"cannot remove {removals} of {num_nodes} nodes")
    order = np.random.default_rng(seed).permutation(num_nodes)[:removals]
    horizon = horizon_s if horizon_s is not None else (removals + 1) * interval_s
    events = tuple(
        NodeEvent(k * interval_s, "fail", (int(n),))
        for k, n in enumerate(order, start=1)
        if k * interval_s < horizon
    )
    return Trace(num_nodes, horizon, events)


def poisson_trace(
    num_nodes: int,
    failures_per_node_day: float,
    horizon_s: float,
    repair_mean_s: float | None = None,
    rack_size: int = 1,
    rack_share: float = 0.0,
    seed: int = 0,
) -> Trace:
    """Each live node fails at ``failures_per_node_day``; a share ``rack_share`` of the failures take every
    live node of the failed node's rack (``rack_size`` consecutive nodes) at once. A lost node returns after
    an exponential repair time of mean ``repair_mean_s`` (never with ``None``)."""
    if failures_per_node_day < 0 or not 0.0 <= rack_share <= 1.0 or rack_size < 1:
        raise ValueError("the failure rate must be >= 0, rack_share in [0, 1] and rack_size >= 1")
    rng = np.random.default_rng(seed)
    rate = failures_per_node_day / DAY_S
    alive = set(range(num_nodes))
    returns: list[tuple[float, int]] = []  # (time, node), a heap
    events: list[NodeEvent] = []
    t = 0.0
    while rate > 0:
        wait = rng.exponential(1.0 / (rate * len(alive))) if alive else np.inf
        if returns and returns[0][0] <= t + wait:
            t, node = heapq.heappop(returns)
            if t >= horizon_s:
                break
            alive.add(node)
            events.append(NodeEvent(t, "return", (node,)))
            continue
        t += wait
        if t >= horizon_s:
            break
        node = sorted(alive)[int(rng.integers(len(alive)))]
        if rng.random() < rack_share:
            rack = node // rack_size * rack_size
            lost = tuple(n for n in range(rack, min(rack + rack_size, num_nodes)) if n in alive)
        else:
            lost = (node,)
        alive -= set(lost)
        events.append(NodeEvent(t, "fail", lost))
        if repair_mean_s is not None:
            for n in lost:
                heapq.heappush(returns, (t + float(rng.exponential(repair_mean_s)), n))
    return Trace(num_nodes, horizon_s, tuple(events))


def mttf_trace(
    num_nodes: int, job_mttf_s: float, horizon_s: float, repair_mean_s: float | None = None, seed: int = 0
) -> Trace:
    """A Poisson trace whose whole job of ``num_nodes`` fails on average every ``job_mttf_s``."""
    if job_mttf_s <= 0:
        raise ValueError(f"the job's mean time to failure must be positive, got {job_mttf_s}")
    per_node_day = DAY_S / (job_mttf_s * num_nodes)
    return poisson_trace(num_nodes, per_node_day, horizon_s, repair_mean_s, seed=seed)
