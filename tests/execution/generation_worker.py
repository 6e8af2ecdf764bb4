"""One worker of the abort test: generation 0 over every worker, the last one hangs (SIGSTOP), the others
leave generation 0 with operations pending on it (:meth:`ProcessGroups.abort`) and build generation 1.

``python generation_worker.py RANK WORLD PORT BACKEND OUT``: writes a JSON result to ``OUT`` (survivors).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_harness import plan_from_splits

from lightning_oobleck.execution import PeerFailure, ProcessGroups


def main() -> None:
    rank, world, port, backend, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    every = plan_from_splits([[(0, 2)]] * world, [1] * world, 1)  # one replica of the model per worker
    groups = ProcessGroups(every, (rank, 0), store, 0, backend, timeout=timedelta(seconds=60))
    never = threading.Event()
    groups.all_reduce(torch.ones(1, device=device), never)  # every worker is connected
    if rank == world - 1:
        store.set("stopped", b"1")
        os.kill(os.getpid(), signal.SIGSTOP)  # a silent peer: alive, never answering
        return
    store.wait(["stopped"])
    pending = dist.irecv(torch.zeros(4, device=device), world - 1, group=groups.world)  # never completes
    abort = threading.Event()
    threading.Timer(0.5, abort.set).start()
    try:
        groups.all_reduce(torch.ones(1, device=device), abort)  # the hung peer never contributes
        raise AssertionError("an all-reduce with a stopped peer completed")
    except PeerFailure:
        pass
    started = time.monotonic()
    groups.abort("a peer hangs")
    abort_s = time.monotonic() - started
    result = {
        "abort_s": abort_s,
        "errored": str(groups.errored()),
        "initialized_after_abort": dist.is_initialized(),
        "pending_completed": pending.is_completed(),
    }
    survivors = plan_from_splits([[(0, 2)]] * (world - 1), [1] * (world - 1), 1)
    started = time.monotonic()
    following = ProcessGroups(survivors, (rank, 0), store, 1, backend, timeout=timedelta(seconds=60))
    total = following.all_reduce(torch.ones(1, device=device), never)
    result["next_generation_s"] = time.monotonic() - started
    result["next_sum"] = total.item()
    following.destroy()
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # generation 0's groups stay referenced until the process ends, as recovery keeps them


if __name__ == "__main__":
    main()
