"""``python examples/gpt/train.py`` (the README's main command) runs end to end as a script: planner,
pipelines, the plan table, training, validation and the final metrics."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_gpt_example_trains_validates_and_shows_a_node_dying_and_a_new_one_joining(tmp_path: Path) -> None:
    """The planner's plan, training with validation, and ``--kill-rank R --kill-at-step S
    --rejoin-after-s T``: the whole cycle on one machine."""
    args = [
        "--devices=4",
        "--max-steps=150",
        "--fault-tolerance=1",
        "--kill-rank=1",
        "--kill-at-step=5",
        "--rejoin-after-s=0.5",
        "model.n_blocks=2",
        "model.d_model=32",
        "data.num_chars=20000",
        "trainer.val_check_interval=30",
        "strategy.global_batch_size=8",
        "strategy.microbatch_size=2",
    ]
    run = subprocess.run(
        [sys.executable, str(TRAIN), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "KillAt: SIGKILL to rank 1" in output
    assert "starting node 4 to replace node 1" in output
    assert "oobleck: node(s) 4 joined at step" in output and "4 pipelines on 4 nodes, f=1" in output
    # the joiner's layers came from the three replicas at once, and the line says how much and how fast
    copied = r"joined at step \d+: 4 pipelines on 4 nodes, f=1 \([\d.]+ (bytes|kB|MB) of state copied "
    copied += r"from (\d) workers at"
    assert (line := re.search(copied, output)) and int(line[2]) > 1, output[-3000:]
    assert "Oobleck plan: 4 pipelines, f=1, global batch 8 = " in run.stdout
    assert "done: 150 steps" in run.stdout and "val_loss" in run.stdout
