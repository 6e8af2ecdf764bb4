"""make_plan: the issue's 13-node example, the Plan API the engine uses, JSON round trip, clear errors."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from lightning_oobleck.planning import ClusterSpec, Plan, PlanningError, make_plan, synthetic_gpt_profile
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.instantiation import IterationTimeModel
from lightning_oobleck.planning.reconfigure import after_failures
from lightning_oobleck.planning.templates import InfeasibleTemplateError


@pytest.fixture(scope="module")
def plan13() -> Plan:
    profile = synthetic_gpt_profile(24, microbatch_size=4)
    return make_plan(profile, ClusterSpec(13, 1), fault_tolerance=2, global_batch_size=512)


def test_thirteen_nodes_form_at_least_three_pipelines(plan13: Plan) -> None:
    assert plan13.nodes == tuple(range(13))
    assert len(plan13.pipelines) >= 3
    assert sum(p.microbatches for p in plan13.pipelines) == 128
    assert all(p.microbatches >= 1 for p in plan13.pipelines)
    sizes = {t.num_nodes for t in plan13.templates}
    assert set(range(plan13.n0, 2 * plan13.n0)) <= sizes
    assert plan13.planning_s > 0


def test_plan_api_is_consistent(plan13: Plan) -> None:
    ranges = [plan13.microbatch_range(i) for i in range(len(plan13.pipelines))]
    assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
    assert ranges[0].start == 0 and ranges[-1].stop == plan13.num_microbatches
    assert len(plan13.workers) == 13
    for layer in range(plan13.num_layers):
        owners = plan13.layer_owners(layer)
        assert len(owners) == len(plan13.pipelines)
        assert all(layer in plan13.role(*w).layers for w in owners)


def test_predicted_time_matches_the_instantiation_model(plan13: Plan) -> None:
    cost = CostModel(synthetic_gpt_profile(24, microbatch_size=4), ClusterSpec(13, 1))
    templates = [p.template for p in plan13.pipelines]
    distinct = list({t.num_nodes: t for t in templates}.values())
    model = IterationTimeModel(distinct, cost, 128, len(templates))
    counts = [sum(t.num_nodes == d.num_nodes for t in templates) for d in distinct]
    assert plan13.iteration_time_s == pytest.approx(model(np.array(counts)))


def test_json_round_trip_keeps_the_plan_and_its_inputs(plan13: Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan13.to_json())
    loaded = Plan.load(path)
    assert loaded == plan13
    assert loaded.extra["profile"] == plan13.extra["profile"]
    d = plan13.to_dict()
    for key in ("n0", "fault_tolerance", "templates", "pipelines", "iteration_time_s", "planning_s"):
        assert key in d
    stage = d["templates"][0]["stages"][0]
    assert stage["layers"] == [0, stage["layers"][1]] and stage["node"] == 0
    assert {"template_nodes", "nodes", "microbatches"} <= set(d["pipelines"][0])
    tied = replace(plan13, tied_layers=((0, 23), (2, 5)))
    assert Plan.from_dict(json.loads(tied.to_json())) == tied


def test_engine_style_call_with_counts_instead_of_a_cluster() -> None:
    plan = make_plan(
        synthetic_gpt_profile(8, 256, 128, 2),
        num_nodes=4,
        gpus_per_node=2,
        fault_tolerance=1,
        global_batch_size=16,
    )
    assert plan.microbatch_size == 2 and plan.gpus_per_node == 2 and len(plan.workers) == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"fault_tolerance": 7},
            PlanningError,
            r"f=7 needs 8 pipelines .* the fault tolerance to 5 \(OobleckStrategy\(fault_tolerance=5\)",
        ),
        (
            {"global_batch_size": 510},
            ValueError,
            r"not a multiple of the micro-batch 4: use a global batch of 508",
        ),
        ({"global_batch_size": 8}, PlanningError, r"2 micro-batches cannot feed the 3 pipelines"),
        ({"microbatch_size": 2}, PlanningError, r"measured for micro-batch 4, the plan asks for 2"),
        ({"fault_tolerance": -1}, PlanningError, r"must be >= 0"),
    ],
)
def test_bad_requests_name_the_problem_and_the_fix(kwargs: dict, error: type, message: str) -> None:
    args = {"fault_tolerance": 2, "global_batch_size": 512} | kwargs
    with pytest.raises(error, match=message):
        make_plan(synthetic_gpt_profile(24, microbatch_size=4), ClusterSpec(13, 1), **args)


def test_model_too_big_for_the_cluster_is_a_clear_error() -> None:
    profile = synthetic_gpt_profile(8, 16384, microbatch_size=1)
    with pytest.raises(InfeasibleTemplateError, match="does not fit on any number of nodes"):
        make_plan(
            profile, ClusterSpec(8, 1, device_memory_bytes=16e9), fault_tolerance=0, global_batch_size=8
        )


def test_zero_bubble_plan_is_costed_by_simulating_its_schedule() -> None:
    profile = synthetic_gpt_profile(24, microbatch_size=1)
    args = {"fault_tolerance": 2, "global_batch_size": 128}
    one_f_one_b = make_plan(profile, ClusterSpec(13, 1), **args)
    plan = make_plan(profile, ClusterSpec(13, 1), schedule="zb-h1", **args)
    assert plan.schedule == "zb-h1" and one_f_one_b.schedule == "1f1b"
    assert plan.iteration_time_s < one_f_one_b.iteration_time_s
    cost = CostModel(profile, ClusterSpec(13, 1), schedule="zb-h1")
    for template in plan.templates:
        stages = len(template.stages)
        for m in (stages, stages + 1, 2 * stages, 3 * stages):
            assert template.iteration_time_s(m) == pytest.approx(cost.simulated_time_s(template, m), rel=5e-3)
    loaded = Plan.from_dict(json.loads(plan.to_json()))
    assert loaded == plan and loaded.templates[0].schedule_fit_s == plan.templates[0].schedule_fit_s
    shrunk = after_failures(plan, [plan.nodes[0]]).plan
    assert shrunk.schedule == "zb-h1" and shrunk.templates[0].schedule_fit_s is not None


@pytest.mark.parametrize(("nodes", "chosen"), [(16, "zb-h1"), (8, "1f1b")])
def test_schedule_auto_keeps_the_faster_predicted_plan(nodes: int, chosen: str) -> None:
    """On 16 nodes of 16 GB both schedules plan and ZB-H1 predicts the shorter step; on 8, ZB-H1's
    ``min(S, m)`` micro-batches on every stage need pipelines of 6 nodes, too long for f = 1: 1F1B plans."""
    profile = synthetic_gpt_profile(24, 2048, 2048, 1)
    cluster = ClusterSpec(nodes, 1, device_memory_bytes=16e9)
    args = {"fault_tolerance": 1, "global_batch_size": 64}
    plan = make_plan(profile, cluster, schedule="auto", **args)
    alone = {}
    for name in ("1f1b", "zb-h1"):
        try:
            alone[name] = make_plan(profile, cluster, schedule=name, **args).iteration_time_s
        except PlanningError as err:
            alone[name] = str(err)
    assert plan.schedule == chosen and plan.iteration_time_s == alone[chosen]
    assert plan.iteration_time_s == min(t for t in alone.values() if isinstance(t, float))
    recorded = {
        c["schedule"]: c.get("iteration_time_s", c.get("infeasible")) for c in plan.extra["schedule_choices"]
    }
    assert recorded == alone
    assert after_failures(plan, [plan.nodes[-1]]).plan.schedule == chosen  # replans keep the choice


def test_schedule_auto_without_weight_gradient_times_plans_1f1b_and_says_why() -> None:
    profile = synthetic_gpt_profile(24, microbatch_size=4)
    untimed = replace(profile, layers=tuple(replace(layer, weight_grad_s=None) for layer in profile.layers))
    plan = make_plan(untimed, ClusterSpec(13, 1), fault_tolerance=2, global_batch_size=512, schedule="auto")
    assert plan.schedule == "1f1b"
    assert any("no weight-gradient times" in w for w in plan.warnings)


def test_a_measured_profile_without_backward_peaks_is_planned_with_a_warning_to_profile_again() -> None:
    synthetic = synthetic_gpt_profile(8)
    old = replace(
        synthetic, device="NVIDIA H100 80GB HBM3"
    )  # as a profile saved before the peaks were measured
    measured = replace(old, layers=tuple(replace(la, backward_peak_bytes=0) for la in old.layers))
    for profile, warned in ((old, 1), (measured, 0), (synthetic, 0)):
        plan = make_plan(profile, ClusterSpec(4, 1), fault_tolerance=1, global_batch_size=16)
        assert (
            sum("no backward peaks" in w and "profile the model again" in w for w in plan.warnings) == warned
        )
