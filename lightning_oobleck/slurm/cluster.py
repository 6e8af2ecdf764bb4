"""What SLURM says: partition sizes (``scontrol``), a job's accounting records (``sacct``), host lists.

Thin wrappers over SLURM's commands with bounded run times and errors that say what is missing.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

COMMAND_TIMEOUT_S = 30.0

TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
"""Job states after which nothing of the job runs any more (a shrunk job passes through RESIZING: not one)."""


class SlurmError(RuntimeError):
    """A SLURM command is missing or failed."""


@dataclass(frozen=True)
class JobRecord:
    """One accounting row of a job: a shrunk job has one row per size (RESIZING rows, then the current)."""

    state: str
    nodes: tuple[str, ...]


def run(*command: str) -> str:
    """Run a SLURM command; its stdout, or :class:`SlurmError` with its stderr."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError as e:
        raise SlurmError(f"`{command[0]}` not found: run this where SLURM's commands are installed") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"`{' '.join(command)}` did not answer in {COMMAND_TIMEOUT_S:.0f} s") from e
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise SlurmError(f"`{' '.join(command)}` failed: {last[0]} (is SLURM configured here? SLURM_CONF)")
    return done.stdout


def partition_size(partition: str | None) -> tuple[str, int]:
    """``(name, total nodes)`` of ``partition``, or of the default partition when ``None``."""
    partitions: dict[str, dict[str, str]] = {}
    for line in run("scontrol", "show", "partition", "--oneliner").splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if "PartitionName" in fields:
            partitions[fields["PartitionName"]] = fields
    if partition is None:
        defaults = [name for name, fields in partitions.items() if fields.get("Default") == "YES"]
        if not defaults:
            raise SlurmError(f"the cluster has no default partition; choose one of: {', '.join(partitions)}")
        partition = defaults[0]
    if partition not in partitions:
        raise SlurmError(
            f"no partition '{partition}' on this cluster; choose one of: {', '.join(partitions)}"
        )
    return partition, int(partitions[partition]["TotalNodes"])


def partition_gpus(partition: str) -> int:
    """The most GPUs a node of ``partition`` has (``sinfo``'s generic resources; 0 on a CPU-only cluster)."""
    most = 0
    for gres in run("sinfo", "--partition", partition, "--noheader", "--format=%G").split():
        for resource in gres.split(","):
            kind, _, rest = resource.partition(":")
            if kind == "gpu":
                count = rest.split("(")[0].rsplit(":", 1)[-1]
                most = max(most, int(count) if count.isdigit() else 1)
    return most


def job_records(job_id: str) -> list[JobRecord]:
    """The job's accounting rows, oldest first (empty until the job reaches accounting)."""
    out = run(
        "sacct", "--jobs", job_id, "--allocations", "--noheader", "--parsable2", "--format=State,NodeList"
    )
    records = []
    for line in out.splitlines():
        state, _, nodelist = line.partition("|")
        nodes = tuple(expand_hostlist(nodelist)) if nodelist and nodelist != "None assigned" else ()
        records.append(JobRecord(state.split()[0] if state else "UNKNOWN", nodes))
    return records


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields of ``job_id`` (``StdOut``, ``BatchHost``, ``JobState``...)."""
    line = run("scontrol", "show", "job", job_id, "--oneliner")
    return dict(token.split("=", 1) for token in line.split() if "=" in token)


def expand_hostlist(hostlist: str) -> list[str]:
    """``node[1-3]`` -> ``['node1', 'node2', 'node3']`` (SLURM's own expansion, in SLURM's order)."""
    return run("scontrol", "show", "hostnames", hostlist).split()
