"""The simulator on traces whose answer is known by hand, and its properties on random traces."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from lightning_oobleck.planning import ClusterSpec, LayerCopy, Plan, make_plan, synthetic_gpt_profile
from lightning_oobleck.planning.planner import PlannerInputs
from lightning_oobleck.planning.reconfigure import after_failures, after_joins, copy_time_s
from lightning_oobleck.simulation import (
    POLICIES,
    Costs,
    NodeEvent,
    Trace,
    fixed_interval_trace,
    mttf_trace,
    poisson_trace,
    simulate,
    simulate_checkpoint_restart,
    simulate_oobleck,
    simulate_replica_groups,
)
from lightning_oobleck.simulation.simulator import state_bytes, young_daly_interval_s
from lightning_oobleck.worker import Worker

HOUR = 3600.0


@pytest.fixture(scope="module")
def plan() -> Plan:
    profile = synthetic_gpt_profile(16, 2048, 1024, microbatch_size=2)  # 4 pipelines of 2 nodes
    return make_plan(profile, ClusterSpec(8, 1), fault_tolerance=1, global_batch_size=256)


def steps(seconds: float, step_s: float) -> int:
    return int(seconds / step_s * (1 + 1e-12))


def test_without_failures_every_policy_trains_the_failure_free_run(plan: Plan) -> None:
    trace = Trace(8, 10 * HOUR, ())
    expected = steps(10 * HOUR, plan.iteration_time_s) * plan.global_batch_size
    no_checkpoints = Costs(checkpoint_interval_s=20 * HOUR, oobleck_checkpoint_interval_s=20 * HOUR)
    for result in simulate(plan, trace, costs=no_checkpoints):
        assert result.samples == result.failure_free_samples == expected, result.policy
        assert result.samples_per_s == pytest.approx(plan.global_batch_size / plan.iteration_time_s, rel=1e-3)
        assert (result.recovery_s, result.lost_s, result.events) == (0.0, 0.0, 0)


def test_checkpoints_cost_their_writes(plan: Plan) -> None:
    interval = 100 * plan.iteration_time_s
    costs = Costs(checkpoint_interval_s=interval)
    write_s = state_bytes(PlannerInputs.from_plan(plan)) / costs.checkpoint_write_bandwidth
    result = simulate_checkpoint_restart(plan, Trace(8, HOUR, ()), costs)
    cycle = interval + write_s
    full, rest = divmod(HOUR, cycle)
    expected = (int(full) * 100 + steps(min(rest, interval), plan.iteration_time_s)) * plan.global_batch_size
    assert result.samples == expected
    assert result.recovery_s == pytest.approx(int(full) * write_s + max(0.0, rest - interval))


def test_one_failure_in_place_costs_the_formula(plan: Plan) -> None:
    t, horizon = 1000.3, 2 * HOUR
    trace = Trace(8, horizon, (NodeEvent(t, "fail", (3,)),))
    result = simulate_oobleck(plan, trace, Costs(oobleck_checkpoint_interval_s=10 * HOUR))
    step = after_failures(plan, [3])
    pause = (
        Costs().detection_s
        + Costs().protocol_s
        + result.replan_s[0]
        + copy_time_s(step.copies, PlannerInputs.from_plan(plan), Costs().state_copy_link_share)
    )
    before = steps(t, plan.iteration_time_s)
    after = steps(horizon - t - pause, step.plan.iteration_time_s)
    assert result.samples == (before + after) * plan.global_batch_size
    assert result.lost_s == pytest.approx(t - before * plan.iteration_time_s)
    assert result.recovery_s == pytest.approx(pause)
    assert result.events == 1 and result.final_pipelines == len(step.plan.pipelines)
    rates = [s.samples_per_s for s in result.segments]
    assert rates == [
        pytest.approx(plan.global_batch_size / plan.iteration_time_s),
        0.0,
        pytest.approx(plan.global_batch_size / step.plan.iteration_time_s),
    ]


def test_one_failure_under_checkpoint_restart_loses_the_work_since_the_checkpoint(plan: Plan) -> None:
    interval, t, horizon = 500 * plan.iteration_time_s, 1.7 * HOUR, 4 * HOUR
    costs = Costs(checkpoint_interval_s=interval)
    inputs = PlannerInputs.from_plan(plan)
    write_s = state_bytes(inputs) / costs.checkpoint_write_bandwidth
    reload_s = state_bytes(inputs) / costs.checkpoint_read_bandwidth
    result = simulate_checkpoint_restart(plan, Trace(8, horizon, (NodeEvent(t, "fail", (5,)),)), costs)
    kept = int(t // (interval + write_s))  # checkpoints written before the failure
    seven = make_plan(
        inputs.profile, replace(inputs.cluster, num_nodes=7), fault_tolerance=0, global_batch_size=256
    )
    resumed = t + costs.restart_s + reload_s
    interval7 = max(1, round(interval / seven.iteration_time_s)) * seven.iteration_time_s
    full, rest = divmod(horizon - resumed, interval7 + write_s)
    after = int(full) * round(interval / seven.iteration_time_s) + steps(
        min(rest, interval7), seven.iteration_time_s
    )
    assert result.samples == (kept * 500 + after) * plan.global_batch_size
    assert result.lost_s == pytest.approx(t - kept * (interval + write_s))


def test_a_lost_replica_group_leaves_the_others_training_with_their_share(plan: Plan) -> None:
    t, horizon = 600.0, HOUR
    victim = plan.pipelines[0]
    result = simulate_replica_groups(plan, Trace(8, horizon, (NodeEvent(t, "fail", (victim.nodes[0],)),)))
    before = steps(t, plan.iteration_time_s) * plan.global_batch_size
    share = plan.global_batch_size - victim.microbatches * plan.microbatch_size
    pause = Costs().detection_s + Costs().protocol_s
    after = steps(horizon - t - pause, plan.iteration_time_s) * share
    assert result.samples == before + after
    assert result.final_pipelines == len(plan.pipelines) - 1


def test_a_returned_node_joins_and_the_throughput_grows_back(plan: Plan) -> None:
    trace = Trace(8, 2 * HOUR, (NodeEvent(600.0, "fail", (2,)), NodeEvent(1800.0, "return", (2,))))
    costs = Costs(oobleck_checkpoint_interval_s=10 * HOUR)
    result = simulate_oobleck(plan, trace, costs)
    without = simulate_oobleck(plan, trace, costs, rejoin=False)
    assert result.events == 2 and without.events == 1
    shrunk = after_failures(plan, [2]).plan
    grown = after_joins(shrunk, 1).plan
    assert sorted(len(p.nodes) for p in grown.pipelines) != sorted(len(p.nodes) for p in shrunk.pipelines)
    assert [s.samples_per_s for s in result.segments[-3:]] == [
        pytest.approx(plan.global_batch_size / shrunk.iteration_time_s),
        0.0,
        pytest.approx(plan.global_batch_size / grown.iteration_time_s),
    ]
    assert grown.iteration_time_s < shrunk.iteration_time_s and without.samples < result.samples


def test_too_few_nodes_in_place_falls_back_to_the_checkpoint(plan: Plan) -> None:
    """Losing every replica of a layer at once: the job restarts from its last checkpoint."""
    pipelines = plan.pipelines
    holders = tuple(sorted({p.nodes[0] for p in pipelines}))  # every pipeline's first node: layer 0
    trace = Trace(8, 3 * HOUR, (NodeEvent(HOUR + 5.0, "fail", holders),))
    result = simulate_oobleck(plan, trace, Costs(oobleck_checkpoint_interval_s=HOUR / 2))
    assert result.events == 1
    assert result.recovery_s >= Costs().restart_s
    assert 0 < result.samples < result.failure_free_samples


def test_the_default_interval_is_young_daly(plan: Plan) -> None:
    assert young_daly_interval_s(60.0, 8 * HOUR) == pytest.approx(math.sqrt(2 * 60 * 8 * HOUR))


REROUTING = ("oobleck-reroute",)
"""Policies that keep a rerouted layout even where it is slower than the one a re-instantiation would give: a
later failure that rerouting cannot take forces that re-instantiation, and can so raise what they train
(``oobleck-auto`` weighs both at every failure)."""


@pytest.mark.parametrize("seed", range(6))
def test_no_policy_beats_the_failure_free_run_and_more_failures_never_help(plan: Plan, seed: int) -> None:
    """Without returns, dropping a trace's last failure never lowers what a policy trains, except under the
    rerouting policies (:data:`REROUTING`). (With returns it can: checkpoint-restart takes returned nodes
    only at its next restart, which a failure brings forward.)"""
    horizon = 12 * HOUR
    with_returns = poisson_trace(8, 2.0, horizon, repair_mean_s=2 * HOUR, seed=seed)
    for result in simulate(plan, with_returns):
        assert result.samples <= result.failure_free_samples, result.policy
    trace = poisson_trace(8, 3.0, horizon, seed=seed)
    assert trace.failures >= 2
    fewer = Trace(8, horizon, trace.events[:-1])
    for more, less in zip(simulate(plan, trace), simulate(plan, fewer), strict=True):
        assert less.samples <= less.failure_free_samples, (more.policy, seed)
        if more.policy not in REROUTING:
            assert more.samples <= less.samples, (more.policy, seed)


def test_traces_are_checked_and_round_trip(tmp_path) -> None:
    trace = poisson_trace(16, 2.0, 2 * 86_400, repair_mean_s=HOUR, rack_size=4, rack_share=0.5, seed=3)
    assert any(len(e.nodes) > 1 for e in trace.events)
    path = tmp_path / "trace.json"
    trace.save(path)
    assert Trace.load(path) == trace
    with pytest.raises(ValueError, match="already down"):
        Trace(4, 10.0, (NodeEvent(1.0, "fail", (1,)), NodeEvent(2.0, "fail", (1,))))
    with pytest.raises(ValueError, match="without having failed"):
        Trace(4, 10.0, (NodeEvent(1.0, "return", (1,)),))
    with pytest.raises(ValueError, match="time order"):
        Trace(4, 10.0, (NodeEvent(2.0, "fail", (1,)), NodeEvent(1.0, "fail", (2,))))
    table2 = fixed_interval_trace(30, 15, HOUR)
    assert [e.time_s for e in table2.events] == [k * HOUR for k in range(1, 16)]
    assert len({e.nodes for e in table2.events}) == 15 and table2.horizon_s == 16 * HOUR


def test_generated_failure_rates_match_the_request() -> None:
    trace = mttf_trace(64, 2 * HOUR, 200 * 86_400, repair_mean_s=HOUR, seed=1)
    rate = trace.failures / trace.horizon_s
    assert rate == pytest.approx(1 / (2 * HOUR), rel=0.05)
    counts = np.bincount([n for e in trace.events for n in e.nodes], minlength=64)
    assert counts.min() > 0


def test_a_trace_for_another_cluster_is_refused(plan: Plan) -> None:
    with pytest.raises(ValueError, match="the trace is for 9 nodes but the plan runs on 8"):
        simulate(plan, Trace(9, HOUR, ()))
    with pytest.raises(ValueError, match="unknown policy 'varuna'"):
        simulate(plan, Trace(8, HOUR, ()), policies=["varuna"])
    assert set(POLICIES) == {
        "oobleck",
        "oobleck-reroute",
        "oobleck-auto",
        "checkpoint-restart",
        "replica-groups",
    }


def test_a_copy_striped_over_replicas_charges_each_sender_its_share(plan: Plan) -> None:
    """Two receivers each newly hold layer 0: from one source, it sends the layer twice; striped over two
    replicas, each sends one layer's worth (the receivers' links are then the limit). A replica on the
    receiver's node crosses no link. The link share divides the bandwidth."""
    inputs = PlannerInputs.from_plan(plan)
    one_layer = copy_time_s([LayerCopy(0, 5, 0)], inputs)
    assert one_layer > 0
    single = [LayerCopy(0, to, 0) for to in (5, 6)]
    striped = [LayerCopy(0, to, 0, replicas=(Worker(0, 0), Worker(1, 0))) for to in (5, 6)]
    assert copy_time_s(single, inputs) == pytest.approx(2 * one_layer)
    assert copy_time_s(striped, inputs) == pytest.approx(one_layer)
    assert copy_time_s([LayerCopy(0, 5, 5, to_device=1)], inputs) == 0.0
    assert copy_time_s(striped, inputs, link_share=0.5) == pytest.approx(2 * one_layer)


def test_losing_the_coordinators_machine_costs_a_failover_or_with_its_standby_a_restart(plan: Plan) -> None:
    """Under SLURM the coordinator and the store start on the batch host, the allocation's first machine,
    with a standby on the next: losing the first costs a failover (its workers' loss in place, plus the
    failover's pause), the standby's machine then hosts the coordinator and a new standby starts on the next
    machine up. Losing both at once, or the coordinator before a new standby runs, restarts the job from
    its last checkpoint; after a restart the first machine up hosts it. Without failover (as before) every
    loss of its machine restarts the job; off the training machines (the local supervisor) none does."""
    horizon, costs = 6 * HOUR, Costs(oobleck_checkpoint_interval_s=HOUR / 2)
    fail = (NodeEvent(HOUR + 5.0, "fail", (0,)), NodeEvent(3 * HOUR + 5.0, "fail", (1,)))
    result = simulate_oobleck(plan, Trace(8, horizon, fail), costs)
    assert (result.coordinator_failures, result.coordinator_restarts, result.events) == (2, 0, 2)
    in_place = simulate_oobleck(plan, Trace(8, horizon, fail), replace(costs, failover_s=0.0))
    assert result.recovery_s == pytest.approx(in_place.recovery_s + 2 * costs.failover_s, rel=0.05)
    assert result.recovery_s < Costs().restart_s
    # the coordinator's and its standby's machines at once; then the coordinator before a standby runs
    both = simulate_oobleck(plan, Trace(8, horizon, (NodeEvent(HOUR + 5.0, "fail", (0, 1)),)), costs)
    assert (both.coordinator_failures, both.coordinator_restarts) == (1, 1)
    assert both.recovery_s >= Costs().restart_s
    quick = (NodeEvent(HOUR + 5.0, "fail", (0,)), NodeEvent(HOUR + 6.0, "fail", (1,)))
    too_soon = simulate_oobleck(plan, Trace(8, horizon, quick), costs)
    assert (too_soon.coordinator_failures, too_soon.coordinator_restarts) == (2, 1)
    # without failover, every loss of the coordinator's machine restarts the job
    before = simulate_oobleck(plan, Trace(8, horizon, fail), replace(costs, coordinator_failover=False))
    assert (before.coordinator_failures, before.coordinator_restarts) == (2, 2)
    assert before.recovery_s >= 2 * Costs().restart_s and before.samples < result.samples
    off = replace(costs, coordinator_on_first_machine=False)
    elsewhere = simulate_oobleck(plan, Trace(8, horizon, fail), off)
    assert elsewhere.coordinator_failures == 0 and elsewhere.recovery_s < Costs().restart_s
    # a machine other than the batch host: in place, as before
    other = simulate_oobleck(plan, Trace(8, horizon, (NodeEvent(HOUR + 5.0, "fail", (3,)),)), costs)
    assert other.coordinator_failures == 0 and other.recovery_s < Costs().restart_s


@pytest.mark.parametrize("repair_s", [360.0, None])
def test_auto_weighs_a_layout_until_the_lost_node_returns(repair_s: float | None) -> None:
    """Three failures 2 h apart on links slow enough that a re-instantiation's copy takes minutes. Nodes back
    after 6 minutes: a rerouted layout only has to last until the return (which both ways pay a copy for), so
    auto's horizon is the expected time to the next failure or the return, ``1 / (1 / MTBF + 1 / repair)``,
    and auto reroutes where weighing the time between failures alone re-instantiated: it trains more than
    re-instantiation. Nodes that never return: auto re-instantiates, ahead of rerouting throughout."""
    profile = synthetic_gpt_profile(16, 2048, 1024, microbatch_size=2)
    slow = ClusterSpec(8, 1, inter_node_bandwidth=5e7)
    plan = make_plan(profile, slow, fault_tolerance=1, global_batch_size=256)  # 4 pipelines of 2 nodes
    events = []
    for k, node in enumerate((1, 4, 6)):
        events.append(NodeEvent((2 * k + 1) * HOUR, "fail", (node,)))
        if repair_s is not None:
            events.append(NodeEvent((2 * k + 1) * HOUR + repair_s, "return", (node,)))
    trace = Trace(8, 7 * HOUR, tuple(events))
    assert trace.mean_repair_s == repair_s
    policies = ("oobleck", "oobleck-reroute", "oobleck-auto")
    costs = Costs(oobleck_checkpoint_interval_s=20 * HOUR)
    reinstantiated, rerouted, auto = (r.samples for r in simulate(plan, trace, policies, costs))
    if repair_s is not None:
        assert auto > reinstantiated
    else:
        assert auto == reinstantiated > rerouted
