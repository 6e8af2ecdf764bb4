"""What splitting stages over a node's devices buys, as the planner predicts it: large models on 8-GPU nodes.

    python benchmarks/tensor_parallel.py                 # GPT-3 6.7B, a 70B-class and a 405B-class model
    python benchmarks/tensor_parallel.py --nodes 16 32   # fewer cluster sizes
    python benchmarks/tensor_parallel.py --emulated      # the cost model's t term against a measurement

For each model and cluster size, the planner plans at tensor parallelism 1 (a stage per GPU, today's
default) and with ``tensor_parallel="auto"`` (every degree the profile describes, the fastest kept), on
synthetic GPT profiles (:func:`~lightning_oobleck.planning.synthetic_gpt_profile`: Megatron's split of a
block, 1/t of its FLOPs per device at the same achieved FLOP/s). It prints the predicted step, the slowest
pipeline's shares of compute, tensor-parallel all-reduces and bubble, the largest stage's memory per device,
and the planning time; then, per template size, the degree each template would choose alone: when every size
prefers the plan's degree, one degree for the whole plan (what the planner does, so that a layer's gradient
is summed shard by shard) costs nothing.

``--emulated`` checks the tensor-parallel term of the cost model against a measurement on this machine: one
pipeline of 2 stages, each on 1 device (t = 1) or on the 2 devices of a node (t = 2), of emulated layers
(:class:`~lightning_oobleck.testing.EmulatedSplitLayer`: sleeps that halve at t = 2, and the real gloo
all-reduces of a Megatron pair), trained through the engine; the prediction is the cost model's 1F1B step
from the same times, with the all-reduce and the point-to-point send timed first between two processes. The
layers are split twice over: by hand (their two all-reduces run as torch's functional collectives, nothing
else added: the cost model's terms alone) and through DTensor (as a model's layers are, its host work per
split product included).

The cluster is an H100 SXM node as docs/benchmarks.md gives it: 8 GPUs, 68 GB of tensors per device (80 GB
less the allocator's share measured on an H200), 400 TFLOP/s achieved in bf16, 360 GB/s all-reduce bus
bandwidth inside a node, 50 GB/s between nodes, f = 1, micro-batch 1, activation recomputation where a
stage would not fit otherwise (``activation_checkpointing="auto"``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from schedules import spawn  # benchmarks/schedules.py: run workers in processes, gather their results
from torch.distributed import TCPStore
from torch.distributed import _functional_collectives as funcol

from lightning_oobleck.execution import PipelineEngine, ProcessGroups, profile_layers
from lightning_oobleck.planning import ClusterSpec, Plan, make_plan, synthetic_gpt_profile
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.layout import layout_plan
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.planning.templates import InfeasibleTemplateError, generate_template
from lightning_oobleck.testing import DeviceTimes, EmulatedSplitLayer, emulated_profile


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


# ------------------------------------------------------------------ the emulated measurement
LAYERS, WIDTH, MICRO, SEQ, MICROBATCHES = 8, 2048, 1, 32, 8
TIMES = DeviceTimes(0.01, 0.01, 0.01)
"""Per layer, one device: a stage of 4 layers takes 40 ms forward; its all-reduces carry 256 KiB."""


def emulated_layers(dtensor: bool = True) -> list[torch.nn.Module]:
    return [EmulatedSplitLayer(WIDTH, TIMES, dtensor=dtensor) for _ in range(LAYERS)]


def emulated_plan(t: int, stages: int) -> Plan:
    """One pipeline of ``stages`` stages (1: layers 0-7; 2: layers 0-3, 4-7) on nodes of ``t`` devices, each
    stage on all ``t``."""
    return layout_plan(
        [list(range(0, LAYERS + 1, LAYERS // stages))],
        LAYERS,
        gpus_per_node=t,
        fault_tolerance=0,
        global_batch_size=MICRO * MICROBATCHES,
        microbatch_size=MICRO,
        tensor_parallel=t,
    )


def emulated_worker(index: int, port: int, job: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    plan = emulated_plan(job["t"], job["stages"])
    groups = ProcessGroups(plan, plan.workers[index], store, 0)
    engine = PipelineEngine(
        functools.partial(emulated_layers, job["dtensor"]),
        lambda y, target: ((y - target) ** 2).mean(),
        groups,
        torch.device("cpu"),
    )
    inputs = torch.randn(plan.global_batch_size, SEQ, WIDTH)
    times = []
    for step in range(job["steps"] + 1):
        dist.barrier()
        start = time.perf_counter()
        engine.module.zero_grad(set_to_none=True)
        engine.train_step(
            inputs[engine.batch_slice] if engine.is_first_stage else None,
            inputs[engine.batch_slice] if engine.is_last_stage else None,
        )
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
    groups.destroy()
    out.put((index, statistics.median(times)))


def link_worker(index: int, port: int, job: dict[str, Any], out: Any) -> None:
    """Four processes in two pairs, as the t = 2 run places them: the one-way time of an activation between
    the pairs' first processes, then of an all-reduce of the same bytes inside each pair, both pairs at once
    (the machine's cores are shared as in the run)."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=index, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[index // 2]
    message = torch.zeros(MICRO, SEQ, WIDTH)
    send_s = 0.0
    if index in (0, 2):
        peer = 2 - index
        first, second = (dist.send, dist.recv) if index == 0 else (dist.recv, dist.send)
        for repeat in range(job["repeats"] + 5):
            if repeat == 5:
                start = time.perf_counter()
            first(message, peer)
            second(message, peer)
        send_s = (time.perf_counter() - start) / (2 * job["repeats"])
    dist.barrier()
    for _ in range(5):
        funcol.wait_tensor(funcol.all_reduce(message, "sum", pair))
    start = time.perf_counter()
    for _ in range(job["repeats"]):  # as the split layers run it: a functional collective, waited for
        funcol.wait_tensor(funcol.all_reduce(message, "sum", pair))
    out.put((index, (send_s, (time.perf_counter() - start) / job["repeats"])))
    dist.destroy_process_group()


def configured_profile() -> ModelProfile:
    """The emulated layers' profile from their configured times: halved at t = 2, with the all-reduces of a
    Megatron pair (the first layer, fed the data, has no input gradient to sum)."""
    nbytes = MICRO * SEQ * WIDTH * 4
    whole = emulated_profile(LAYERS, WIDTH, TIMES, MICRO, sequence=SEQ)
    split = tuple(
        replace(
            layer,
            forward_s=layer.forward_s / 2,
            backward_s=layer.backward_s / 2,
            weight_grad_s=(layer.weight_grad_s or 0.0) / 2,
            tensor_parallel_forward_bytes=(nbytes,),
            tensor_parallel_backward_bytes=(nbytes,) if i else (),
        )
        for i, layer in enumerate(whole.layers)
    )
    return replace(whole, sharded={2: split})


def predicted_s(
    profile: ModelProfile, t: int, stages: int, send_s: float, allreduce_s: float
) -> tuple[float, float]:
    """The cost model's 1F1B step and its tensor-parallel part, with the links as measured: the all-reduce's
    bus bandwidth from its time (a 2-device ring moves the bytes once each way), the sends' latency."""
    nbytes = MICRO * SEQ * WIDTH * 4
    profile = profile.at(t)
    cluster = ClusterSpec(
        num_nodes=stages,
        gpus_per_node=t,
        inter_node_latency_s=send_s,
        inter_node_bandwidth=1e15,
        intra_node_latency_s=0.0,
        tensor_parallel_bandwidth=nbytes / allreduce_s,
    )
    cost = CostModel(profile, cluster)
    plan = emulated_plan(t, stages)
    stages = plan.pipelines[0].stages
    times = [cost.stage_time_s(s.first_layer, s.end_layer, k, len(stages)) for k, s in enumerate(stages)]
    tensor = [cost.tensor_parallel_s(s.first_layer, s.end_layer) for s in stages]
    slowest = max(range(len(stages)), key=times.__getitem__)
    return cost.pipeline_time_s(times, MICROBATCHES), MICROBATCHES * tensor[slowest]


def emulated(steps: int, console: Console) -> None:
    links = spawn(link_worker, 4, {"repeats": 50})
    send_s, allreduce_s = links[0][0], statistics.median(r[1] for r in links.values())
    table = Table(
        title=f"{MICROBATCHES} micro-batches of emulated layers through the engine, t = 2 against t = 1 "
        "(gloo, this machine)"
    )
    for name in ("layers split", "pipeline", "profile", "measured t=1 / t=2", "predicted t=1 / t=2",
                 "of which TP all-reduces", "measured / predicted at t=2", "speed-up measured / predicted",
                 "ratio"):  # fmt: skip
        table.add_column(name, justify="right")
    for dtensor in (False, True):
        kind = "through DTensor" if dtensor else "by hand"
        profiles = {
            "configured": configured_profile(),
            "profiled": profile_layers(
                functools.partial(emulated_layers, dtensor),
                torch.zeros(MICRO, SEQ, WIDTH),
                torch.device("cpu"),
                repeat=5,
                tensor_parallel=(2,),
            ),
        }
        for stages in (1, 2):
            measured = {}
            for t in (1, 2):
                job = {"t": t, "stages": stages, "steps": steps, "dtensor": dtensor}
                measured[t] = statistics.median(spawn(emulated_worker, stages * t, job).values())
            for name, profile in profiles.items():
                predicted = {t: predicted_s(profile, t, stages, send_s, allreduce_s) for t in (1, 2)}
                speedup = measured[1] / measured[2], predicted[1][0] / predicted[2][0]
                table.add_row(
                    kind,
                    f"{stages} stage{'s' if stages > 1 else ''} ({stages} and {2 * stages} processes)",
                    name,
                    f"{measured[1] * 1e3:.0f} / {measured[2] * 1e3:.0f} ms",
                    f"{predicted[1][0] * 1e3:.0f} / {predicted[2][0] * 1e3:.0f} ms",
                    f"{predicted[2][1] * 1e3:.1f} ms",
                    f"{measured[2] / predicted[2][0]:.3f}",
                    f"{speedup[0]:.2f} / {speedup[1]:.2f}",
                    f"{speedup[0] / speedup[1]:.3f}",
                )
    console.print(table)
    console.print(f"links measured: a {MICRO * SEQ * WIDTH * 4 / 2**10:.0f} KiB send {send_s * 1e3:.2f} ms, "
                  f"its all-reduce in each of two pairs at once {allreduce_s * 1e3:.2f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--emulated", action="store_true", help="measure t = 2 against t = 1 on this machine")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    console = Console(width=max(Console().width, 140))
    if args.emulated:
        emulated(args.steps, console)
        return
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
