"""Workers lost before the first step, in the loop users run (that of ``test_realistic_loop``).

A worker SIGKILLs itself at a moment of the start: while its model is built, before it registered with the
coordinator (the launcher's supervisor reports its end); on the worker that makes the plan, while it
profiles the layers for the planner; in ``LightningModule.setup``; in the validation sanity check. The
survivors must start without it, on the plan reconfigured for them, and train to the weights, learning
rates, logged losses and checkpoints of single-process training, every sample fed once; or, when they
cannot train without it, stop within seconds with an error that names it. Never wait out
``plan_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_realistic_loop import LoopFaults, RealisticNet, check_loop, fit_loop
from test_realistic_loop import loop_reference as loop_reference  # the fixture

from lightning_oobleck.lightning.environment import NODE_VAR
from lightning_oobleck.recovery.startup import StartFailure

REGISTER, PLANNING, SETUP, SANITY = "register", "planning", "setup", "sanity"


class StartupNet(RealisticNet):
    """:class:`RealisticNet` whose node ``n`` SIGKILLs itself at ``kill_at[n]`` (a moment of the start)."""

    def __init__(self, out: Path, kill_at: dict[int, str]) -> None:
        super().__init__()
        self.out, self.kill_at = out, kill_at
        self.example_input_array = torch.zeros(1, 4)
        self.layer_builds = 0

    def _kill_if(self, moment: str) -> None:
        node = os.environ.get(NODE_VAR)  # set in the workers only
        if node is not None and self.kill_at.get(int(node)) == moment:
            (self.out / f"fault-{node}.0.json").write_text(f'["{moment}"]')
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_layers(self) -> list[torch.nn.Module]:
        # Built first to count the layers (before registering), then to profile them (the planner only).
        self.layer_builds += 1
        self._kill_if(REGISTER if self.layer_builds == 1 else PLANNING)
        return super().configure_layers()

    def setup(self, stage: str) -> None:
        self._kill_if(SETUP)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.trainer.sanity_checking:
            self._kill_if(SANITY)
        return super().validation_step(*args, **kwargs)


@pytest.mark.timeout(300)
def test_lost_before_registering_and_in_the_sanity_check(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """6 nodes, 3 pipelines of 2 (f = 2): node 5 dies while its model is built, before it registered, so
    generation 0 starts without it at once; node 2 dies in the sanity check, recovered like any unit."""
    started = time.monotonic()
    trainer = fit_loop(
        tmp_path,
        LoopFaults(tmp_path, {}),
        6,
        module=StartupNet(tmp_path, {5: REGISTER, 2: SANITY}),
        trainer_kw={"num_sanity_val_steps": 1},
    )
    check_loop(trainer, tmp_path, loop_reference, dead={2, 5}, num_nodes=6, lost_before_start={5})
    assert time.monotonic() - started < 200


@pytest.mark.timeout(300)
def test_the_planner_lost_while_it_plans_and_a_worker_lost_in_setup(
    tmp_path: Path, loop_reference: dict[str, Any]
) -> None:
    """5 nodes, the automatic plan (f = 1) with activation recomputation on every stage: node 0, which makes
    the plan, dies while it profiles the layers; the lowest survivor makes it instead. Node 3 dies in
    ``LightningModule.setup``; the recovery rebuilds recomputing stages."""
    trainer = fit_loop(
        tmp_path,
        LoopFaults(tmp_path, {}),
        5,
        module=StartupNet(tmp_path, {0: PLANNING, 3: SETUP}),
        fault_tolerance=1,
        activation_checkpointing=True,
    )
    check_loop(trainer, tmp_path, loop_reference, dead={0, 3}, num_nodes=5, lost_before_start={0})


@pytest.mark.timeout(120)
def test_a_start_the_survivors_cannot_train_without_ends_at_once_naming_the_lost_node(tmp_path: Path) -> None:
    """One pipeline of 3 nodes (f = 0): node 1 dies before registering; no pipeline fits on the others."""
    started = time.monotonic()
    with pytest.raises(StartFailure, match=r"node\(s\) \[1\] were lost before training started"):
        fit_loop(
            tmp_path,
            LoopFaults(tmp_path, {}),
            3,
            module=StartupNet(tmp_path, {1: REGISTER}),
            layout=[[0, 2, 4, 6]],
            fault_tolerance=0,
        )
    assert time.monotonic() - started < 60


def test_of_the_survivors_start_failures_the_caller_gets_the_one_that_names_only_the_lost_node(
    tmp_path: Path,
) -> None:
    """Survivors raise :class:`StartFailure` each from its own view: one that agreed again after another had
    already stopped counts it as lost too. The error raised in the caller names only the node really lost,
    whichever survivor ended first (CI saw rank 2's ``[0, 1]`` reach the user)."""
    from lightning_oobleck.lightning.launcher import LaunchReport, _user_exception
    from lightning_oobleck.lightning.results import write_worker_error

    views = {2: (0, 1), 0: (1,)}  # rank 2 ended first; rank 0's view is the earlier one
    for rank, lost in views.items():
        try:
            raise StartFailure(f"node(s) {list(lost)} were lost before training started", lost)
        except StartFailure as e:
            write_worker_error(tmp_path, rank, e)
    report = LaunchReport({0: 1, 2: 1}, (), user_error=2, errors=(2, 0))
    error = _user_exception(tmp_path, report)
    assert isinstance(error, StartFailure)
    assert error.lost == (1,) and "node(s) [1] were lost" in str(error)


def test_read_plan_is_answered_by_the_publication_stops_on_abort_and_times_out_by_name() -> None:
    """Workers that wait for the plan wait on the store (answered when it is published, not by polling);
    a lost worker's abort ends the wait at once, and no plan at all is one error that names the setting."""
    import threading
    from datetime import timedelta

    from dist_harness import plan_from_splits

    from lightning_oobleck.recovery.coordinator import Coordinator
    from lightning_oobleck.recovery.keystore import KeyStoreClient
    from lightning_oobleck.recovery.startup import publish_plan, read_plan

    plan = plan_from_splits([[(0, 2), (2, 4)]], [4], 1)
    server = Coordinator(1, "127.0.0.1", secret="secret").start()  # the job's store, as workers reach it
    try:
        clients = []  # a Python store inside a PrefixStore must stay referenced (torch holds no reference)

        def client(prefix: str) -> dist.Store:
            clients.append(KeyStoreClient(server.address, "secret", timedelta(seconds=30)))
            return dist.PrefixStore(prefix, clients[-1])

        store = client("published")
        started = time.monotonic()  # before the timer starts: it fires 0.3 s after its start
        threading.Timer(0.3, publish_plan, (store, lambda: plan)).start()
        assert read_plan(store, 10.0) == plan
        assert 0.3 <= time.monotonic() - started < 2.0

        abort = threading.Event()
        started = time.monotonic()
        threading.Timer(0.3, abort.set).start()
        assert read_plan(client("aborted"), 10.0, abort) is None
        assert time.monotonic() - started < 2.0
        with pytest.raises(TimeoutError, match=r"plan_timeout_s=0.5 s"):
            read_plan(client("never"), 0.5)
    finally:
        server.stop()
