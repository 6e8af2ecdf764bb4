"""Cluster environments for Oobleck: where a process sits at launch, and ranks that can shrink later.

Lightning's environments read ranks from the process environment on every call and (for SLURM) ignore
``set_world_size``/``set_global_rank``; after a node failure Oobleck keeps training on fewer processes, so
the strategy must be able to renumber the survivors. These environments:

* read the launch position once (SLURM's variables go stale after a shrink: they are never read again);
* let ``set_world_size``/``set_global_rank`` take effect (and move ``rank_zero_only`` with the rank);
* keep the *worker identity* ``(node, device)`` fixed: it names the failure domain in the plan
  (:mod:`lightning_oobleck.planning.plan`) and never changes when ranks are renumbered;
* take the rendezvous store address from ``OOBLECK_STORE_ADDR=host:port``: the store (and the recovery
  coordinator) run in a process of their own, never in worker rank 0, with a standby that takes over;
* are not :class:`~lightning.fabric.plugins.environments.SLURMEnvironment` subclasses, so Lightning's
  ``_SignalConnector`` installs no SIGUSR1 auto-requeue handler (a requeue would restart the job and undo
  in-process recovery).
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_oobleck.recovery.protocol import NODE_KEY_ENV, SECRET_ENV
from lightning_oobleck.worker import Worker

STORE_ADDR_VAR = "OOBLECK_STORE_ADDR"
"""``host:port`` of the job's rendezvous store, its coordinators (set by the local launcher, or by the SLURM
batch script; several, comma-separated, the active one first)."""
RANK_VAR = "OOBLECK_RANK"
WORLD_SIZE_VAR = "OOBLECK_WORLD_SIZE"
NODE_VAR = "OOBLECK_NODE"
DEVICE_VAR = "OOBLECK_DEVICE"
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")


@dataclass(frozen=True)
class LaunchPosition:
    """Where a process was placed at launch; fixed for the life of the process."""

    global_rank: int
    world_size: int
    node: int
    """Failure-domain id (the plan's node id)."""
    device: int
    """Device index inside the node (the plan's device id, Lightning's ``local_rank``)."""


def parse_store_address(value: str, source: str = STORE_ADDR_VAR) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 hosts in brackets: ``[::1]:29500``), with an error that names ``source``."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{source}={value!r} is not 'host:port' (for example 'node001:29500')")
    return host, int(port)


def local_worker_env(
    global_rank: int, world_size: int, devices_per_node: int, store_addr: str
) -> dict[str, str]:
    """The variables the local launcher gives worker ``global_rank``: node = rank // G, device = rank % G."""
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
    return {
        STORE_ADDR_VAR: store_addr,
        RANK_VAR: str(global_rank),
        WORLD_SIZE_VAR: str(world_size),
        NODE_VAR: str(global_rank // devices_per_node),
        DEVICE_VAR: str(global_rank % devices_per_node),
    }


class OobleckEnvironment(ClusterEnvironment):
    """Base: launch position from :meth:`_read_position`, ranks overridable by the strategy after a shrink."""

    def __init__(self) -> None:
        super().__init__()
        self._global_rank: int | None = None
        self._world_size: int | None = None
        self._node: int | None = None

    def devices_per_node(self, configured: int | None) -> int:
        """The processes per failure domain: ``configured`` (the strategy's ``devices_per_node``) or this
        environment's default; an error names the key when it contradicts how the processes were placed."""
        return 1 if configured is None else configured

    @abstractmethod
    def _read_position(self) -> LaunchPosition:
        """The launch position of this process."""

    @property
    def position(self) -> LaunchPosition:
        return self._read_position()

    @property
    def worker(self) -> Worker:
        """``(node, device)``: this process's worker id in the plan; unchanged by renumbering."""
        return self.node_rank(), self.position.device

    @property
    def node_key(self) -> str | None:
        """The name of this process's node if it joins a running training (``OOBLECK_NODE_KEY``), else
        ``None``: its node id is then the coordinator's (:meth:`set_node`), not its launch position's."""
        return os.environ.get(NODE_KEY_ENV) or None

    def set_node(self, node: int) -> None:
        """The node id the coordinator gave this joining process."""
        self._node = node

    @property
    def store_address(self) -> str:
        """``host:port`` of the job's rendezvous store (:mod:`~lightning_oobleck.recovery.keystore`), served
        by its coordinators: several, comma-separated, the active one first."""
        value = os.environ.get(STORE_ADDR_VAR)
        if not value:
            raise RuntimeError(
                f"{STORE_ADDR_VAR} is not set. The rendezvous store runs in a coordinator process: "
                "locally OobleckLauncher sets it; under SLURM the batch script must start the coordinator on "
                f"the batch host and `export {STORE_ADDR_VAR}=$(hostname):PORT` before `srun`."
            )
        for address in value.split(","):
            parse_store_address(address)
        return value

    @property
    def secret(self) -> str:
        """The job's secret (``OOBLECK_COORDINATOR_SECRET``), which the store and the coordinator ask of every
        process: made by whatever started the job (the local launcher, the SLURM batch script's
        ``oobleck-rendezvous`` line) and given to its processes only."""
        value = os.environ.get(SECRET_ENV)
        if not value:
            raise RuntimeError(
                f"{SECRET_ENV} is not set: the job's store answers only its own processes. Locally "
                "OobleckLauncher sets it; under SLURM the batch script's `eval $(python -m "
                "lightning_oobleck.slurm.rendezvous ...)` exports it (or submit with `oobleck submit`)."
            )
        return value

    @property
    def main_address(self) -> str:
        return parse_store_address(self.store_address.split(",")[0])[0]

    @property
    def main_port(self) -> int:
        return parse_store_address(self.store_address.split(",")[0])[1]

    def world_size(self) -> int:
        return self.position.world_size if self._world_size is None else self._world_size

    def set_world_size(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        self._world_size = size

    def global_rank(self) -> int:
        return self.position.global_rank if self._global_rank is None else self._global_rank

    def set_global_rank(self, rank: int) -> None:
        if rank < 0:
            raise ValueError(f"global rank must be >= 0, got {rank}")
        self._global_rank = rank
        rank_zero_only.rank = rank

    def local_rank(self) -> int:
        return self.position.device

    def node_rank(self) -> int:
        return self.position.node if self._node is None else self._node


class LocalOobleckEnvironment(OobleckEnvironment):
    """Processes started on this machine by :class:`~lightning_oobleck.lightning.launcher.OobleckLauncher`.

    In the supervisor (no ``OOBLECK_RANK``) it reports rank 0 of a world of 1 until the strategy sets the
    world size, and ``creates_processes_externally`` is false so that the strategy installs our launcher.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return RANK_VAR in os.environ

    @staticmethod
    def detect() -> bool:
        return RANK_VAR in os.environ

    def _read_position(self) -> LaunchPosition:
        env = os.environ
        return LaunchPosition(
            global_rank=int(env.get(RANK_VAR, 0)),
            world_size=int(env.get(WORLD_SIZE_VAR, 1)),
            node=int(env.get(NODE_VAR, 0)),
            device=int(env.get(DEVICE_VAR, 0)),
        )


class OobleckSLURMEnvironment(OobleckEnvironment):
    """One task per device started by ``srun``; SLURM's variables are read once, here, at construction.

    After a node is lost SLURM does not update the survivors' variables, so only the launch position comes
    from them; the strategy renumbers ranks with ``set_global_rank``/``set_world_size``. Node ids are
    ``SLURM_NODEID`` and device ids ``SLURM_LOCALID``.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        env = os.environ if environ is None else environ
        missing = [v for v in SLURM_VARS if v not in env]
        if missing:
            raise RuntimeError(
                f"OobleckSLURMEnvironment needs {', '.join(missing)}: start one task per device with `srun` "
                "inside the allocation (see slurm/ for the batch template)."
            )
        self._position = LaunchPosition(
            global_rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            node=int(env["SLURM_NODEID"]),
            device=int(env["SLURM_LOCALID"]),
        )
        self.job_id: str | None = env.get("SLURM_JOB_ID")
        self.nodelist: str | None = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST"))
        self.tasks_per_node: int | None = (
            int(env["SLURM_NTASKS_PER_NODE"]) if "SLURM_NTASKS_PER_NODE" in env else None
        )
        """SLURM's tasks per node, when the job was submitted with ``--ntasks-per-node``."""
        self.num_nodes: int | None = int(env["SLURM_NNODES"]) if "SLURM_NNODES" in env else None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @staticmethod
    def detect() -> bool:
        """Inside an ``srun`` step (not an interactive ``bash``/``interactive`` job, as Lightning decides)."""
        return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in (
            "bash",
            "interactive",
        )

    def _read_position(self) -> LaunchPosition:
        return self._position

    def devices_per_node(self, configured: int | None) -> int:
        """SLURM's tasks per node: one node of the job is one failure domain."""
        placed = self.tasks_per_node
        if placed is None and self.num_nodes and self.world_size() % self.num_nodes == 0:
            placed = self.world_size() // self.num_nodes
        if configured is not None and placed is not None and configured != placed:
            raise ValueError(
                f"OobleckStrategy(devices_per_node={configured}) but SLURM runs {placed} task(s) per node: a "
                f"node is a failure domain, so leave devices_per_node unset (it follows SLURM) or set "
                f"devices_per_node={placed}"
            )
        return configured or placed or 1

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if self.tasks_per_node is not None and self.tasks_per_node != num_devices:
            raise ValueError(
                f"Trainer(devices={num_devices}) but SLURM runs --ntasks-per-node={self.tasks_per_node}: "
                f"set devices={self.tasks_per_node} or submit with --ntasks-per-node={num_devices}."
            )
        if self.num_nodes is not None and self.num_nodes != num_nodes:
            raise ValueError(
                f"Trainer(num_nodes={num_nodes}) but the SLURM job has --nodes={self.num_nodes}: "
                f"set num_nodes={self.num_nodes} or submit with --nodes={num_nodes}."
            )


def detect_environment() -> OobleckEnvironment:
    """The environment for this process: SLURM inside ``srun``, otherwise the local launcher's."""
    return OobleckSLURMEnvironment() if OobleckSLURMEnvironment.detect() else LocalOobleckEnvironment()
