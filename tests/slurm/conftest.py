"""A real 3-node SLURM cluster (slurm/start-cluster.sh, with accounting) for the tests marked ``slurm``.

The cluster is started once per session in a temporary directory ``oobleck-slurm-*`` and always stopped: by
the fixture's ``finally`` (test failures, timeouts, Ctrl-C; SIGTERM is turned into an exit for it) and, should
the interpreter end without running fixture finalizers, by an ``atexit`` hook. A cluster left behind by a
session that was SIGKILLed is stopped when the next session starts (one session at a time: fixed ports).
Set ``OOBLECK_SLURM_KEEP=1`` to keep the directory (logs) after the session.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import NODES, SCRIPTS, Cluster, script

PREFIX = "oobleck-slurm-"


def _stop(directory: Path, remove: bool) -> None:
    subprocess.run([str(SCRIPTS / "stop-cluster.sh"), str(directory)], timeout=60, check=False)
    if remove:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    script("install-deps.sh")
    for stale in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if (stale / "slurm.conf").exists():
            _stop(stale, remove=True)
    directory = Path(tempfile.mkdtemp(prefix=PREFIX))
    stopped = threading.Event()

    def stop() -> None:
        if not stopped.is_set():
            stopped.set()
            _stop(directory, remove=not os.environ.get("OOBLECK_SLURM_KEEP"))

    atexit.register(stop)
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    previous = os.environ.get("SLURM_CONF")
    try:
        script("start-cluster.sh", str(directory), str(NODES), "acct")
        os.environ["SLURM_CONF"] = str(directory / "slurm.conf")
        yield Cluster(directory, tuple(f"node{i}" for i in range(1, NODES + 1)))
    finally:
        stop()
        signal.signal(signal.SIGTERM, previous_sigterm)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


@pytest.fixture
def cluster(slurm_cluster: Cluster) -> Cluster:
    """The session's cluster, with every node idle."""
    slurm_cluster.wait_idle()
    return slurm_cluster
