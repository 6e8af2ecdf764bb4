"""The coordinator as a service of the local launcher's supervisor (``SupervisorService`` protocol).

The supervisor process outlives every worker, so the coordinator it hosts survives the loss of any of
them, rank 0 included. Under SLURM the batch host plays that role instead (``coordinator.main``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lightning_oobleck.recovery.coordinator import Coordinator
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import ADDRESS_ENV
from lightning_oobleck.worker import Worker

if TYPE_CHECKING:
    from lightning_oobleck.lightning.launcher import Supervisor


class CoordinatorService:
    """Starts a :class:`Coordinator` for the supervisor's workers and exports its address to them.

    All workers run on this machine, so fenced workers are also SIGKILLed (``kill_fenced``): a stopped
    worker's peers then see its connections close at once.
    """

    def __init__(self, settings: MembershipSettings | None = None) -> None:
        self.settings = settings or MembershipSettings()
        self.coordinator: Coordinator | None = None

    def start(self, supervisor: Supervisor) -> None:
        settings = replace(
            self.settings,
            kill_fenced=True,  # every worker runs on this machine
            devices_per_node=supervisor.devices_per_node,
        )
        self.coordinator = Coordinator(
            supervisor.world_size,
            supervisor.host,
            settings=settings,
            secret=supervisor.secret,  # only processes the supervisor starts (replacements too) know it
        ).start()
        supervisor.worker_env[ADDRESS_ENV] = self.coordinator.address

    def worker_exited(self, rank: int, exitcode: int) -> None:
        """Tell the coordinator, which needs it for a worker that died before it registered."""
        if self.coordinator is not None:
            how = f"killed by signal {-exitcode}" if exitcode < 0 else f"exited with status {exitcode}"
            per_node = (
                self.coordinator.machine.settings.devices_per_node
            )  # the launcher numbers ranks node by node
            worker = Worker(*divmod(rank, per_node))
            self.coordinator.worker_exited(worker, f"its process ended ({how}) before it registered")

    def stop(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
