"""``examples/gpt/train.py`` runs end to end: planner, pipelines, progress, the plan table, final metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"


@pytest.mark.timeout(180)
def test_gpt_example_trains_with_the_planners_plan(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As when run as a script: its directory is on sys.path (also for the workers, which unpickle `train`).
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import train

    train.main(
        [
            "--devices=2",
            "--max-steps=3",
            "--fault-tolerance=1",
            "model.n_blocks=2",
            "model.d_model=32",
            "data.num_chars=20000",
            "trainer.val_check_interval=3",
            "strategy.global_batch_size=8",
            "strategy.microbatch_size=2",
            "strategy.start_method=forkserver",
        ]
    )
    out = capfd.readouterr().out
    assert "Oobleck plan: 2 pipelines, f=1, global batch 8 = 4 x 2" in out
    assert "done: 3 steps" in out
    assert "val_loss" in out
