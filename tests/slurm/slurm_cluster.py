"""The test cluster: the repository's ``slurm/*.sh`` scripts, node crashes, SLURM's view of a node."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "slurm"
NODES = 3
SCRIPT_TIMEOUT_S = 120


def script(name: str, *args: str) -> str:
    done = subprocess.run(
        [str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"slurm/{name} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return done.stdout


@dataclass
class Cluster:
    """The running test cluster: its directory and the node operations the tests need."""

    dir: Path
    nodes: tuple[str, ...]

    def crash(self, node: str) -> float:
        """SIGKILL ``node``'s slurmd, step daemons and tasks; return the time of the kill (epoch seconds)."""
        out = script("crash-node.sh", str(self.dir), node)
        return float(out.split(" at ", 1)[1].split(":", 1)[0])

    def restart(self, node: str) -> None:
        script("restart-node.sh", str(self.dir), node)

    def node_state(self, node: str) -> str:
        return subprocess.run(
            ["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until every node is idle (the previous test's jobs and crashes are over)."""
        deadline = time.monotonic() + timeout_s
        while any(self.node_state(n) != "idle" for n in self.nodes):
            if time.monotonic() > deadline:
                states = {n: self.node_state(n) for n in self.nodes}
                raise TimeoutError(f"nodes not idle after {timeout_s:.0f} s: {states}")
            time.sleep(0.2)


class DownWatch(threading.Thread):
    """Polls SLURM's view of a node in the background; records when SLURM first calls it DOWN."""

    def __init__(self, cluster: Cluster, node: str, timeout_s: float = 90.0) -> None:
        super().__init__(daemon=True)
        self.cluster, self.node, self.timeout_s = cluster, node, timeout_s
        self.down_at: float | None = None
        self.not_responding_at: float | None = None

    def run(self) -> None:
        deadline = time.time() + self.timeout_s
        while time.time() < deadline and self.down_at is None:
            state = self.cluster.node_state(self.node)
            if state.endswith("*") and self.not_responding_at is None:  # "*": not responding
                self.not_responding_at = time.time()
            if state.startswith("down"):
                self.down_at = time.time()
            time.sleep(0.2)
