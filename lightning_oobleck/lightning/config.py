"""The strategy's configuration: one dataclass, usable as an OmegaConf structured config.

``OobleckStrategy(...)`` (a typed keyword argument per field) and ``OobleckStrategy.from_config(cfg)`` take
the same keys; a YAML file with a ``strategy:`` section plus command-line dot-list overrides
(``strategy.fault_tolerance=2``) is the usual way to set them (see ``examples/gpt/config.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig

from lightning_oobleck.config import load_config, structured
from lightning_oobleck.planning.rerouting import RECOVERY_POLICIES
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES
from lightning_oobleck.recovery.admission import JoinPolicy

StartMethod = Literal["forkserver", "spawn", "fork"]
START_METHODS: tuple[str, ...] = ("forkserver", "spawn", "fork")
JOIN_POLICIES: tuple[str, ...] = tuple(policy.value for policy in JoinPolicy)


@dataclass
class OobleckConfig:
    """Everything the Oobleck strategy needs besides the model, the data and the Trainer's own flags."""

    global_batch_size: int | None = None
    """Samples per optimizer step, over all pipelines, fixed whatever the layout. ``None``: the training
    DataLoader's ``batch_size`` (the batch the model would see on one device), or, for a DataModule that
    makes its loaders in ``setup()``, the ``batch_size`` attribute or hyperparameter of the DataModule or
    the module (Lightning's convention)."""
    microbatch_size: int | None = None
    """Samples per micro-batch; must divide ``global_batch_size``. ``None``: the largest divisor that gives
    every process at least two micro-batches per step."""
    fault_tolerance: int = 1
    """f: node failures to survive at once (the plan runs at least f + 1 pipelines)."""
    devices_per_node: int | None = None
    """Devices (processes) per failure domain: a node dies as a whole. ``None``: under SLURM the tasks per
    node (``--ntasks-per-node``, the Trainer's ``devices``); with the local launcher 1 (each local process
    stands for a node, so that one machine can rehearse node failures)."""
    seed: int = 0
    """Seeds the sample order (initial weights come from the module's ``init_seed``)."""
    backend: str | None = None
    """torch.distributed backend; ``None`` picks gloo on CPU and NCCL on GPU."""
    heartbeat_timeout_s: float = 5.0
    """Failure detection: a worker silent for this long is declared dead and fenced (it sends heartbeats 4
    times as often). Must exceed the longest time a worker's Python thread can be starved (e.g. a long
    GIL-holding call). The first of the timeouts: heartbeat < collective <= hang."""
    collective_timeout_s: float = 60.0
    """Slow is not dead: a collective or transfer still waiting after this long on peers that all send
    heartbeats logs a warning and goes on waiting (a dead peer is found by its heartbeats, not by this).
    Without the recovery coordinator (a bare ``torch.distributed`` setup) the wait ends with an error."""
    hang_timeout_s: float = 1800.0
    """The last resort: a wait on live peers that makes no progress for this long (a deadlock in user code)
    ends the run with an error; also how long a recovery waits for a live member to reach its agreement
    barrier before declaring it dead."""
    plan_timeout_s: float = 300.0
    """How long workers wait for rank 0 to publish the plan (profiling and planning included)."""
    start_method: str = "forkserver"
    """How the local launcher starts workers: ``forkserver`` or ``spawn`` (both need the ``__main__``
    guard), or ``fork`` (notebooks; unsafe once torch ran ops or threads in the calling process)."""
    planner: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the planner's ``make_plan``."""
    profile_path: str | None = None
    """A saved layer profile (JSON) to plan from instead of profiling the model at start-up, e.g. the
    ``profile.json`` of a checkpoint, so that a resume elsewhere plans as the run that wrote it."""
    profile_cache_dir: str | None = None
    """Where measured profiles are kept, keyed by the layers, input shape, dtype, device and torch version
    (``None``: ``oobleck-profiles`` in the Trainer's ``default_root_dir``). A run finds the profile of an
    earlier run of the same model there, so the automatic plan does not follow timing noise from run to
    run; delete it to measure again."""
    plan_path: str | None = None
    """A saved plan (JSON, as printed by ``oobleck plan --json``) to run instead of planning."""
    layout: list[list[int]] | None = None
    """An explicit layout instead of the planner's: one list of stage boundaries per pipeline, e.g.
    ``[[0, 3, 6], [0, 6]]`` is a 2-stage pipeline (layers 0-2 and 3-5) beside a 1-stage one."""
    activation_checkpointing: Any = False
    """Activation recomputation (``torch.utils.checkpoint`` per layer): ``False``, ``True`` (every stage) or
    ``"auto"`` (the planner turns it on per template exactly where a split would not fit otherwise). With
    ``layout``, ``True`` or ``False``."""
    microbatches: list[int] | None = None
    """With ``layout``: micro-batches per pipeline (default: as even as possible)."""
    tensor_parallel: Any = 1
    """The devices of one node each stage runs on, its layers split over them (Megatron-LM's tensor
    parallelism, through DTensor; each layer's split is ``PipelineModule.tensor_parallel_plan``): ``1``, a
    divisor of ``devices_per_node``, or ``"auto"`` (the planner profiles the layers at every such degree and
    keeps the fastest plan)."""
    schedule: str = "1f1b"
    """The pipeline schedule: ``1f1b``, ``zb-h1`` (zero bubble: each backward split into the input's
    gradient, sent upstream at once, and the weights', run later in what would be bubbles; shorter steps at
    1F1B's peak activation memory on every stage), or ``"auto"`` (the planner plans both and keeps the faster
    predicted). The planner plans for it; a ``plan_path`` must have been made for it."""
    join_policy: str = "at_once"
    """When nodes that come back (or spares) join the running training: ``at_once`` (at the next step
    boundary), ``whole_template`` (once they form a pipeline of their own) or ``hot_standby`` (only to
    replace lost nodes: they wait, started, for a failure)."""
    replace_failed_after_s: float | None = None
    """Local launcher: start a replacement for a dead worker's node this long after its death (it joins the
    running training); ``None``: never."""
    recovery_policy: str = "reinstantiate"
    """How training goes on after nodes fail: ``reinstantiate`` (Oobleck: pipelines rebuilt from the
    templates, the layers a worker newly holds copied to it), ``reroute`` (ReCycle: the damaged pipelines keep
    their surviving stages and the lost stages' micro-batches run on other pipelines' replicas; nothing is
    copied, the steps are slower; re-instantiation where a layer has no live replica) or ``auto`` (per
    failure, whichever the cost model predicts trains more samples within ``failure_interval_s``)."""
    failure_interval_s: float = 3600.0
    """The expected time from one failure to the next, before the run has seen any: ``recovery_policy="auto"``
    weighs a faster step against the copy it costs over how long the layout it chooses is expected to last:
    until the next failure, this interval revised by the failures the run has seen (the configured interval
    counts as one failure's worth of evidence: ``(failure_interval_s + time run) / (1 + failures seen)``),
    or until the replacement joins (``replace_failed_after_s``), whichever is sooner."""

    def validate(self) -> None:
        """Raise a :class:`ValueError` naming the bad key and the fix."""
        for name in ("global_batch_size", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        b, big_b = self.microbatch_size, self.global_batch_size
        if b is not None and big_b is not None and big_b % b:
            raise ValueError(
                f"microbatch_size={b} does not divide global_batch_size={big_b}: pick a divisor, "
                f"e.g. microbatch_size={_largest_divisor_at_most(big_b, b)}"
            )
        if not 0 < self.heartbeat_timeout_s < self.collective_timeout_s <= self.hang_timeout_s:
            raise ValueError(
                f"the timeouts must rise: 0 < heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) < "
                f"collective_timeout_s ({self.collective_timeout_s:g}) <= "
                f"hang_timeout_s ({self.hang_timeout_s:g})"
            )
        if self.fault_tolerance < 0:
            raise ValueError(f"fault_tolerance must be >= 0, got {self.fault_tolerance}")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}"
            )
        if self.activation_checkpointing not in (False, True, "auto"):
            raise ValueError(
                "activation_checkpointing must be false, true or 'auto', got "
                f"{self.activation_checkpointing!r}"
            )
        if self.activation_checkpointing == "auto" and (
            self.layout is not None or self.plan_path is not None
        ):
            raise ValueError(
                "activation_checkpointing='auto' lets the planner choose where to recompute; with a fixed "
                "layout or plan_path give true or false (a plan_path's stages say it themselves)"
            )
        if self.schedule not in (*SCHEDULE_NAMES, "auto"):
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULE_NAMES)} or 'auto', got {self.schedule!r}"
            )
        if self.schedule == "auto" and self.layout is not None:
            raise ValueError(
                "schedule='auto' lets the planner choose; with a fixed layout name the schedule: "
                f"{' or '.join(SCHEDULE_NAMES)}"
            )
        t = self.tensor_parallel
        if t != "auto" and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"tensor_parallel must be a positive integer or 'auto', got {t!r}")
        if t == "auto" and (self.layout is not None or self.plan_path is not None):
            raise ValueError(
                "tensor_parallel='auto' lets the planner choose; with a fixed layout give its degree (an "
                "integer), with plan_path none (the plan says it)"
            )
        if self.join_policy not in JOIN_POLICIES:
            raise ValueError(
                f"join_policy must be one of {', '.join(JOIN_POLICIES)}, got {self.join_policy!r}"
            )
        if self.recovery_policy not in RECOVERY_POLICIES:
            raise ValueError(
                f"recovery_policy must be one of {', '.join(RECOVERY_POLICIES)}, got {self.recovery_policy!r}"
            )
        if self.failure_interval_s <= 0:
            raise ValueError(f"failure_interval_s must be positive, got {self.failure_interval_s}")
        if self.replace_failed_after_s is not None and self.replace_failed_after_s < 0:
            raise ValueError(
                f"replace_failed_after_s must be >= 0 (or None), got {self.replace_failed_after_s}"
            )
        if self.microbatches is not None and self.layout is None:
            raise ValueError("microbatches is only meaningful with layout=[[...], ...]")
        if sum(x is not None for x in (self.layout, self.plan_path)) > 1:
            raise ValueError("give at most one of layout and plan_path")

    def with_batch(self, loader_batch_size: int | None, num_workers: int) -> OobleckConfig:
        """This config with both batch sizes set (see the fields for the defaults)."""
        big_b = self.global_batch_size if self.global_batch_size is not None else loader_batch_size
        if big_b is None:
            raise ValueError(
                "the oobleck strategy needs a fixed global batch size and found no training DataLoader "
                "batch_size to take it from (a DataModule makes its loaders after the plan is made): "
                "Trainer(strategy=OobleckStrategy(global_batch_size=64)), or a batch_size attribute or "
                "hyperparameter on your DataModule"
            )
        b = self.microbatch_size
        if b is None:
            b = _largest_divisor_at_most(big_b, max(1, big_b // (2 * num_workers)))
        resolved = replace(self, global_batch_size=big_b, microbatch_size=b)
        resolved.validate()
        return resolved

    @property
    def num_microbatches(self) -> int:
        assert self.global_batch_size is not None and self.microbatch_size is not None, "call with_batch()"
        return self.global_batch_size // self.microbatch_size


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def load_oobleck_config(cfg: OobleckConfig | DictConfig | dict[str, Any] | str | Path) -> OobleckConfig:
    """Merge ``cfg`` (dataclass, OmegaConf node, dict or YAML path) over the defaults, type-checked."""
    if isinstance(cfg, OobleckConfig):
        return cfg
    if isinstance(cfg, str | Path):
        return load_config(OobleckConfig, cfg)
    return structured(OobleckConfig, cfg, source="the strategy's configuration (OobleckConfig)")
