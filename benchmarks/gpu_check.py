"""The planner's time and memory model against a real device, bf16 training on one GPU, and the NCCL
generation path: one script, one call, under 5 minutes on one GPU, no network.

    python benchmarks/gpu_check.py                          # on a machine with one CUDA GPU
    python benchmarks/gpu_check.py --device cpu --small     # the same comparisons on the CPU (the tests)

Its sections, each a list of rows ``(section, case, term, predicted, measured, ratio, tolerance)``:

* ``profile``: the example GPT (``examples/gpt``; hidden 4096, sequence 2048, 32 heads, vocabulary 50304,
  bfloat16) profiled layer by layer by the project's profiler at micro-batches 1, 2 and 4, against the whole
  model run forward and backward as one stage (plain and recomputing), timed with CUDA events: the step time
  the profile predicts, and the activation bytes one micro-batch keeps (the allocator's growth across the
  forward).
* ``stage``: three stages of that model (:func:`stage_layouts`), each one step as 1F1B runs it (the stage's
  in-flight micro-batches forward, then a backward and a forward in turn, then the backwards left, then
  AdamW), allocated bytes per term against the cost model's: parameters, activations in flight, gradients,
  the most a backward raises the bytes alive once the gradients exist, optimizer state, the optimizer step's
  temporaries, and the stage's peak (``torch.cuda.max_memory_allocated``) against its predicted bytes; then
  the peak of one ZB-H1 step (its backwards split, ``W`` trailing ``I``) against the model's under ZB-H1.
* ``loop``: ``examples/gpt/train.py`` on ``devices=1`` with ``precision="bf16-mixed"`` (validation, LR
  schedule, clipping): it must finish.
* ``allocator`` (a GPU only, reported): the allocator's cache over the tensors' peak, and the device memory
  in use outside the allocator (the CUDA context, libraries' workspaces): terms the model has not measured.
* ``generation``: a one-rank generation (:class:`~lightning_oobleck.execution.ProcessGroups`, NCCL on a GPU)
  created, used (an all-reduce), aborted, and replaced by generation 1.

On a GPU the allocator's statistics measure; on the CPU, which keeps none, the bytes of live tensors
(:class:`~lightning_oobleck.testing.LiveTensorMeter`). Times are compared on a GPU only (a shared CPU's
timings are noise). The table is printed and the rows written as JSON (``--out``, default
``benchmarks/results/gpu_check-<device>.json``); the exit status is 1 when any row is outside its tolerance,
each such row named with the term that is off and by how much.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import Tensor

from lightning_oobleck.execution import ProcessGroups, profile_layers
from lightning_oobleck.execution.backward import backward_input, backward_weight, split_parameters
from lightning_oobleck.execution.profiler import timed
from lightning_oobleck.execution.stage import build_stage
from lightning_oobleck.planning import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.planner import PlannerInputs
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.schedules import SCHEDULES, Op, in_flight_limit
from lightning_oobleck.testing import LiveTensorMeter
from lightning_oobleck.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPTConfig, gpt_layers, gpt_loss  # examples/gpt

ROOT = Path(__file__).resolve().parents[1]
REALISTIC = GPTConfig(vocab_size=50304, seq_len=2048, d_model=4096, n_heads=32, n_blocks=4)
SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_blocks=4)
MICROBATCHES = (1, 2, 4)
STAGES = 3
STEP_MICROBATCHES = 2 * STAGES
"""Micro-batches of a checked stage's step: more than any stage keeps in flight, so that backwards run while
the parameters' gradients exist (every micro-batch's but a step's first)."""

TIME_TOLERANCE = 0.20
"""A step's measured time may differ from the profile's sum by this share (a GPU only)."""
MEMORY_TOLERANCE = 0.10
"""A memory term may differ from the model's by this share of the prediction."""
PARAMETER_TOLERANCE = 0.01
"""Parameter and gradient bytes are counted exactly, but for the allocator's rounding."""


@dataclass(frozen=True)
class Row:
    """One comparison: the model's ``predicted`` value of ``term`` against the ``measured`` one."""

    section: str
    case: str
    term: str
    predicted: float
    measured: float
    tolerance: float | None
    """The largest accepted ``|measured / predicted - 1|``; ``None``: reported, not checked."""
    unit: str = "bytes"

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else math.inf

    @property
    def ok(self) -> bool:
        return self.tolerance is None or abs(self.ratio - 1) <= self.tolerance

    def off(self) -> str:
        """What is off, for the failure report."""
        return (
            f"{self.section} [{self.case}] {self.term}: measured {_fmt(self.measured, self.unit)}, the model "
            f"predicts {_fmt(self.predicted, self.unit)} (x{self.ratio:.3f}, tolerance "
            f"±{self.tolerance:.0%})"
        )


class Meter(Protocol):
    """The device's allocated bytes now and at peak, for what runs inside it (a context manager)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...


class CudaMeter:
    """``torch.cuda``'s allocator statistics."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> CudaMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


class LiveTensorBytes:
    """The bytes of live tensors (:class:`LiveTensorMeter`), for a device whose allocator keeps no
    statistics."""

    def __init__(self) -> None:
        self.meter = LiveTensorMeter()

    def __enter__(self) -> LiveTensorBytes:
        self.meter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.meter.__exit__(None, None, None)

    def allocated(self) -> int:
        return self.meter.live_bytes

    def peak(self) -> int:
        return self.meter.peak_bytes

    def reset_peak(self) -> None:
        self.meter.reset_peak()


def meter_for(device: torch.device) -> CudaMeter | LiveTensorBytes:
    return CudaMeter(device) if device.type == "cuda" else LiveTensorBytes()


# ---------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Workload:
    """The model checked, its dtype and the device."""

    config: GPTConfig
    device: torch.device
    dtype: torch.dtype = torch.bfloat16

    def layers(self) -> list[torch.nn.Module]:
        return gpt_layers(self.config)

    def tokens(self, rows: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.config.vocab_size, (rows, self.config.seq_len + 1), generator=g)
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)

    def profile(self, microbatch: int) -> ModelProfile:
        inputs, targets = self.tokens(microbatch)
        return profile_layers(
            self.layers, inputs, self.device, self.dtype, loss_fn=gpt_loss, example_target=targets
        )

    def cost(self, profile: ModelProfile, schedule: str = "1f1b") -> CostModel:
        """The cost model on one node of :data:`STAGES` devices of unbounded memory (the check compares
        terms; it does not ask what fits)."""
        return CostModel(profile, ClusterSpec(1, STAGES, device_memory_bytes=math.inf), schedule=schedule)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- sections
def profile_rows(work: Workload, meter: Meter, microbatch: int, repeat: int = 5) -> list[Row]:
    """The profile of every layer against the whole model run as one stage, plain and recomputing."""
    profile = work.profile(microbatch)
    cost = work.cost(profile)
    layers = range(profile.num_layers)
    rows = []
    for recompute in (False, True):
        case = f"micro-batch {microbatch}, {'recomputing' if recompute else 'plain'}"
        stage = build_stage(work.layers, layers, work.device, dtype=work.dtype)
        stage.recompute = recompute
        inputs, targets = work.tokens(microbatch, seed=1)

        def step(stage: Any = stage, inputs: Tensor = inputs, targets: Tensor = targets) -> None:
            gpt_loss(stage(inputs), targets).backward()
            stage.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        times = [timed(step, work.device)[1] for _ in range(repeat)]
        before = meter.allocated()
        loss = gpt_loss(stage(inputs), targets)
        held = meter.allocated() - before
        loss.backward()
        del loss, stage
        _free(work.device)
        predicted_s = sum(la.forward_s + la.backward_s + recompute * la.forward_s for la in profile.layers)
        predicted = cost.held_bytes(0, profile.num_layers, recompute)
        time_tolerance = TIME_TOLERANCE if work.device.type == "cuda" else None
        measured_s = statistics.median(times)
        rows.append(Row("profile", case, "step time", predicted_s, measured_s, time_tolerance, "s"))
        rows.append(Row("profile", case, "activations of one micro-batch", predicted, held, MEMORY_TOLERANCE))
    return rows


def stage_layouts(num_layers: int) -> list[tuple[int, int]]:
    """The :data:`STAGES` stages checked, ``[first, end)`` each: the embedding with the first block, the other
    blocks, and the head alone (whose logits' gradient is the most a backward allocates at once). Fixed, not
    the planner's template of measured times, which moves with the machine's noise."""
    return [(0, 2), (2, num_layers - 1), (num_layers - 1, num_layers)]


def stage_rows(work: Workload, meter: Meter, microbatch: int) -> list[Row]:
    """Every stage of :func:`stage_layouts`, one 1F1B step each term by term, and one ZB-H1 step's peak."""
    profile = work.profile(microbatch)
    cost, zb = work.cost(profile), work.cost(profile, "zb-h1")
    rows = []
    for s, (first, end) in enumerate(stage_layouts(profile.num_layers)):
        case = f"stage {s} of {STAGES}: layers {first}-{end - 1}, micro-batch {microbatch}"
        in_flight = in_flight_limit("1f1b", STAGES, s, STEP_MICROBATCHES)
        params = cost.parameter_bytes(first, end)
        activations = cost.held_bytes(first, end)
        layers = (first, end, end == profile.num_layers)
        measured = _stage_step(work, meter, s, layers, microbatch, "1f1b")
        zero_bubble = _stage_step(work, meter, s, layers, microbatch, "zb-h1")
        factor = cost.state_factor
        rows += [
            Row("stage", case, "parameters", params, measured["parameters"], PARAMETER_TOLERANCE),
            Row("stage", case, f"activations ({in_flight} in flight)", activations * in_flight,
                measured["activations"], MEMORY_TOLERANCE),
            Row("stage", case, "gradients", params, measured["gradients"], PARAMETER_TOLERANCE),
            Row("stage", case, "backward peak", cost.backward_peak_bytes(first, end, s),
                measured["backward peak"], MEMORY_TOLERANCE),
            Row("stage", case, "optimizer state", params * (factor - 2), measured["optimizer state"],
                MEMORY_TOLERANCE),
            Row("stage", case, "optimizer step temporaries", float(cost.step_bytes(params)),
                measured["optimizer step temporaries"], MEMORY_TOLERANCE),
            Row("stage", case, "peak", cost.stage_memory_bytes(first, end, s, STAGES), measured["peak"],
                MEMORY_TOLERANCE),
            Row("stage", case, "peak under ZB-H1", zb.stage_memory_bytes(first, end, s, STAGES),
                zero_bubble["peak"], MEMORY_TOLERANCE),
        ]  # fmt: skip
    return rows


def _stage_step(
    work: Workload, meter: Meter, s: int, layers: tuple[int, int, bool], microbatch: int, schedule: str
) -> dict[str, float]:
    """Two steps of stage ``s``, holding ``layers = (first, end, whether the model's last layer is in)``,
    in the order ``schedule`` gives it for
    :data:`STEP_MICROBATCHES` micro-batches (the second measured: the optimizer's state exists, as in every
    step but the first), its backwards whole or split as the executor runs them; then AdamW."""
    first, end, last = layers
    _free(work.device)
    start = meter.allocated()
    stage = build_stage(work.layers, range(first, end), work.device, dtype=work.dtype)
    parameters = meter.allocated() - start
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4, foreach=True)  # the default on a GPU
    split, whole = split_parameters(stage.layers.values())
    hidden = (microbatch, work.config.seq_len, work.config.d_model)
    in_flight = in_flight_limit(schedule, STAGES, s, STEP_MICROBATCHES)
    result: dict[str, float] = {"parameters": parameters}

    def forward(stage: torch.nn.Module, step: int, mb: int) -> tuple[Tensor, list[Tensor]]:
        inputs, targets = work.tokens(microbatch, seed=10 * step + mb)
        if first > 0:  # an activation received from the previous stage
            inputs = torch.randn(hidden, device=work.device, dtype=work.dtype, requires_grad=True)
        # the executor keeps a stage's output (the last stage's loss) until the micro-batch's backward
        out = stage(inputs)
        return (gpt_loss(out, targets) if last else out), ([inputs] if first > 0 else [])

    for step in range(2):
        stage.zero_grad(set_to_none=True)
        base = meter.allocated()
        meter.reset_peak()
        kept: dict[int, tuple[Tensor, list[Tensor]]] = {}
        pending = {}
        rises, peak = [], 0
        for op, mb in SCHEDULES[schedule](STAGES, s, STEP_MICROBATCHES):
            if op is Op.F:
                kept[mb] = forward(stage, step, mb)
                if len(kept) == in_flight and not rises and not pending:
                    result["activations"] = meter.allocated() - base
                continue
            before = meter.allocated()
            peak = max(peak, meter.peak())
            meter.reset_peak()
            if op is Op.W:
                backward_weight(pending.pop(mb))
                del kept[mb]
            else:
                root, inputs = kept[mb] if op is Op.I else kept.pop(mb)
                grad = [torch.ones_like(root)]
                if op is Op.I:
                    pending[mb] = backward_input([root], grad, inputs, split, whole)
                else:
                    torch.autograd.backward([root], grad)
                del root, inputs, grad
                rises.append(meter.peak() - before)
        peak = max(peak, meter.peak())
        after_backward = meter.allocated()
        result["gradients"] = after_backward - base
        # the first backward makes the gradients, which the cost model counts with the parameters' state
        result["backward peak"] = max(rises[1:])
        meter.reset_peak()
        optimizer.step()
        step_peak = meter.peak()
        result["optimizer step temporaries"] = step_peak - after_backward
        if step == 0:  # the step that creates the state
            result["optimizer state"] = meter.allocated() - after_backward
        result["peak"] = max(peak, step_peak) - start
    del stage, optimizer
    _free(work.device)
    return result


def allocator_rows(device: torch.device) -> list[Row]:
    """What the CUDA allocator and the process hold beyond the tensors (no term of the model yet; reported):
    the cache over the allocated peak (rounding, fragmentation) and the device memory in use that the
    allocator does not hold (the CUDA context, libraries' workspaces)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    peak_reserved, peak_allocated = (
        torch.cuda.max_memory_reserved(device),
        torch.cuda.max_memory_allocated(device),
    )
    return [
        Row("allocator", "since the start", "reserved over allocated at peak", float(peak_allocated),
            float(peak_reserved), None),
        Row("allocator", "now", "in use outside the allocator (context, libraries)", 0.0,
            float(total - free - reserved), None),
    ]  # fmt: skip


def loop_arguments(device: torch.device, small: bool) -> list[str]:
    """``examples/gpt/train.py``'s arguments: one device, ``bf16-mixed``, validation every few steps."""
    return [
        "--accelerator", "gpu" if device.type == "cuda" else "cpu", "--devices", "1",
        "--precision", "bf16-mixed", "--max-steps", "4" if small else "30", "--fault-tolerance", "0",
        "trainer.val_check_interval=2" if small else "trainer.val_check_interval=10",
        "strategy.planner.cluster.device_memory_bytes=80.0e+9",
    ]  # fmt: skip


def loop_rows(device: torch.device, small: bool, timeout_s: float) -> list[Row]:
    """``examples/gpt/train.py`` on one device under ``bf16-mixed``: it must finish (1: it did)."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    command = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), *loop_arguments(device, small)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    finished = done.returncode == 0 and "done:" in done.stdout
    if not finished:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
    case = f"examples/gpt/train.py, 1 {accelerator}, bf16-mixed, {time.monotonic() - started:.0f} s"
    return [Row("loop", case, "finished", 1.0, float(finished), 0.0, "flag")]


def generation_rows(device: torch.device) -> list[Row]:
    """A one-rank generation (NCCL on a GPU, gloo elsewhere) created, used, aborted and replaced."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    profile = Workload(SMALL, device).profile(1)
    plan = PlannerInputs(profile, ClusterSpec(1, 1), fault_tolerance=0).make_plan(1, 1)
    worker, never = Worker(0, 0), threading.Event()
    rows = []

    def row(generation: int, term: str, expected: float, measured: float) -> None:
        rows.append(
            Row("generation", f"{backend}, generation {generation}", term, expected, measured, 0.0, "x")
        )

    groups = ProcessGroups(plan, worker, store, 0, backend, timeout=timedelta(seconds=30))
    try:
        total = torch.full((4,), 3.0, device=device)
        groups.all_reduce(total, never)
        row(0, "all-reduce", 3.0, total[0].item())
        row(0, "device mesh size", 1.0, float(groups.device_mesh().size()))
        started = time.monotonic()
        groups.abort("the GPU check aborts generation 0")
        aborted_s = time.monotonic() - started
        row(0, f"abort returned within 5 s (in {aborted_s:.3f} s)", 1.0, float(aborted_s <= 5.0))
        row(0, "errored after abort", 1.0, float(groups.errored() is not None))
        groups = ProcessGroups(plan, worker, store, 1, backend, timeout=timedelta(seconds=30))
        again = torch.ones(4, device=device)
        groups.all_reduce(again, never)
        row(1, "all-reduce", 1.0, again[0].item())
    finally:
        if not groups.destroyed:
            groups.destroy()
    return rows


# ---------------------------------------------------------------------------------------------- the report
def _fmt(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:,.1f} MiB" if abs(value) >= 2**20 else f"{value:,.0f} B"
    if unit == "s":
        return f"{value * 1e3:,.2f} ms" if value < 1 else f"{value:,.2f} s"
    return f"{value:g}"


def table(rows: list[Row], title: str) -> Table:
    out = Table(title=title)
    for column in ("section", "case", "term", "predicted", "measured", "ratio", "tolerance", "ok"):
        out.add_column(column, justify="right" if column in ("predicted", "measured", "ratio") else "left")
    for r in rows:
        tolerance = "reported" if r.tolerance is None else f"±{r.tolerance:.0%}"
        out.add_row(
            r.section, r.case, r.term, _fmt(r.predicted, r.unit), _fmt(r.measured, r.unit),
            f"{r.ratio:.3f}", tolerance, "ok" if r.ok else "OFF",
        )  # fmt: skip
    return out


def failures(rows: list[Row]) -> list[str]:
    """Each row outside its tolerance, named by its term and how far it is off."""
    return [r.off() for r in rows if not r.ok]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@contextmanager
def section(console: Console, name: str) -> Iterator[None]:
    started = time.monotonic()
    console.print(f"[bold]{name}[/bold] ...")
    yield
    console.print(f"  {name}: {time.monotonic() - started:.1f} s")


def run(device: torch.device, small: bool, sections: list[str], loop_timeout_s: float) -> list[Row]:
    console = Console(stderr=True)
    work = Workload(SMALL if small else REALISTIC, device)
    meter = meter_for(device)
    rows: list[Row] = []
    with meter:
        if "profile" in sections:
            with section(console, "profile"):
                for microbatch in MICROBATCHES:
                    rows += profile_rows(work, meter, microbatch)
        if "stage" in sections:
            with section(console, "stage"):
                rows += stage_rows(work, meter, 2)
    if device.type == "cuda":
        rows += allocator_rows(device)
    if "loop" in sections:
        with section(console, "loop"):
            rows += loop_rows(device, small, loop_timeout_s)
    if "generation" in sections:
        with section(console, "generation"):
            rows += generation_rows(device)
    return rows


SECTIONS = ("profile", "stage", "loop", "generation")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--small", action="store_true", help="a tiny GPT instead of hidden 4096, sequence 2048"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--loop-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, help="the JSON results (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run it on a GPU machine, or pass --device cpu --small")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    started = time.monotonic()
    rows = run(device, args.small, args.sections, args.loop_timeout_s)
    name = device_name(device)
    out = (
        args.out or ROOT / "benchmarks" / "results" / f"gpu_check-{re.sub(r'[^A-Za-z0-9]+', '-', name)}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "small": args.small,
        "seconds": round(time.monotonic() - started, 1),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "host": os.uname().nodename,
        "rows": [asdict(r) | {"ratio": r.ratio, "ok": r.ok} for r in rows],
    }
    out.write_text(json.dumps(report, indent=2))
    console = Console(width=160)
    console.print(table(rows, f"gpu_check on {name} (torch {torch.__version__}), {report['seconds']} s"))
    console.print(f"results: {out}")
    off = failures(rows)
    for line in off:
        console.print(f"OFF: {line}", style="bold red", markup=False)
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
