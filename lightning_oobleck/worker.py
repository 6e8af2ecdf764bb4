"""The one definition of a worker, the unit every layer of the package names: device ``device`` of node
``node``, one process. Its own module so that the light entry points (the coordinator, the SLURM task
runner) import it without the planner's NumPy and SciPy."""

from __future__ import annotations

from typing import NamedTuple


class Worker(NamedTuple):
    """One worker process: device ``device`` of node ``node`` (the node is the failure domain).

    A plain ``(node, device)`` tuple compares and hashes equal to it; it prints as one."""

    node: int
    device: int

    def __repr__(self) -> str:
        return f"({self.node}, {self.device})"

    __str__ = __repr__
