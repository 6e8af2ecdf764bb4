"""State copy speed: the streamed copy of a recovery against a raw send of the same bytes, and the old path.

One receiving worker newly holds a stage of 8 layers (``nn.Linear(d, d)``, float32) with their AdamW state
(weights, ``exp_avg``, ``exp_avg_sq``), held by one or two surviving replicas. Three processes on this
machine, gloo over loopback; for each size, side by side in one run (best of ``--repeat``):

* **raw send**: every tensor sent by one source into a tensor allocated for it, whole and one at a time, or
  in slices of the bucket size with two in flight: the most the link moves here (the better of the two is
  the reference, ``of raw`` = 1);
* **serialised** (the copy before issue 27): ``torch.save`` of the layers and state into bytes, one
  message, ``torch.load`` and ``load_state_dict`` into freshly initialised layers (skipped above 1 GB: it
  needs about three times the payload on the receiver);
* **streamed, 1 source** / **2 sources**: :func:`~lightning_oobleck.recovery.state_transfer.transfer_state`
  as a recovery runs it (buckets of ``--bucket-mib``), from one replica or striped over two.

Columns: seconds, GB/s, the fraction of the raw send's GB/s, and the receiver's peak resident memory
beyond the state it receives (freed memory is returned to the system at once, so the peak is what the copy
needs). On one machine the link is loopback and both sources share its cores, so two sources are not
expected to beat one here; across nodes each source has its own link.

    python benchmarks/state_copy.py [--sizes 0.25 1 4] [--repeat 2] [--bucket-mib 64]
"""

from __future__ import annotations

import argparse
import io
import math
import multiprocessing as mp
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

from lightning_oobleck.execution import ProcessGroups, build_stage
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.planning.plan import LayerCopy, Pipeline, PipelineTemplate, Plan, Stage
from lightning_oobleck.recovery.state_transfer import state_by_name, transfer_state
from lightning_oobleck.testing import PeakResidentMemory
from lightning_oobleck.worker import Worker

LAYERS = 8
RECEIVER = 2
CPU = torch.device("cpu")
METHODS = (
    "raw send, whole tensors",
    "raw send, bucket slices",
    "serialised",
    "streamed, 1 source",
    "streamed, 2 sources",
)
RAW = METHODS[:2]
SERIALISED_MAX_GB = 1.0


def width(gigabytes: float) -> int:
    """``d`` such that 8 layers of ``Linear(d, d)`` with AdamW's two moments hold ``gigabytes``."""
    return int(math.sqrt(gigabytes * 1e9 / (LAYERS * 3 * 4)))


def plan(nodes: int) -> Plan:
    """``nodes`` one-node pipelines, each holding the whole model on one device."""
    template = PipelineTemplate(1, 1, (Stage(0, LAYERS, 0),), (1.0,))
    return Plan(
        num_layers=LAYERS,
        gpus_per_node=1,
        fault_tolerance=nodes - 1,
        n0=1,
        microbatch_size=1,
        global_batch_size=nodes,
        templates=(template,),
        pipelines=tuple(Pipeline(template, (n,), 1) for n in range(nodes)),
    )


def _worker(rank: int, port: int, sizes: list[float], repeat: int, bucket: int, results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    me, new_plan, generation = Worker(rank, 0), plan(3), 0
    for gigabytes in sizes:
        d = width(gigabytes)

        def layers(d: int = d) -> list[nn.Module]:
            return [nn.Linear(d, d, bias=False) for _ in range(LAYERS)]

        module, state = StageModule({}), {}
        if rank != RECEIVER:
            module = build_stage(layers, range(LAYERS), CPU)
            optimizer = torch.optim.AdamW(module.parameters())
            for p in module.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
            state = state_by_name(optimizer, module)
            module.zero_grad(set_to_none=True)
            del optimizer
        payload = LAYERS * 3 * d * d * 4
        for method in METHODS:
            if method == "serialised" and gigabytes > SERIALISED_MAX_GB:
                continue
            for _ in range(repeat):
                groups = ProcessGroups(new_plan, me, store, generation, timeout=timedelta(seconds=600))
                generation += 1
                groups.all_reduce(torch.zeros(1), threading.Event())
                with PeakResidentMemory() as memory:
                    started = time.perf_counter()
                    received = RUNS[method](groups, module, state, layers, bucket)
                    seconds = time.perf_counter() - started
                    del received
                extra = memory.growth_bytes - (payload if rank == RECEIVER else 0)
                groups.all_reduce(torch.zeros(1), threading.Event())
                groups.destroy()
                if rank == RECEIVER:
                    results.put((gigabytes, method, payload, seconds, extra))
    if rank == RECEIVER:
        results.put(None)


def _raw(sliced: bool) -> Any:
    def run(groups: ProcessGroups, module: StageModule, state: dict, layers: Any, bucket: int) -> Any:
        """Every tensor from worker 0 into tensors allocated for it: whole, one at a time, or in slices of
        ``bucket``, two in flight."""
        if groups.worker.node == RECEIVER:
            with torch.device("meta"):
                d = layers()[0].in_features
            tensors = [torch.empty(d, d) for _ in range(3 * LAYERS)]
            op, peer = dist.irecv, 0
        elif groups.worker.node == 0:
            tensors = [t.detach() for p, n in module.global_names().items() for t in (p, *state[n].values())]
            tensors, op, peer = [t for t in tensors if t.dim()], dist.isend, RECEIVER
        else:
            return None
        messages = [piece for t in tensors for piece in t.view(-1).split(bucket // 4)] if sliced else tensors
        in_flight: list[dist.Work] = []
        for message in messages:
            in_flight.append(op(message, peer, group=groups.world))
            if len(in_flight) == (2 if sliced else 1):
                in_flight.pop(0).wait()
        for work in in_flight:
            work.wait()
        return tensors

    return run


def _serialised(groups: ProcessGroups, module: StageModule, state: dict, layers: Any, bucket: int) -> Any:
    """The copy before issue 27: ``torch.save`` into bytes, one message, ``torch.load``, then
    ``load_state_dict`` into initialised layers."""
    world = groups.world
    if groups.worker.node == 0:
        buffer = io.BytesIO()
        torch.save(
            {"layers": {i: module.layer(i).state_dict() for i in range(LAYERS)}, "optim": state}, buffer
        )
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()]), RECEIVER, group=world)
        dist.send(data, RECEIVER, group=world)
        return None
    if groups.worker.node != RECEIVER:
        return None
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, 0, group=world)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, 0, group=world)
    payload = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    fresh = build_stage(layers, range(LAYERS), CPU)
    for i, layer_state in payload["layers"].items():
        fresh.layer(i).load_state_dict(layer_state)
    return fresh, payload["optim"]


def _streamed(sources: int) -> Any:
    def run(groups: ProcessGroups, module: StageModule, state: dict, layers: Any, bucket: int) -> Any:
        replicas = tuple(Worker(n, 0) for n in range(sources))
        copies = [LayerCopy(layer, RECEIVER, 0, replicas=replicas) for layer in range(LAYERS)]
        allocate = lambda indices: build_stage(layers, indices, CPU, init=None)  # noqa: E731
        return transfer_state(module, state, copies, groups, allocate, threading.Event(), CPU, bucket)

    return run


RUNS = {
    "raw send, whole tensors": _raw(sliced=False),
    "raw send, bucket slices": _raw(sliced=True),
    "serialised": _serialised,
    "streamed, 1 source": _streamed(1),
    "streamed, 2 sources": _streamed(2),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="GB of stage state")
    parser.add_argument("--repeat", type=int, default=2, help="runs per method and size; the best is shown")
    parser.add_argument("--bucket-mib", type=float, default=64)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    bucket = int(args.bucket_mib * 2**20)
    procs = [
        ctx.Process(target=_worker, args=(rank, port, args.sizes, args.repeat, bucket, results))
        for rank in range(3)
    ]
    for proc in procs:
        proc.start()
    best: dict[tuple[float, str], tuple[int, float, int]] = {}
    while (row := results.get(timeout=1800)) is not None:
        gigabytes, method, payload, seconds, extra = row
        if (gigabytes, method) not in best or seconds < best[gigabytes, method][1]:
            best[gigabytes, method] = (payload, seconds, extra)
    for proc in procs:
        proc.join(timeout=60)
    table = Table(title=f"State copy to one worker (gloo, loopback; buckets of {args.bucket_mib:g} MiB)")
    for column in ("state", "method", "seconds", "GB/s", "of raw", "peak extra memory (MiB)"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for gigabytes in args.sizes:
        raw = min((best[gigabytes, method] for method in RAW), key=lambda run: run[1])
        for method in METHODS:
            if (gigabytes, method) not in best:
                table.add_row(f"{gigabytes:g} GB", method, "not run", "", "", "")
                continue
            payload, seconds, extra = best[gigabytes, method]
            speed, raw_speed = payload / seconds / 1e9, raw[0] / raw[1] / 1e9
            table.add_row(
                f"{payload / 1e9:.2f} GB",
                method,
                f"{seconds:.2f}",
                f"{speed:.2f}",
                f"{speed / raw_speed:.2f}",
                f"{extra / 2**20:.0f}",
            )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
