"""Test harness: a coordinator (the job's store too) in the test process, and real worker processes.

``Cluster`` starts ``recovery_worker.py`` processes (one per ``(node, device)``), lets tests signal
them for real and read what each one reported. Every wait is bounded; leaving the ``with`` block
kills the workers it started that are still running and stops the coordinator.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dist_harness import ScriptProcess

from lightning_oobleck.recovery import Coordinator, Membership, Worker
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.replica import ReplicaSettings

STORE_SECRET = "the-tests-job"
"""The secret of the test run's coordinator and store."""

WORKER_SCRIPT = Path(__file__).with_name("recovery_worker.py")


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns a truthy value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Cluster:
    def __init__(
        self,
        directory: Path,
        workers: list[tuple[int, int]],
        *,
        heartbeat_timeout: float = 1.5,
        settle_s: float = 0.1,
        agreement_timeout: float = 10.0,
        worker_args: dict[tuple[int, int], list[str]] | None = None,
        standby: bool = False,
    ) -> None:
        self.directory = directory
        self.stop_file = directory / "stop"
        self.events_file = directory / "run.jsonl"
        self.coordinator = Coordinator(
            len(workers),
            "127.0.0.1",
            settings=MembershipSettings(
                heartbeat_timeout=heartbeat_timeout, settle_s=settle_s, agreement_timeout=agreement_timeout
            ),
            secret=STORE_SECRET,
            replica_settings=ReplicaSettings(standby=standby),
        ).start()
        self.procs: dict[Worker, ScriptProcess] = {}
        for worker in workers:
            self.spawn(Worker(*worker), (worker_args or {}).get(worker, []))

    def spawn(self, worker: Worker, args: list[str] | None = None) -> None:
        """Start the process of ``worker`` (at any time: after the start, it joins the run)."""
        command = [
            f"--coordinator={self.coordinator.address}",
            f"--store={self.coordinator.address}",
            f"--store-secret={STORE_SECRET}",
            f"--node={worker.node}",
            f"--device={worker.device}",
            f"--out={self._out(worker)}",
            f"--stop-file={self.stop_file}",
            f"--events={self.events_file}",
            *(args or []),
        ]
        log = self.directory / f"worker-{worker.node}-{worker.device}.log"
        self.procs[worker] = ScriptProcess(WORKER_SCRIPT, command, log)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None:  # shown by pytest with the failure
            for w in self.procs:
                log = (self.directory / f"worker-{w.node}-{w.device}.log").read_text()[-2000:]
                print(f"--- worker {tuple(w)} (exit {self.procs[w].poll()}) ---\n{log}")
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # also ends a stopped process
                proc.wait(timeout=10)
        self.coordinator.stop()

    def _out(self, worker: Worker) -> Path:
        return self.directory / f"worker-{worker.node}-{worker.device}.jsonl"

    def reports(self, worker: Worker, kind: str) -> list[dict[str, Any]]:
        path = self._out(worker)
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    def signal(self, worker: Worker, signum: int) -> float:
        """Send ``signum`` to ``worker``'s process; returns the wall-clock time it was sent."""
        sent = time.time()
        os.kill(self.procs[worker].pid, signum)
        return sent

    def wait_steps(self, workers: list[Worker], count: int, generation: int, timeout: float = 60.0) -> None:
        """Wait until each of ``workers`` completed ``count`` steps in ``generation`` (at the start this
        includes importing torch, slow on a loaded machine)."""
        for w in workers:
            wait_until(
                lambda w=w: sum(r["generation"] == generation for r in self.reports(w, "step")) >= count,
                timeout,
                f"{count} steps of worker {tuple(w)} in generation {generation}",
            )

    def wait_agreed(self, generation: int, timeout: float = 20.0) -> Membership:
        """Wait until the coordinator agreed on ``generation`` (or a later one); return the newest agreed."""
        return wait_until(
            lambda: (m := self.coordinator.agreed) is not None and m.generation >= generation and m,
            timeout,
            f"agreement on generation {generation}",
        )

    def exit_code(self, worker: Worker, timeout: float) -> int:
        return self.procs[worker].wait(timeout=timeout)

    def finish(self, timeout: float = 20.0) -> dict[Worker, int]:
        """Ask the live workers to stop at a common step; return every worker's exit status."""
        self.stop_file.touch()
        return {w: p.wait(timeout=timeout) for w, p in self.procs.items()}
