"""What rank 0 prints when training starts (no processes: the console's own functions)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_oobleck.lightning.console import print_start
from lightning_oobleck.planning import ClusterSpec, make_plan, synthetic_gpt_profile


def test_the_start_shows_the_plan_and_each_of_the_planners_warnings_once(
    capsys: pytest.CaptureFixture,
) -> None:
    profile = replace(synthetic_gpt_profile(8), device="cpu")  # measured before backward peaks were
    plan = make_plan(profile, ClusterSpec(4, 1), fault_tolerance=1, global_batch_size=16)
    assert plan.warnings
    print_start(plan, None, None)
    out = capsys.readouterr().out
    assert "Oobleck plan: 2 pipelines" in out
    for warning in plan.warnings:
        assert out.count("oobleck: warning: " + warning[:40]) == 1
