"""A worker process for the in-process recovery tests: the tiny GPT in float64 under :class:`UnitRunner`.

It trains ``--steps`` AdamW steps (gradients clipped with the committed norm) on the plan ``--plan``,
with a WorkerAgent of the test's coordinator and the test's store, and injects its own faults for
real (``--fault``, repeatable), through the package's fault points (:mod:`lightning_oobleck.testing`):

* ``kill-forward:S`` / ``stop-forward:S``: SIGKILL / SIGSTOP itself in the middle of step S's 1F1B;
* ``kill-commit:S``: SIGKILL itself after step S's commit completed, before its optimizer update;
* ``kill-copy:S``: SIGKILL itself during a recovery in step S, after the state copy and before the
  switch barrier;

and, beside them, a race (not a fault): ``lag-commit:S``: see step S's commit only late (after a failure
notice): a survivor that must catch up with a step the others applied;
* ``kill-pending:0`` / ``kill-receive:0`` (a joiner, ``--node-key``): SIGKILL itself once registered
  (pending) / while it receives its layers.

The run ends after ``--steps`` steps, or earlier at the step the test sets under :data:`STOP_KEY` in the
store (every worker reads it at each step boundary: the test sets it a few steps ahead, once the joins it
waits for are over).

With ``--node-key`` instead of ``--node`` the worker is a joiner: it registers without a node id, waits
to be admitted at a step boundary (:func:`join_training`) and trains on from the members' step.

It appends JSON lines to ``--out``: one ``applied`` record per optimizer step (with the global-batch
sample indices the pipeline's first stage fed, on first stages), ``recovery`` records, and at the end
``done``; the final parameters go to ``--out`` with suffix ``.pt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "examples"), str(Path(__file__).parents[1])]

from execution.exec_workloads import CPU, SEED, global_batch, model, optimizer  # noqa: E402
from gpt.model import gpt_loss  # noqa: E402

from lightning_oobleck.execution import PeerFailure, PipelineEngine, ProcessGroups  # noqa: E402
from lightning_oobleck.execution.stage import build_stage  # noqa: E402
from lightning_oobleck.planning.plan import Plan  # noqa: E402
from lightning_oobleck.recovery import EventLog, WorkerAgent  # noqa: E402
from lightning_oobleck.recovery.admission import JoinPolicy  # noqa: E402
from lightning_oobleck.recovery.agent import TrainingFinished  # noqa: E402
from lightning_oobleck.recovery.errors import UnrecoverableFailure  # noqa: E402
from lightning_oobleck.recovery.joiner import join_training  # noqa: E402
from lightning_oobleck.recovery.keystore import KeyStoreClient  # noqa: E402
from lightning_oobleck.recovery.unit_runner import UnitRunner  # noqa: E402
from lightning_oobleck.testing import Fault, FaultAction, FaultPoint, arm  # noqa: E402

MAX_NORM = 0.5
GROUP_TIMEOUT = timedelta(seconds=20)
UNRECOVERABLE_EXIT = 3
STOP_KEY = "test/stop_at_step"


def clip_and_step(opt: torch.optim.Optimizer, norm_sq: float) -> None:
    """``clip_grad_norm_(max_norm=MAX_NORM)`` with the committed global norm, then the update."""
    coef = min(1.0, MAX_NORM / (math.sqrt(norm_sq) + 1e-6))
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(coef)
    opt.step()


FAULTS = {
    "kill-forward": (FaultPoint.FORWARD, FaultAction.KILL, 2),  # the step's second forward
    "stop-forward": (FaultPoint.FORWARD, FaultAction.STALL, 2),
    "kill-commit": (FaultPoint.COMMIT, FaultAction.KILL, 1),
    "kill-copy": (FaultPoint.SWITCH, FaultAction.KILL, 1),
}


class LaggingRunner(UnitRunner):
    """:class:`UnitRunner` that sees the commit of the steps in ``lag_at`` late (the race ``lag-commit``)."""

    def __init__(self, *args: Any, lag_at: set[int], report: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lag_at = lag_at
        self.report = report

    def commit(self, engine: PipelineEngine, loss: torch.Tensor | None, *args: Any) -> Any:
        if self.progress.steps not in self.lag_at:
            return super().commit(engine, loss, *args)
        waiter = engine.groups.waiter

        def see_it_late(works: Any, abort: Any) -> None:
            """Contribute to the commit but see it complete only after the failure notice."""
            deadline = time.monotonic() + 10
            while not abort.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.report("lagged", step=self.progress.steps)
            raise PeerFailure("test: this worker saw the commit only after the failure notice")

        waiter.wait = see_it_late  # type: ignore[method-assign]
        return super().commit(engine, loss, *args)


def train_step(
    runner: UnitRunner,
    batch: Any,
    update: Any,
) -> float:
    """A whole training step of a plain loop: the step unit, then ``update(optimizer, norm²)``, then
    :meth:`UnitRunner.advance`. ``batch(step)`` returns that step's whole global batch ``(inputs,
    targets)``; each pipeline takes its slice under the plan of the moment. Returns the global mean loss."""

    def step(engine: PipelineEngine) -> Any:
        engine.module.zero_grad(set_to_none=True)
        inputs, targets = batch(runner.progress.steps)
        loss = engine.train_step(
            inputs[engine.batch_slice] if engine.is_first_stage else None,
            targets[engine.batch_slice] if engine.is_last_stage else None,
        )
        return runner.commit(engine, loss)

    committed = runner.step(step)
    update(runner.optimizer, committed.grad_norm_sq)
    runner.advance()
    return committed.loss


class Host:
    """The plain loop's side of recovery: AdamW over any layers, the step count as checkpoint metadata."""

    def __init__(self) -> None:
        self.runner: UnitRunner | None = None

    def build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        return optimizer(module.parameters())

    def checkpoint_metadata(self) -> dict[str, Any]:
        assert self.runner is not None
        return {"global_step": self.runner.progress.steps}

    def switched(self, runner: UnitRunner, event: Any) -> None:
        pass

    def join_state(self) -> None:
        return None  # the plain loop's position is the progress's step count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--store", required=True, help="the coordinator that serves the store")
    parser.add_argument("--store-secret", required=True)
    parser.add_argument("--node", type=int)
    parser.add_argument("--node-key")
    parser.add_argument("--join-policy", default="at_once")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle after each step")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args()
    faults = [(kind, int(at)) for kind, at in (f.split(":") for f in args.fault)]
    out = open(args.out, "a", buffering=1)  # noqa: SIM115 (the process ends with os._exit)

    def report(kind: str, **fields: Any) -> None:
        out.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")

    kinds = {}
    for kind, at in faults:
        if kind in FAULTS:
            point, action, occurrence = FAULTS[kind]
            fault = Fault(point, action, step=at, occurrence=occurrence)
            kinds[fault] = kind
            arm(fault, report=lambda fault: report("fault", fault=kinds[fault], at=fault.step))

    store = KeyStoreClient(args.store, args.store_secret, timeout=GROUP_TIMEOUT)
    agent = WorkerAgent(
        (args.node, 0),
        args.coordinator,
        connect_timeout=60.0,
        node_key=args.node_key,
        secret=args.store_secret,
    ).start()
    admission = None
    if args.node_key:
        report("registered", node=agent.worker.node)
        if ("kill-pending", 0) in faults:
            report("fault", fault="kill-pending", at=0)
            os.kill(os.getpid(), signal.SIGKILL)

        def build_layers(layers: Any) -> Any:
            if ("kill-receive", 0) in faults:  # called once the layers are described, before their data
                report("fault", fault="kill-receive", at=0)
                os.kill(os.getpid(), signal.SIGKILL)
            return build_stage(model, layers, CPU, dtype=torch.float64, init=None)

        try:
            admission = join_training(agent, store, build_layers, CPU, group_timeout=GROUP_TIMEOUT)
        except TrainingFinished as e:
            report("not_admitted", error=str(e))
            out.flush()
            os._exit(0)
        groups = admission.groups
        report("admitted", generation=groups.generation, step=admission.progress.steps)
    else:
        membership = agent.agree(-1, timeout=120.0)
        groups = ProcessGroups(
            Plan.load(args.plan), agent.worker, store, membership.generation, timeout=GROUP_TIMEOUT
        )
    module = admission.module if admission is not None else None
    engine = PipelineEngine(
        model, gpt_loss, groups, CPU, seed=SEED, abort=agent.abort, dtype=torch.float64, module=module
    )
    pending: dict[str, Any] = {}

    def update(opt: torch.optim.Optimizer, norm_sq: float) -> None:
        report("applied", step=runner.progress.steps, generation=runner.generation, **pending)
        clip_and_step(opt, norm_sq)
        time.sleep(args.step_sleep)  # long enough a run for joiners to start (importing torch) meanwhile

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = runner.engine
        pending.clear()
        if e.is_first_stage:
            pending["samples"] = list(range(e.plan.global_batch_size))[e.batch_slice]
        return global_batch(step, e.plan.global_batch_size)

    host = Host()
    runner = host.runner = LaggingRunner(
        agent,
        store,
        engine,
        optimizer(engine.module.parameters()),
        model,
        host,
        dtype=torch.float64,
        group_timeout=GROUP_TIMEOUT,
        events=EventLog(args.events),
        checkpoint_dir=args.checkpoint_dir,
        join_policy=JoinPolicy(args.join_policy),
        admission=admission,
        lag_at={at for kind, at in faults if kind == "lag-commit"},
        report=report,
    )
    generation = runner.generation
    stop_at = args.steps
    while runner.progress.steps < stop_at:
        try:
            train_step(runner, batch, update)
        except UnrecoverableFailure as e:
            report("unrecoverable", step=runner.progress.steps, error=str(e))
            out.flush()
            os._exit(UNRECOVERABLE_EXIT)
        if runner.generation != generation:
            generation = runner.generation
            plan = runner.plan
            pipelines = [list(p.nodes) for p in plan.pipelines]
            report("recovered", generation=generation, pipelines=pipelines, f=plan.fault_tolerance)
        if store.check([STOP_KEY]):
            stop_at = min(stop_at, int(store.get(STOP_KEY)))
    runner.finish()
    torch.save({n: p.detach().clone() for n, p in runner.module.named_parameters()}, args.out + ".pt")
    report("done", step=runner.progress.steps, generation=runner.generation)
    out.flush()
    agent.close(finished=True)
    runner.engine.groups.destroy()
    os._exit(0)


if __name__ == "__main__":
    main()
