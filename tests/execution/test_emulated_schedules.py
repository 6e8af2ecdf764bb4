"""On emulated devices (8 gloo processes whose layers sleep known times), the measured iteration time of
each schedule matches the cost model's event simulation of its action lists, on one pipeline of 4 stages,
one of 8, and two heterogeneous pipelines of 3 and 5 stages with unequal micro-batches; and ZB-H1 saves at
least half the time over 1F1B that the simulation says it does. The prediction starts from the profiler's
measurement of the emulated layers, as the planner's would. Each time is the fastest of two steps and the
bounds are wide (the machine is shared); ``benchmarks/schedules.py`` has the exact numbers. And the
per-failure choice between rerouting and re-instantiation picks the faster measured way
(``benchmarks/failure_throughput.py`` has more cases)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import exec_workloads as wl
import pytest
import torch
from dist_harness import WorkerPool, indexed_pool, plan_from_splits

from lightning_oobleck.execution import profile_layers
from lightning_oobleck.planning import make_plan
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.cost import CostModel
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.planning.reconfigure import after_failures
from lightning_oobleck.planning.rerouting import choose_recovery, reroute
from lightning_oobleck.planning.schedules import SCHEDULE_NAMES
from lightning_oobleck.testing import DeviceTimes, emulated_layers

LAYOUTS = {
    "one pipeline of 4 stages": plan_from_splits([[(0, 2), (2, 4), (4, 6), (6, 8)]], [8], 2),
    "one pipeline of 8 stages": plan_from_splits([[(i, i + 1) for i in range(8)]], [8], 2),
    "pipelines of 3 and 5 stages": plan_from_splits(
        [[(0, 3), (3, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8)]], [6, 10], 2
    ),
}
STEPS = 2
TIMES = DeviceTimes(0.08, 0.08, 0.08)
"""Each layer's forward, input gradient and weight gradient for the schedules' test: 80 ms. At 40 ms, beside
the rest of the suite in CI, ZB-H1 ran 7.5% over its simulation on the pipelines of 3 and 5 stages and took
0.940-0.956 of 1F1B's time against at most 0.938 (two CI runs of four). At 20 ms the
executor's own work around each action, 8 processes on 2 cores, grew on a slow day to 4-5 ms under ZB-H1
(more of its actions run at once), and ZB-H1 measured 0.81-0.85 of 1F1B's time on 8 stages against 0.71
simulated; at 40 ms, 0.717-0.728 against 0.705 in three runs on that day, each schedule within 1-5% of its
simulation."""


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with indexed_pool(8) as workers:
        yield workers


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    return profile_layers(lambda: emulated_layers(8, 4, TIMES), torch.zeros(2, 4), wl.CPU, repeat=7)


def simulated_s(plan: Plan, profile: ModelProfile) -> float:
    cost = CostModel(profile, ClusterSpec(num_nodes=len(plan.nodes)), schedule=plan.schedule)
    return max(cost.simulated_time_s(p.template, p.microbatches) for p in plan.pipelines)


def misses(measured: dict[str, float], simulated: dict[str, float]) -> list[str]:
    """What of the schedules' promises ``measured`` breaks: each within -5%..+35% of its simulation, and
    ZB-H1 saving over 1F1B at least half the time the simulation says it saves and at most that plus 5% of
    1F1B's time (a ZB-H1 that lost its overlap would save nothing). The simulation has no per-action overhead,
    which grows on a slow machine (see :data:`TIMES`) and weighs more on ZB-H1, more of whose actions run at
    once: CI measured it at 0.786 of 1F1B's time on 8 stages against 0.708 simulated, 1F1B 0.5% and ZB-H1 11%
    over their simulations. Hence the room on the slow side."""
    broken = [
        f"{schedule} took {measured[schedule] / simulated[schedule]:.2f} of its simulation"
        for schedule in SCHEDULE_NAMES
        if not 0.95 < measured[schedule] / simulated[schedule] < 1.35
    ]
    speedup, predicted = measured["zb-h1"] / measured["1f1b"], simulated["zb-h1"] / simulated["1f1b"]
    if not predicted - 0.05 < speedup < 1 - (1 - predicted) / 2:
        broken.append(f"ZB-H1 took {speedup:.3f} of 1F1B's time, simulated {predicted:.3f}")
    return broken


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_measured_iteration_times_match_the_event_simulation(pool: WorkerPool, profile: ModelProfile) -> None:
    """8 processes share 2 cores, and load from elsewhere only slows a run, more so the schedule with more
    actions running at once (ZB-H1): a layout that breaks a promise is measured again, both schedules, up to
    twice more, and each schedule's fastest is kept (the promises and the runs that set them: :func:`misses`;
    beside the rest of the suite in CI, the fastest of two runs each had ZB-H1 at 0.940 of 1F1B's time on the
    pipelines of 3 and 5 stages, against at most 0.938)."""
    generation = 0
    for name, layout in LAYOUTS.items():
        plans = {schedule: dataclasses.replace(layout, schedule=schedule) for schedule in SCHEDULE_NAMES}
        simulated = {schedule: simulated_s(plan, profile) for schedule, plan in plans.items()}
        measured: dict[str, float] = {}
        for _ in range(3):
            for schedule, plan in plans.items():
                generation += 1
                task = (wl.emulated_steps, (plan, generation, STEPS, TIMES))
                run = max(pool.run(dict.fromkeys(range(len(plan.workers)), task), timeout=120).values())
                measured[schedule] = min(run, measured.get(schedule, run))
            if not (missed := misses(measured, simulated)):
                break
        assert not missed, (name, missed, measured, simulated)


def recovery_case(nodes: int, per_device: int, batch: int) -> Plan:
    """The planner's f = 1 plan of 6 emulated layers (F = I = W = 20 ms, ``per_device`` fit on a device)."""
    layer = LayerProfile(0.02, 0.04, 1000, 100, 100, weight_grad_s=0.02)
    cluster = ClusterSpec(num_nodes=nodes, gpus_per_node=1, device_memory_bytes=per_device * 20_000 / 3)
    return make_plan(
        ModelProfile((layer,) * 6, microbatch_size=1), cluster, fault_tolerance=1, global_batch_size=batch
    )


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_auto_recovery_picks_the_faster_measured_way(pool: WorkerPool) -> None:
    """Two plans, one node lost, the copy negligible (a long horizon): pipelines of 3 stages and 3
    micro-batches, whose bubbles take the rerouted work (rerouting predicted 17% faster than the 5-stage
    pipeline re-instantiation makes), and pipelines of 2 stages and 8 micro-batches, where the one helper
    would run 16 micro-batches on a stage (re-instantiating predicted 26% faster). On emulated devices, the
    way ``auto`` picks is the faster measured in each; so the choice goes both ways."""
    picked = []
    for generation, (plan, expected) in enumerate(
        ((recovery_case(6, 2, 6), "reroute"), (recovery_case(4, 3, 16), "reinstantiate")), start=300
    ):
        failed = [plan.pipelines[0].nodes[0]]
        choice = choose_recovery(plan, failed, "auto", horizon_s=1e6)
        layouts = {"reinstantiate": after_failures(plan, failed).plan, "reroute": reroute(plan, failed)}
        measured = {}
        for k, (policy, layout) in enumerate(layouts.items()):
            task = (wl.emulated_steps, (layout, 2 * generation + k, STEPS))
            measured[policy] = min(
                pool.run(dict.fromkeys(range(len(layout.workers)), task), timeout=120).values()
            )
        assert choice.policy == expected == min(measured, key=measured.__getitem__), (measured, choice)
        picked.append(choice.policy)
    assert picked == ["reroute", "reinstantiate"]
