"""Schedules as action lists: the generators, the validator and the event simulation (pure, no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_oobleck.planning.schedules import (
    SCHEDULE_NAMES,
    SCHEDULES,
    Action,
    Op,
    Payload,
    PipelineSpec,
    ScheduleError,
    in_flight_limit,
    iteration_time_s,
    merge,
    one_f_one_b_order,
    pending_weight_limit,
    pipeline_actions,
    pipeline_times_s,
    simulate,
    validate,
)
from lightning_oobleck.worker import Worker


def spec(stages: int, microbatches: int, first_microbatch: int = 0) -> PipelineSpec:
    return PipelineSpec(
        tuple((s, 0) for s in range(stages)),
        tuple((2 * s, 2 * s + 1) for s in range(stages)),
        tuple(range(first_microbatch, first_microbatch + microbatches)),
    )


def limits(name: str, stages: int, microbatches: int) -> dict:
    return {(s, 0): in_flight_limit(name, stages, s, microbatches) for s in range(stages)}


def unit_times(worker: tuple[int, int], action: Action) -> float:
    """F = I = W = 1, B = 2."""
    return 2.0 if action.op is Op.B else 1.0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 24), st.integers(0, 50), st.sampled_from(SCHEDULE_NAMES))
def test_every_generated_list_is_valid_and_runs_each_microbatch_once(
    stages: int, microbatches: int, first: int, name: str
) -> None:
    schedule = pipeline_actions(spec(stages, microbatches, first), name)
    validate(schedule, limits(name, stages, microbatches), dict.fromkeys(schedule, 1))
    ids = list(range(first, first + microbatches))
    for actions in schedule.values():
        compute = [(a.op, a.microbatch) for a in actions if a.op in (Op.F, Op.I, Op.W, Op.B)]
        ops = (Op.F, Op.B) if name == "1f1b" else (Op.F, Op.I, Op.W)
        assert sorted(compute) == sorted((op, mb) for op in ops for mb in ids)
        assert actions[-1].op is Op.REDUCE
    evaluation = pipeline_actions(spec(stages, microbatches, first), name, train=False)
    validate(evaluation)
    assert all(a.op is not Op.REDUCE for actions in evaluation.values() for a in actions)


def simulated_pipeline(
    name: str, phases: list[tuple[float, float, float]], delays: list[float], m: int
) -> float:
    """The event simulation of the pipeline's action lists, as the validator and the benchmarks run it."""

    def duration(worker: tuple[int, int], action: Action) -> float:
        f, i, w = phases[worker[0]]
        return {Op.F: f, Op.I: i, Op.W: w, Op.B: i + w}[action.op]

    def transfer(sender: tuple[int, int], receiver: tuple[int, int], action: Action) -> float:
        return delays[min(sender[0], receiver[0])]

    return iteration_time_s(simulate(pipeline_actions(spec(len(phases), m), name), duration, transfer))


pipeline_shapes = st.tuples(
    st.lists(st.tuples(*[st.floats(0.0, 2.0)] * 3), min_size=1, max_size=9),
    st.lists(st.floats(0.0, 0.5), min_size=9, max_size=9),
    st.integers(1, 24),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(pipeline_shapes, min_size=1, max_size=4), st.sampled_from(SCHEDULE_NAMES))
def test_simulating_pipelines_together_gives_the_event_simulation_to_the_last_bit(
    pipelines: list, name: str
) -> None:
    """The planner's simulation of many pipelines at once (every stage of every pipeline advancing together)
    equals simulating each one's action lists alone, exactly: same events, same arithmetic."""
    shaped = [(phases, delays[: len(phases)], m) for phases, delays, m in pipelines]
    expected = [simulated_pipeline(name, *p) for p in shaped]
    assert pipeline_times_s(name, shaped).tolist() == expected


def test_1f1b_keeps_the_engine_order() -> None:
    """Stage 1 of 4 with 6 micro-batches: 2 warm-up forwards, then F/B pairs, then 2 backwards."""
    order = [f"{op.value}{i}" for op, i in one_f_one_b_order(4, 1, 6)]
    assert order == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]


@pytest.mark.parametrize(("stages", "microbatches", "one_f_one_b", "zb_h1"), [(8, 8, 45, 31), (4, 4, 21, 15)])
def test_the_papers_iteration_times(stages: int, microbatches: int, one_f_one_b: float, zb_h1: float) -> None:
    """Qi et al.: with F = I = W = 1, 1F1B takes (m + S - 1) * 3, ZB-H1 3m + S - 1."""
    times = {
        name: iteration_time_s(simulate(pipeline_actions(spec(stages, microbatches), name), unit_times))
        for name in SCHEDULE_NAMES
    }
    assert times == {"1f1b": one_f_one_b, "zb-h1": zb_h1}


def test_zb_h1_defers_stage_s_weight_gradients_to_the_end() -> None:
    for s in range(4):
        actions = pipeline_actions(spec(4, 6), "zb-h1")[(s, 0)]
        compute = [a.op for a in actions if a.op in (Op.F, Op.I, Op.W)]
        tail = len(compute) - max(k for k, op in enumerate(compute) if op is Op.I) - 1
        assert tail == s + 1  # the W that follows the last I, and the s deferred ones
        assert in_flight_limit("zb-h1", 4, s, 6) == 4


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_memory_limits_are_what_each_stage_holds_at_once_at_most(name: str) -> None:
    # the cost model charges both limits at once: one moment of the order reaches both
    for stages in range(1, 8):
        for microbatches in range(1, 18):
            for s in range(stages):
                forwarded, pending, held = set(), set(), []
                for op, i in SCHEDULES[name](stages, s, microbatches):
                    forwarded |= {i} if op is Op.F else set()
                    pending |= {i} if op is Op.I else set()
                    held.append((len(forwarded), len(pending)))
                    if op in (Op.B, Op.W):
                        forwarded.discard(i)
                        pending.discard(i)
                limits = (
                    in_flight_limit(name, stages, s, microbatches),
                    pending_weight_limit(name, stages, s, microbatches),
                )
                assert max(held) == limits, (stages, microbatches, s)
                assert max(f for f, _ in held) == limits[0] and max(p for _, p in held) == limits[1]


def broken(schedule: dict, worker: tuple[int, int], edit) -> dict:
    out = {w: list(actions) for w, actions in schedule.items()}
    out[worker] = edit(out[worker])
    return out


def test_the_validator_names_a_missing_receive() -> None:
    schedule = pipeline_actions(spec(3, 4), "1f1b")
    lost = Action(Op.RECV, 2, peer=(0, 0), payload=Payload.ACTIVATION)
    bad = broken(schedule, (1, 0), lambda acts: [a for a in acts if a != lost])
    with pytest.raises(
        ScheduleError, match=r"worker \(0, 0\): SEND\(activation of micro-batch 2 to \(1, 0\)\)"
    ):
        validate(bad)


def test_the_validator_names_crossed_transfer_order() -> None:
    """Stage 0 sends micro-batch 3's activation after taking micro-batch 1's gradient: every transfer has its
    match, but stage 1 posts them the other way round (a deadlock under NCCL)."""
    schedule = pipeline_actions(spec(3, 4), "1f1b")
    send = Action(Op.SEND, 3, peer=(1, 0), payload=Payload.ACTIVATION)
    take = Action(Op.RECV, 1, peer=(1, 0), payload=Payload.GRADIENT)

    def late_send(acts: list[Action]) -> list[Action]:
        acts.remove(send)
        acts.insert(acts.index(take) + 1, send)
        return acts

    with pytest.raises(
        ScheduleError,
        match=r"worker \(0, 0\): RECV\(gradient of micro-batch 1 from \(1, 0\)\) is its "
        r"transfer number 4 .* must post their transfers in the same order",
    ):
        validate(broken(schedule, (0, 0), late_send))


def test_the_validator_names_a_bucket_reduced_twice_or_too_early() -> None:
    schedule = pipeline_actions(spec(2, 3), "zb-h1", {(1, 0): [(3,), (2,)]})
    reduce_twice = broken(schedule, (1, 0), lambda acts: [*acts, acts[-1]])
    with pytest.raises(
        ScheduleError, match=r"worker \(1, 0\), action \d+ REDUCE\(bucket 1, layers \[2\]\): bucket 1"
    ):
        validate(reduce_twice)

    def early(acts: list[Action]) -> list[Action]:
        reduce = acts.pop()
        return [*acts[:-2], reduce, *acts[-2:]]

    with pytest.raises(ScheduleError, match=r"REDUCE\(bucket 1.*comes before action .* W\(micro-batch 2\)"):
        validate(broken(schedule, (1, 0), early))
    missing = broken(schedule, (1, 0), lambda acts: acts[:-1])
    with pytest.raises(ScheduleError, match=r"gradient bucket\(s\) \[1\] are never reduced"):
        validate(missing, buckets={(1, 0): 2})


def test_the_validator_names_an_activation_bound_overrun_and_a_w_before_its_i() -> None:
    schedule = pipeline_actions(spec(3, 6), "zb-h1")
    with pytest.raises(
        ScheduleError,
        match=r"worker \(1, 0\), action \d+ F\(micro-batch 2\): 3 micro-batches in flight, above the plan's "
        r"bound of 2",
    ):
        validate(schedule, limits("1f1b", 3, 6))

    def w_first(acts: list[Action]) -> list[Action]:
        w = acts.index(Action(Op.W, 0, (4, 5)))
        i = acts.index(Action(Op.I, 0, (4, 5)))
        acts[w], acts[i] = acts[i], acts[w]
        return acts

    with pytest.raises(ScheduleError, match=r"W\(micro-batch 0\): runs before the micro-batch's I"):
        validate(broken(schedule, (2, 0), w_first))


def test_a_deadlock_is_named_by_the_blocked_actions() -> None:
    """Both stages receive before they send: each waits for the other."""
    a, b = (0, 0), (1, 0)
    schedule = {
        a: [
            Action(Op.RECV, 0, peer=b, payload=Payload.GRADIENT),
            Action(Op.SEND, 1, peer=b, payload=Payload.GRADIENT),
        ],
        b: [
            Action(Op.RECV, 1, peer=a, payload=Payload.GRADIENT),
            Action(Op.SEND, 0, peer=a, payload=Payload.GRADIENT),
        ],
    }
    with pytest.raises(ScheduleError, match=r"deadlock: worker \(0, 0\) at action 0 RECV"):
        simulate(schedule)


def test_a_merge_holds_back_a_parts_forwards_until_the_worker_has_room() -> None:
    """Worker (0, 0) runs its own 2-stage pipeline and another part's micro-batch (10 bytes held per
    forward until its backward). In the bubble while it waits for its first gradient, the other part's
    forward would bring it to 30 bytes; with room for 20, which its own 2 micro-batches in flight take, that
    forward waits for its own first backward (after which its own work adds nothing more), and the merged
    lists still pass the validator."""
    w, v = Worker(0, 0), Worker(1, 0)
    own = pipeline_actions(PipelineSpec((w, v), ((0,), (1,)), (0, 1)), "1f1b", None, True, 0)
    other = pipeline_actions(PipelineSpec((w,), ((0, 1),), (2,)), "1f1b", None, True, 1)

    def change(worker: Worker, action: Action) -> float:
        return {Op.F: 10.0, Op.B: -10.0}[action.op]

    def most_held(schedule: dict) -> float:
        held = peak = 0.0
        for a in schedule[w]:
            if a.op in (Op.F, Op.B):
                held += change(w, a)
                peak = max(peak, held)
        return peak

    free, _ = merge([own, other], unit_times)
    limited, _ = merge([own, other], unit_times, None, change, {(1, w): 20.0})
    assert most_held(free) == 30.0 and most_held(limited) == 20.0
    computed = [(a.op, a.microbatch) for a in limited[w] if a.op in (Op.F, Op.B)]
    assert computed.index((Op.F, 2)) == computed.index((Op.B, 0)) + 1
    validate(limited, {w: 3, v: 1}, {w: 0, v: 0})
