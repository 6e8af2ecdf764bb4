"""The configuration of ``oobleck simulate`` (loaded with :func:`lightning_oobleck.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_oobleck.planning.config import PlannerConfig
from lightning_oobleck.simulation.simulator import POLICIES, Costs
from lightning_oobleck.simulation.trace import Trace, fixed_interval_trace, mttf_trace, poisson_trace

HOUR_S = 3600.0
TRACE_KINDS = ("poisson", "mttf", "fixed", "file")


@dataclass
class TraceConfig:
    """Where the node events come from: ``kind`` picks the generator (or ``file``)."""

    kind: str = "poisson"
    failures_per_node_day: float = 0.0065
    """``poisson``: failures per node and day (Meta's research clusters: 6.50 and 2.34 per 1,000
    node-days)."""
    job_mttf_h: float = 7.9
    """``mttf``: the whole job's mean time to failure (Meta: 7.9 h measured for 1,024-GPU jobs)."""
    repair_mean_h: float | None = None
    """Mean time until a lost node is back (exponential); ``None``: never."""
    rack_size: int = 1
    rack_share: float = 0.0
    """``poisson``: the share of failures that take every live node of a rack of ``rack_size`` nodes."""
    removals: int = 15
    interval_h: float = 1.0
    """``fixed``: ``removals`` nodes lost one at a time every ``interval_h`` (the Oobleck paper's Table 2)."""
    file: str | None = None
    """``file``: a trace JSON (``Trace.save``); its node count must be the cluster's."""
    seed: int = 0


@dataclass
class SimulateConfig:
    """Everything ``oobleck simulate`` needs: the job (as ``oobleck plan``), the trace, the policies."""

    job: PlannerConfig = field(default_factory=PlannerConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    horizon_h: float = 24.0
    """Simulated wall time; a ``fixed`` trace's default is one interval after its last removal (0 here)."""
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    costs: Costs = field(default_factory=Costs)

    def validate(self) -> None:
        self.job.validate()
        if self.trace.kind not in TRACE_KINDS:
            raise ValueError(f"unknown trace.kind {self.trace.kind!r}; use one of {', '.join(TRACE_KINDS)}")
        if unknown := [p for p in self.policies if p not in POLICIES]:
            raise ValueError(f"unknown policy {unknown[0]!r}; use one of {', '.join(POLICIES)}")
        if self.horizon_h <= 0 and self.trace.kind != "fixed":
            raise ValueError(f"horizon_h must be positive, got {self.horizon_h}")

    def make_trace(self) -> Trace:
        """The trace this configuration names, over the job's cluster."""
        t, nodes = self.trace, self.job.cluster.num_nodes
        horizon = self.horizon_h * HOUR_S
        repair = None if t.repair_mean_h is None else t.repair_mean_h * HOUR_S
        if t.kind == "file":
            if t.file is None:
                raise ValueError("trace.kind=file needs trace.file=PATH (a JSON written by Trace.save)")
            trace = Trace.load(t.file)
            if trace.num_nodes != nodes:
                raise ValueError(
                    f"the trace {t.file} is for {trace.num_nodes} nodes but the cluster has {nodes}: "
                    f"set job.cluster.num_nodes={trace.num_nodes}"
                )
            return trace
        if t.kind == "fixed":
            return fixed_interval_trace(
                nodes, t.removals, t.interval_h * HOUR_S, horizon if horizon > 0 else None, t.seed
            )
        if t.kind == "mttf":
            return mttf_trace(nodes, t.job_mttf_h * HOUR_S, horizon, repair, t.seed)
        return poisson_trace(
            nodes, t.failures_per_node_day, horizon, repair, t.rack_size, t.rack_share, t.seed
        )
