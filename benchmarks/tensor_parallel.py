"""What splitting stages over a node's devices buys, as the planner predicts it: large models on 8-GPU nodes.

    python benchmarks/tensor_parallel.py                 # GPT-3 6.7B, a 70B-class and a 405B-class model
    python benchmarks/tensor_parallel.py --nodes 16 32   # fewer cluster sizes

For each model and cluster size, the planner plans at tensor parallelism 1 (a stage per GPU, today's
default) and with ``tensor_parallel="auto"`` (every degree the profile describes, the fastest kept), on
synthetic GPT profiles (:func:`~lightning_oobleck.planning.synthetic_gpt_profile`: Megatron's split of a
block, 1/t of its FLOPs per device at the same achieved FLOP/s). It prints the predicted step, the slowest
pipeline's shares of compute, tensor-parallel all-reduces and bubble, the largest stage's memory per device,
and the planning time; then, per template size, the degree each template would choose alone: when every size
prefers the plan's degree, one degree for the whole plan (what the planner does, so that a layer's gradient
is summed shard by shard) costs nothing.

The cluster is an H100 SXM node as docs/benchmarks.md gives it: 8 GPUs, 68 GB of tensors per device (80 GB
less the allocator's share measured on an H200), 400 TFLOP/s achieved in bf16, 360 GB/s all-reduce bus
bandwidth inside a node, 50 GB/s between nodes, f = 1, micro-batch 1, activation recomputation where a
stage would not fit otherwise (``activation_checkpointing="auto"``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from lightning_oobleck.planning import ClusterSpec, Plan, make_plan, synthetic_gpt_profile
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.templates import InfeasibleTemplateError, generate_template


@dataclass(frozen=True)
class Model:
    name: str
    blocks: int
    hidden: int
    heads: int
    seq_len: int
    global_batch: int


MODELS = (
    Model("GPT-3 6.7B", 32, 4096, 32, 2048, 512),
    Model("70B-class", 80, 8192, 64, 4096, 1024),
    Model("405B-class", 126, 16384, 128, 4096, 1024),
)
H100_NODE = dict(
    gpus_per_node=8,
    device_memory_bytes=68e9,
    intra_node_bandwidth=450e9,
    tensor_parallel_bandwidth=360e9,
    inter_node_bandwidth=50e9,
    device_memory_bandwidth=3.0e12,
)
ACHIEVED_FLOPS = 400e12


def profile_of(model: Model) -> ModelProfile:
    return synthetic_gpt_profile(
        model.blocks + 2, model.hidden, model.seq_len, 1, ACHIEVED_FLOPS, heads=model.heads, dtype="bfloat16"
    )


def plan(profile: ModelProfile, nodes: int, model: Model, tensor_parallel: int | str) -> Plan | str:
    try:
        return make_plan(
            profile,
            ClusterSpec(nodes, **H100_NODE),
            fault_tolerance=1,
            global_batch_size=model.global_batch,
            tensor_parallel=tensor_parallel,
            activation_checkpointing="auto",
        )
    except ValueError as e:
        return "does not fit" if "does not fit" in str(e) or "no tensor-parallel" in str(e) else str(e)[:40]


def row(plan_or_reason: Plan | str) -> list[str]:
    if isinstance(plan_or_reason, str):
        return [plan_or_reason, "", "", "", "", "", ""]
    p = plan_or_reason
    slowest = max(p.pipelines, key=lambda q: q.iteration_time_s())
    compute, tensor, bubble = slowest.template.time_split(slowest.microbatches)
    memory = max(max(t.stage_memory_bytes) for t in p.templates)
    depth = max(len(q.stages) for q in p.pipelines)
    return [
        str(p.tensor_parallel),
        f"{p.iteration_time_s:.1f} s",
        f"{len(p.pipelines)} x <= {depth}",
        f"{compute:.0%} / {tensor:.0%} / {bubble:.0%}",
        f"{memory / 1e9:.1f} GB",
        f"{p.planning_s:.2f} s",
        "",
    ]


def best_degree_per_template(profile: ModelProfile, nodes: int, sizes: list[int]) -> dict[int, int | None]:
    """For each template size, the degree whose template alone is fastest at 16 micro-batches per node."""
    best: dict[int, int | None] = {}
    for size in sizes:
        times = {}
        for t in profile.tensor_parallel_degrees:
            cost = CostModel(profile.at(t), ClusterSpec(nodes, **H100_NODE), activation_checkpointing="auto")
            try:
                times[t] = generate_template(cost, size, 16 * size).iteration_time_s(16 * size)
            except InfeasibleTemplateError:
                continue
        best[size] = min(times, key=times.__getitem__) if times else None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args()
    console = Console(width=max(Console().width, 140))
    table = Table(title="Predicted step on 8 x H100 nodes: a stage per GPU (t = 1) against the planner's t")
    for name in ("model", "nodes", "planned", "t", "step", "pipelines x stages", "compute / TP / bubble",
                 "memory/device", "planned in", "each template's best t"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("model", "planned") else "right")
    for model in MODELS:
        profile = profile_of(model)
        for nodes in args.nodes:
            whole = plan(profile, nodes, model, 1)
            auto = plan(profile, nodes, model, "auto")
            for label, result in (("t = 1", whole), ("auto", auto)):
                cells = row(result)
                if label == "auto" and isinstance(result, Plan):
                    sizes = sorted({t.num_nodes for t in result.templates})
                    best = best_degree_per_template(profile, nodes, sizes)
                    degrees = sorted({t for t in best.values() if t is not None})
                    cells[-1] = f"{'/'.join(map(str, degrees))} ({len(sizes)} sizes)"
                table.add_row(model.name, str(nodes), label, *cells)
        table.add_section()
    console.print(table)


if __name__ == "__main__":
    main()
