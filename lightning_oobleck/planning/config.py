"""The planner's configuration schema (loaded with :func:`lightning_oobleck.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_oobleck.planning.batch import num_microbatches
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import PlannerInputs
from lightning_oobleck.planning.profile import ModelProfile, synthetic_gpt_profile


@dataclass
class SyntheticModelSpec:
    """A GPT-like model for :func:`synthetic_gpt_profile`, used when no measured profile is given."""

    layers: int = 24
    hidden: int = 2048
    seq_len: int = 2048
    heads: int = 0
    """0: ``hidden // 128``."""
    vocab_size: int = 50257
    dtype: str = "float16"
    device_flops: float = 1.0e14
    """Achieved FLOP/s of one device."""


@dataclass
class PlannerConfig:
    """Everything ``oobleck plan`` needs: the cluster, the model, the guarantee and the batch."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    model: SyntheticModelSpec = field(default_factory=SyntheticModelSpec)
    profile: str | None = None
    """Path of a measured profile JSON (``ModelProfile.save``); replaces ``model``."""
    fault_tolerance: int = 1
    global_batch: int = 512
    microbatch: int = 4
    state_factor: float | None = None
    """Bytes of parameter + gradient + optimizer state per parameter byte; None: from the dtype."""
    exact_limit: int = 20_000
    """Evaluate every template multiset when there are at most this many (exact instantiation)."""
    activation_checkpointing: Any = False
    """Activation recomputation: false, true (every stage) or auto (only where a split would not fit)."""
    schedule: str = "1f1b"
    """The pipeline schedule the plan runs: 1f1b, zb-h1, or auto (the faster predicted)."""
    tensor_parallel: Any = 1
    """The devices of a node each stage runs on (1, 2, 4, 8: a divisor of the GPUs per node), or auto: the
    fastest plan among the degrees the profile describes."""

    def validate(self) -> None:
        self.cluster.validate()
        if self.fault_tolerance < 0:
            raise ValueError(f"fault_tolerance must be >= 0, got {self.fault_tolerance}")
        num_microbatches(self.global_batch, self.microbatch)

    def load_profile(self) -> ModelProfile:
        """The measured profile if ``profile`` is set, else the synthetic GPT one for ``model``."""
        if self.profile is not None:
            return ModelProfile.load(self.profile)
        m = self.model
        return synthetic_gpt_profile(
            m.layers,
            m.hidden,
            m.seq_len,
            self.microbatch,
            m.device_flops,
            heads=m.heads or None,
            vocab_size=m.vocab_size,
            dtype=m.dtype,
        )

    def make_plan(self, profile: ModelProfile | None = None) -> Plan:
        """The plan for this configuration (``profile``: the one :meth:`load_profile` gives, if loaded)."""
        return self.inputs(profile).make_plan(self.global_batch, self.microbatch)

    def inputs(self, profile: ModelProfile | None = None) -> PlannerInputs:
        """What the planner plans this configuration from."""
        return PlannerInputs(
            profile if profile is not None else self.load_profile(),
            self.cluster,
            self.fault_tolerance,
            self.state_factor,
            self.exact_limit,
            self.activation_checkpointing,
            self.schedule,
            self.tensor_parallel,
        )
