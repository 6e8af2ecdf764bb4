"""Shared test setup: make ``examples/`` importable (``from gpt.model import ...``), and one CPU thread per
process.

Each process of a test stands for a device of its own, as on a cluster where SLURM's ``--cpus-per-task`` or
Lightning's launcher limits a worker's threads. Here 4-8 of them share 2 cores, and with torch's default
(a thread per core) every small operation waited for the other processes' spinning OpenMP threads: a
rerouted training step of the tiny test model took 4 times longer. Set in the environment before any test
starts a process, so every worker inherits it; a test of the thread limit itself removes it (``tests/slurm``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if "OMP_NUM_THREADS" not in os.environ:  # a limit of the developer's own stays
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)


@pytest.fixture
def killed_process_env() -> Iterator[dict[str, str]]:
    """The environment for a process the test SIGKILLs: ``TMPDIR`` a folder removed after the test, so that
    the temporary folders the process could not remove itself go with it. Not ``tmp_path``: the fork server's
    socket lives in ``TMPDIR``, and its path must stay under 108 characters."""
    with tempfile.TemporaryDirectory(prefix="oobleck-test-") as folder:
        yield {**os.environ, "TMPDIR": folder}
