"""Structured recovery events and per-step records, as JSON lines and as Lightning logger metrics.

A run's event file has one JSON object per line, each with a ``kind``:

* ``{"kind": "step", "step", "time", "duration_s", "samples", "generation"}``: one optimizer step that
  counted, ``time`` being its end (wall clock); ``oobleck timeline`` turns these into throughput.
* ``{"kind": "failover", "lost", "standby", "epoch", "reason", "lost_at", "took_over_at", "step"}``: the
  job's coordinator at ``lost`` was lost and its standby took over (epoch ``epoch``); training went on. A loss
  of workers with it (the coordinator's node) is a recovery of its own.
* ``{"kind": "recovery", "generation", "removed", "added", "cause", "failed_at", "detected_at",
  "agreed_at", "replanned_at", "rebuilt_at", "state_copied_at", "resumed_at", "fault_tolerance",
  "warnings", "copied_bytes", "copy_senders", "durations", "copy_gb_per_s"}``: one failure (or join) and
  its recovery. The phases happen in that order; each ``*_at`` is a wall-clock time, ``durations`` the time
  of each phase since the previous one (``failed_at`` is only known when the failure was injected, e.g. by
  ``--kill-at-step``). ``copied_bytes``: the layers and optimizer state every worker received, from
  ``copy_senders`` workers; ``copy_gb_per_s``: those bytes over the ``state_copied`` phase (from the new
  groups to the switch barrier, on the writer).

One process should write a given file (the rank 0 of the current generation): lines are appended with
one ``write`` each, so a writer killed mid-run never leaves half a line for the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from lightning_oobleck.recovery.protocol import Membership

PHASES = ("detected", "agreed", "replanned", "rebuilt", "state_copied", "resumed")
"""Recovery phases in the order they happen; ``RecoveryEvent`` has a ``<phase>_at`` field for each."""


class MetricsLogger(Protocol):
    """The part of a Lightning logger (``lightning.pytorch.loggers.Logger``) that events use."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


@dataclass
class RecoveryEvent:
    """One failure (or join) and the wall-clock time each recovery phase ended."""

    generation: int
    removed: list[list[int]] = field(default_factory=list)
    added: list[list[int]] = field(default_factory=list)
    cause: str = ""
    failed_at: float | None = None
    detected_at: float | None = None
    agreed_at: float | None = None
    replanned_at: float | None = None
    rebuilt_at: float | None = None
    state_copied_at: float | None = None
    resumed_at: float | None = None
    fault_tolerance: int | None = None
    """The f the new plan tolerates (less than configured when too few nodes remain: see ``warnings``)."""
    warnings: list[str] = field(default_factory=list)
    """What the new plan warns of (f reduced, ...)."""
    copied_bytes: int = 0
    """Bytes of layers and optimizer state received by the workers of the new generation, together."""
    copy_senders: int = 0
    """How many workers sent a share of them (every surviving replica of a copied layer)."""
    tensor_parallel: int | None = None
    """The devices each stage of the new plan runs on (replans keep the degree the run was planned at)."""
    schedule: str | None = None
    """The new plan's pipeline schedule."""
    predicted_step_s: float | None = None
    """The new plan's predicted step (the cost model's), against which the measured steps can be read."""
    recovery_policy: str | None = None
    """How the failure was recovered from, where a policy chose (``reinstantiate`` or ``reroute``)."""
    candidates: list[str] = field(default_factory=list)
    """The ways weighed, each with its predicted step, copy and samples before the next failure."""
    horizon_s: float | None = None
    """How long the chosen layout was expected to last: the time the candidates' samples are counted over."""

    @classmethod
    def from_membership(cls, membership: Membership) -> RecoveryEvent:
        """Start an event from an agreed membership: detection and agreement times come from the
        coordinator; the worker then :meth:`mark`\\ s the phases it runs."""
        return cls(
            generation=membership.generation,
            removed=[list(w) for w in membership.removed],
            added=[list(w) for w in membership.added],
            cause=membership.cause,
            detected_at=membership.detected_at,
            agreed_at=membership.agreed_at,
        )

    def mark(self, phase: str, at: float | None = None) -> None:
        """Record that ``phase`` ended now (or at ``at``)."""
        if phase not in PHASES:
            raise ValueError(f"unknown recovery phase {phase!r}: expected one of {', '.join(PHASES)}")
        setattr(self, f"{phase}_at", time.time() if at is None else at)

    def durations(self) -> dict[str, float]:
        """Seconds spent in each recorded phase (since the previous recorded one), plus ``total``."""
        out: dict[str, float] = {}
        previous = self.failed_at
        for phase in PHASES:
            at = getattr(self, f"{phase}_at")
            if at is None:
                continue
            if previous is not None:
                out[phase] = at - previous
            previous = at
        start = self.failed_at if self.failed_at is not None else self.detected_at
        if start is not None and self.resumed_at is not None:
            out["total"] = self.resumed_at - start
        return out

    def copy_gb_per_s(self) -> float | None:
        """How fast the state copy ran: the bytes received over the ``state_copied`` phase (``None``: no
        copy)."""
        seconds = self.durations().get("state_copied")
        return self.copied_bytes / seconds / 1e9 if self.copied_bytes and seconds else None

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "recovery",
            **asdict(self),
            "durations": self.durations(),
            "copy_gb_per_s": self.copy_gb_per_s(),
        }


_TAIL_BYTES = 1 << 16
"""How much of the file's end :meth:`EventLog.last_step` reads (many records, whatever their kind)."""


class StepRecord(NamedTuple):
    """One completed optimizer step, as :meth:`EventLog.step` records it."""

    step: int
    samples: int
    duration_s: float
    generation: int
    at: float


@dataclass(frozen=True)
class Failover:
    """The job's coordinator was lost and its standby took over, as a worker's agent saw it."""

    lost: str
    """The lost coordinator's address."""
    standby: str
    """The address of the standby that took over."""
    epoch: int
    reason: str
    """How the worker saw the coordinator lost."""
    lost_at: float
    """When the worker saw it lost (wall clock)."""
    took_over_at: float
    """When the standby welcomed the worker back (wall clock)."""

    def to_record(self, step: int | None = None) -> dict[str, Any]:
        return {"kind": "failover", **asdict(self), "step": step}


class EventLog:
    """Appends step and recovery records to a JSONL file, and recovery phase durations to a logger.

    ``new``: this run's records start the file (an earlier run's, in the same directory, are removed); the
    writers that take over later (a new rank 0) append."""

    def __init__(self, path: str | Path, logger: MetricsLogger | None = None, new: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.logger = logger
        if new:
            self.path.unlink(missing_ok=True)

    def step(
        self, step: int, samples: int, duration_s: float, generation: int, at: float | None = None
    ) -> None:
        """Record one completed optimizer step of ``samples`` samples that took ``duration_s``."""
        self._append(
            {
                "kind": "step",
                "step": step,
                "time": time.time() if at is None else at,
                "duration_s": duration_s,
                "samples": samples,
                "generation": generation,
            }
        )

    def last_step(self) -> int:
        """The newest step the file records (0: none), from its end only: a new writer fills in the steps its
        predecessor completed but did not get to record, on the recovery path, whatever the run's length."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as f:
            f.seek(max(0, self.path.stat().st_size - _TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
        for line in reversed(lines):
            with contextlib.suppress(ValueError):  # the tail's first line may be cut
                record = json.loads(line)
                if record.get("kind") == "step":
                    return int(record["step"])
        return 0

    def recovery(self, event: RecoveryEvent, step: int | None = None) -> None:
        """Record a finished recovery (a failure, a join or both); the logger gets ``recovery/<phase>_s``,
        the generation, the nodes lost and joined, and the fault tolerance, at ``step``."""
        self._append(event.to_record())
        if self.logger is not None:
            metrics = {f"recovery/{phase}_s": seconds for phase, seconds in event.durations().items()}
            metrics["recovery/generation"] = float(event.generation)
            metrics["recovery/nodes_lost"] = float(len({node for node, _ in event.removed}))
            metrics["recovery/nodes_joined"] = float(len({node for node, _ in event.added}))
            if event.fault_tolerance is not None:
                metrics["recovery/fault_tolerance"] = float(event.fault_tolerance)
            if event.predicted_step_s is not None:
                metrics["recovery/predicted_step_s"] = event.predicted_step_s
            metrics["recovery/copied_gb"] = event.copied_bytes / 1e9
            if (speed := event.copy_gb_per_s()) is not None:
                metrics["recovery/copy_gb_per_s"] = speed
            self.logger.log_metrics(metrics, step=step)

    def failover(self, failover: Failover, step: int | None = None) -> None:
        """Record that the coordinator failed over (the logger gets ``recovery/coordinator_failover_s``)."""
        self._append(failover.to_record(step))
        if self.logger is not None:
            seconds = failover.took_over_at - failover.lost_at
            self.logger.log_metrics({"recovery/coordinator_failover_s": seconds}, step=step)

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def read_events(path: str | Path) -> tuple[list[dict[str, Any]], list[RecoveryEvent]]:
    """Read an event file: its step records (sorted by time) and its recovery events."""
    steps: list[dict[str, Any]] = []
    recoveries: list[RecoveryEvent] = []
    fields = set(RecoveryEvent.__dataclass_fields__)
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{number} is not a JSON line ({e}): is this an oobleck event file?"
                ) from e
            if record.get("kind") == "step":
                steps.append(record)
            elif record.get("kind") == "recovery":
                recoveries.append(RecoveryEvent(**{k: v for k, v in record.items() if k in fields}))
    steps.sort(key=lambda r: r["time"])
    return steps, recoveries
