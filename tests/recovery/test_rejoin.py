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

from lightning_oobleck.recovery import read_events
from lightning_oobleck.recovery.admission import JoinPolicy


def last(result: dict, label: object, kind: str) -> dict:
    return [r for r in result["records"][label] if r["kind"] == kind][-1]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_a_replacement_joins_after_a_failure_and_the_pipelines_grow_back(tmp_path: Path) -> None:
    """Node 1 dies mid-1F1B at step 1: 5 nodes go on with 2 pipelines (f = 1). A replacement starts
    after step 2 and is admitted at a step boundary: 3 pipelines and f = 2 again. Another joiner dies
    while it waits to be admitted: it is dropped, nobody recovers."""
    joins = (Join("a", after_step=2), Join("b", after_step=2, faults=("kill-pending:0",)))
    result = run_training(tmp_path, 100, {1: ["kill-forward:1"]}, joins=joins, step_sleep=0.1)
    check_run(result, result["steps"], dead={1, "b"})
    joiner = last(result, "a", "registered")["node"]
    assert joiner not in range(6)  # a fresh node id, never one the job had
    admitted = last(result, "a", "admitted")
    assert admitted["step"] >= 3  # it continued the run, it did not start it over
    grown = last(result, 0, "recovered")
    assert len(grown["pipelines"]) == 3 and grown["f"] == 2
    assert sorted(n for p in grown["pipelines"] for n in p) == sorted({0, 2, 3, 4, 5, joiner})
    # the failure, the join: nothing for "b" (if the join's announcement named it before it died, that
    # generation is never agreed; the next one admits "a" alone)
    agreed = [m for m in result["history"] if m.agreed_at is not None]
    assert [(m.removed, m.added) for m in agreed] == [((), ()), (((1, 0),), ()), ((), ((joiner, 0),))]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_two_joins_in_a_row_a_joiner_lost_while_receiving_and_a_join_with_a_failure(tmp_path: Path) -> None:
    """Six nodes train; a joiner dies while it receives its layers (the members recover without it), two
    more join after it (the pipelines grow to 4), and a member dies as soon as a fourth
    joiner registered: the failure and the join are one recovery. Every replica, the joiners' included,
    ends with the failure-free weights."""
    joins = (
        Join("a", after_step=1, faults=("kill-receive:0",)),
        Join("b", after_step=3, after_exit="a"),
        Join("c", after_step=5),
        Join("d", after_step=None, kill_when_pending=3, after_admitted=("b", "c")),
    )
    result = run_training(tmp_path, 200, {}, joins=joins, step_sleep=0.1)
    check_run(result, result["steps"], dead={"a", 3})
    history = result["history"]
    joined = {label: last(result, label, "registered")["node"] for label in "abcd"}
    admitted = [w.node for m in history if m.agreed_at is not None for w in m.added]
    assert admitted.count(joined["a"]) == 1 and joined["a"] not in history[-1].nodes
    # b starts once a is gone, c after step 5: either may come first, or both in one generation
    later = [n for n in admitted if n != joined["a"]]
    assert sorted(later[:2]) == sorted([joined["b"], joined["c"]]) and later[2] == joined["d"]
    final = last(result, 0, "recovered")
    assert final["f"] == 2 and sorted(n for p in final["pipelines"] for n in p) == sorted(
        {0, 1, 2, 4, 5, joined["b"], joined["c"], joined["d"]}
    )
    agreed = [m for m in history if m.agreed_at is not None]
    assert [(m.removed, m.added) for m in agreed][-1] == (((3, 0),), ((joined["d"], 0),))
    _, recoveries = read_events(tmp_path / "run.jsonl")
    assert [(e.removed, e.added) for e in recoveries][-1] == ([[3, 0]], [[joined["d"], 0]])


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_whole_template_admits_joiners_once_they_form_a_pipeline(tmp_path: Path) -> None:
    """``join_policy="whole_template"`` (n0 = 2 here): a first joiner waits, pending, until a second one
    registers; both are admitted in one generation, as a pipeline of their own. A third one never finds a
    partner: it waits until the training ends, and then ends too, with status 0."""
    joins = (
        Join("a", after_step=1),
        Join("b", after_step=4),
        Join("c", after_step=None, after_admitted=("a", "b"), never_admitted=True),
    )
    result = run_training(tmp_path, 100, {}, joins=joins, policy="whole_template", step_sleep=0.1)
    check_run(result, result["steps"], dead=set(), idle={"c"})
    assert "the training ended before this worker was admitted" in last(result, "c", "not_admitted")["error"]
    joined = {last(result, label, "registered")["node"] for label in "ab"}
    (join,) = [m for m in result["history"] if m.added]
    assert {w.node for w in join.added} == joined
    assert last(result, "a", "admitted")["step"] == last(result, "b", "admitted")["step"] >= 4
    assert [sorted(p) for p in last(result, 0, "recovered")["pipelines"]][-1] == sorted(joined)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_a_hot_standby_waits_for_a_failure_and_replaces_the_lost_node(tmp_path: Path) -> None:
    """``join_policy="hot_standby"``: a spare that started early stays pending while the plan has all its
    nodes, and is admitted at the step boundary after node 2 dies, in its place. The failure comes 8 steps
    (seconds) after the spare's start: forked from the harness's fork server, it has registered by then."""
    kill_step = 8
    joins = (Join("s", after_step=0),)
    result = run_training(
        tmp_path, 100, {2: [f"kill-forward:{kill_step}"]}, joins=joins, policy="hot_standby", step_sleep=0.2
    )
    check_run(result, result["steps"], dead={2})
    registered = last(result, "s", "registered")["t"]
    killed = last(result, 2, "fault")["t"]
    assert registered < killed  # it waited, started, before the failure
    failure, join = [m for m in result["history"] if m.generation > 0]
    assert failure.removed == ((2, 0),) and join.added == ((6, 0),)
    assert last(result, "s", "admitted")["step"] >= kill_step
    assert last(result, 0, "recovered")["f"] == 2


def test_the_join_policies_decide_from_the_waiting_nodes_and_the_plan() -> None:
    from test_runtime import six_node_plan

    from lightning_oobleck.planning.reconfigure import after_failures

    full = six_node_plan()  # 6 nodes, n0 = 2
    shrunk = after_failures(full, [1, 3]).plan
    assert [JoinPolicy.AT_ONCE.nodes_to_admit(k, full) for k in (0, 1, 3)] == [0, 1, 3]
    assert [JoinPolicy.WHOLE_TEMPLATE.nodes_to_admit(k, full) for k in (0, 1, 2, 3)] == [0, 0, 2, 3]
    assert [JoinPolicy.HOT_STANDBY.nodes_to_admit(k, full) for k in (0, 1, 3)] == [0, 0, 0]
    assert [JoinPolicy.HOT_STANDBY.nodes_to_admit(k, shrunk) for k in (0, 1, 3)] == [0, 1, 2]
