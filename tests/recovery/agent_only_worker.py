"""A worker process with only a WorkerAgent (no torch, starts fast): it agrees on the first generation,
optionally forks a child that outlives it (as a DataLoader worker would), then idles until it is killed
or fenced. Usage: ``agent_only_worker.py ADDRESS NODE [CHILD_PID_FILE]``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from lightning_oobleck.recovery import WorkerAgent

address, node = sys.argv[1], int(sys.argv[2])
agent = WorkerAgent((node, 0), address, connect_timeout=20.0).start()
agent.agree(after=-1, timeout=30.0)
if len(sys.argv) > 3:
    child = os.fork()
    if child == 0:
        time.sleep(30.0)
        os._exit(0)
    Path(sys.argv[3]).write_text(str(child))
while True:
    time.sleep(0.1)
