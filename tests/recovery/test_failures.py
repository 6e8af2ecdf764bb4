"""Real failures in real worker processes running gloo collectives: SIGKILL (rank 0, a whole node, two at
once), SIGSTOP then SIGCONT, and a kill during the agreement barrier. The survivors must agree on one
membership promptly, keep training together, and a fenced worker must never come back."""

from __future__ import annotations

import argparse
import itertools
import signal
import struct
from pathlib import Path

import pytest
from recovery_cluster import Cluster, wait_until

from lightning_oobleck.cli import timeline
from lightning_oobleck.recovery import FENCED_EXIT_CODE, PHASES, Membership, Worker, read_events

W = Worker


def assert_survivors_agree(cluster: Cluster, survivors: list[Worker], generation: int) -> Membership:
    """Every survivor reports the coordinator's newest agreed generation and membership."""
    agreed = cluster.wait_agreed(generation)
    for w in survivors:
        wait_until(
            lambda w=w: any(r["generation"] == agreed.generation for r in cluster.reports(w, "generation")),
            20,
            f"worker {tuple(w)} to join generation {agreed.generation}",
        )
        last = cluster.reports(w, "generation")[-1]
        assert (last["generation"], [tuple(x) for x in last["workers"]]) == (
            agreed.generation,
            list(agreed.workers),
        )
    return agreed


def assert_trained_together(cluster: Cluster, survivors: list[Worker]) -> None:
    """Each step was reduced over the whole generation at one step number, and no step was skipped."""
    for w in survivors:
        steps = cluster.reports(w, "step")
        sizes = {m.generation: m.world_size for m in cluster.coordinator.history}
        for r in steps:
            assert r["world"] == sizes[r["generation"]]
            assert r["step_sum"] == r["step"] * r["world"]
        numbers = [r["step"] for r in steps]
        assert all(0 <= b - a <= 1 for a, b in itertools.pairwise(numbers)), numbers


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_sigkill_of_rank_0_takes_its_node_out_and_survivors_agree_within_a_second(tmp_path: Path) -> None:
    rank0, sibling, survivors = W(0, 0), W(0, 1), [W(1, 0), W(2, 0)]
    with Cluster(tmp_path, [rank0, sibling, *survivors]) as cluster:
        cluster.wait_steps([rank0, sibling, *survivors], 5, generation=0)
        killed_at = cluster.signal(rank0, signal.SIGKILL)

        assert cluster.exit_code(sibling, timeout=5) == FENCED_EXIT_CODE  # node 0 is out as a whole
        agreed = assert_survivors_agree(cluster, survivors, generation=1)
        assert (agreed.generation, agreed.workers, agreed.removed) == (1, tuple(survivors), (rank0, sibling))
        detected = next(d.at for d in cluster.coordinator.deaths if d.worker == rank0)
        aborted = [cluster.reports(w, "abort")[0]["aborted_at"] for w in survivors]
        print(
            f"\nSIGKILL: detected after {detected - killed_at:.3f} s, survivors aborted after "
            f"{max(aborted) - killed_at:.3f} s, agreed after {agreed.agreed_at - killed_at:.3f} s"
        )
        assert detected - killed_at < 0.5
        assert max(aborted) - killed_at < 1.0

        cluster.wait_steps(survivors, 5, generation=1)
        exits = cluster.finish()
        assert [exits[w] for w in survivors] == [0, 0]
        assert_trained_together(cluster, survivors)
        assert cluster.coordinator.wait_done(5) and cluster.coordinator.finished


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_two_nodes_killed_at_once_make_one_recovery_and_the_timeline_shows_it(tmp_path: Path) -> None:
    """Each closed connection is announced at once (no settle window), so the second death may come while
    the first generation is being agreed: the coordinator moves everyone on, the survivors fold both."""
    victims, survivors = [W(1, 0), W(3, 0)], [W(0, 0), W(2, 0)]
    with Cluster(tmp_path, sorted(victims + survivors)) as cluster:
        cluster.wait_steps(survivors + victims, 10, generation=0)
        killed_at = min(cluster.signal(w, signal.SIGKILL) for w in victims)

        wait_until(
            lambda: (a := cluster.coordinator.agreed) is not None and a.workers == tuple(survivors),
            20,
            "agreement on the survivors",
        )
        agreed = assert_survivors_agree(cluster, survivors, generation=1)
        assert agreed.workers == tuple(survivors)
        cluster.wait_steps(survivors, 10, generation=agreed.generation)
        exits = cluster.finish()
        assert [exits[w] for w in survivors] == [0, 0]
        assert_trained_together(cluster, survivors)

    steps, recoveries = read_events(cluster.events_file)
    (event,) = recoveries
    assert event.generation == agreed.generation and event.removed == [list(w) for w in victims]
    times = [getattr(event, f"{phase}_at") for phase in PHASES]
    assert killed_at <= times[0] and times == sorted(times), times
    assert set(event.durations()) == {*PHASES[1:], "total"}
    assert [s["step"] for s in steps] == sorted(s["step"] for s in steps)

    png = tmp_path / "timeline.png"
    parser = argparse.ArgumentParser()
    timeline.register(parser.add_subparsers())
    args = parser.parse_args(["timeline", str(cluster.events_file), "-o", str(png)])
    assert args.func(args) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert struct.unpack(">II", data[16:24]) == (1200, 540)  # 10 x 4.5 inches at 120 dpi


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_sigstop_interrupts_blocked_peers_after_the_heartbeat_timeout_and_the_woken_worker_is_fenced(
    tmp_path: Path,
) -> None:
    heartbeat_timeout = 1.5
    stopped, survivors = W(1, 0), [W(0, 0), W(2, 0)]
    with Cluster(
        tmp_path, [survivors[0], stopped, survivors[1]], heartbeat_timeout=heartbeat_timeout
    ) as cluster:
        cluster.wait_steps([stopped, *survivors], 5, generation=0)
        stopped_at = cluster.signal(stopped, signal.SIGSTOP)

        agreed = assert_survivors_agree(cluster, survivors, generation=1)
        assert agreed.workers == tuple(survivors)
        (death,) = cluster.coordinator.deaths
        assert death.worker == stopped and "sent nothing" in death.reason
        for w in survivors:
            abort = cluster.reports(w, "abort")[0]
            assert abort["pending"], "the survivor was not blocked in the collective"
            interrupted_after = abort["noticed_at"] - stopped_at
            print(
                f"\nSIGSTOP: {tuple(w)} blocked in all_reduce was interrupted after {interrupted_after:.3f} s"
            )
            # dead = silent for the timeout since its last heartbeat, sent up to one interval before the stop
            assert heartbeat_timeout * 3 / 4 - 0.1 <= interrupted_after <= heartbeat_timeout + 1.0

        cluster.signal(stopped, signal.SIGCONT)
        assert cluster.exit_code(stopped, timeout=5) == FENCED_EXIT_CODE
        assert [r["generation"] for r in cluster.reports(stopped, "generation")] == [0]
        cluster.wait_steps(survivors, 5, generation=1)
        exits = cluster.finish()
        assert [exits[w] for w in survivors] == [0, 0]
        assert all(stopped not in m.workers for m in cluster.coordinator.history[1:])
        assert_trained_together(cluster, survivors)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_kill_during_the_agreement_barrier_moves_everyone_to_a_newer_generation(tmp_path: Path) -> None:
    first, during, survivors = W(0, 0), W(1, 0), [W(2, 0), W(3, 0)]
    slow = {tuple(survivors[1]): ["--ready-delay=2.0"]}  # holds the barrier of generation 1 open
    with Cluster(tmp_path, [first, during, *survivors], worker_args=slow) as cluster:
        cluster.wait_steps([first, during, *survivors], 5, generation=0)
        cluster.signal(first, signal.SIGKILL)
        wait_until(lambda: len(cluster.coordinator.history) == 2, 10, "generation 1 to be announced")
        wait_until(lambda: cluster.reports(during, "abort"), 5, "the second victim to enter the barrier")
        cluster.signal(during, signal.SIGKILL)

        agreed = assert_survivors_agree(cluster, survivors, generation=2)
        history = cluster.coordinator.history
        assert [m.generation for m in history] == [0, 1, 2]
        assert history[1].agreed_at is None  # abandoned: never agreed
        # removed: compared with generation 0, the one the survivors ran
        assert (agreed.generation, agreed.workers, agreed.removed) == (2, tuple(survivors), (first, during))
        cluster.wait_steps(survivors, 5, generation=2)
        exits = cluster.finish()
        assert [exits[w] for w in survivors] == [0, 0]
        assert_trained_together(cluster, survivors)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_new_node_joins_the_running_training_and_takes_over_its_step(tmp_path: Path) -> None:
    running, newcomer = [W(0, 0), W(1, 0)], W(5, 0)
    with Cluster(tmp_path, running) as cluster:
        cluster.wait_steps(running, 5, generation=0)
        cluster.spawn(newcomer)

        agreed = assert_survivors_agree(cluster, [*running, newcomer], generation=1)
        assert (agreed.workers, agreed.added, agreed.removed) == ((*running, newcomer), (newcomer,), ())
        cluster.wait_steps([*running, newcomer], 5, generation=1)
        exits = cluster.finish()
        assert list(exits.values()) == [0, 0, 0]
        assert_trained_together(cluster, [*running, newcomer])
        first_step = cluster.reports(newcomer, "step")[0]["step"]
        assert first_step >= 5  # it continued the run, it did not start it over
