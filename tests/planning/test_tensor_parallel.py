"""The planner with stages over several devices of a node (tensor parallelism ``t``): the profile at ``t``,
the cost of a stage's all-reduces, templates of ``G / t`` stages per node, ``auto`` against every degree,
the f+1 guarantee at ``t``, and the plan's JSON."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import pytest
from planning_cases import check_reconfiguration

from lightning_oobleck.planning import ClusterSpec, Plan, after_failures, make_plan, synthetic_gpt_profile
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.planner import PlannerInputs, PlanningError
from lightning_oobleck.planning.profile import ModelProfile

# 64 heads: every degree of 1, 2, 4, 8 splits it
PROFILE = synthetic_gpt_profile(10, 4096, 2048, 1, heads=64)


def test_the_profile_at_each_degree_is_one_ranks_share_and_round_trips_through_json() -> None:
    assert PROFILE.tensor_parallel_degrees == (1, 2, 4, 8)
    whole, half = PROFILE.at(1).layers[1], PROFILE.at(2).layers[1]
    h = 4096
    assert half.forward_s == pytest.approx(whole.forward_s / 2)
    assert half.parameter_bytes == ((12 * h * h + 7 * h) // 2 + 6 * h) * 2
    assert half.activation_bytes < whole.activation_bytes
    assert (
        half.tensor_parallel_forward_bytes
        == half.tensor_parallel_backward_bytes
        == (whole.output_activation_bytes,) * 2
    )
    assert whole.tensor_parallel_forward_bytes == ()
    loaded = ModelProfile.from_dict(PROFILE.to_dict())
    assert (
        loaded.sharded == PROFILE.sharded
        and loaded.at(4) == PROFILE.at(4)
        and loaded.at(4).tensor_parallel == 4
    )
    with pytest.raises(ValueError, match=r"no layers at tensor parallelism 16.*1, 2, 4, 8"):
        PROFILE.at(16)
    plain = replace(PROFILE, sharded={})
    with pytest.raises(ValueError, match="declare no tensor-parallel plan"):
        plain.at(2)


def test_a_stage_at_t_pays_its_all_reduces_as_a_ring_over_the_node() -> None:
    cluster = ClusterSpec(1, 8, tensor_parallel_bandwidth=200e9, intra_node_latency_s=3e-6)
    cost = CostModel(PROFILE.at(4), cluster)
    block = PROFILE.at(4).layers[1]
    ring = 2 * 3 / 4 * block.output_activation_bytes / 200e9 + 2 * 3 * 3e-6
    assert cost.tensor_parallel_s(1, 2) == pytest.approx(4 * ring)
    assert cost.compute_s(1, 2) == pytest.approx(block.forward_s + block.backward_s + 4 * ring)
    # the forward's two all-reduces go to F, the backward's two to I (the input gradient), none to W
    f, i, w = cost.stage_phases_s(1, 2, stage=1)
    assert f == pytest.approx(block.forward_s + 2 * ring)
    assert w == pytest.approx(block.weight_grad_s)
    assert i == pytest.approx(block.backward_s - block.weight_grad_s + 2 * ring)
    assert cost.stages_per_node == 2
    with pytest.raises(ValueError, match="does not divide the 6 GPUs"):
        CostModel(PROFILE.at(4), ClusterSpec(1, 6))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_templates_at_t_put_g_over_t_stages_on_each_node_and_use_every_device_once(t: int) -> None:
    plan = make_plan(
        PROFILE,
        ClusterSpec(4, 8, device_memory_bytes=80e9),
        fault_tolerance=1,
        global_batch_size=64,
        tensor_parallel=t,
    )
    assert plan.tensor_parallel == t
    for template in plan.templates:
        assert template.tensor_parallel == t and len(template.stages) == template.num_nodes * 8 // t
        assert [s.device for s in template.stages[: 8 // t]] == list(range(0, 8, t))
    roles = {}
    for worker in plan.workers:
        role = plan.role(*worker)
        roles.setdefault((role.pipeline, role.stage), []).append((worker, role.tensor_rank))
    # every stage has t workers of one node, ranks 0..t-1 on consecutive devices
    assert len(roles) == sum(len(p.stages) for p in plan.pipelines)
    for (pi, si), members in roles.items():
        assert [w for w, _ in members] == list(plan.pipelines[pi].workers_of_stage(si))
        assert [r for _, r in members] == list(range(t)) and len({w.node for w, _ in members}) == 1
    again = Plan.from_dict(plan.to_dict())
    assert again.templates == plan.templates and again.tensor_parallel == t


def _cases() -> list[tuple[ModelProfile, ClusterSpec]]:
    small = synthetic_gpt_profile(8, 1024, 1024, 2, heads=8)
    return [
        (small, ClusterSpec(n, g, device_memory_bytes=mem, tensor_parallel_bandwidth=bw))
        for n, g, mem, bw in itertools.product((2, 3, 5), (2, 4), (8e9, 48e9), (20e9, 600e9))
    ]


@pytest.mark.parametrize(("profile", "cluster"), _cases())
def test_auto_chooses_the_fastest_degree_that_plans(profile: ModelProfile, cluster: ClusterSpec) -> None:
    by_degree = {}
    for t in (1, 2, 4):
        if cluster.gpus_per_node % t == 0:
            with contextlib.suppress(ValueError):
                by_degree[t] = make_plan(
                    profile, cluster, fault_tolerance=1, global_batch_size=32, tensor_parallel=t
                )
    if not by_degree:
        with pytest.raises(PlanningError, match=r"no tensor-parallel degree gives a plan: t=1: .*; t=2: "):
            make_plan(profile, cluster, fault_tolerance=1, global_batch_size=32, tensor_parallel="auto")
        return
    chosen = make_plan(profile, cluster, fault_tolerance=1, global_batch_size=32, tensor_parallel="auto")
    best = min(by_degree, key=lambda t: (by_degree[t].iteration_time_s, t))
    assert chosen.tensor_parallel == best
    assert chosen.iteration_time_s == pytest.approx(by_degree[best].iteration_time_s)
    choices = {c["tensor_parallel"]: c for c in chosen.extra["tensor_parallel_choices"]}
    for t, c in choices.items():
        assert (
            c["iteration_time_s"] == pytest.approx(by_degree[t].iteration_time_s)
            if t in by_degree
            else "infeasible" in c
        )
    # replanning keeps the chosen degree
    assert PlannerInputs.from_plan(chosen).tensor_parallel == best


def test_a_model_that_fits_nowhere_at_t1_plans_at_a_larger_t() -> None:
    big = synthetic_gpt_profile(12, 8192, 4096, 1, heads=64)
    cluster = ClusterSpec(8, 8, device_memory_bytes=40e9)
    with pytest.raises(ValueError, match=r"does not fit on any number of nodes.*more tensor parallelism"):
        make_plan(big, cluster, fault_tolerance=1, global_batch_size=64)
    plan = make_plan(big, cluster, fault_tolerance=1, global_batch_size=64, tensor_parallel="auto")
    assert plan.tensor_parallel > 1
    assert "infeasible" in plan.extra["tensor_parallel_choices"][0]


def test_a_degree_the_node_or_the_profile_cannot_give_is_one_error_naming_the_fix() -> None:
    cluster = ClusterSpec(4, 4)
    with pytest.raises(
        PlanningError, match=r"tensor_parallel=8 does not divide the 4 GPUs.*one of \[1, 2, 4\]"
    ):
        make_plan(PROFILE, cluster, fault_tolerance=1, global_batch_size=64, tensor_parallel=8)
    with pytest.raises(PlanningError, match="'auto' or a positive integer"):
        make_plan(PROFILE, cluster, fault_tolerance=1, global_batch_size=64, tensor_parallel="two")
    plain = replace(PROFILE, sharded={})
    with pytest.raises(PlanningError, match="declare no tensor-parallel plan"):
        make_plan(plain, cluster, fault_tolerance=1, global_batch_size=64, tensor_parallel=2)
    auto = make_plan(plain, cluster, fault_tolerance=1, global_batch_size=64, tensor_parallel="auto")
    assert auto.tensor_parallel == 1 and any("declare no tensor-parallel plan" in w for w in auto.warnings)


@pytest.mark.timeout(120)
def test_every_failure_set_up_to_f_at_t2_keeps_the_guarantee() -> None:
    """Nodes are the failure domain at every ``t``: the guarantee's check on nodes of 2 devices, each node
    one stage of 2."""
    profile = synthetic_gpt_profile(8, 1024, 1024, 2, heads=8)
    checked = 0
    for f in range(3):
        for nodes in range(f + 1, 10):
            cluster = ClusterSpec(nodes, 2, device_memory_bytes=48e9)
            plan = make_plan(profile, cluster, fault_tolerance=f, global_batch_size=64, tensor_parallel=2)
            assert len(plan.pipelines) >= f + 1 and plan.tensor_parallel == 2
            for size in range(1, f + 1):
                for failed in itertools.combinations(range(nodes), size):
                    result = after_failures(plan, failed)
                    check_reconfiguration(plan, set(failed), result)
                    assert result.plan.tensor_parallel == 2
                    checked += 1
    assert checked > 100
