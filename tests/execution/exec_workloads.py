"""Tasks run inside the spawned test workers, and the single-process reference they are compared with."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from gpt.model import GPTConfig, gpt_layers, gpt_loss
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_oobleck.execution import PeerFailure, PipelineEngine, ProcessGroups, build_reference_model
from lightning_oobleck.execution.memory import SavedTensorMeter
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.testing import DeviceTimes, LiveTensorMeter, emulated_layers

CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_blocks=4)
SEED = 7
LR = 1e-2
CPU = torch.device("cpu")


def model() -> list[torch.nn.Module]:
    return gpt_layers(CONFIG)


def global_batch(step: int, size: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch: random token rows and their next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference_run(steps: int, batch_size: int) -> dict[str, Any]:
    """Single-process training on the same global batches: per-step losses, grad norms, final weights."""
    reference = build_reference_model(model, CPU, SEED, torch.float64)
    opt = optimizer(reference.parameters())
    losses, norms = [], []
    for step in range(steps):
        inputs, targets = global_batch(step, batch_size)
        loss = gpt_loss(reference(inputs), targets)
        loss.backward()
        norms.append(sum(p.grad.pow(2).sum() for p in reference.parameters()).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inputs, targets = global_batch(steps, batch_size)
    with torch.no_grad():
        eval_loss = gpt_loss(reference(inputs), targets).item()
    return {"losses": losses, "norms": norms, "eval": eval_loss, "params": dict(reference.named_parameters())}


def share(batch: Tensor, engine: PipelineEngine) -> Tensor:
    """The samples of a global batch that ``engine``'s worker takes (its pipeline's and rerouted ones)."""
    return torch.cat([batch[r.start : r.stop] for r in engine.samples])


def train_layout(
    store: dist.Store, state: dict[str, Any], plan: Plan, generation: int, steps: int, bucket_cap_bytes: int
) -> dict:
    """Train ``steps`` AdamW steps as worker ``plan.workers[rank]``; report what the test compares.

    Records the token rows the first layer of each pipeline actually received, to check that every
    sample of a global batch is used by exactly one pipeline exactly once.
    """
    worker = plan.workers[state["index"]]
    groups = ProcessGroups(plan, worker, store, generation, timeout=timedelta(seconds=30))
    try:
        engine = PipelineEngine(
            model, gpt_loss, groups, CPU, seed=SEED, dtype=torch.float64, bucket_cap_bytes=bucket_cap_bytes
        )
        rows: list[Tensor] = []
        if engine.is_first_stage:
            first = engine.module.layer(0)
            first.register_forward_pre_hook(lambda _m, args: rows.append(args[0].clone()))
        opt = optimizer(engine.module.parameters())
        losses, norms, seen = [], [], []
        for step in range(steps):
            inputs, targets = global_batch(step, plan.global_batch_size)
            rows.clear()
            with SavedTensorMeter(exclude=engine.module.parameters()) as meter:
                loss = engine.train_step(
                    share(inputs, engine) if engine.is_first_stage else None,
                    share(targets, engine) if engine.is_last_stage else None,
                )
            norm = engine.grad_norm_sq()
            dist.all_reduce(norm)
            counts = loss is not None and groups.tensor_rank == 0  # a split stage's loss counts once
            total = loss if counts else torch.zeros((), dtype=torch.float64)
            dist.all_reduce(total)  # each pipeline's last stage adds its share of the global loss
            losses.append(total.item())
            norms.append(norm.item())
            seen.append(torch.cat(rows) if rows else None)
            opt.step()
            opt.zero_grad()
        inputs, targets = global_batch(steps, plan.global_batch_size)
        eval_loss = engine.eval_step(
            share(inputs, engine) if engine.is_first_stage else None,
            share(targets, engine) if engine.is_last_stage else None,
        )
        counts = eval_loss is not None and groups.tensor_rank == 0
        total = eval_loss if counts else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total)
        return {
            "rank": groups.rank,
            "role": engine.role,
            "peak_activation_bytes": meter.peak_bytes,
            "generation": groups.generation,
            "losses": losses,
            "norms": norms,
            "eval": total.item(),
            "seen": seen,
            "params": {n: whole(p).detach().clone() for n, p in engine.module.named_parameters()},
        }
    finally:
        groups.destroy()


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: a split one gathered from its stage's devices (a collective over them)."""
    return param.full_tensor() if isinstance(param, DTensor) else param


def join_groups(
    store: dist.Store, state: dict[str, Any], plan: Plan, generation: int, timeout_s: float
) -> int:
    """Create this worker's groups and engine for ``plan`` and keep them in the process state."""
    worker = plan.workers[state["index"]]
    groups = ProcessGroups(plan, worker, store, generation, timeout=timedelta(seconds=timeout_s))
    abort = threading.Event()
    state["groups"] = groups
    state["abort"] = abort
    state["engine"] = PipelineEngine(
        model, gpt_loss, groups, CPU, seed=SEED, dtype=torch.float64, abort=abort
    )
    return groups.rank


def blocked_step(store: dist.Store, state: dict[str, Any], abort_after_s: float | None) -> dict[str, Any]:
    """Run a step whose peer is silent or dead, setting the abort event after ``abort_after_s`` if given."""
    engine: PipelineEngine = state["engine"]
    timer = None if abort_after_s is None else threading.Timer(abort_after_s, state["abort"].set)
    inputs, _ = global_batch(0, engine.plan.global_batch_size)
    start = time.monotonic()
    if timer is not None:
        timer.start()
    try:
        engine.train_step(inputs[engine.batch_slice], None)
        outcome = "returned"
    except PeerFailure as e:
        outcome = f"PeerFailure: {e}"
    elapsed = time.monotonic() - start
    state["groups"].destroy()
    return {"outcome": outcome, "elapsed": elapsed}


def leave_groups(store: dist.Store, state: dict[str, Any]) -> bool:
    state.pop("engine")
    state["groups"].destroy()
    return state.pop("groups").destroyed


EMULATED = DeviceTimes(0.02, 0.02, 0.02)
"""Every emulated layer's forward, input gradient and weight gradient take 20 ms: long enough that the
executor's own work around each action (about 1 ms with 8 processes on 2 cores) stays a few percent."""


def emulated_steps(
    store: dist.Store,
    state: dict[str, Any],
    plan: Plan,
    generation: int,
    steps: int,
    times: DeviceTimes = EMULATED,
) -> float:
    """Train ``steps`` steps of emulated layers taking ``times`` under ``plan`` after one warm-up step; the
    fastest step's seconds (each timed between barriers of all workers): on a shared machine, noise only
    adds time."""
    worker = plan.workers[state["index"]]
    groups = ProcessGroups(plan, worker, store, generation, timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        engine = PipelineEngine(
            lambda: emulated_layers(plan.num_layers, 4, times), emulated_loss, groups, CPU
        )
        inputs = torch.randn(plan.global_batch_size, 4)
        timings = []
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(
                share(inputs, engine) if engine.is_first_stage else None,
                share(inputs, engine) if engine.is_last_stage else None,
            )
            dist.barrier()
            if step > 0:
                timings.append(time.perf_counter() - start)
        return min(timings)
    finally:
        groups.destroy()


def emulated_loss(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


WIDE = 128
"""The width of :func:`fp32_boundary_layers`: a micro-batch's activation is ``rows * WIDE`` elements."""


class Float32Output(torch.nn.Module):
    """A linear layer whose output leaves in float32 under autocast, as a transformer block's residual sum
    does: the next stage's first matrix product casts it to bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(WIDE, WIDE)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x).float()


def fp32_boundary_layers() -> list[torch.nn.Module]:
    return [Float32Output(), torch.nn.Linear(WIDE, WIDE)]


def bytes_alive_after_a_step(store: dist.Store, state: dict[str, Any], plan: Plan, generation: int) -> int:
    """One training step under bfloat16 autocast as ``plan.workers[index]`` of :func:`fp32_boundary_layers`:
    the bytes of tensors still alive once it returned, inside the autocast region, but for the batch's."""
    worker = plan.workers[state["index"]]
    groups = ProcessGroups(plan, worker, store, generation, timeout=timedelta(seconds=30))
    try:
        batch = torch.randn(plan.global_batch_size, WIDE, generator=torch.Generator().manual_seed(0))
        with LiveTensorMeter() as meter, torch.autocast("cpu", torch.bfloat16):
            engine = PipelineEngine(fp32_boundary_layers, lambda y, t: (y - t).pow(2).mean(), groups, CPU)
            engine.train_step(
                batch[engine.batch_slice] if engine.is_first_stage else None,
                batch[engine.batch_slice] if engine.is_last_stage else None,
            )
            return meter.live_bytes - batch.untyped_storage().nbytes()
    finally:
        groups.destroy()


def recover_split_stages(
    store: dist.Store, state: dict[str, Any], old: Plan, new: Plan, copies: list, steps: tuple[int, int]
) -> dict[str, Any]:
    """Train ``steps[0]`` steps under ``old``, then (the workers of ``new``) copy the layers ``copies`` names
    into generation 1, split anew over its devices, and train ``steps[1]`` more under ``new``: what
    recovery does at tensor parallelism > 1, without the failure (the old generation is left normally)."""
    from functools import partial

    from lightning_oobleck.execution import build_stage
    from lightning_oobleck.recovery.state_transfer import load_state_by_name, state_by_name, transfer_state

    worker = old.workers[state["index"]]
    groups = ProcessGroups(old, worker, store, 0, timeout=timedelta(seconds=30))
    engine = PipelineEngine(model, gpt_loss, groups, CPU, seed=SEED, dtype=torch.float64)
    opt = optimizer(engine.module.parameters())

    def train(step: int) -> None:
        inputs, targets = global_batch(step, engine.plan.global_batch_size)
        engine.train_step(
            inputs[engine.batch_slice] if engine.is_first_stage else None,
            targets[engine.batch_slice] if engine.is_last_stage else None,
        )
        opt.step()
        opt.zero_grad()

    for step in range(steps[0]):
        train(step)
    groups.destroy()
    if worker not in new.workers:
        return {"left": True}
    groups = ProcessGroups(new, worker, store, 1, timeout=timedelta(seconds=30))
    try:
        build = partial(build_stage, model, device=CPU, dtype=torch.float64, init=None)
        module, moved, stats = transfer_state(
            engine.module, state_by_name(opt, engine.module), copies, groups, build, threading.Event()
        )
        opt = optimizer(module.parameters())
        load_state_by_name(opt, module, moved)
        engine.reconfigure(groups, module)
        for step in range(steps[0], sum(steps)):
            train(step)
        return {
            "left": False,
            "received": stats.received_bytes,
            "layers": list(module.layer_indices),
            "params": {n: whole(p).detach().clone() for n, p in module.named_parameters()},
        }
    finally:
        groups.destroy()
