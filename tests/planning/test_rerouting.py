"""Rerouted plans (ReCycle): every failure set up to f on planner plans gives routes that cross every layer
once on live workers, action lists the validator accepts, the recomputed f, and the per-failure choice."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from lightning_oobleck.planning import ClusterSpec, Plan, ReconfigurationError, make_plan
from lightning_oobleck.planning.planner import PlannerInputs
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.planning.reconfigure import after_failures
from lightning_oobleck.planning.rerouting import (
    NotReroutable,
    _merge_routes,
    _merged,
    affected,
    choose_recovery,
    expected_failure_interval_s,
    peak_memory_bytes,
    phase_duration,
    predict_staggered_step_s,
    predict_step_s,
    reroute,
    routes,
    shared_pairs,
    step_actions,
)
from lightning_oobleck.planning.schedules import (
    COMPUTE,
    Op,
    ScheduleError,
    iteration_time_s,
    simulate,
    validate,
)


def planned(nodes: int, f: int, per_device: int, schedule: str = "zb-h1", batch: int | None = None) -> Plan:
    """8 equal layers (F = I = W = 1 ms), ``per_device`` of them fit on a device; ``batch`` samples (default
    4 per node) of one sample per micro-batch."""
    layer = LayerProfile(1e-3, 2e-3, 1000, 100, 100, weight_grad_s=1e-3)
    return make_plan(
        ModelProfile((layer,) * 8, microbatch_size=1),
        ClusterSpec(num_nodes=nodes, gpus_per_node=1, device_memory_bytes=per_device * 20_000 / 3),
        fault_tolerance=f,
        global_batch_size=batch or 4 * nodes,
        schedule=schedule,
    )


def check_rerouted(plan: Plan, failed: tuple[int, ...]) -> Plan:
    rerouted = reroute(plan, failed)
    assert not set(rerouted.nodes) & set(failed)
    live = set(rerouted.workers)
    seen: list[int] = []
    for spec in routes(rerouted):
        assert set(spec.workers) <= live
        assert [i for layers in spec.layers for i in layers] == list(range(plan.num_layers))
        # a worker runs, for a rerouted micro-batch, only layers it holds
        for worker, layers in zip(spec.workers, spec.layers, strict=True):
            assert set(layers) <= set(rerouted.role(*worker).layers)
        seen += spec.microbatches
    assert sorted(seen) == list(range(plan.num_microbatches))
    schedule, limits = step_actions(rerouted)
    validate(schedule, limits, {w: 1 for w in schedule})
    # the merge's own simulation of its lists is the step the choice predicts
    duration = phase_duration(rerouted)
    assert _merge_routes(rerouted, 0, True, None)[2] == iteration_time_s(simulate(schedule, duration))
    # every micro-batch's every layer is computed exactly once, forward and backward
    for op in (Op.F, Op.I, Op.W):
        done = sorted(
            (a.microbatch, layer)
            for actions in schedule.values()
            for a in actions
            if a.op is op
            for layer in a.layers
        )
        assert done == sorted(itertools.product(range(plan.num_microbatches), range(plan.num_layers)))
    replicas = [len(rerouted.layer_owners(layer)) for layer in range(plan.num_layers)]
    assert rerouted.fault_tolerance == min(plan.fault_tolerance, min(replicas) - 1)
    return rerouted


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_every_failure_set_up_to_f_reroutes_exactly() -> None:
    """4 to 6 pipelines, every set of 1 or 2 lost nodes: the routes, the lists, f."""
    checked = 0
    for nodes, per_device in ((8, 4), (12, 3), (11, 3)):  # n0 = 2, 3 (heterogeneous with 11 nodes)
        plan = planned(nodes, 2, per_device)
        assert len(plan.pipelines) >= 3
        for size in (1, 2):
            for failed in itertools.combinations(plan.nodes, size):
                check_rerouted(plan, failed)
                checked += 1
    assert checked > 100


def test_a_layer_without_a_live_replica_is_not_reroutable_and_says_so() -> None:
    plan = planned(4, 1, 4)  # 2 pipelines of 2 nodes
    first_stages = [p.worker_of_stage(0).node for p in plan.pipelines]
    with pytest.raises(NotReroutable, match=r"no other pipeline holds layers 0\.\.3 on live nodes"):
        reroute(plan, first_stages)


def test_a_second_failure_reroutes_the_rerouted_plan() -> None:
    plan = planned(12, 2, 3)
    once = check_rerouted(plan, (plan.pipelines[0].nodes[0],))
    twice = reroute(once, (plan.pipelines[1].nodes[-1],))
    assert set(twice.lost) == {plan.pipelines[0].nodes[0], plan.pipelines[1].nodes[-1]}
    validate(step_actions(twice)[0])


def test_a_failure_never_raises_the_fault_tolerance() -> None:
    """4 pipelines of one node for f = 1 (every layer has 4 replicas): the rerouted plan keeps f = 1, as
    re-instantiation's 3 pipelines do; 3 live replicas do not make it f = 2 (the console said so once)."""
    plan = planned(4, 1, 8)
    assert len(plan.pipelines) == 4 and plan.fault_tolerance == 1
    lost = (plan.pipelines[0].nodes[0],)
    assert check_rerouted(plan, lost).fault_tolerance == 1 == after_failures(plan, lost).plan.fault_tolerance
    assert not reroute(plan, lost).warnings
    third = reroute(reroute(plan, lost), (plan.pipelines[1].nodes[0], plan.pipelines[2].nodes[0]))
    assert third.fault_tolerance == 0 and "fault tolerance 0 (was 1)" in third.warnings[0]


def test_rerouted_work_lands_in_the_helpers_bubbles() -> None:
    """4 pipelines of 4 stages of 4 micro-batches, one node lost: under both schedules the step grows by less
    than the work each helper takes on (a third of the lost stage's micro-batches on one of its stages),
    because that work fills the bubbles of their schedules."""
    for schedule in ("1f1b", "zb-h1"):
        check_bubbles_absorb(planned(16, 3, 2, schedule, batch=16))


def check_bubbles_absorb(plan: Plan) -> None:
    assert [len(p.stages) for p in plan.pipelines] == [4] * 4
    before = predict_step_s(plan)
    rerouted = reroute(plan, [plan.pipelines[0].nodes[1]])
    (reroute_of,) = rerouted.reroutes
    most = math.ceil(plan.pipelines[0].microbatches / len(reroute_of.helpers))  # the busiest helper's share
    extra = most * plan.pipelines[0].template.stage_times_s[1]
    assert before < rerouted.iteration_time_s < before + extra - 1e-6


def test_a_staggered_optimizer_saves_only_the_skew_of_the_workers_ends() -> None:
    """Starting each worker's next step once the replicas of its layers finished (ReCycle's staggered
    optimizer) is never slower than the commit's barrier, never faster than the busiest worker's compute,
    saves nothing in a 1F1B pipeline alone, and saves where the pipelines' ends are skewed."""
    one = planned(4, 0, 2, "1f1b", batch=8)
    assert predict_staggered_step_s(one) == pytest.approx(predict_step_s(one), rel=1e-12)
    plan = planned(8, 1, 2)  # 2 pipelines of 4 nodes
    lost = [plan.pipelines[0].nodes[-1]]
    again = after_failures(plan, lost).plan  # one heterogeneous pipeline of 7 stages
    assert predict_staggered_step_s(again) < 0.98 * predict_step_s(again)
    for layout in (one, plan, again, reroute(plan, lost), reroute(planned(16, 3, 2, batch=16), [1, 6])):
        duration = phase_duration(layout)
        busiest = max(
            sum(duration(w, a) for a in actions if a.op in COMPUTE)
            for w, actions in step_actions(layout)[0].items()
        )
        assert busiest - 1e-9 <= predict_staggered_step_s(layout) <= predict_step_s(layout) + 1e-9


def test_a_recovery_merges_the_rerouted_step_once() -> None:
    """``choose_recovery`` simulates the rerouted step; the engine's lists under the plan it chose (a worker's
    own gradient buckets) come from that same merge, which takes seconds at scale."""
    plan = planned(16, 3, 2, batch=16)
    _merged.cache_clear()
    chosen = choose_recovery(plan, [1], "reroute").reconfiguration.plan
    merged = _merged.cache_info().misses
    worker = chosen.workers[3]
    buckets = [(layer,) for layer in chosen.role(*worker).layers]  # one bucket a layer
    schedule, limits = step_actions(chosen, 0, {worker: buckets}, True, affected(chosen))
    assert _merged.cache_info().misses == merged
    validate(schedule, limits, {worker: len(buckets)})
    assert [a.layers for a in schedule[worker] if a.op is Op.REDUCE] == buckets


def test_the_json_form_keeps_the_rerouting() -> None:
    rerouted = reroute(planned(8, 2, 4), [1])
    assert Plan.from_dict(rerouted.to_dict()) == rerouted


def test_a_list_on_the_wrong_channel_is_refused_by_its_worker_and_its_peer() -> None:
    """Whole, or as each worker of a merged step checks its own list and its pairs."""
    rerouted = reroute(planned(8, 2, 4), [1])
    schedule, limits = step_actions(rerouted)
    for worker in schedule:
        validate(schedule, limits, worker=worker)
    worker, actions = next((w, a) for w, a in schedule.items() if any(x.channel for x in a))
    k = next(i for i, a in enumerate(actions) if a.channel)
    schedule[worker][k] = dataclasses.replace(actions[k], channel=0)
    for checked in (None, worker, actions[k].peer):
        with pytest.raises(ScheduleError, match=r"no matching|same order"):
            validate(schedule, worker=checked)
    others = set(schedule) - {worker, actions[k].peer}
    for other in others:  # the other workers' lists and pairs are sound
        validate(schedule, limits, worker=other)


def test_the_expected_failure_interval_learns_from_the_failures_seen() -> None:
    """The configured interval is one failure's worth of evidence; the run's record revises it."""
    assert expected_failure_interval_s(3600.0) == 3600.0
    assert expected_failure_interval_s(3600.0, 1, 60.0) == pytest.approx(1830.0)  # soon after the start
    assert expected_failure_interval_s(3600.0, 3, 600.0) == pytest.approx(1050.0)  # 3 in ten minutes
    assert expected_failure_interval_s(3600.0, 1, 7 * 86400.0) > 3600.0  # one failure in a week
    for failures, time_s in itertools.product(range(4), (0.0, 10.0, 1e4)):
        now = expected_failure_interval_s(600.0, failures, time_s)
        assert expected_failure_interval_s(600.0, failures + 1, time_s) < now
        assert expected_failure_interval_s(600.0, failures, time_s + 1.0) > now
    # many failures: the observed mean interval, whatever was configured
    assert expected_failure_interval_s(1e6, 10_000, 1e7) == pytest.approx(1e7 / 10_000, rel=0.11)
    for bad in ((0.0, 0, 0.0), (60.0, -1, 0.0), (60.0, 0, -1.0)):
        with pytest.raises(ValueError, match="failure interval must be positive"):
            expected_failure_interval_s(*bad)


def test_the_choice_weighs_the_step_against_the_copy_over_the_horizon() -> None:
    plan = planned(16, 3, 2)
    failed = [plan.pipelines[0].nodes[1]]
    auto = choose_recovery(plan, failed, "auto", horizon_s=3600.0)
    by_policy = {c.policy: c for c in auto.candidates}
    assert set(by_policy) == {"reinstantiate", "reroute"}
    assert by_policy["reroute"].transition_s == 0.0 and by_policy["reinstantiate"].transition_s > 0.0
    best = max(auto.candidates, key=lambda c: c.samples)
    assert auto.policy == best.policy
    for c in auto.candidates:
        assert c.samples == pytest.approx(plan.global_batch_size * (3600.0 - c.transition_s) / c.step_s)
    # a horizon shorter than the copy: rerouting trains, re-instantiation would still be copying
    short = choose_recovery(plan, failed, "auto", horizon_s=by_policy["reinstantiate"].transition_s / 2)
    assert short.policy == "reroute"
    # the fixed policies take their way whatever the prediction
    assert choose_recovery(plan, failed, "reroute").policy == "reroute"
    assert choose_recovery(plan, failed, "reinstantiate").reconfiguration.copies


def test_reroute_falls_back_to_reinstantiation_where_it_cannot_keep_the_step_exact() -> None:
    plan = planned(8, 1, 2)  # 2 pipelines of 4 nodes: two failures leave layers with no replica
    failed = [plan.pipelines[0].nodes[0], plan.pipelines[1].nodes[0]]
    with pytest.raises(ReconfigurationError):
        choose_recovery(plan, failed, "reroute")
    plan = planned(8, 2, 4)
    rerouted = reroute(plan, [1])
    if shared_pairs(rerouted):  # without message tags (NCCL) two routes may not share a pair of workers
        choice = choose_recovery(plan, [1], "reroute", message_tags=False)
        assert choice.policy == "reinstantiate"
        assert "message tags" in next(c.infeasible for c in choice.candidates if c.policy == "reroute")


def test_compute_actions_only_run_held_layers() -> None:
    rerouted = reroute(planned(11, 2, 3), [4])
    schedule, _ = step_actions(rerouted)
    for worker, actions in schedule.items():
        held = set(rerouted.role(*worker).layers)
        assert all(set(a.layers) <= held for a in actions if a.op in COMPUTE)


def with_backward_memory(nodes: int, per_device: int, schedule: str) -> Plan:
    """:func:`planned`'s model with activations that matter: each layer saves 400 bytes, its backward rises
    300 (200 split), its ``I`` keeps 150 for its ``W``."""
    layer = LayerProfile(
        1e-3,
        2e-3,
        1000,
        100,
        400,
        weight_grad_s=1e-3,
        backward_peak_bytes=300,
        split_backward_peak_bytes=200,
        weight_gradient_kept_bytes=150,
    )
    return make_plan(
        ModelProfile((layer,) * 8, microbatch_size=1),
        ClusterSpec(num_nodes=nodes, gpus_per_node=1, device_memory_bytes=per_device * 20_000 / 3),
        fault_tolerance=1,
        global_batch_size=4 * nodes,
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_steps_memory_counted_along_the_lists_stays_within_the_cost_models_bound(schedule: str) -> None:
    # 1F1B reaches each stage's bound; ZB-H1's last stage holds one micro-batch at a time, below its bound
    for nodes, per_device in ((9, 4), (12, 4), (8, 3)):
        plan = with_backward_memory(nodes, per_device, schedule)
        cost = PlannerInputs.from_plan(plan).cost()
        peaks = peak_memory_bytes(plan)
        for p in plan.pipelines:
            for si, stage in enumerate(p.stages):
                bound = cost.stage_memory_bytes(
                    stage.first_layer, stage.end_layer, si, len(p.stages), p.microbatches
                )
                peak = peaks[p.workers_of_stage(si)[0]]
                assert peak == bound if schedule == "1f1b" else peak <= bound


def uneven_and_full() -> Plan:
    """7 nodes, 8 layers of uneven activations and parameters: a pipeline of 4 stages and one of 3, their
    devices nearly full."""
    saved = (1600, 400, 400, 100, 1600, 400, 1600, 100)
    params = (500, 2000, 2000, 500, 500, 500, 500, 1000)
    layers = tuple(
        LayerProfile(
            1e-3,
            2e-3,
            p,
            100,
            a,
            weight_grad_s=1e-3,
            backward_peak_bytes=a // 2,
            split_backward_peak_bytes=a // 3,
            weight_gradient_kept_bytes=a // 8,
        )
        for a, p in zip(saved, params, strict=True)
    )
    return make_plan(
        ModelProfile(layers, microbatch_size=1),
        ClusterSpec(num_nodes=7, gpus_per_node=1, device_memory_bytes=20_000),
        fault_tolerance=1,
        global_batch_size=28,
    )


def test_rerouting_never_overfills_a_device_it_falls_back_to_reinstantiation() -> None:
    """Every failure of two plans that fill their devices: a rerouting is taken only where every worker's
    step, counted along its merged list, fits its device (the helpers' rerouted forwards wait for room, and
    all of a lost stage's micro-batches go to one helper where spreading them does not fit); else it is
    refused, naming the worker, and the choice re-instantiates."""
    refused = []
    for plan in (with_backward_memory(8, 3, "1f1b"), uneven_and_full()):
        cap = PlannerInputs.from_plan(plan).cluster.device_memory_bytes
        for node in plan.nodes:
            try:
                rerouted = reroute(plan, [node])
            except NotReroutable as e:
                assert "would need" in str(e) and f"of its device's {cap:.4g}" in str(e)
                refused.append((plan, node))
                continue
            assert max(peak_memory_bytes(rerouted).values()) <= cap
    plan, node = refused[0]
    assert [len(p.stages) for p in plan.pipelines] == [4, 3]
    choice = choose_recovery(plan, [node], "reroute")
    assert choice.policy == "reinstantiate"
    assert "would need" in next(c.infeasible for c in choice.candidates if c.policy == "reroute")


def test_a_lost_stages_micro_batches_go_to_one_helper_where_spreading_them_overfills() -> None:
    # 4 pipelines of 2 stages, nearly full: spread over 3 helpers, the damaged pipeline's first stage would
    # warm up once per helper
    plan = with_backward_memory(8, 3, "1f1b")
    rerouted = reroute(plan, [plan.pipelines[0].nodes[1]])
    assert [len(r.helpers) for r in rerouted.reroutes] == [1]
    roomy = dataclasses.replace(
        plan, extra={**plan.extra, "cluster": {**plan.extra["cluster"], "device_memory_bytes": 1e9}}
    )
    assert [len(r.helpers) for r in reroute(roomy, [roomy.pipelines[0].nodes[1]]).reroutes] == [3]


def test_two_damaged_pipelines_on_full_devices_reroute_or_are_refused_never_deadlock() -> None:
    """Failures in both pipelines of a full plan: each pipeline helps the other, and each one's rerouted
    forwards could wait for the other's (with node 2 and 4 lost, the memory-aware merge deadlocked once). The
    waiting workers then go on and the memory count decides: a rerouting that fits, or a refusal."""
    plan = uneven_and_full()
    cap = PlannerInputs.from_plan(plan).cluster.device_memory_bytes
    for a, b in itertools.product(plan.pipelines[0].nodes, plan.pipelines[1].nodes):
        for at_once in (True, False):
            try:
                rerouted = reroute(plan, [a, b]) if at_once else reroute(reroute(plan, [a]), [b])
            except NotReroutable as e:
                assert "would need" in str(e) or "no other pipeline holds" in str(e)
                continue
            assert max(peak_memory_bytes(rerouted).values()) <= cap
