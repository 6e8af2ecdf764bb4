"""Reconfiguration: the f+1 guarantee for every failure set on small clusters, random sets at 1,024 nodes.

Every check goes through :func:`planning_cases.check_reconfiguration`, which applies the copy list to what
the survivors held and asserts that every worker then holds exactly the layers its new stage needs.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_cases import check_reconfiguration

from lightning_oobleck.planning import (
    ClusterSpec,
    Plan,
    ReconfigurationError,
    after_failures,
    after_joins,
    make_plan,
    reconfigure,
    synthetic_gpt_profile,
)
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Stage

# Two small models: the first fits one 48 GB device (n0 = 1), the second needs two 32 GB ones (n0 = 2).
_MODELS = {
    1: (synthetic_gpt_profile(8, 1024, 1024, 2), 48e9),
    2: (synthetic_gpt_profile(8, 4096, 2048, 2), 32e9),
}


def _plan(n0: int, nodes: int, f: int) -> Plan:
    profile, memory = _MODELS[n0]
    cluster = ClusterSpec(nodes, 1, device_memory_bytes=memory)
    plan = make_plan(profile, cluster, fault_tolerance=f, global_batch_size=64)
    assert plan.n0 == n0
    return plan


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n0", [1, 2])
@pytest.mark.slow
def test_every_failure_set_up_to_f_on_every_small_cluster(n0: int) -> None:
    checked = 0
    for f in range(4):
        for nodes in range((f + 1) * n0, 17):
            plan = _plan(n0, nodes, f)
            assert len(plan.pipelines) >= f + 1 and plan.nodes == tuple(range(nodes))
            for size in range(1, f + 1):
                for failed in itertools.combinations(range(nodes), size):
                    check_reconfiguration(plan, set(failed), after_failures(plan, failed))
                    checked += 1
    assert checked > 3000


@pytest.mark.timeout(120)
def test_every_failure_set_up_to_f_leaves_every_tie_a_live_replica_and_keeps_the_ties() -> None:
    """A tied embedding and head (the first and the last layer) and a tie inside the model: after any
    failure set of size <= f, each tie still has a surviving holder to copy from, every new holder of a
    tied layer gets it from a survivor, and the new plan carries the ties (its tie groups are rebuilt)."""
    checked = 0
    for f in range(1, 4):
        for nodes in range(f + 1, 13):
            plan = _plan(1, nodes, f)
            last = plan.num_layers - 1
            plan = replace(plan, tied_layers=((0, last), (1, last // 2)))
            for size in range(1, f + 1):
                for failed in itertools.combinations(range(nodes), size):
                    result = after_failures(plan, failed)
                    assert result.plan.tied_layers == plan.tied_layers
                    for tie in plan.tied_layers:
                        live = [w for w in plan.tie_owners(tie) if w[0] not in failed]
                        assert live, (tie, failed)
                        assert len(result.plan.tie_owners(tie)) >= len(result.plan.pipelines)
                    for c in result.copies:
                        assert c.from_node not in failed
                    checked += 1
    assert checked > 500


def test_a_lost_node_only_moves_layers_inside_its_pipeline() -> None:
    plan = make_plan(
        synthetic_gpt_profile(24, microbatch_size=4),
        ClusterSpec(13, 1),
        fault_tolerance=2,
        global_batch_size=512,
    )
    victim = plan.pipelines[0].nodes[-1]
    result = after_failures(plan, [victim])
    touched = {c.to_node for c in result.copies}
    assert touched <= set(plan.pipelines[0].nodes)
    for p in plan.pipelines[1:]:
        assert p.nodes in [q.nodes for q in result.plan.pipelines]


def test_survivors_below_f_plus_one_n0_keep_the_largest_f_and_say_so() -> None:
    plan = _plan(2, 8, 3)
    result = after_failures(plan, [0, 2, 4])
    check_reconfiguration(plan, {0, 2, 4}, result)
    assert result.plan.fault_tolerance == 1 and len(result.plan.pipelines) == 2
    assert "tolerates f=1 failure(s) instead of 3" in result.plan.warnings[0]


def test_joining_nodes_get_fresh_ids_and_restore_the_guarantee() -> None:
    plan = _plan(2, 8, 3)
    shrunk = after_failures(plan, [0, 2, 4]).plan
    grown = after_joins(shrunk, 3)
    check_reconfiguration(shrunk, set(), grown, added=3)
    assert set(grown.plan.nodes) - set(shrunk.nodes) == {8, 9, 10}
    assert grown.plan.fault_tolerance == 3 and not grown.plan.warnings
    again = after_joins(grown.plan, 1)
    assert set(again.plan.nodes) - set(grown.plan.nodes) == {11}


def test_a_node_back_completes_its_shrunk_pipeline_when_that_is_faster() -> None:
    """Three 3-node pipelines and a 2-node one after a failure (n0 = 1): the returning node completes the
    short pipeline (the first plan's speed again) rather than forming a slow 1-node pipeline of its own."""
    profile = synthetic_gpt_profile(24, 4096, 2048, 1)
    plan = make_plan(profile, ClusterSpec(12, 4), fault_tolerance=1, global_batch_size=256)
    assert plan.n0 == 1 and sorted(len(p.nodes) for p in plan.pipelines) == [3, 3, 3, 3]
    shrunk = after_failures(plan, [plan.nodes[1]]).plan
    grown = after_joins(shrunk, 1)
    check_reconfiguration(shrunk, set(), grown, added=1)
    assert sorted(len(p.nodes) for p in grown.plan.pipelines) == [3, 3, 3, 3]
    assert grown.plan.iteration_time_s == pytest.approx(plan.iteration_time_s)
    assert grown.plan.iteration_time_s < shrunk.iteration_time_s


@pytest.mark.parametrize("n0", [1, 2])
def test_failures_and_joins_seen_at_once_are_one_reconfiguration(n0: int) -> None:
    plan = _plan(n0, 8, 2)
    failed, joined = {plan.pipelines[0].nodes[0]}, [20, 21, 22]
    result = reconfigure(plan, failed=failed, joined=joined)
    check_reconfiguration(plan, failed, result, added=3)
    assert set(result.plan.nodes) == set(plan.nodes) - failed | set(joined)
    assert result.plan.extra["next_node_id"] == 23
    assert result.plan.fault_tolerance == 2 and not result.plan.warnings
    # the same plan on every worker that computes it (joiners included)
    assert reconfigure(plan, failed=failed, joined=joined).plan.pipelines == result.plan.pipelines


def test_a_joining_node_that_is_in_the_plan_or_failed_is_refused() -> None:
    plan = _plan(1, 4, 1)
    with pytest.raises(ReconfigurationError, match=r"joining node id\(s\) \[0\] are already in the plan"):
        reconfigure(plan, joined=[0])
    with pytest.raises(ReconfigurationError, match=r"\[3\] are already in the plan: a node that comes back"):
        reconfigure(plan, failed=[3], joined=[3])


def test_unrecoverable_failures_say_how_to_resume() -> None:
    plan = _plan(2, 8, 1)
    with pytest.raises(ReconfigurationError, match=r"node id\(s\) \[42\] are not in the plan"):
        after_failures(plan, [42])
    with pytest.raises(
        ReconfigurationError, match=r"every replica of layer 0 .* resume from the last checkpoint"
    ):
        after_failures(plan, [p.nodes[0] for p in plan.pipelines])
    small = _plan(2, 4, 1)
    with pytest.raises(ReconfigurationError, match="needs n0=2: no pipeline fits; resume"):
        after_failures(small, small.nodes[1:])
    with pytest.raises(ReconfigurationError, match="positive number of nodes"):
        after_joins(plan, 0)


@pytest.mark.timeout(120)
def test_random_failure_sets_on_a_thousand_nodes() -> None:
    profile = synthetic_gpt_profile(96, 4096, 2048, 1)
    plan = make_plan(
        profile, ClusterSpec(1024, 8, device_memory_bytes=80e9), fault_tolerance=4, global_batch_size=8192
    )
    assert len(plan.nodes) == 1024 and len(plan.pipelines) >= 5
    rng = np.random.default_rng(0)
    for _ in range(8):
        failed = set(rng.choice(1024, size=int(rng.integers(1, 5)), replace=False).tolist())
        started = time.perf_counter()
        result = after_failures(plan, failed)
        assert time.perf_counter() - started < 5.0
        check_reconfiguration(plan, failed, result)


@settings(max_examples=40, deadline=None)
@given(
    n0=st.sampled_from([1, 2]),
    nodes=st.integers(4, 14),
    f=st.integers(0, 2),
    events=st.lists(st.one_of(st.integers(1, 3), st.integers(-2, -1)), min_size=1, max_size=4),
    data=st.data(),
)
def test_sequences_of_failures_and_joins_keep_the_invariants(n0, nodes, f, events, data) -> None:
    if nodes < (f + 1) * n0:
        return
    plan = _plan(n0, nodes, f)
    for event in events:
        if event > 0:
            alive = sorted(plan.nodes)
            failed = set(data.draw(st.lists(st.sampled_from(alive), min_size=1, max_size=event, unique=True)))
            try:
                result = after_failures(plan, failed)
            except ReconfigurationError:
                owners_lost = any(
                    all(w[0] in failed for w in plan.layer_owners(layer)) for layer in range(plan.num_layers)
                )
                assert owners_lost or len(alive) - len(failed) < plan.n0
                return
            check_reconfiguration(plan, failed, result)
        else:
            result = after_joins(plan, -event)
            check_reconfiguration(plan, set(), result, added=-event)
        plan = result.plan


def test_a_hand_written_layout_cannot_be_replanned_and_says_how_to_resume():
    template = PipelineTemplate(1, 1, (Stage(0, 4, 0),), (1.0,))
    pipelines = tuple(Pipeline(template, (node,), 2) for node in range(3))
    layout = Plan(4, 1, 1, 1, 1, 6, (template,), pipelines)  # no planner inputs in `extra`
    resume_hint = r"(?i)hand-written layout .*Trainer\.fit\(ckpt_path=\.\.\.\)"
    with pytest.raises(ReconfigurationError, match=resume_hint):
        after_failures(layout, {1})
