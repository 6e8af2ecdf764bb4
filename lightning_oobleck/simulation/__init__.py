"""What a training job achieves under failures: traces, and the job replayed on the real planner under
each recovery policy (pure Python, no torch.distributed)."""

from lightning_oobleck.simulation.simulator import (
    POLICIES,
    Costs,
    PolicyResult,
    Segment,
    simulate,
    simulate_checkpoint_restart,
    simulate_oobleck,
    simulate_replica_groups,
)
from lightning_oobleck.simulation.trace import (
    NodeEvent,
    Trace,
    fixed_interval_trace,
    mttf_trace,
    poisson_trace,
)

__all__ = [
    "POLICIES",
    "Costs",
    "NodeEvent",
    "PolicyResult",
    "Segment",
    "Trace",
    "fixed_interval_trace",
    "mttf_trace",
    "poisson_trace",
    "simulate",
    "simulate_checkpoint_restart",
    "simulate_oobleck",
    "simulate_replica_groups",
]
