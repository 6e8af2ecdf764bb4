"""The horizon ``recovery_policy="auto"`` weighs each way over, as every member computes it from the agreed
membership: the configured failure interval revised by the failures the run has seen, capped by a
replacement's arrival; and a run that fails often changes the choice."""

from __future__ import annotations

import pytest

from lightning_oobleck.planning import ClusterSpec, Plan, make_plan
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.planning.rerouting import choose_recovery
from lightning_oobleck.recovery.events import RecoveryEvent
from lightning_oobleck.recovery.protocol import Membership
from lightning_oobleck.recovery.switch import RecoveryPolicy, next_plan
from lightning_oobleck.worker import Worker

START = 1_000_000.0


def plan_of(nodes: int = 12) -> Plan:
    layer = LayerProfile(1e-3, 2e-3, 1000, 100, 100, weight_grad_s=1e-3)
    return make_plan(
        ModelProfile((layer,) * 8, microbatch_size=1),
        ClusterSpec(num_nodes=nodes, gpus_per_node=1, device_memory_bytes=4 * 20_000 / 3),
        fault_tolerance=2,
        global_batch_size=4 * nodes,
        schedule="zb-h1",
    )


def after(plan: Plan, failed: int, failures: int, running_s: float) -> Membership:
    """The membership of the survivors of ``failed``, the run's ``failures``-th, ``running_s`` after the
    start."""
    survivors = tuple(Worker(n, 0) for n in plan.nodes if n != failed)
    return Membership(
        1, survivors, (Worker(failed, 0),), detected_at=START + running_s, started_at=START, failures=failures
    )


def test_the_horizon_is_the_revised_failure_interval_or_the_replacements_arrival() -> None:
    plan = plan_of()
    first = after(plan, 1, 1, 60.0)
    assert RecoveryPolicy("auto", 3600.0).horizon_s(first) == pytest.approx(1830.0)
    assert RecoveryPolicy("auto", 3600.0, replace_failed_after_s=30.0).horizon_s(first) == 30.0
    assert RecoveryPolicy("auto", 20.0, replace_failed_after_s=50.0).horizon_s(first) == pytest.approx(40.0)
    # a membership without a record (an older coordinator's message): the configured interval
    bare = Membership.from_message({"generation": 1, "workers": [[0, 0]]})
    assert RecoveryPolicy("auto", 600.0).horizon_s(bare) == 600.0


def test_a_run_that_fails_often_reroutes_where_a_rare_failure_would_reinstantiate() -> None:
    """Re-instantiation's faster step pays for its copy over a long horizon, not over a short one: the same
    failure is recovered from by re-instantiation at a job's first failure and by rerouting at its eighth
    within minutes, with the horizon, the choice and its candidates in the recovery event."""
    plan = plan_of()
    failed = plan.pipelines[0].nodes[1]
    steps = {c.policy: c for c in choose_recovery(plan, [failed], "auto").candidates}
    slower, copy_s = steps["reroute"].step_s, steps["reinstantiate"].transition_s
    assert steps["reinstantiate"].step_s < slower and copy_s > 0, "the case needs a slower rerouted step"
    even_s = copy_s * slower / (slower - steps["reinstantiate"].step_s)  # both ways train alike
    policy = RecoveryPolicy("auto", failure_interval_s=4 * even_s)
    chosen = {}
    for failures in (1, 8):
        event = RecoveryEvent(generation=1)
        membership = after(plan, failed, failures, running_s=0.0)
        next_plan(plan, membership, [], recovery=policy, event=event)
        assert event.horizon_s == pytest.approx(4 * even_s / (1 + failures))
        assert len(event.candidates) == 2
        chosen[failures] = event.recovery_policy
    assert chosen == {1: "reinstantiate", 8: "reroute"}
