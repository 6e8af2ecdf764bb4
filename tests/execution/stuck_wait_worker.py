"""A worker whose waiter thread is still stuck in an abandoned gloo receive when the process exits.

``python stuck_wait_worker.py RANK STORE_PORT ok|raise COORDINATOR``: rank 1 registers with the coordinator
as worker (1, 0), aborts a receive from rank 0 (which never sends), closes its broken waiter and ends
(normally, or with an uncaught exception) while rank 0 is still alive; rank 0 exits during rank 1's
finalisation, which wakes rank 1's stuck wait at that moment.
"""

import contextlib
import datetime
import sys
import threading
import time

import torch
import torch.distributed as dist

from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.recovery.agent import process_agent

rank, port, mode, coordinator = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
if rank == 1:
    process_agent((1, 0), address=coordinator)
    waiter, abort = CommWaiter(datetime.timedelta(seconds=60)), threading.Event()
    threading.Timer(0.3, abort.set).start()
    with contextlib.suppress(PeerFailure):
        waiter.wait([dist.irecv(torch.zeros(4), src=0)], abort)  # rank 0 never sends
    waiter.close()
    store.set("done1", "1")
    time.sleep(0.2)
    if mode == "raise":
        raise RuntimeError("the training failed")
    print("rank 1 finished", flush=True)
else:
    store.wait(["done1"])
    time.sleep(0.5)  # rank 1 is finalising when this exit closes the connection its waiter is stuck on
