"""Callbacks for runs under the Oobleck strategy: the plan after each recovery on the console, and a fault
injector for drills (does the job survive losing this rank at this step?)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Literal

import lightning as L
from rich.console import Console

from lightning_oobleck.execution.faults import Fault, FaultAction, FaultPoint, arm
from lightning_oobleck.lightning.console import plan_table
from lightning_oobleck.lightning.strategy import OobleckStrategy


class PlanSummary(L.Callback):
    """Global rank 0 prints the new plan after each recovery or join (the strategy prints the first plan and
    a line per recovery)."""

    def __init__(self) -> None:
        self.generation = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, OobleckStrategy) or strategy.generation == self.generation:
            return
        self.generation = strategy.generation
        if trainer.is_global_zero:
            Console().print(plan_table(strategy.plan))


class KillAt(L.Callback):
    """Make the process launched as global rank ``rank`` fail when training reaches step ``step``: ``by``
    ``"sigkill"`` (a crash) or ``"exception"`` (an error in the training code, such as running out of
    memory). With ``after_s`` the SIGKILL comes that many seconds later, from a timer: wherever the
    schedule, a recovery or the next steps are then, as a real crash would. A thin user of the fault points
    of :mod:`lightning_oobleck.testing` (:attr:`~lightning_oobleck.testing.FaultPoint.STEP`), which name
    any moment of a step, a recovery or a checkpoint."""

    def __init__(
        self, rank: int, step: int, by: Literal["sigkill", "exception"] = "sigkill", after_s: float = 0.0
    ) -> None:
        if by not in ("sigkill", "exception"):
            raise ValueError(f"KillAt(by={by!r}): choose 'sigkill' or 'exception'")
        if after_s < 0 or (after_s > 0 and by != "sigkill"):
            raise ValueError(
                f"KillAt(after_s={after_s!r}, by={by!r}): a delay must be >= 0, and only a SIGKILL can come "
                "later (an exception raised by a timer would not reach the training)"
            )
        action = FaultAction.KILL if by == "sigkill" else FaultAction.RAISE
        message = f"KillAt: an error in rank {rank} at step {step} (a demo)"
        self.fault = Fault(FaultPoint.STEP, action, step=step, after_s=after_s, message=message)
        self.rank, self.step, self.by, self.after_s = rank, step, by, after_s

    def on_fit_start(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, OobleckStrategy) or strategy.joined:
            return  # a node that joined later was not launched as a rank
        node, device = divmod(self.rank, strategy.config.devices_per_node)
        if strategy.worker != (node, device):
            return
        if self.by == "sigkill":
            when = f" {self.after_s:g} s into step {self.step}" if self.after_s else f" at step {self.step}"
            Console().print(f"[bold red]KillAt: SIGKILL to rank {self.rank} (pid {os.getpid()}){when}")
        arm(replace(self.fault, node=node, device=device))
