"""The job's coordinator is lost and its standby takes over, through ``Trainer.fit(strategy="oobleck")``.

The coordinator (the failure detector, the membership authority and the rendezvous store) runs in a process
of its own; a worker of another node starts its standby. Here a worker SIGKILLs or SIGSTOPs the active
coordinator at a chosen moment (a fault point that targets it: ``Fault(..., target="coordinator")``):
mid-step, in the middle of a recovery from a worker node's loss, together with a worker node, and silently
(a stopped coordinator: the standby takes over on the votes of the workers). Each run must end normally with
every step, every sample of every counted global batch fed once, and the weights of single-process training
(float64, 1e-9); the run's events record the failover, and the recoveries remove exactly the workers killed.

=============================  =================================  ===============================
who                            when                               test
=============================  =================================  ===============================
the coordinator (SIGKILL)      backward                           ..._mid_step_...
the coordinator (SIGKILL)      a node's recovery, before its copy ..._during_a_recovery
coordinator + a worker node    forward, the same step             ..._together_with_a_worker_node
the coordinator (SIGSTOP),     forward: silent, not closed, then  ..._stopped_coordinator_...
then a worker node             backward
=============================  =================================  ===============================
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from test_fault_matrix import BACKWARD, FORWARD, STATE_COPY, Fault, check, fit_with_faults
from test_fault_matrix import reference as reference

from lightning_oobleck.lightning.units import EVENTS_FILE

COORDINATOR = "coordinator"


def failovers(out: Path) -> list[dict]:
    """The failovers the run's rank 0 recorded."""
    lines = (out / EVENTS_FILE).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "failover"]


def coordinator_killed_by(out: Path) -> set[str]:
    """The workers whose fault hit the coordinator."""
    return {p.stem.split("-", 1)[1] for p in out.glob("coordinator-*.json")}


@pytest.mark.timeout(300)
def test_the_coordinator_killed_mid_step_is_replaced_and_the_step_goes_on(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """No worker was lost: the workers reconnect to the standby, which takes over; no generation changes,
    nothing is redone, and a new standby is started."""
    trainer = fit_with_faults(tmp_path, {(1, 1): Fault(signal.SIGKILL, BACKWARD, target=COORDINATOR)})
    check(trainer, tmp_path, reference, dead=set())
    assert coordinator_killed_by(tmp_path) == {"1.0"}
    [failover] = failovers(tmp_path)
    assert failover["epoch"] == 1 and failover["lost"] != failover["standby"]
    assert failover["took_over_at"] - failover["lost_at"] < 5.0


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_coordinator_killed_during_a_recovery(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Node 2 dies in step 1's backward; once the survivors built the next generation's groups, before the
    state copy into them, node 0 kills the coordinator (node 1 runs its standby): the recovery goes on with
    the standby, and the run ends with the weights of one device."""
    faults = {
        (2, 1): Fault(signal.SIGKILL, BACKWARD),
        (0, 1): Fault(signal.SIGKILL, STATE_COPY, target=COORDINATOR),
    }
    trainer = fit_with_faults(tmp_path, faults)
    check(trainer, tmp_path, reference, dead={2})
    assert coordinator_killed_by(tmp_path) == {"0.0"} and len(failovers(tmp_path)) == 1


@pytest.mark.timeout(300)
def test_the_coordinator_killed_together_with_a_worker_node(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """In step 2 node 4 kills the coordinator, then itself: the standby takes over, node 4 never reconnects
    and is declared dead, and the survivors recover without it."""
    faults = {
        (4, 2): [Fault(signal.SIGKILL, FORWARD, target=COORDINATOR), Fault(signal.SIGKILL, BACKWARD)],
    }
    trainer = fit_with_faults(tmp_path, faults)
    check(trainer, tmp_path, reference, dead={4})
    assert coordinator_killed_by(tmp_path) == {"4.0"} and len(failovers(tmp_path)) == 1


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_stopped_coordinator_is_replaced_on_the_workers_votes_and_runs_the_next_recovery(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """A stopped coordinator's connections stay open: in step 1 node 2 stops it, then node 3 dies. Nobody
    can agree on anything until the standby, which saw the coordinator fall silent, takes over on the votes
    of more than half of the workers (they saw it silent too); it then declares node 3 dead (it never
    reconnects), and the survivors recover without it."""
    faults = {
        (2, 1): Fault(signal.SIGSTOP, FORWARD, target=COORDINATOR),
        (3, 1): Fault(signal.SIGKILL, BACKWARD),
    }
    trainer = fit_with_faults(tmp_path, faults)
    check(trainer, tmp_path, reference, dead={3})
    [failover] = failovers(tmp_path)
    assert "sent nothing" in failover["reason"]
