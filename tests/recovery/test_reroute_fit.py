"""Rerouting (ReCycle) in the loop users run: ``Trainer.fit`` with ``recovery_policy="reroute"``, workers
SIGKILLed for real; the damaged pipelines keep their surviving stages, no state is copied, and the run ends
with single-process training's weights, learning rates, logged losses, samples and checkpoints (the loop of
:mod:`test_realistic_loop`: validation, checkpoints, loader workers, an LR schedule, clipping). A node that
comes back ends the rerouting. ``recovery_policy="auto"`` takes both ways in one run."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fault_matrix import BACKWARD, FORWARD, Fault, check, fit_with_faults, reference
from test_realistic_loop import CHECKPOINT, VALIDATION, LoopFaults, check_loop, fit_loop, loop_reference
from test_rejoin_fit import HoldForTheReplacement

from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.planning import Plan, choose_recovery
from lightning_oobleck.recovery import read_events

__all__ = ["loop_reference", "reference"]  # the fixtures, shared with test_realistic_loop, test_fault_matrix


def recoveries(out: Path) -> list[Any]:
    """The recovery events of a run of :func:`fit_loop` (its logger's folder)."""
    return read_events(out / "logs" / "version_0" / EVENTS_FILE)[1]


def recoveries_in(out: Path) -> list[Any]:
    """The recovery events of a run of :func:`fit_with_faults` (no logger)."""
    return read_events(out / EVENTS_FILE)[1]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_reroute_a_first_stage_then_a_last_stage_of_another_pipeline(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """6 nodes, 3 pipelines of 2 stages. Rank 0 (a first stage) dies in a training forward of step 1: its
    pipeline's micro-batches take the other two pipelines' first stages. In step 5 a last stage of another
    pipeline (node 3) dies in a backward: two pipelines are rerouted at once. Nothing is copied."""
    faults = {(0, 1): Fault(signal.SIGKILL, FORWARD), (3, 5): Fault(signal.SIGKILL, BACKWARD)}
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 6, recovery_policy="reroute")
    check_loop(trainer, tmp_path, loop_reference, dead={0, 3}, num_nodes=6)
    events = recoveries(tmp_path)
    assert [e.recovery_policy for e in events] == ["reroute", "reroute"]
    assert all(e.copied_bytes == 0 for e in events)
    assert [e.fault_tolerance for e in events] == [1, 1]  # each layer keeps 2 live replicas


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_reroute_a_middle_stage_in_validation_and_a_last_stage_in_a_checkpoint(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """7 nodes: pipelines (0, 1, 2), (3, 4), (5, 6) of unequal splits. The middle stage node 1 dies in the
    validation after step 3 (its layers run on both other pipelines, whose stages split them differently);
    the last stage node 4 dies in the checkpoint save of step 4."""
    faults = {(1, 3): Fault(signal.SIGKILL, VALIDATION), (4, 4): Fault(signal.SIGKILL, CHECKPOINT)}
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 7, recovery_policy="reroute")
    check_loop(trainer, tmp_path, loop_reference, dead={1, 4}, num_nodes=7)
    assert [e.recovery_policy for e in recoveries(tmp_path)] == ["reroute", "reroute"]


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_a_replacement_node_ends_the_rerouting(tmp_path: Path, loop_reference: dict[str, Any]) -> None:
    """Rank 0 dies in step 1 and its pipeline is rerouted; the launcher's replacement joins at a step
    boundary, which re-instantiates: the pipelines whole again (f back to 2), the replacement holding the
    lost stage's layers, copied to it, and the run ends with the reference's weights on every worker."""
    faults = HoldForTheReplacement(tmp_path, {(0, 1): Fault(signal.SIGKILL, FORWARD)})
    trainer = fit_loop(tmp_path, faults, 6, replace_failed_after_s=0.2, recovery_policy="reroute")
    replacement = 6
    check_loop(trainer, tmp_path, loop_reference, dead={0}, num_nodes=6, joined={replacement})
    failure, join = recoveries(tmp_path)
    assert failure.recovery_policy == "reroute" and failure.copied_bytes == 0
    assert join.added == [[replacement, 0]] and join.fault_tolerance == 2 and join.copied_bytes > 0


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_auto_reroutes_one_failure_and_reinstantiates_after_the_next(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """``recovery_policy="auto"`` on 6 nodes, 3 pipelines of 2 stages: rank 0 dies in step 1 and rerouting
    its first stage is predicted faster than re-instantiating 5 nodes; node 3 dies in step 5, when
    rerouting a second pipeline through the first one's helpers is predicted slower than re-instantiating
    the 4 live nodes from the templates, so auto re-instantiates from the rerouted plan. Each
    decision is the cost model's (:func:`choose_recovery` on the same plans), and the run ends with
    single-process training's weights."""
    faults = {(0, 1): Fault(signal.SIGKILL, FORWARD), (3, 5): Fault(signal.SIGKILL, BACKWARD)}
    trainer = fit_loop(tmp_path, LoopFaults(tmp_path, faults), 6, recovery_policy="auto")
    check_loop(trainer, tmp_path, loop_reference, dead={0, 3}, num_nodes=6)
    rerouted, reinstantiated = recoveries(tmp_path)
    # the run's first and second failure, within its first minute: the next one is expected 1/2 and 1/3 of
    # failure_interval_s (3600 s) away
    assert 1800.0 < rerouted.horizon_s < 1830.0 and 1200.0 < reinstantiated.horizon_s < 1220.0
    first = choose_recovery(Plan.load(tmp_path / "plan.json"), [0], "auto", rerouted.horizon_s)
    second = choose_recovery(first.reconfiguration.plan, [3], "auto", reinstantiated.horizon_s)
    assert (first.policy, second.policy) == ("reroute", "reinstantiate")
    assert [rerouted.recovery_policy, reinstantiated.recovery_policy] == [first.policy, second.policy]
    assert rerouted.candidates == [str(c) for c in first.candidates]
    assert rerouted.copied_bytes == 0
    # the plans the run switched to are the chosen ones: the rerouted layout, then pipelines whole again
    assert rerouted.predicted_step_s == pytest.approx(first.reconfiguration.plan.iteration_time_s)
    assert reinstantiated.predicted_step_s == pytest.approx(second.reconfiguration.plan.iteration_time_s)
    assert not second.reconfiguration.plan.reroutes and len(second.reconfiguration.plan.pipelines) == 2


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_reroute_a_whole_node_of_two_processes(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """3 nodes of 2 processes, one 2-stage pipeline on each. Device 0 of node 1 is SIGKILLed in a forward of
    step 1: the node is out (its device 1 fenced) and its whole pipeline is gone; its micro-batches run on
    the two other nodes' stages, nothing copied."""
    faults = {(1, 1): Fault(signal.SIGKILL, FORWARD, device=0)}
    trainer = fit_with_faults(tmp_path, faults, num_nodes=3, devices_per_node=2, recovery_policy="reroute")
    check(trainer, tmp_path, reference, dead={1}, num_nodes=3, devices_per_node=2)
    (event,) = recoveries_in(tmp_path)
    assert sorted(map(tuple, event.removed)) == [(1, 0), (1, 1)]
    assert event.recovery_policy == "reroute" and event.copied_bytes == 0
