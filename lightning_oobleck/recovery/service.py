"""The coordinator of a local run, in a process of its own that the launcher's supervisor starts.

A process, not a thread of the supervisor: any process of the job may be lost, the coordinator's included
(its standby, started by a worker, then takes over), and the supervisor, which returns ``trainer.fit``'s
result to the caller, must not be one of them. Under SLURM the batch host's rendezvous plays this role
(:mod:`lightning_oobleck.slurm.rendezvous`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
from pathlib import Path

from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import SECRET_ENV, encode, parse_address, parse_addresses
from lightning_oobleck.worker import Worker

STARTUP_TIMEOUT_S = 60.0
"""How long the coordinator's process may take to listen (a loaded machine starts Python slowly)."""
STOP_TIMEOUT_S = 5.0


class CoordinatorProcess:
    """Starts ``python -m lightning_oobleck.recovery`` (the coordinator) for ``world_size`` workers on
    ``host`` (loopback: every process of a local run is on this machine; the standby a worker starts listens
    there too), dying with this process; tells it of workers that ended before they registered; stops it.

    ``join_file``: where the coordinators keep their current addresses (:attr:`addresses` reads it), so that
    a replacement started after a failover finds the one that took over. ``node``: the job's node it counts
    as part of (default: the first, as SLURM's batch host is), so that its standby runs on another, and a
    loss of that node's processes with it is a loss of the coordinator's node."""

    def __init__(
        self,
        world_size: int,
        secret: str,
        join_file: Path,
        *,
        settings: MembershipSettings | None = None,
        host: str = "127.0.0.1",
        node: int | None = 0,
    ) -> None:
        settings = settings or MembershipSettings()
        self.join_file = join_file
        command = [sys.executable, "-m", "lightning_oobleck.recovery"]
        command += ["--world-size", str(world_size), "--host", host, "--bind", host]
        command += ["--devices-per-node", str(settings.devices_per_node)]
        command += [
            "--heartbeat-timeout",
            str(settings.heartbeat_timeout),
            "--settle",
            str(settings.settle_s),
        ]
        command += ["--agreement-timeout", str(settings.agreement_timeout), "--join-file", str(join_file)]
        command += ["--watch-pid", str(os.getpid()), "--loopback"]
        if node is not None:
            command += ["--node", str(node)]
        if settings.kill_fenced:
            command.append("--kill-fenced")
        if not settings.allow_joins:
            command.append("--no-joins")
        self._secret = secret
        self._reports: socket.socket | None = None
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env={**os.environ, SECRET_ENV: secret},
        )
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)
            line = self.process.stdout.readline().decode().strip() if sel.select(STARTUP_TIMEOUT_S) else ""
        if not line:
            self.stop()
            raise RuntimeError(
                f"the job's coordinator did not start within {STARTUP_TIMEOUT_S:.0f} s "
                f"(exit status {self.process.poll()}); its errors are above"
            )
        self.address = line
        """Where the coordinator listens (``host:port``): the workers' ``OOBLECK_COORDINATOR_ADDR``."""
        update = join_file.with_name(f".{join_file.name}.new")
        fd = os.open(update, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the coordinators keep it current
        with os.fdopen(fd, "w") as f:
            json.dump({"coordinator": line, "store": line}, f)
        os.replace(update, join_file)

    @property
    def addresses(self) -> str:
        """The job's coordinators as they are now, the active first: the join file's, else the first one's."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            return ",".join(parse_addresses(json.loads(self.join_file.read_text())["coordinator"]))
        return self.address

    def worker_exited(self, worker: Worker, reason: str) -> None:
        """Tell the coordinator that ``worker``'s process ended (it matters for one that never registered:
        the start does not wait for it). Best effort: a lost coordinator's standby does not need it."""
        with contextlib.suppress(OSError):
            if self._reports is None:
                self._reports = socket.create_connection(parse_address(self.address), timeout=5.0)
                fields = {"secret": self._secret}
            else:
                fields = {}
            node, device = worker
            self._reports.sendall(encode("exited", node=node, device=device, reason=reason, **fields))

    def stop(self) -> None:
        """End the coordinator (a standby that follows it is told the job ended, and ends too)."""
        if self._reports is not None:
            self._reports.close()
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)  # a stopped one (a drill) ends too
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
