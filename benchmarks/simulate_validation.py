"""``oobleck simulate`` against a real run: samples trained through two node failures, predicted and measured.

Real: ``Trainer.fit`` with ``OobleckStrategy`` on 6 CPU processes, each a node, f = 2, training a
``PipelineModule`` of emulated layers (:mod:`lightning_oobleck.testing`: each layer sleeps its set compute
time, so 6 processes on 2 cores behave like 6 devices of known speed) on the planner's plan, in the loop
users run (a DataLoader worker per process, AdamW with a per-step LR schedule, gradient clipping, a CSV
logger; no validation runs, which the simulator does not model). Two nodes SIGKILL themselves at set times
after the first step (a fault at the point ``step`` with ``after_s``), wherever the
schedule is then; the survivors recover in place and train on. The run's event file says when each step
ended and each recovery resumed.

Predicted: :func:`~lightning_oobleck.simulation.simulate_oobleck` on the same plan, with a trace of the same
two losses at the measured kill times, the default :class:`~lightning_oobleck.simulation.Costs`, over the
real run's horizon: from the end of its first step (which includes the warm-up a steady-state model does not
know) to the end of its last. The cost model is calibrated to the host first: its compute times and link
latencies are multiplied by the failure-free phase's measured step over the model's (the shared 2 cores run
the same run 5-35% slower on a busy day than on an idle one), which leaves the planner's layouts as they are;
so the comparison is of what the failures cost, the pauses, the new layouts and their slower steps.

It prints, per phase between failures, the pipelines the real run used against the simulator's, the cost
model's iteration time against the median measured one, and the pause of each recovery; then the samples
trained by each failure and by the horizon, measured against predicted. ``--plot PATH`` draws both curves.

    python benchmarks/simulate_validation.py [--steps 30] [--kill 1:3.5 --kill 2:7.5] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck.lightning import OobleckStrategy, PipelineModule
from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.planning import ClusterSpec, make_plan
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.reconfigure import after_failures
from lightning_oobleck.recovery import read_events
from lightning_oobleck.simulation import Costs, NodeEvent, PolicyResult, Trace, simulate_oobleck
from lightning_oobleck.testing import DeviceTimes, Fault, FaultPoint, arm, emulated_layers, emulated_profile

NODES, LAYERS, WIDTH, GLOBAL_BATCH, MICRO = 6, 6, 16, 24, 2
TIMES = DeviceTimes(forward_s=0.01, input_grad_s=0.01, weight_grad_s=0.01)
LINK_LATENCY_S = 3e-4
"""A gloo message between two processes of this machine in a busy pipeline (docs/benchmarks.md)."""
DEVICE_MEMORY_BYTES = 1_200
"""Three emulated layers' state and activations fit on a device, six do not."""
DEFAULT_KILLS = ((1, 3.5), (2, 7.5))


def job_plan(speed: float = 1.0) -> Plan:
    """The planner's plan for the emulated model on 6 nodes, f = 2; a device holds half the layers at most,
    so pipelines have two stages or more and a failure moves layers. ``speed``: every compute time and
    link latency of the profile multiplied by it (the same layouts, every time ``speed`` times longer)."""
    times = DeviceTimes(*(speed * t for t in (TIMES.forward_s, TIMES.input_grad_s, TIMES.weight_grad_s)))
    profile = emulated_profile(LAYERS, WIDTH, times, MICRO)
    cluster = ClusterSpec(
        num_nodes=NODES,
        device_memory_bytes=DEVICE_MEMORY_BYTES,
        intra_node_latency_s=speed * LINK_LATENCY_S,
        inter_node_latency_s=speed * LINK_LATENCY_S,
    )
    return make_plan(
        profile, cluster, fault_tolerance=2, global_batch_size=GLOBAL_BATCH, microbatch_size=MICRO
    )


class EmulatedNet(PipelineModule, L.LightningModule):
    """Emulated layers (``y = x + bias``, sleeping their compute time), a mean squared error, AdamW with a
    cosine schedule stepped per step."""

    def configure_layers(self) -> list[nn.Module]:
        return emulated_layers(LAYERS, WIDTH, TIMES)

    def compute_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class TimedKill(L.Callback):
    """SIGKILL node ``node`` ``after_s`` seconds into step 1 (the fault point ``step``, then a timer: wherever
    the schedule is then), writing the moment of the kill to ``out``."""

    def __init__(self, out: Path, node: int, after_s: float) -> None:
        self.out, self.node, self.after_s = out, node, after_s

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        arm(Fault(FaultPoint.STEP, node=self.node, step=1, after_s=self.after_s), report=self._record)

    def _record(self, fault: Fault) -> None:
        (self.out / f"killed-{self.node}").write_text(str(time.time()))


class PlanLog(L.Callback):
    """The rank 0 of each generation records the pipelines it trains on."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.generation = -1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        generation = strategy.generation
        if trainer.is_global_zero and generation != self.generation:
            self.generation = generation
            pipelines = [list(p.nodes) for p in strategy.plan.pipelines]
            with open(self.out / "plans.jsonl", "a") as f:
                f.write(json.dumps({"generation": generation, "pipelines": pipelines}) + "\n")


def fit(out: Path, steps: int, kills: dict[int, float]) -> Plan:
    """The real run: ``steps`` steps on the job's plan, node ``n`` killed ``kills[n]`` s into step 1 (each
    node is one process: its rank), in the loop users run: loader worker processes, an LR schedule,
    gradient clipping, a logger."""
    plan = job_plan()
    (out / "plan.json").write_text(plan.to_json())
    strategy = OobleckStrategy(
        plan_path=str(out / "plan.json"),
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        fault_tolerance=2,
        start_method="forkserver",
        heartbeat_timeout_s=4.0,
        collective_timeout_s=20.0,
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1, WIDTH, generator=g), torch.randn(4096, 1, WIDTH, generator=g))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=NODES,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[PlanLog(out), *(TimedKill(out, node, after_s) for node, after_s in kills.items())],
        logger=CSVLogger(out),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True, num_workers=1, persistent_workers=True)
    trainer.fit(EmulatedNet(), loader)
    return plan


@dataclass
class Phase:
    """The training between two failures: pipelines and iteration times, real and predicted."""

    pipelines: list[list[int]]
    """The nodes of each pipeline the real run trained on."""
    predicted_pipelines: list[list[int]]
    measured_step_s: float
    """The median of the phase's steps but its first (which follows a recovery)."""
    predicted_step_s: float
    """The plan's iteration time (the cost model's)."""


@dataclass
class Validation:
    """A real run beside the simulator's prediction of it; times from the end of the real run's first step."""

    kills: list[tuple[int, float]]
    """(node, seconds) of each kill, in time order."""
    horizon_s: float
    speed: float
    """The host's speed against the cost model: the failure-free phase's measured step over the model's. The
    prediction runs the model's times multiplied by it: the step before any failure is the host's, what the
    failures cost (pauses, new layouts, their slower steps) is the simulator's."""
    calibrated: Plan
    """The job's plan with the cost model's times multiplied by ``speed``: what the simulator runs."""
    phases: list[Phase]
    recovery_s: list[float]
    """Each failure's pause in the real run: from the kill to the resumed training."""
    predicted_recovery_s: list[float]
    """The simulator's pauses: detection, protocol, re-planning and state copy."""
    trained: list[tuple[float, int, int]]
    """(seconds, samples trained by then in the real run, predicted) at each kill and at the horizon."""

    @property
    def ratio(self) -> float:
        """Samples trained by the horizon, measured over predicted."""
        _, real, predicted = self.trained[-1]
        return real / predicted


def _layout(pipelines: list[list[int]]) -> str:
    return " ".join("[" + ",".join(map(str, nodes)) + "]" for nodes in pipelines)


def events_file(out: Path) -> Path:
    """The run's event file (in the logger's directory)."""
    (path,) = out.rglob(EVENTS_FILE)
    return path


def layouts(plan: Plan) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Each pipeline's nodes, layer split and micro-batches: what the planner chose, times aside."""
    return [(p.nodes, tuple(len(stage.layers) for stage in p.stages), p.microbatches) for p in plan.pipelines]


def analyse(out: Path, plan: Plan) -> Validation:
    """Compare the real run in ``out`` with :func:`simulate_oobleck` of ``plan`` on its kill times, the cost
    model calibrated to the host by the run's failure-free phase."""
    steps, recoveries = read_events(events_file(out))
    origin = steps[0]["time"]
    kills = sorted(
        ((int(p.name.split("-")[1]), float(p.read_text()) - origin) for p in out.glob("killed-*")),
        key=lambda kill: kill[1],
    )
    horizon = steps[-1]["time"] - origin

    def trained(until: float) -> int:
        return sum(s["samples"] for s in steps[1:] if s["time"] - origin <= until + 1e-9)

    real_plans = [json.loads(line)["pipelines"] for line in (out / "plans.jsonl").read_text().splitlines()]
    plans = [plan]
    for node, _ in kills:
        plans.append(after_failures(plans[-1], [node]).plan)
    phases = []
    generations = [steps[0]["generation"]] + [e.generation for e in recoveries]
    for k, predicted_plan in enumerate(plans):
        generation = generations[k] if k < len(generations) else -1
        durations = [s["duration_s"] for s in steps[1:] if s["generation"] == generation][1:]
        phases.append(
            Phase(
                pipelines=real_plans[k] if k < len(real_plans) else [],
                predicted_pipelines=[list(p.nodes) for p in predicted_plan.pipelines],
                measured_step_s=statistics.median(durations) if durations else float("nan"),
                predicted_step_s=predicted_plan.iteration_time_s,
            )
        )
    speed = phases[0].measured_step_s / phases[0].predicted_step_s
    calibrated = job_plan(speed)
    if layouts(calibrated) != layouts(plan):
        raise AssertionError(f"the layouts changed at the speed {speed:.3f}: {calibrated} != {plan}")
    result = predicted(calibrated, kills, horizon)
    pauses = [s.end_s - s.start_s for s in result.segments if s.samples_per_s == 0]
    times = [t for _, t in kills] + [horizon]
    return Validation(
        kills=kills,
        horizon_s=horizon,
        speed=speed,
        calibrated=calibrated,
        phases=phases,
        recovery_s=[e.resumed_at - origin - t for e, (_, t) in zip(recoveries, kills, strict=False)],
        predicted_recovery_s=pauses,
        trained=[(t, trained(t), predicted(calibrated, kills, t).samples) for t in times],
    )


def predicted(plan: Plan, kills: list[tuple[int, float]], until: float) -> PolicyResult:
    """The simulator's run of ``plan`` to ``until``, losing node ``n`` at ``t`` for each ``(n, t)`` of
    ``kills`` before then."""
    events = tuple(NodeEvent(t, "fail", (node,)) for node, t in kills if t < until)
    # the local launcher's supervisor hosts the coordinator and the store, off the training machines
    return simulate_oobleck(plan, Trace(NODES, until, events), Costs(coordinator_on_first_machine=False))


def print_tables(v: Validation, console: Console) -> None:
    phases = Table(title="Phases between failures: the real run against the simulator")
    for column in (
        "phase",
        "pipelines (real)",
        "pipelines (simulated)",
        "step s measured",
        "step s model",
        "model x speed",
    ):
        phases.add_column(column, justify="left" if column.startswith(("phase", "pipelines")) else "right")
    names = ["start"] + [f"after node {node} lost at {t:.1f} s" for node, t in v.kills]
    for name, p in zip(names, v.phases, strict=True):
        phases.add_row(
            name,
            _layout(p.pipelines),
            _layout(p.predicted_pipelines),
            f"{p.measured_step_s:.3f}",
            f"{p.predicted_step_s:.3f}",
            f"{v.speed * p.predicted_step_s:.3f}",
        )
    console.print(phases)
    console.print(f"the host's speed against the cost model (measured / model, failure-free): {v.speed:.3f}")
    samples = Table(title="Samples trained (from the end of the first step)")
    for column in ("by", "seconds", "real", "simulated", "real / simulated", "recovery s real", "simulated"):
        samples.add_column(column, justify="left" if column == "by" else "right")
    for k, (t, real, predicted) in enumerate(v.trained):
        last = k == len(v.trained) - 1
        pause = ("", "") if last else (f"{v.recovery_s[k]:.2f}", f"{v.predicted_recovery_s[k]:.2f}")
        by = "the horizon" if last else f"node {v.kills[k][0]} lost"
        samples.add_row(by, f"{t:.2f}", str(real), str(predicted), f"{real / predicted:.3f}", *pause)
    console.print(samples)


def plot(out: Path, v: Validation, path: str) -> None:
    """Samples trained over time, real (the event file's steps) and simulated (its segments)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, _ = read_events(events_file(out))
    origin = steps[0]["time"]
    real_t, real_n = [0.0], [0]
    for s in steps[1:]:
        real_t.append(s["time"] - origin)
        real_n.append(real_n[-1] + s["samples"])
    sim_t = [v.horizon_s * k / 400 for k in range(1, 401)]
    sim_n = [predicted(v.calibrated, v.kills, t).samples for t in sim_t]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(real_t, real_n, where="post", label="real run (6 processes, emulated devices)")
    ax.step(sim_t, sim_n, "--", where="post", label="oobleck simulate")
    for node, t in v.kills:
        ax.axvline(t, color="black", linestyle=":", linewidth=1)
        label = f"node {node} killed"
        ax.annotate(label, (t, 0.98), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right")
    ax.set_xlabel("seconds since the end of the first step")
    ax.set_ylabel("samples trained")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def kill_spec(text: str) -> tuple[int, float]:
    node, seconds = text.split(":")
    return int(node), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill", type=kill_spec, action="append", help="NODE:SECONDS after the first step")
    parser.add_argument("--plot", help="write the samples-over-time plot here (PNG)")
    args = parser.parse_args()
    kills = dict(args.kill or DEFAULT_KILLS)
    console = Console(width=120)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        plan = fit(out, args.steps, kills)
        v = analyse(out, plan)
        print_tables(v, console)
        if args.plot:
            plot(out, v, args.plot)


if __name__ == "__main__":
    main()
