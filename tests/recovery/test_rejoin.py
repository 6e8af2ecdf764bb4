"""Nodes rejoin a running training (plain loop, no Lightning): real worker processes, real SIGKILL, float64.

A replacement registers without a node id while 6 single-device nodes train (3 pipelines of 2 stages,
f = 2); it waits, pending, without disturbing a step, and is admitted at the next step boundary: it gets a
fresh node id, its layers and their AdamW state from live replicas, and the members' step. Each run checks
what matters: every worker that lives ends with all steps done, every sample of every step was fed exactly
once, and every replica's final weights (the joiners' included) equal single-process training to 1e-9.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_runtime import RUN_TIMEOUT_S, Join, check_run, run_training


def last(result: dict, label: object, kind: str) -> dict:
    return [r for r in result["records"][label] if r["kind"] == kind][-1]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_replacement_joins_after_a_failure_and_the_pipelines_grow_back(tmp_path: Path) -> None:
    """Node 1 dies mid-1F1B at step 1: 5 nodes go on with 2 pipelines (f = 1). A replacement starts
    after step 2 and is admitted at a step boundary: 3 pipelines and f = 2 again. Another joiner dies
    while it waits to be admitted: it is dropped, nobody recovers."""
    steps = 30
    joins = (Join("a", after_step=2), Join("b", after_step=2, faults=("kill-pending:0",)))
    result = run_training(tmp_path, steps, {1: ["kill-forward:1"]}, joins=joins, step_sleep=0.2)
    check_run(result, steps, dead={1, "b"})
    joiner = last(result, "a", "registered")["node"]
    assert joiner not in range(6)  # a fresh node id, never one the job had
    admitted = last(result, "a", "admitted")
    assert admitted["step"] >= 3  # it continued the run, it did not start it over
    grown = last(result, 0, "recovered")
    assert len(grown["pipelines"]) == 3 and grown["f"] == 2
    assert sorted(n for p in grown["pipelines"] for n in p) == sorted({0, 2, 3, 4, 5, joiner})
    history = result["history"]
    assert [m.generation for m in history] == [0, 1, 2]  # the failure, the join: nothing for "b"
    assert history[2].added == ((joiner, 0),) and history[2].removed == ()
