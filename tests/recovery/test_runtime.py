"""In-process recovery without Lightning: real worker processes, real SIGKILL/SIGSTOP, float64 GPT.

Each test runs one training of 6 single-device nodes (3 pipelines of 2 stages, f = 2) in which several
faults happen one after another, and checks what matters: every worker ends with all steps done, every
sample of every counted global batch was fed exactly once, and the final weights of every replica equal
single-process training on the same batches to 1e-9.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import ScriptProcess
from execution.exec_workloads import CPU, SEED, global_batch, model, optimizer
from gpt.model import gpt_loss

# runtime_worker also makes tests/execution and examples/ importable
from runtime_worker import MAX_NORM, STOP_KEY, UNRECOVERABLE_EXIT

from lightning_oobleck.execution import build_reference_model
from lightning_oobleck.execution.checkpoint import load_sharded_model
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import make_plan
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.recovery import Coordinator, read_events
from lightning_oobleck.recovery.keystore import KeyStoreClient
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.replica import ReplicaSettings

STORE_SECRET = "the-tests-job"

WORKER = Path(__file__).with_name("runtime_worker.py")
NODES = 6
GLOBAL_BATCH = 12
RUN_TIMEOUT_S = 150
STOP_MARGIN = 4
"""A run with joins ends this many steps after every joiner was admitted or gone: each trains a few steps."""


def six_node_plan() -> Plan:
    """3 pipelines of 2 nodes (layers 0-2 | 3-5) over a 6-layer model, f = 2, templates of 2 and 3 nodes."""
    layers = tuple(LayerProfile(1e-3, 2e-3, 1000, 100, 100) for _ in range(6))
    cluster = ClusterSpec(num_nodes=NODES, device_memory_bytes=20_000)
    return make_plan(
        ModelProfile(layers, microbatch_size=2), cluster, fault_tolerance=2, global_batch_size=12
    )


def reference_weights(steps: int) -> dict[str, torch.Tensor]:
    """Single-process training with the workers' update (clip to MAX_NORM, AdamW)."""
    reference = build_reference_model(model, CPU, SEED, torch.float64)
    opt = optimizer(reference.parameters())
    for step in range(steps):
        inputs, targets = global_batch(step, GLOBAL_BATCH)
        gpt_loss(reference(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in reference.named_parameters()}


@dataclasses.dataclass(frozen=True)
class Join:
    """A node that joins the running training: its process starts once any worker applied ``after_step``
    (``after_step=None``: at once, before the training starts it waits pending)."""

    label: str
    after_step: int | None
    faults: tuple[str, ...] = ()
    kill_when_pending: int | None = None
    """A member node the test SIGKILLs as soon as this joiner registered (a failure while it waits)."""
    after_exit: str | None = None
    """Start only once the joiner of this label has exited too (joins one after the other, however long a
    process takes to start on a loaded machine)."""
    after_admitted: tuple[str, ...] = ()
    """Start only once the joiners of these labels were admitted."""
    never_admitted: bool = False
    """It is expected to wait, pending, until the training ends: the run may end once it registered."""


def run_training(
    tmp_path: Path,
    steps: int,
    faults: dict[int, list[str]],
    plan: Plan | None = None,
    kill_together: set[int] = frozenset(),
    joins: tuple[Join, ...] = (),
    policy: str = "at_once",
    step_sleep: float = 0.0,
) -> dict[str, Any]:
    """Run the 6-node training with ``faults[node]``; return each node's records, exit codes and weights
    (keyed by node, and by label for the ``joins``), and the steps trained: ``steps``, or with ``joins``
    :data:`STOP_MARGIN` more than had been applied once every joiner was admitted or gone (``steps`` then
    only bounds the run).

    ``kill_together``: nodes the test SIGKILLs within a millisecond once every node applied step 0.
    """
    plan_file = tmp_path / "plan.json"
    plan_file.write_text((plan or six_node_plan()).to_json())
    coordinator = Coordinator(
        NODES,
        "127.0.0.1",
        settings=MembershipSettings(
            heartbeat_timeout=3.0, settle_s=0.2, agreement_timeout=30.0, kill_fenced=True
        ),
        secret=STORE_SECRET,
        replica_settings=ReplicaSettings(standby=False),
    ).start()
    store = KeyStoreClient(coordinator.address, STORE_SECRET, timedelta(seconds=30))
    procs: dict[int | str, ScriptProcess] = {}

    def start(label: int | str, position: list[str], worker_faults: Any) -> None:
        command = [
            f"--coordinator={coordinator.address}",
            f"--store={coordinator.address}",
            f"--store-secret={STORE_SECRET}",
            *position,
            f"--plan={plan_file}",
            f"--steps={steps}",
            f"--out={tmp_path / f'node{label}.jsonl'}",
            f"--events={tmp_path / 'run.jsonl'}",
            f"--checkpoint-dir={tmp_path / 'checkpoints'}",
            f"--join-policy={policy}",
            f"--step-sleep={step_sleep}",
            *(f"--fault={f}" for f in worker_faults),
        ]
        procs[label] = ScriptProcess(WORKER, command, tmp_path / f"node{label}.log")

    def applied(step: int, labels: Any = None) -> bool:
        """Whether any of ``labels`` (every worker by default) applied step ``step`` or a later one."""
        paths = (
            [tmp_path / f"node{label}.jsonl" for label in labels] if labels else tmp_path.glob("node*.jsonl")
        )
        return any(
            r["kind"] == "applied" and r["step"] >= step
            for path in paths
            if path.exists()
            for r in map(json.loads, path.read_text().splitlines())
        )

    def ready(join: Join) -> bool:
        """Whether ``join``'s process may start now."""
        exited = join.after_exit is None or (
            join.after_exit in procs and procs[join.after_exit].poll() is not None
        )
        admitted = all('"admitted"' in _text(tmp_path / f"node{x}.jsonl") for x in join.after_admitted)
        return (join.after_step is None or applied(join.after_step)) and exited and admitted

    def settled(join: Join) -> bool:
        """Whether ``join`` is over: admitted, gone, or (``never_admitted``) registered."""
        text = _text(tmp_path / f"node{join.label}.jsonl")
        return join.label in procs and (
            procs[join.label].poll() is not None
            or '"admitted"' in text
            or (join.never_admitted and '"registered"' in text)
        )

    def last_applied() -> int:
        return max(
            (
                r["step"]
                for path in tmp_path.glob("node*.jsonl")
                for r in map(json.loads, path.read_text().splitlines())
                if r["kind"] == "applied"
            ),
            default=-1,
        )

    try:
        for node in range(NODES):
            start(node, [f"--node={node}"], faults.get(node, []))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        waiting = list(joins)
        kill_when = {j.label: j.kill_when_pending for j in joins if j.kill_when_pending is not None}
        while waiting or kill_together or kill_when:
            assert time.monotonic() < deadline, "the training did not reach the joins and kills"
            for join in [j for j in waiting if ready(j)]:
                start(join.label, [f"--node-key={join.label}"], join.faults)
                waiting.remove(join)
            for label in [x for x in kill_when if '"registered"' in _text(tmp_path / f"node{x}.jsonl")]:
                procs[kill_when.pop(label)].send_signal(signal.SIGKILL)
            if kill_together and all(applied(0, [node]) for node in range(NODES)):
                for node in kill_together:
                    procs[node].send_signal(signal.SIGKILL)
                kill_together = frozenset()
            time.sleep(0.01)
        while joins and not all(settled(j) for j in joins):
            assert time.monotonic() < deadline, "the joins did not end"
            time.sleep(0.01)
        trained = steps
        if joins:
            trained = min(steps, last_applied() + 1 + STOP_MARGIN)
            store.set(STOP_KEY, str(trained))
        codes = {}
        for label, proc in list(procs.items()):
            codes[label] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        for label in procs:
            print(f"--- node {label} ---\n{(tmp_path / f'node{label}.log').read_text()[-3000:]}")
        raise
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        coordinator.stop()

    records = {
        label: [json.loads(line) for line in (tmp_path / f"node{label}.jsonl").read_text().splitlines()]
        if (tmp_path / f"node{label}.jsonl").exists()
        else []
        for label in procs
    }
    weights = {
        label: torch.load(tmp_path / f"node{label}.jsonl.pt")
        for label in procs
        if (tmp_path / f"node{label}.jsonl.pt").exists()
    }
    return {
        "codes": codes,
        "records": records,
        "weights": weights,
        "history": coordinator.history,
        "steps": trained,
    }


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def check_run(
    result: dict[str, Any], steps: int, dead: set[int | str], idle: set[int | str] = frozenset()
) -> None:
    """Every worker but the ``dead`` ended with all steps and the reference weights (``idle``: joiners never
    admitted, which end with status 0 and train nothing), every sample of every step fed once."""
    survivors = set(result["codes"]) - dead - idle
    for node, code in result["codes"].items():
        if node in idle:
            assert code == 0 and not [r for r in result["records"][node] if r["kind"] == "applied"]
        elif node in dead:
            assert code != 0, f"node {node} should have died"
        else:
            assert code == 0, f"survivor node {node} exited with {code}"
            done = [r for r in result["records"][node] if r["kind"] == "done"]
            assert done and done[0]["step"] == steps
    # every sample of every counted global batch fed exactly once
    for step in range(steps):
        fed = [
            i
            for records in result["records"].values()
            for r in records
            if r["kind"] == "applied" and r["step"] == step
            for i in r.get("samples", [])
        ]
        assert sorted(fed) == list(range(GLOBAL_BATCH)), f"step {step} fed samples {sorted(fed)}"
    # every surviving replica equals single-process training
    reference = reference_weights(steps)
    assert set(result["weights"]) == survivors
    held = set()
    for node, weights in result["weights"].items():
        for name, value in weights.items():
            held.add(name)
            torch.testing.assert_close(
                value, reference[name], rtol=0, atol=1e-9, msg=f"{name} on node {node}"
            )
    assert held == set(reference)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_rank0_then_committed_step_then_kill_during_recovery(tmp_path: Path) -> None:
    """Node 0 (global rank 0, a first stage) dies mid-1F1B at step 1: step 1 is redone on 5 nodes. At
    step 3 a last stage dies after its commit while a survivor has not seen the commit: the survivor
    catches up, nothing is redone. During that recovery another worker dies after the state copy:
    the survivors agree again and recover on 3 nodes."""
    steps = 6
    result = run_training(
        tmp_path,
        steps,
        {0: ["kill-forward:1"], 5: ["kill-commit:3"], 4: ["lag-commit:3"], 2: ["kill-copy:4"]},
    )
    check_run(result, steps, dead={0, 2, 5})
    assert any(r["kind"] == "lagged" for r in result["records"][4])
    generations = [m.generation for m in result["history"]]
    assert generations[-1] == 3
    _, recoveries = read_events(tmp_path / "run.jsonl")
    assert [e.generation for e in recoveries] == [1, 3]
    assert all(e.resumed_at is not None for e in recoveries)
    # node 0's pipeline is rebuilt from the others: its event says what the copy moved and how fast (the
    # second recovery's layout needs no layer anyone lacks: nothing copied, no speed)
    first = recoveries[0]
    assert first.copied_bytes > 0 and first.copy_senders > 0 and first.copy_gb_per_s() > 0
    assert all((e.copied_bytes > 0) == (e.copy_gb_per_s() is not None) for e in recoveries)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_two_nodes_at_once_then_sigstop(tmp_path: Path) -> None:
    """f = 2 at the same moment: a last stage (node 1) and a first stage (node 2) of two different
    pipelines die mid-1F1B at step 1; later a first stage (node 4) hangs (SIGSTOP) at step 3: it is
    declared dead after the heartbeat timeout, fenced (killed) and the survivors go on."""
    steps = 5
    result = run_training(
        tmp_path, steps, {1: ["kill-forward:1"], 2: ["kill-forward:1"], 4: ["stop-forward:3"]}
    )
    check_run(result, steps, dead={1, 2, 4})
    # The two deaths of step 1 fold into one generation when the coordinator sees both within its settle
    # window; on a loaded machine they may land in two. Either way each node is removed exactly once, by
    # a recovery that resumed, and the hang of step 3 comes last.
    _, recoveries = read_events(tmp_path / "run.jsonl")
    removed = [sorted(w[0] for w in e.removed) for e in recoveries]
    assert sorted(n for nodes in removed[:-1] for n in nodes) == [1, 2] and removed[-1] == [4]
    assert all(e.resumed_at is not None for e in recoveries)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_every_replica_lost_ends_with_clear_error(tmp_path: Path) -> None:
    """Three first stages die at once: layers 0-2 have no replica left. The survivors must not hang:
    they stop with an error that says how to resume."""
    result = run_training(tmp_path, 3, {0: ["kill-forward:1"], 2: ["kill-forward:1"], 4: ["kill-forward:1"]})
    for node in (1, 3, 5):
        assert result["codes"][node] == UNRECOVERABLE_EXIT
        (error,) = [r["error"] for r in result["records"][node] if r["kind"] == "unrecoverable"]
        assert "every replica of layer 0" in error and "ckpt_path" in error


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.slow
def test_no_pipeline_fits_writes_checkpoint_from_survivors(tmp_path: Path) -> None:
    """With n0 raised to 3, four nodes dying at once leave 2 nodes that still hold every layer (node 0:
    layers 0-2, node 3: layers 3-5) but cannot form a pipeline: they write a checkpoint of the last
    applied step and stop with an error naming it; the checkpoint holds the reference weights."""
    plan = dataclasses.replace(six_node_plan(), n0=3)
    result = run_training(tmp_path, 1000, {}, plan, kill_together={1, 2, 4, 5})
    (step,) = {r["step"] for node in (0, 3) for r in result["records"][node] if r["kind"] == "unrecoverable"}
    for node in (0, 3):
        assert result["codes"][node] == UNRECOVERABLE_EXIT
        (error,) = [r["error"] for r in result["records"][node] if r["kind"] == "unrecoverable"]
        assert "no pipeline fits" in error and "ckpt_path=" in error
    path = tmp_path / "checkpoints" / f"survivors-step{step}"
    full = build_reference_model(model, CPU, SEED + 1, torch.float64)
    load_sharded_model(path, full)
    for name, value in reference_weights(step).items():
        torch.testing.assert_close(full.state_dict()[name], value, rtol=0, atol=1e-9, msg=name)
