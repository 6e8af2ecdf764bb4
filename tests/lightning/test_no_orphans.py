"""No process outlives the one that started it, by PID: a training worker's ``DataLoader(num_workers=2)``
workers when the training worker is SIGKILLed (training goes on without it), and every process of the run
(training workers, their loader workers, the fork server, the resource tracker) when the launching
process is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_oobleck.lightning.units import EVENTS_FILE

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    sys.path.insert(0, sys.argv[2])
    from pipeline_testing import TinyNet, dataset
    from lightning_oobleck.lightning import OobleckStrategy

    OUT = Path(sys.argv[1])

    class Slow(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                node = os.environ["OOBLECK_NODE"]
                (OUT / f"training-{node}").write_text(str(os.getpid()))
            time.sleep(0.2)

    if __name__ == "__main__":
        strategy = OobleckStrategy(
            layout=[[0, 6], [0, 6]], fault_tolerance=1, global_batch_size=4, microbatch_size=2,
            heartbeat_timeout_s=2.0,
        )
        loader = DataLoader(dataset(400, seed=1, dtype=torch.float32), batch_size=4, num_workers=2)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=10_000, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[Slow()], default_root_dir=OUT,
        )
        model = TinyNet()
        model.example_input_array = torch.zeros(1, 4)  # profiled: the layout can recover in place
        trainer.fit(model, loader)
    """
)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def recovered(out: Path) -> bool:
    """Whether the run's events record a finished recovery (the survivor trains on)."""
    events = out / EVENTS_FILE
    lines = events.read_text().splitlines() if events.exists() else []
    return any(json.loads(line)["kind"] == "recovery" for line in lines if line.endswith("}"))


def wait_gone(pids: set[int], within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_loader_workers_die_with_their_training_worker_and_everything_with_the_launcher(
    tmp_path: Path, killed_process_env: dict[str, str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    stderr = tmp_path / "launcher.err"
    with open(stderr, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(Path(__file__).parent)],
            stderr=err,
            env=killed_process_env,
        )
    everything: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"training-{n}").exists() for n in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None, stderr.read_text()[-3000:]
            time.sleep(0.05)
        victim = int((tmp_path / "training-1").read_text())
        survivor = int((tmp_path / "training-0").read_text())
        victims_loaders = descendants(victim)
        assert len(victims_loaders) >= 2, "the DataLoader's workers should be running"
        os.kill(victim, signal.SIGKILL)
        assert not wait_gone(victims_loaders, 10.0), "loader workers outlived their training worker"
        deadline = time.monotonic() + 30
        while not recovered(tmp_path) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.05)
        assert recovered(tmp_path), stderr.read_text()[-3000:]
        assert alive(survivor) and launcher.poll() is None, "training should go on without node 1"

        deadline = time.monotonic() + 10  # the survivor's loader workers (its iterator may be restarting)
        while len(descendants(survivor)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        everything = descendants(launcher.pid)
        assert survivor in everything and len(descendants(survivor)) >= 2
        launcher.kill()
        launcher.wait(timeout=10)
        left = wait_gone(everything, 10.0)
        assert not left, (
            f"processes outlived the launcher: {[Path(f'/proc/{p}/cmdline').read_bytes() for p in left]}"
        )
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        for pid in everything:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
