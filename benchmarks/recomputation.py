"""Activation recomputation: what each stage keeps and costs, predicted by the cost model and measured.

The GPT example's layers are profiled on this CPU; a device-memory cap below what the plain 4-stage split
needs forces recomputation. For ``activation_checkpointing`` off / on / auto, the planner's 4-stage
template (one node of 4 devices, 1F1B with ``m >= 4``) is shown stage by stage: its layers, whether it
recomputes, the predicted peak memory (parameters and optimizer state, plus the activations of the
micro-batches in flight on that stage), the measured activation memory of that many micro-batches run
forward on the stage (autograd's saved tensors, counted with ``saved_tensors_hooks``; a recomputing stage's
prediction also holds the largest layer's saved tensors while it is recomputed, shown beside), and the
predicted and measured forward + backward time of one micro-batch (one process, real compute, median of 5).

    python benchmarks/recomputation.py [--blocks 8] [--d-model 256] [--seq-len 128] [--microbatch 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from lightning_oobleck.execution.memory import SavedTensorMeter
from lightning_oobleck.execution.profiler import profile_layers
from lightning_oobleck.execution.stage import build_reference_model, build_stage
from lightning_oobleck.planning import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import PipelineTemplate
from lightning_oobleck.planning.templates import InfeasibleTemplateError, generate_template

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPTConfig, gpt_layers, gpt_loss  # examples/gpt

STAGES = 4
MODES = (False, True, "auto")
COLUMNS = (
    "stage",
    "layers",
    "recomputes",
    "memory predicted (MiB)",
    "memory measured (MiB)",
    "+ recompute peak (MiB)",
    "time predicted (ms)",
    "time measured (ms)",
)


def measure(layers, template: PipelineTemplate, example: torch.Tensor, target: torch.Tensor):
    """Per stage: saved activation bytes of its in-flight micro-batches, and seconds per micro-batch."""
    cpu = torch.device("cpu")
    whole = build_reference_model(layers, cpu)
    rows = []
    x = example
    for index, stage_spec in enumerate(template.stages):
        stage = build_stage(layers, stage_spec.layers, cpu)
        stage.recompute = stage_spec.recompute
        last = index == len(template.stages) - 1

        def step(inputs: torch.Tensor, stage=stage, last=last) -> torch.Tensor:
            out = stage(inputs)
            return gpt_loss(out, target) if last else out.square().mean()

        leaf = x.detach().requires_grad_(x.is_floating_point())
        in_flight = STAGES - index
        with SavedTensorMeter(exclude=list(stage.parameters())) as meter:
            losses = [step(leaf) for _ in range(in_flight)]
            kept = meter.live_bytes
            for loss in losses:
                loss.backward()
        times = []
        for _ in range(5):
            started = time.perf_counter()
            step(leaf).backward()
            times.append(time.perf_counter() - started)
        rows.append((kept, statistics.median(times)))
        with torch.no_grad():
            for i in stage_spec.layers:
                x = whole.layer(i)(x)
    return rows


def peak(profile, stage) -> float:
    """The saved tensors of the stage's largest layer, alive while it is recomputed in the backward: in the
    prediction, not in the measurement (the recomputation saves through its own hooks)."""
    return max(profile.layers[i].activation_bytes for i in stage.layers)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_blocks=args.blocks)

    def layers():
        return gpt_layers(config)

    example = torch.randint(0, config.vocab_size, (args.microbatch, config.seq_len))
    target = torch.randint(0, config.vocab_size, (args.microbatch, config.seq_len))
    profile = profile_layers(layers, example, torch.device("cpu"), loss_fn=gpt_loss, example_target=target)
    unlimited = ClusterSpec(1, STAGES, device_memory_bytes=1e15)
    plain = generate_template(CostModel(profile, unlimited), 1, 2 * STAGES)
    cap = 0.7 * max(plain.stage_memory_bytes)
    cluster = replace(unlimited, device_memory_bytes=cap)

    console = Console()
    console.print(
        f"GPT example: {args.blocks} blocks, d_model {args.d_model}, sequence {args.seq_len}, micro-batch "
        f"{args.microbatch}; device memory cap {cap / 2**20:.1f} MiB (70% of the plain split's largest stage)"
    )
    for mode in MODES:
        cost = CostModel(profile, cluster, activation_checkpointing=mode)
        title = f"activation_checkpointing={mode!r}"
        try:
            template = generate_template(cost, 1, 2 * STAGES)
        except InfeasibleTemplateError as e:
            console.print(f"[bold]{title}[/bold]: {e}")
            continue
        table = Table(
            title=f"{title}: iteration {template.iteration_time_s(2 * STAGES) * 1e3:.0f} ms predicted"
        )
        for column in COLUMNS:
            table.add_column(column, justify="right")
        params = [
            cost.parameter_bytes(s.first_layer, s.end_layer) * cost.state_factor for s in template.stages
        ]
        for index, (s, (kept, seconds)) in enumerate(
            zip(template.stages, measure(layers, template, example, target), strict=True)
        ):
            table.add_row(
                str(index),
                f"{s.first_layer}-{s.end_layer}",
                "yes" if s.recompute else "no",
                f"{template.stage_memory_bytes[index] / 2**20:.2f}",
                f"{(params[index] + kept) / 2**20:.2f}",
                f"{peak(profile, s) / 2**20:.2f}" if s.recompute else "",
                f"{template.stage_times_s[index] * 1e3:.1f}",
                f"{seconds * 1e3:.1f}",
            )
        console.print(table)


if __name__ == "__main__":
    main()
