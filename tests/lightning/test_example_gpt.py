"""``python examples/gpt/train.py`` (the README's main command) runs end to end as a script: planner,
pipelines, the plan table, training, validation and the final metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"


@pytest.mark.timeout(240)
def test_gpt_example_trains_with_the_planners_plan(tmp_path: Path) -> None:
    args = [
        "--devices=2",
        "--max-steps=3",
        "--fault-tolerance=1",
        "model.n_blocks=2",
        "model.d_model=32",
        "data.num_chars=20000",
        "trainer.val_check_interval=3",
        "strategy.global_batch_size=8",
        "strategy.microbatch_size=2",
    ]
    run = subprocess.run(
        [sys.executable, str(TRAIN), *args],
        cwd=tmp_path,  # where the run writes its files (the recovery event log)
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Oobleck plan: 2 pipelines, f=1, global batch 8 = 4 x 2" in run.stdout
    assert "done: 3 steps" in run.stdout
    assert "val_loss" in run.stdout
