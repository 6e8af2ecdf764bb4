"""The fault matrix through ``Trainer.fit(strategy="oobleck")``: real SIGKILL / SIGSTOP of workers.

Each run trains float64 ``TinyNet`` (AdamW with a per-step LR schedule, gradient clipping active,
shuffled data crossing an epoch) on 6 or 7 processes with f = 2, and loses several nodes one after
another, at a chosen moment of a chosen step: in a layer's forward, in a layer's backward, right after
the stage issued its first gradient all-reduce, after the step's commit (before the optimizer update),
or while the survivors recover from an earlier failure. It must end normally with
``global_step == max_steps``, every sample of every counted global batch fed exactly once, weights equal
to single-process Lightning training on the same global batches (1e-9), and recovery events that
remove exactly the killed nodes.

=================  ===========================================  ============================
who                when                                         test
=================  ===========================================  ============================
rank 0 (first)     forward (SIGKILL)                            rank0_then_a_hung_first_stage
last stage         optimizer step, after the commit (SIGKILL)   rank0_then_a_hung_first_stage
first stage        forward (SIGSTOP: hang)                      rank0_then_a_hung_first_stage
last + first       forward, f = 2 at once (SIGKILL)             two_nodes_at_once
middle stage       backward (SIGKILL)                           middle_stage_...
first stage        mid-copy in the recovery from it (SIGKILL)   middle_stage_...
first stage        gradient sync (SIGKILL)                      middle_stage_...
whole node of 2    gradient sync (SIGKILL of one process)       whole_nodes_...
whole node of 2    backward (SIGSTOP of one process)            whole_nodes_...
rank 0, split      forward, t = 2 (SIGKILL of one process)      a_stage_split_...
2 split stages     forward, t = 2, f = 2 at once (SIGKILL)      two_nodes_of_split_...
split stage        forward, t = 2, then a replacement joins     replacement_node_of_split_...
=================  ===========================================  ============================
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parents[1] / "lightning"))
from pipeline_testing import TinyNet, dataset

from lightning_oobleck.lightning import GlobalBatchSampler, OobleckStrategy
from lightning_oobleck.lightning.units import EVENTS_FILE
from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.planning.planner import make_plan
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile
from lightning_oobleck.recovery import read_events
from lightning_oobleck.recovery.agent import known_coordinators
from lightning_oobleck.testing import Fault as PointFault
from lightning_oobleck.testing import FaultAction, FaultPoint, FaultTarget, arm

SEED, STEPS, CLIP, GLOBAL_BATCH, MICRO, SAMPLES = 3, 5, 0.05, 12, 2, 36

FORWARD, BACKWARD, GRAD_SYNC, OPTIMIZER, MID_COPY, STATE_COPY = (
    "forward",
    "backward",
    "grad_sync",
    "optimizer",
    "mid_copy",
    "state_copy",
)
INPUT_GRAD, WEIGHT_GRAD, REDUCE = "input_grad", "weight_grad", "reduce"
"""The moments of a split backward (``schedule="zb-h1"``): in the step's second ``I``, in its second ``W``,
in its first ``REDUCE`` action."""


class Fault(NamedTuple):
    """A signal a worker sends itself (or the job's coordinator: ``target``) at a moment (``when``) of a
    step; ``device`` picks the process of the node."""

    signal: int
    when: str
    device: int = 0
    target: str = "worker"


class Faults(L.Callback):
    """On node ``n`` at step ``s`` (``faults[(n, s)] = Fault(...)``), signal this very process at the
    fault's moment, through the package's fault points (:mod:`lightning_oobleck.testing`): the step's
    second forward (``FORWARD``), its first backward (``BACKWARD``), right after issuing its first gradient
    bucket's all-reduce (``GRAD_SYNC``), after its commit, before the optimizer update (``OPTIMIZER``), once
    the first chunks of the state copy of a recovery during that step are in flight (``MID_COPY``), or,
    under a split backward, at the step's second :data:`INPUT_GRAD` or :data:`WEIGHT_GRAD`, or its first
    :data:`REDUCE`; records, per counted step, the samples the pipeline's first stage fed."""

    POINTS: ClassVar = {
        FORWARD: (FaultPoint.FORWARD, 2),
        BACKWARD: (FaultPoint.BACKWARD, 1),
        GRAD_SYNC: (FaultPoint.REDUCE, 1),
        OPTIMIZER: (FaultPoint.COMMIT, 1),
        MID_COPY: (FaultPoint.COPY_CHUNK, 1),
        STATE_COPY: (FaultPoint.STATE_COPY, 1),
        INPUT_GRAD: (FaultPoint.INPUT_GRAD, 2),
        WEIGHT_GRAD: (FaultPoint.WEIGHT_GRAD, 2),
        REDUCE: (FaultPoint.REDUCE, 1),
    }

    def __init__(self, out: Path, faults: dict[tuple[int, int], Fault | list[Fault]]) -> None:
        self.out, self.faults = out, faults
        self.fed: list[tuple[int, torch.Tensor]] = []

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        self.worker = trainer.strategy.worker
        self.name = f"{self.worker[0]}.{self.worker[1]}"
        self.engine = lambda: trainer.strategy.engine
        for (node, step), faults in self.faults.items():
            for fault in faults if isinstance(faults, list) else [faults]:
                if (node, fault.device) == tuple(self.worker) and fault.when in self.POINTS:
                    point, occurrence = self.POINTS[fault.when]
                    action = FaultAction.STALL if fault.signal == signal.SIGSTOP else FaultAction.KILL
                    armed = PointFault(point, action, step=step, occurrence=occurrence, target=fault.target)
                    arm(armed, report=self._record)

    def _record(self, fault: PointFault) -> None:
        """``fault-N.D.json`` for a worker that killed or stopped itself, ``coordinator-N.D.json`` for one
        that did so to the coordinator. After a step's commit, the step counts: its samples are recorded."""
        kind = "fault" if fault.target is FaultTarget.WORKER else "coordinator"
        (self.out / f"{kind}-{self.name}.json").write_text(json.dumps(fault.to_json()))
        if fault.point is FaultPoint.COMMIT:
            self._write_fed(fault.step)

    def _write_fed(self, step: int | None) -> None:
        counted = self.engine().groups.generation  # an attempt interrupted by a recovery does not count
        rows = [r for g, rows in self.fed if g == counted for r in rows.tolist()]
        with open(self.out / f"fed-{self.name}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "rows": rows}) + "\n")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.fed.clear()
        step = trainer.global_step
        if any(f.target == "coordinator" for n, s in self.faults if s == step for f in self._at(n, s)):
            # the coordinator's loss is survived once a standby follows it (started within about a second)
            deadline = time.monotonic() + 30
            while len(known_coordinators()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)

    def _at(self, node: int, step: int) -> list[Fault]:
        faults = self.faults[(node, step)]
        return faults if isinstance(faults, list) else [faults]

    def _on_forward(self, layer: torch.nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation recomputation: the forward run again inside a backward
        engine = self.engine()
        # a stage split over its node's devices feeds each sample on every one: counted on the first
        if engine.is_first_stage and engine.groups.tensor_rank == 0 and layer is engine.module.layer(0):
            self.fed.append((engine.groups.generation, args[0].detach().clone()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._write_fed(trainer.global_step - 1)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # a stage split over its node's devices: each parameter gathered whole (a collective of the stage)
        weights = {
            k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()
        }
        torch.save(weights, self.out / f"final-{self.name}.pt")
        (self.out / f"schedule-{self.name}").write_text(self.engine().plan.schedule)


def trainer_kwargs(tmp_path: Path, callbacks: list) -> dict:
    return dict(
        accelerator="cpu",
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    data = dataset(SAMPLES, seed=1, dtype=torch.float64)
    loader = DataLoader(data, batch_sampler=GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED))
    model = TinyNet()
    L.Trainer(devices=1, **trainer_kwargs(tmp_path_factory.mktemp("reference"), [])).fit(model, loader)
    return dict(model.state_dict())


def planned(num_nodes: int, devices_per_node: int = 1, schedule: str = "1f1b") -> Plan:
    """The planner's plan (f = 2) of the 6 layers of ``TinyNet`` (equal profiles, 3 fit on a device) on
    ``num_nodes`` nodes: 3 pipelines of 2 stages on 6 nodes, of 3 + 2 + 2 stages on 7, and one pipeline
    per node on 3 nodes of 2 devices."""
    layers = tuple(LayerProfile(1e-3, 2e-3, 1000, 100, 100, weight_grad_s=1e-3) for _ in range(6))
    return make_plan(
        ModelProfile(layers, microbatch_size=MICRO),
        ClusterSpec(num_nodes=num_nodes, gpus_per_node=devices_per_node, device_memory_bytes=20_000),
        fault_tolerance=2,
        global_batch_size=GLOBAL_BATCH,
        schedule=schedule,
    )


SPLIT_TIMEOUT_S = 10.0
"""The collective timeout of the runs whose stages span two processes: under gloo, a stage peer left inside a
tensor-parallel collective by a failure waits for it (docs/limitations.md), so it sets how long they take."""


def planned_split(num_nodes: int, fault_tolerance: int = 1, device_memory_bytes: int = 10_000) -> Plan:
    """Nodes of 2 processes, each stage split over both (tensor parallelism 2), f = 1: half a device's worth
    of each layer per device, three layers per stage at most (n0 = 2): two pipelines of 2 nodes on 4. With
    twice the memory a stage holds all six layers (n0 = 1)."""
    whole = tuple(LayerProfile(1e-3, 2e-3, 1000, 100, 100, weight_grad_s=1e-3) for _ in range(6))
    split = tuple(
        LayerProfile(5e-4, 1e-3, 500, 100, 50, 5e-4, tensor_parallel_forward_bytes=(100,)) for _ in range(6)
    )
    return make_plan(
        ModelProfile(whole, microbatch_size=MICRO, sharded={2: split}),
        ClusterSpec(num_nodes=num_nodes, gpus_per_node=2, device_memory_bytes=device_memory_bytes),
        fault_tolerance=fault_tolerance,
        global_batch_size=GLOBAL_BATCH,
        tensor_parallel=2,
    )


def fit_with_faults(
    tmp_path: Path,
    faults: dict[tuple[int, int], Fault | list[Fault]],
    num_nodes: int = 6,
    devices_per_node: int = 1,
    plan: Plan | None = None,
    callbacks: list[L.Callback] = (),
    collective_timeout_s: float = 20.0,
    **options: Any,
) -> L.Trainer:
    """Train on ``plan`` (default: the plan of ``planned(num_nodes, devices_per_node)``), one process per
    device, with ``faults`` (and ``callbacks``, and the strategy's ``options``)."""
    plan = plan or planned(num_nodes, devices_per_node)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    strategy = OobleckStrategy(
        plan_path=str(plan_path),
        devices_per_node=devices_per_node,
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        fault_tolerance=plan.fault_tolerance,
        seed=SEED,
        start_method="forkserver",
        collective_timeout_s=collective_timeout_s,
        heartbeat_timeout_s=4.0,
        **options,
    )
    loader = DataLoader(dataset(SAMPLES, seed=1, dtype=torch.float64), batch_size=GLOBAL_BATCH, shuffle=True)
    callbacks = [Faults(tmp_path, faults), *callbacks]
    trainer = L.Trainer(
        devices=num_nodes * devices_per_node, strategy=strategy, **trainer_kwargs(tmp_path, callbacks)
    )
    model = TinyNet()
    trainer.fit(model, loader)
    return trainer


def assert_every_sample_fed_once(out: Path, data: torch.Tensor, steps: int) -> None:
    """Every sample of every counted global batch was fed once (the ``fed-*.jsonl`` of :class:`Faults`)."""
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED)
    fed: dict[int, list[tuple[float, ...]]] = {}
    for path in out.glob("fed-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            fed.setdefault(record["step"], []).extend(map(tuple, record["rows"]))
    for step in range(steps):
        epoch, index = divmod(step, len(sampler))
        expected = sorted(tuple(data[i].tolist()) for i in sampler.global_batch(epoch, index))
        assert sorted(fed[step]) == expected, f"step {step}"


def check(
    trainer: L.Trainer,
    tmp_path: Path,
    reference: dict[str, torch.Tensor],
    dead: set[int],
    num_nodes: int = 6,
    devices_per_node: int = 1,
    joined: set[int] = frozenset(),
) -> None:
    """The run's properties (see the module docstring) when the nodes ``dead`` were killed and the nodes
    ``joined`` joined."""
    assert trainer.state.finished and trainer.global_step == STEPS
    assert {int(p.stem.split("-")[1].split(".")[0]) for p in tmp_path.glob("fault-*.json")} == dead
    workers = {divmod(rank, devices_per_node) for rank in range(num_nodes * devices_per_node)}
    newcomers = {(node, device) for node in joined for device in range(devices_per_node)}
    survivors = {w for w in workers if w[0] not in dead}
    finishers = survivors | newcomers
    assert {tuple(map(int, p.stem[6:].split("."))) for p in tmp_path.glob("final-*.pt")} == finishers
    for node, device in finishers:
        weights = torch.load(tmp_path / f"final-{node}.{device}.pt")
        for name, value in weights.items():
            torch.testing.assert_close(
                value, reference[name], rtol=0, atol=1e-9, msg=f"{name} on worker {(node, device)}"
            )
    assert_every_sample_fed_once(tmp_path, dataset(SAMPLES, seed=1, dtype=torch.float64).tensors[0], STEPS)
    # The recoveries removed exactly the workers of the killed nodes, every one of them, once; every step is
    # recorded once (a new rank 0 records those its lost predecessor did not get to).
    steps, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert sorted(s["step"] for s in steps) == list(range(1, STEPS + 1))
    removed = [tuple(w) for e in recoveries for w in e.removed]
    assert sorted(removed) == sorted(workers - survivors)
    assert sorted(tuple(w) for e in recoveries for w in e.added) == sorted(newcomers)
    assert all((e.removed or e.added) and e.resumed_at is not None for e in recoveries)


@pytest.mark.timeout(300)
def test_rank0_lost_after_a_commit_leaves_no_step_unrecorded(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Global rank 0, which records the steps, dies after step 2's commit, before its update: the others
    apply the step, and the new rank 0 records it (the events file has every step once)."""
    trainer = fit_with_faults(tmp_path, {(0, 2): Fault(signal.SIGKILL, OPTIMIZER)})
    check(trainer, tmp_path, reference, dead={0})


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_rank0_then_a_hung_first_stage(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Global rank 0 (node 0, a first stage) is SIGKILLed mid-step 1; a last stage (node 5) after its
    commit of step 2, before its optimizer update (the step counts: nothing is redone); node 4 (a first
    stage) hangs (SIGSTOP) mid-step 3 and is fenced after the heartbeat timeout."""
    faults = {
        (0, 1): Fault(signal.SIGKILL, FORWARD),
        (5, 2): Fault(signal.SIGKILL, OPTIMIZER),
        (4, 3): Fault(signal.SIGSTOP, FORWARD),
    }
    trainer = fit_with_faults(tmp_path, faults)
    check(trainer, tmp_path, reference, dead={0, 4, 5})
    # Node 4 may stop while the others already recover from node 5: that agreement then waits for it
    # until it is declared dead, and one recovery removes both.
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert [w[0] for w in recoveries[0].removed] == [0] and len(recoveries) in (2, 3)


@pytest.mark.timeout(300)
def test_two_nodes_at_once_then_a_last_stage(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """f = 2: a last stage (node 1) and a first stage (node 2) of two pipelines die together mid-step 1;
    then the last stage node 3 dies mid-step 3."""
    kill = Fault(signal.SIGKILL, FORWARD)
    trainer = fit_with_faults(tmp_path, {(1, 1): kill, (2, 1): kill, (3, 3): kill})
    check(trainer, tmp_path, reference, dead={1, 2, 3})


@pytest.mark.timeout(300)
def test_middle_stage_in_backward_a_kill_during_its_recovery_then_a_gradient_sync(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """7 nodes: pipeline 0 has 3 stages (nodes 0, 1, 2), pipelines 1 and 2 have 2 (nodes 3-4, 5-6).
    The middle stage (node 1) is SIGKILLed in its backward of step 1; node 3 (a first stage) in the recovery
    from it, with layer 2 for node 0 in flight (layer 2's replicas are nodes 3 and 5; its one chunk is
    node 3's share); node 5 (a first stage) right after issuing its first gradient all-reduce of step 3 (by
    then nodes 0, 4, 2 form a 3-stage pipeline with layers copied in, and nodes 5, 6 a 2-stage one)."""
    faults = {
        (1, 1): Fault(signal.SIGKILL, BACKWARD),
        (3, 1): Fault(signal.SIGKILL, MID_COPY),
        (5, 3): Fault(signal.SIGKILL, GRAD_SYNC),
    }
    assert [p.nodes for p in planned(7).pipelines] == [(0, 1, 2), (3, 4), (5, 6)]
    trainer = fit_with_faults(tmp_path, faults, num_nodes=7)
    check(trainer, tmp_path, reference, dead={1, 3, 5}, num_nodes=7)
    # The recovery from node 1 failed with node 3 and was redone without it: one event removes both, and
    # says what the redone copy moved.
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert [sorted(w[0] for w in e.removed) for e in recoveries] == [[1, 3], [5]]
    assert recoveries[0].copied_bytes > 0 and recoveries[0].copy_gb_per_s() is not None


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_whole_nodes_of_two_processes(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """3 nodes of 2 processes, one 2-stage pipeline each. Device 0 of node 1 is SIGKILLed right after
    issuing its first gradient all-reduce of step 1: node 1 is out, its device 1 fenced. Device 1 of
    node 2 hangs (SIGSTOP) in its backward of step 3: after the heartbeat timeout node 2 is out, both
    its processes fenced; node 0 trains on alone."""
    faults = {
        (1, 1): Fault(signal.SIGKILL, GRAD_SYNC, device=0),
        (2, 3): Fault(signal.SIGSTOP, BACKWARD, device=1),
    }
    trainer = fit_with_faults(tmp_path, faults, num_nodes=3, devices_per_node=2)
    check(trainer, tmp_path, reference, dead={1, 2}, num_nodes=3, devices_per_node=2)
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert [sorted(map(tuple, e.removed)) for e in recoveries] == [[(1, 0), (1, 1)], [(2, 0), (2, 1)]]


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("recovery_policy", ["reinstantiate", "reroute"])
def test_a_stage_split_over_two_processes_loses_global_rank_0(
    tmp_path: Path, reference: dict[str, torch.Tensor], recovery_policy: str
) -> None:
    """Tensor parallelism 2: 4 nodes of 2 processes, each stage on both (its layers split by TinyNet's plan),
    two pipelines of 2 nodes. Global rank 0 (device 0 of node 0, a first stage) is SIGKILLed mid-step 1: its
    node is out, its device 1 fenced. Re-instantiated, the 3 survivors form one pipeline of 3 stages, each
    device receiving its own shards of the layers it newly holds from its counterpart, and every kept layer
    split anew over the new generation's devices. Rerouted, pipeline 0's micro-batches take the other
    pipeline's first stage, each shard's work on its counterpart of the same tensor rank: nothing copied."""
    plan = planned_split(4)
    assert [p.nodes for p in plan.pipelines] == [(0, 1), (2, 3)] and plan.tensor_parallel == 2
    faults = {(0, 1): Fault(signal.SIGKILL, FORWARD, device=0)}
    trainer = fit_with_faults(
        tmp_path,
        faults,
        num_nodes=4,
        devices_per_node=2,
        plan=plan,
        collective_timeout_s=SPLIT_TIMEOUT_S,
        recovery_policy=recovery_policy,
    )
    check(trainer, tmp_path, reference, dead={0}, num_nodes=4, devices_per_node=2)
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert [sorted(map(tuple, e.removed)) for e in recoveries] == [[(0, 0), (0, 1)]]
    if recovery_policy == "reroute":
        assert recoveries[0].recovery_policy == "reroute" and recoveries[0].copied_bytes == 0
    else:
        assert recoveries[0].copied_bytes > 0


def wait_for_the_replacement(trainer: L.Trainer, workers: int, timeout_s: float = 120.0) -> None:
    """Wait (bounded) until a replacement node waits to join or its join is announced (``workers`` in the
    newest membership, agreed or not: an announced join waits for this worker to be ready), so that a short
    run cannot end before the replacement's processes have started on this loaded machine."""
    agent = trainer.strategy._agent
    deadline = time.monotonic() + timeout_s
    while agent.joiners == 0 and len(agent.announced.workers) < workers and time.monotonic() < deadline:
        time.sleep(0.05)


class HoldForTheReplacement(L.Callback):
    """At step 2 the members wait for the replacement (:func:`wait_for_the_replacement`)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2 and trainer.strategy.admission is None:
            wait_for_the_replacement(trainer, self.workers)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_replacement_node_of_split_stages_joins(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Tensor parallelism 2, two pipelines of 2 nodes of 2 processes. Device 0 of node 1 is SIGKILLed mid-step
    1 (its node is out); the launcher starts a replacement node (id 4) that joins at a step boundary, each of
    its devices receiving its own shards of its layers from its counterparts. The run ends with the weights
    of single-process training on every process, the replacement's included, and the plan's two pipelines."""
    plan = planned_split(4)
    faults = {(1, 1): Fault(signal.SIGKILL, FORWARD, device=0)}
    trainer = fit_with_faults(
        tmp_path,
        faults,
        num_nodes=4,
        devices_per_node=2,
        plan=plan,
        callbacks=[HoldForTheReplacement(8)],
        replace_failed_after_s=0.2,
        collective_timeout_s=SPLIT_TIMEOUT_S,
    )
    check(trainer, tmp_path, reference, dead={1}, num_nodes=4, devices_per_node=2, joined={4})
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    # the join is its own recovery, or (when the failure's recovery waited for a stage peer's collective, see
    # docs/limitations.md) one with the failure; either way two pipelines again, the newcomer's shards copied
    [join] = [e for e in recoveries if e.added]
    assert join.added == [[4, 0], [4, 1]] and join.copied_bytes > 0 and join.tensor_parallel == 2
    assert recoveries[-1].fault_tolerance == 1


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_nodes_of_split_stages_at_once(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Tensor parallelism 2, f = 2: 4 nodes of 2 processes, each node a pipeline of one stage split over its
    two devices. Global rank 0 (node 0) and device 1 of node 2 are SIGKILLed together mid-step 1: both
    nodes are out, their other processes fenced, and the two survivors train on with every layer."""
    plan = planned_split(4, fault_tolerance=2, device_memory_bytes=20_000)
    assert plan.fault_tolerance == 2 and len(plan.pipelines) >= 3 and plan.tensor_parallel == 2
    kill = {0: Fault(signal.SIGKILL, FORWARD, device=0), 2: Fault(signal.SIGKILL, FORWARD, device=1)}
    faults = {(node, 1): fault for node, fault in kill.items()}
    trainer = fit_with_faults(
        tmp_path, faults, num_nodes=4, devices_per_node=2, plan=plan, collective_timeout_s=SPLIT_TIMEOUT_S
    )
    check(trainer, tmp_path, reference, dead={0, 2}, num_nodes=4, devices_per_node=2)
    _, recoveries = read_events(tmp_path / EVENTS_FILE)
    assert sorted(w for e in recoveries for w in map(tuple, e.removed)) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    # each event says what the new plan is: still split over both devices of a node, and its predicted step
    assert all(e.tensor_parallel == 2 and e.predicted_step_s for e in recoveries)
