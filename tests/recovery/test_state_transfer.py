"""The state copy of a recovery or a join: layers and optimizer state move as tensors, bit for bit.

Real processes and real gloo groups. Each case compares what a worker holds after the copy with the same
layers trained in one process: parameters, buffers and every optimizer state entry equal, for AdamW, SGD
with momentum, Adafactor (state not shaped like its parameter, a ``step`` counter) and an optimizer whose
state holds plain Python values. Small buckets make every case cut large tensors into slices and pack small
ones together. The NCCL variant of the swap needs two GPUs (none is lent to this project), so it runs only
on a machine that has them.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from dist_harness import indexed_pool, plan_from_splits
from torch import nn

from lightning_oobleck.execution import ProcessGroups, build_stage
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.stage import StageModule
from lightning_oobleck.planning.plan import LayerCopy, Plan
from lightning_oobleck.recovery.state_transfer import CopyStats, _chunks, state_by_name, transfer_state
from lightning_oobleck.testing import Fault, FaultAction, FaultPoint, PeakResidentMemory, arm
from lightning_oobleck.worker import Worker

SEED = 11
WIDTH = 8
CPU = torch.device("cpu")
BUCKET = 2048
"""Small enough that every kind of chunk occurs: the 4 KiB weight of layer 2 goes in slices, the 512-byte
weights whole from where they are, biases, buffers and Adafactor's factors packed into buckets."""


class CountingSGD(torch.optim.Optimizer):
    """Plain SGD whose per-parameter state is Python values only: a step count and a label."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                state["label"] = f"seen {state['count']}x"
                p.add_(p.grad, alpha=-group["lr"])


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.1),
    "python-state": lambda params: CountingSGD(params, lr=0.1),
}


class Norm(nn.Module):
    """A layer with buffers: running statistics (in its state dict), a scale that is not, and frequencies
    it keeps in float32 whatever the model's dtype (as Hugging Face's rotary embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(WIDTH))
        self.register_buffer("running", torch.empty(WIDTH))
        self.register_buffer("scale", torch.empty(()), persistent=False)
        self.register_buffer("freq", torch.empty(WIDTH), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.running)
        nn.init.ones_(self.scale)
        self.freq.copy_(1.0 / 10_000 ** (torch.arange(WIDTH, device=self.freq.device) / WIDTH))

    def keep_float32(self) -> None:
        """What a model that computes these in float32 ends with, where this worker's build cast them."""
        self.freq = self.freq.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running.lerp_(x.mean(0), 0.1)
            self.scale.mul_(1.5)
        return x * self.weight * self.scale


def layers() -> list[nn.Module]:
    """Six layers: one with buffers, and a weight tied between layers 0 and 5."""
    built: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), Norm()]
    built += [nn.Linear(WIDTH, 8 * WIDTH), nn.Linear(8 * WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)]
    built.append(nn.Linear(WIDTH, WIDTH))
    built[5].weight = built[0].weight
    return built


def trained(held: range, optimizer: str, device: torch.device) -> tuple[StageModule, torch.optim.Optimizer]:
    """The layers ``held`` after two optimizer steps on a fixed loss: the same on any process."""
    module = build_stage(layers, held, device, seed=SEED, dtype=torch.float64)
    if 1 in held:
        module.layer(1).keep_float32()
    opt = OPTIMIZERS[optimizer](module.parameters())
    for step in range(2):
        if 1 in held:  # buffers that differ from their initial values
            module.layer(1)(
                torch.randn(4, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            )
        sum((p**2).sum() * len(name) for p, name in module.global_names().items()).backward()
        opt.step()
        opt.zero_grad()
    return module, opt


def allocate(device: torch.device) -> Any:
    return lambda indices: build_stage(layers, indices, device, dtype=torch.float64, init=None)


def copy(
    store: Any,
    state: dict,
    optimizer: str,
    backend: str,
    old: Plan,
    new: Plan,
    copies: list[LayerCopy],
    generation: int,
) -> dict[str, Any]:
    """Train the layers this worker holds under ``old``, copy into ``new`` in buckets of :data:`BUCKET`
    bytes."""
    worker = Worker(state["index"], 0)
    device = torch.device(f"cuda:{worker.node}") if backend == "nccl" else torch.device("cpu")
    held = old.role(*worker).layers if worker.node in old.nodes else range(0)
    module, opt = trained(held, optimizer, device) if len(held) else (StageModule({}), None)
    groups = ProcessGroups(
        new, worker, store, generation=generation, backend=backend, timeout=timedelta(seconds=20)
    )
    try:
        new_module, new_state, stats = transfer_state(
            module,
            state_by_name(opt, module) if opt else {},
            copies,
            groups,
            allocate(device),
            threading.Event(),
            device,
            bucket_bytes=BUCKET,
        )
    finally:
        groups.destroy()
    tied = new_module.tied()
    return {
        "model": {k: v.cpu() for k, v in new_module.state_dict().items()},
        "buffers": {k: v.cpu() for k, v in new_module.named_buffers()},
        "state": {
            name: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
            for name, s in new_state.items()
        },
        "tied_once": len({id(p) for p in tied}) == len({t.name for t in tied.values()}),
        "stats": stats,
    }


def check_equal_to_reference(result: dict[str, Any], layers_held: range, optimizer: str) -> None:
    reference, reference_opt = trained(range(6), optimizer, torch.device("cpu"))
    expected_model = {k: v for k, v in reference.state_dict().items() if int(k.split(".")[1]) in layers_held}
    assert result["model"].keys() == expected_model.keys()
    for name, value in expected_model.items():
        assert torch.equal(result["model"][name], value), name
    for name, value in reference.named_buffers():  # non-persistent ones too, in their own dtype
        if int(name.split(".")[1]) in layers_held:
            got = result["buffers"][name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
    tied = reference.tied()
    held = {  # a tied weight by its canonical name wherever one of its layers is held
        name
        for p, name in reference.global_names().items()
        if set(tied[p].layers if p in tied else [int(name.split(".")[1])]) & set(layers_held)
    }
    expected_state = {n: s for n, s in state_by_name(reference_opt, reference).items() if n in held}
    assert result["state"].keys() == expected_state.keys()
    for name, entries in expected_state.items():
        assert result["state"][name].keys() == entries.keys(), name
        for key, value in entries.items():
            got = result["state"][name][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, (name, key)
    assert result["tied_once"]


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="NCCL between two ranks needs 2 GPUs"
            ),
        ),
    ],
)
@pytest.mark.timeout(180)
def test_two_workers_copy_their_layers_to_each_other_for_every_kind_of_optimizer_state(backend: str) -> None:
    """Worker (0, 0) holds layers 0-2 and worker (1, 0) layers 3-5; the new plan swaps them, so each sends
    while it receives (with NCCL, sends and receives issued one by one could wait on each other)."""
    old = plan_from_splits([[(0, 3), (3, 6)]], [2], 1)
    new = dataclasses.replace(old, pipelines=(dataclasses.replace(old.pipelines[0], nodes=(1, 0)),))
    copies = [
        LayerCopy(layer, to_node=to, from_node=1 - to) for to in (0, 1) for layer in new.role(to, 0).layers
    ]
    with indexed_pool(2) as pool:
        for generation, optimizer in enumerate(OPTIMIZERS):
            args = (optimizer, backend, old, new, copies, generation)
            results = pool.run({n: (copy, args) for n in (0, 1)}, timeout=90)
            for node, result in results.items():
                check_equal_to_reference(result, new.role(node, 0).layers, optimizer)
                assert result["stats"].sources == 1


@pytest.mark.timeout(180)
def test_a_joiner_pulls_its_layers_from_every_replica_at_once() -> None:
    """Three one-node pipelines hold the whole model; a fourth node joins. Every replica sends a share of
    every layer (by bytes: each within one bucket of a third), the tied weight arrives once and is one
    parameter of layers 0 and 5 again, and the result is bit for bit the trained model. Then the same with
    two replicas."""
    one_stage = [(0, 6)]
    with indexed_pool(4) as pool:
        for generation, replicas in enumerate((3, 2)):
            old = plan_from_splits([one_stage] * replicas, [1] * replicas, 1)
            new = plan_from_splits([one_stage] * (replicas + 1), [1] * (replicas + 1), 1)
            sources = tuple(Worker(n, 0) for n in range(replicas))
            copies = [LayerCopy(layer, replicas, 0, replicas=sources) for layer in range(6)]
            args = ("adamw", "gloo", old, new, copies, generation)
            results = pool.run({n: (copy, args) for n in range(replicas + 1)}, timeout=90)
            check_equal_to_reference(results[replicas], range(6), "adamw")
            received: CopyStats = results[replicas]["stats"]
            assert received.sources == replicas
            reference, _ = trained(range(6), "adamw", torch.device("cpu"))
            params = sum(p.numel() * p.element_size() for p in reference.parameters())  # the tie once
            buffers = sum(b.numel() * b.element_size() for b in reference.buffers())
            assert received.received_bytes == 3 * params + buffers  # weights, exp_avg, exp_avg_sq
            sent = [results[n]["stats"].sent_bytes for n in range(replicas)]
            assert sum(sent) == received.received_bytes
            assert max(sent) - min(sent) <= 6 * BUCKET, sent  # at most a bucket apart per layer


def copy_and_measure(
    store: Any, state: dict, old: Plan, new: Plan, copies: list[LayerCopy], bucket: int, generation: int = 0
) -> dict:
    """Copy layers of ``WIDE``-wide linears; the receiver reports its peak resident memory growth."""
    worker = Worker(state["index"], 0)
    wide = lambda: [nn.Linear(WIDE, WIDE) for _ in range(2)]  # noqa: E731
    cpu = torch.device("cpu")
    module, opt = StageModule({}), None
    if worker.node in old.nodes:
        module = build_stage(wide, old.role(*worker).layers, cpu)
        opt = torch.optim.AdamW(module.parameters())
        sum(p.sum() for p in module.parameters()).backward()
        opt.step()
    groups = ProcessGroups(
        new, worker, store, generation=generation, backend="gloo", timeout=timedelta(seconds=60)
    )
    try:
        with PeakResidentMemory() as memory:
            _, new_state, stats = transfer_state(
                module,
                state_by_name(opt, module) if opt else {},
                copies,
                groups,
                lambda indices: build_stage(wide, indices, cpu, init=None),
                threading.Event(),
                cpu,
                bucket_bytes=bucket,
            )
    finally:
        groups.destroy()
    return {"growth": memory.growth_bytes, "stats": stats, "states": len(new_state)}


WIDE = 1024


@pytest.mark.skipif(not PeakResidentMemory.supported(), reason="needs Linux's peak resident memory reset")
@pytest.mark.timeout(120)
def test_a_receiver_needs_a_few_buckets_beyond_the_state_it_receives() -> None:
    """24 MiB of weights and AdamW state in 1 MiB buckets: the receiver's peak resident memory grows by what
    it receives plus at most a few buckets (the old serialising copy held the payload four times over), and
    the sender's by at most a few buckets. Measured on the second copy of the processes (the first also pays
    for loading code), with freed memory returned to the system at once."""
    old = plan_from_splits([[(0, 2)]], [1], 1)
    new = plan_from_splits([[(0, 2)]] * 2, [1, 1], 1)
    copies = [LayerCopy(layer, 1, 0) for layer in range(2)]
    bucket = 1 << 20
    with indexed_pool(2) as pool:
        for generation in range(2):  # the first copy of a process also loads code and sets up its links
            args = (old, new, copies, bucket, generation)
            results = pool.run({n: (copy_and_measure, args) for n in (0, 1)}, timeout=90)
    received = results[1]["stats"].received_bytes
    assert received == 2 * 3 * (WIDE * WIDE + WIDE) * 4 and results[1]["states"] == 4
    extra = results[1]["growth"] - received
    assert extra <= 4 * bucket, (
        f"the receiver grew {extra / 2**20:.1f} MiB beyond the {received / 2**20:.1f} MiB"
    )
    assert results[0]["growth"] <= 4 * bucket, f"the sender grew {results[0]['growth'] / 2**20:.1f} MiB"


def copy_while_a_peer_dies(store: Any, state: dict, victim: int) -> dict[str, Any]:
    """Worker 2 held layers 0-2 and newly holds the whole model, layers 3-5 striped over workers 0 and 1
    (which hold the whole model); ``victim`` is SIGKILLed once its first chunks are in flight. Returns
    whether the copy failed as a lost peer, and whether this worker's state is still what it was."""
    worker = Worker(state["index"], 0)
    held = range(6) if worker.node < 2 else range(3)
    module, opt = trained(held, "adamw", torch.device("cpu"))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    before_state = {n: {k: v.clone() for k, v in s.items()} for n, s in state_by_name(opt, module).items()}
    new = plan_from_splits([[(0, 6)]] * 3, [1] * 3, 1)
    copies = [LayerCopy(layer, 2, 0, replicas=(Worker(0, 0), Worker(1, 0))) for layer in range(3, 6)]
    if worker.node == victim:
        arm(Fault(FaultPoint.COPY_CHUNK, FaultAction.KILL, node=victim))
    # a survivor left waiting on the dead peer's chunk fails at this timeout (gloo)
    groups = ProcessGroups(new, worker, store, generation=0, backend="gloo", timeout=timedelta(seconds=8))
    try:
        transfer_state(
            module, state_by_name(opt, module), copies, groups, allocate(CPU), threading.Event(), CPU, BUCKET
        )
        failed = False
    except PeerFailure:
        failed = True
    finally:
        groups.abort("a peer died")
    after_state = state_by_name(opt, module)
    untouched = all(torch.equal(v, module.state_dict()[k]) for k, v in before.items()) and all(
        torch.equal(v, after_state[n][k]) for n, s in before_state.items() for k, v in s.items()
    )
    return {"failed": failed, "untouched": untouched}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "victim", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["a-source", "the-receiver"]
)
def test_a_worker_killed_mid_copy_fails_the_copy_and_leaves_the_others_state_untouched(victim: int) -> None:
    """Real SIGKILL with chunks in flight: each survivor's copy raises ``PeerFailure`` (the recovery then
    starts over with the next generation) and its layers and optimizer state are exactly what they were."""
    with indexed_pool(3) as pool:
        for i in range(3):
            pool.submit(i, copy_while_a_peer_dies, victim)
        survivors = [i for i in range(3) if i != victim]
        results = {i: pool._receive(i, timeout=60) for i in survivors}
        pool.procs[victim].join(timeout=30)
        assert pool.procs[victim].exitcode == -signal.SIGKILL
    for i, (status, result) in results.items():
        assert status == "ok", result
        assert result == {"failed": True, "untouched": True}, i


def test_chunks_pack_small_tensors_send_large_ones_from_where_they_are_and_stripe_by_bytes() -> None:
    """Tensors under 1/16 of a bucket share a bucket; larger ones are sent from the tensor, in slices of a
    bucket where they exceed one; each chunk goes to the replica that has sent the fewest bytes so far."""
    a, b = Worker(0, 0), Worker(1, 0)
    chunks = _chunks([8, 64, 4096, 512, 64], [a, b], bucket_bytes=2048, rotate=0)
    assert [c.pieces for c in chunks] == [
        [(0, 0, 8), (1, 0, 64)],
        [(2, 0, 2048)],
        [(2, 2048, 4096)],
        [(3, 0, 512)],
        [(4, 0, 64)],
    ]
    assert [c.source for c in chunks] == [a, b, a, b, a]
    assert [c.source for c in _chunks([8], [a, b], 2048, rotate=1)] == [b]  # the next layer starts elsewhere
