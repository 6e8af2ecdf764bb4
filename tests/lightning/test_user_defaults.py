"""A newcomer's own module, written from the README alone, with every ``Trainer`` argument at Lightning's
default except ``strategy``, ``devices``, ``max_steps`` (and ``precision="64-true"``, to compare weights to
1e-9): the default ``ModelCheckpoint`` (no ``dirpath``), ``ModelSummary``, progress bar and CSV logger, with
``example_input_array`` set, in the loop users run (validation, a loader worker, a per-step LR schedule,
float32 data). Nothing from the test helpers.

The model does not fit on one device (``planner.cluster.device_memory_bytes``), so the plan is two 2-stage
pipelines over 4 processes: the layout where every rank resolving its own log directory used to leave
checkpoints without their shards, and the model summary's forward failed on the second stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck import OobleckStrategy, PipelineModule, consolidate_checkpoint
from lightning_oobleck.execution import PeerFailure, profile_layers
from lightning_oobleck.lightning.callbacks import KillAt
from lightning_oobleck.lightning.summary import PipelineSummary
from lightning_oobleck.lightning.units import EVENTS_FILE, CheckpointError
from lightning_oobleck.planning import ClusterSpec, make_plan, reroute
from lightning_oobleck.planning.profile import ModelProfile
from lightning_oobleck.recovery import read_events
from lightning_oobleck.recovery.startup import PlanFailure
from lightning_oobleck.testing import FAULTS_ENV, Fault, FaultPoint


class Regressor(PipelineModule, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(1, 8)

    def configure_layers(self) -> list[nn.Module]:
        return [
            nn.Sequential(nn.Linear(8, 32), nn.Tanh()),
            nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
            nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
            nn.Linear(32, 1),
        ]

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class RaisesAtStep3(Regressor):
    """A bug in the user's code: every rank raises it at step 3 (``rank=None``), or one rank only."""

    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self.rank = rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == 3 and self.rank in (None, self.trainer.global_rank):
            raise ValueError("the learning rate must be positive, got -1")
        return super().training_step(batch, batch_idx)


def data(seed: int = 0, workers: int = 1, samples: int = 128) -> DataLoader:
    """Float32 samples (trained under ``64-true``): 8 steps of 16 an epoch, then validation."""
    x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(seed))
    samples = TensorDataset(x, x.sum(1, keepdim=True).sin())
    return DataLoader(samples, batch_size=16, shuffle=workers > 0, num_workers=workers)


def fit(
    module: Regressor,
    steps: int,
    devices: int = 4,
    fault_tolerance: int = 1,
    ckpt_path: Path | None = None,
    callbacks: list[L.Callback] | None = None,
    layout: list[list[int]] | None = None,
    recovery_policy: str = "reinstantiate",
    validation_samples: int = 128,
    profile_path: Path | None = None,
    device_memory_bytes: int = 75_000,  # two devices hold the model
) -> dict[str, torch.Tensor]:
    strategy = OobleckStrategy(
        microbatch_size=2,
        fault_tolerance=fault_tolerance,
        planner={"cluster": {"device_memory_bytes": device_memory_bytes}},
        layout=layout,
        recovery_policy=recovery_policy,
        profile_path=profile_path,
    )
    trainer = L.Trainer(
        strategy=strategy, devices=devices, max_steps=steps, precision="64-true", callbacks=callbacks
    )
    trainer.fit(module, data(), data(seed=1, workers=0, samples=validation_samples), ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-9, msg=name)


FIT_DONE = "the fit of the console test ended"
"""What the user's script of the console test prints after its fit, before it validates and tests."""


def assert_reads_like_one_run(console: str) -> None:
    """No traceback, and each warning printed once, not once per worker."""
    assert "Traceback" not in console
    warnings = [line for line in console.splitlines() if re.match(r"\S+\.py:\d+: ", line)]
    repeated = {line for line in warnings if warnings.count(line) > 1}
    assert not repeated, repeated


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Eight steps without a failure or a restart."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("uninterrupted"))
        return fit(Regressor(), 8)


@pytest.mark.timeout(240)
def test_defaults_train_checkpoint_and_resume_on_another_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    monkeypatch.chdir(tmp_path)
    halfway = fit(Regressor(), 4)

    # One run directory for every worker, and its default checkpoint is complete: two 2-stage pipelines.
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt"
    index = json.loads((checkpoint / "index.json").read_text())["layers"]
    assert index == {"0": "0.0", "1": "0.0", "2": "1.0", "3": "1.0"}
    assert all((checkpoint / "shards" / shard / ".metadata").exists() for shard in index.values())

    # Resumed on another layout (one 2-stage pipeline on 2 processes): the uninterrupted run's weights.
    resumed = fit(Regressor(), 8, devices=2, fault_tolerance=0, ckpt_path=checkpoint)
    assert_same_weights(resumed, uninterrupted)

    # The checkpoint as one file for any strategy: its weights, loaded on one device.
    with pytest.raises(ValueError, match=r"sharded checkpoint.*oobleck consolidate"):
        Regressor.load_from_checkpoint(checkpoint)
    consolidated = consolidate_checkpoint(checkpoint, tmp_path / "model.ckpt")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the module in the precision it was trained in
    try:
        single = Regressor.load_from_checkpoint(consolidated)
    finally:
        torch.set_default_dtype(default_dtype)
    assert_same_weights(dict(single.state_dict()), halfway)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_defaults_survive_rank_zero_sigkilled_mid_run_and_the_console_reads_like_one_run(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """This file run as the user's script (``python test_user_defaults.py``), so that the console is what the
    user sees: every worker's output included. Then ``validate`` and ``test`` in the same script, on
    evaluation sets of 136 samples: the 8 after the last global batch are said to be left out, once per
    run, and Lightning's warning that its sampler may repeat samples, untrue here, is not shown."""
    run = subprocess.run(
        [sys.executable, __file__, "weights.pt", "--kill-rank-0-at-step-3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-3000:]
    assert_same_weights(torch.load(tmp_path / "weights.pt"), uninterrupted)
    assert_reads_like_one_run(run.stdout.split(FIT_DONE)[0] + run.stderr.split(FIT_DONE)[0])
    assert console.count("lost at step 3") == 1
    # Not a terminal: plain step lines from whichever worker is rank 0, not a progress bar's frames.
    assert "\r" not in console and "\x1b[" not in console
    # the 8 steps are epoch 0's 8 batches (Lightning counts the epoch done once training ends)
    assert re.search(r"^oobleck: step 8/8 \(epoch 0\) ", console, re.MULTILINE), console[-3000:]
    assert "Total params: 2.4 K" in console  # the model summary is the whole model's, not one stage's
    assert "Oobleck plan: 2 pipelines" in console
    left_out = r"the (\w+)_dataloader's last 8 of 136 samples are not evaluated: every evaluation step is"
    assert re.findall(left_out, console) == [
        "val",  # the fit's validation, after rank 0's death: printed by the new rank 0 only
        "val",  # trainer.validate
        "test",  # trainer.test
    ], console[-3000:]
    assert "DistributedSampler" not in console
    # The new rank 0 wrote into the same run directory: the final checkpoint is there and complete.
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=8.ckpt"
    index = json.loads((checkpoint / "index.json").read_text())["layers"]
    assert all((checkpoint / "shards" / shard / ".metadata").exists() for shard in index.values())


@pytest.mark.timeout(240)
def test_an_error_in_the_users_code_ends_the_run_with_that_error_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(ValueError, match="the learning rate must be positive") as raised:
        fit(RaisesAtStep3(rank=None), 8)
    assert time.monotonic() - started < 60
    assert "in training_step" in "".join(getattr(raised.value, "__notes__", []))  # the worker's traceback


@pytest.mark.timeout(240)
def test_an_error_on_one_rank_is_a_fault_and_is_survived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert_same_weights(fit(RaisesAtStep3(rank=2), 8), uninterrupted)


@pytest.mark.timeout(240)
def test_rerouting_at_the_defaults_trains_on_and_checkpoints_every_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """``recovery_policy="reroute"`` as the README shows it: rank 0 (the first stage of pipeline 0) is
    SIGKILLed at step 3; pipeline 0 keeps its second stage and pipeline 1's first stage runs its micro-batches
    too, nothing copied. The default checkpoint at step 6, written by the new rank 0 in the rerouted layout,
    holds every layer once, from the replicas that still hold it; resumed from it on another layout, training
    ends with the uninterrupted run's weights."""
    monkeypatch.chdir(tmp_path)
    fit(Regressor(), 6, callbacks=[KillAt(0, 3)], recovery_policy="reroute")
    [events] = tmp_path.glob(f"lightning_logs/version_0/{EVENTS_FILE}")
    steps, [recovery] = read_events(events)
    assert (recovery.removed, recovery.recovery_policy, recovery.copied_bytes) == ([[0, 0]], "reroute", 0)
    assert [s["generation"] for s in steps][-3:] == [recovery.generation] * 3, "steps 4-6 ran rerouted"
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=6.ckpt"
    index = json.loads((checkpoint / "index.json").read_text())["layers"]
    assert sorted(index) == ["0", "1", "2", "3"] and "0.0" not in index.values()
    assert all((checkpoint / "shards" / shard / ".metadata").exists() for shard in index.values())
    resumed = fit(Regressor(), 8, devices=2, fault_tolerance=0, ckpt_path=checkpoint)
    assert_same_weights(resumed, uninterrupted)


PROFILE_ON_FULL_DEVICES = Path(__file__).with_name("full_devices_profile.json")
"""The layer profile of :class:`Regressor` at micro-batch 2 in float64, as a run of it measured it."""


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_rerouting_on_full_devices_waits_for_room_and_trains_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """Three pipelines of two stages on devices just large enough for them (66 kB; the stages need 65 kB).
    Rank 1 (pipeline 0's last stage) is SIGKILLed at step 3. Spread over both other pipelines, its
    micro-batches would make rank 0 warm up once per helper, more than its device holds, so they all take
    one helper, whose rerouted forwards wait for room beside its own micro-batches: a slower step, nothing
    copied, and the uninterrupted run's weights. The run plans from a saved profile of this model
    (``profile_path``): the bytes are the same in every run, but the order of the merged step, which the peak
    bytes follow, follows the measured times, and with 1 kB to spare another order lets the spread fit."""
    monkeypatch.chdir(tmp_path)
    weights = fit(
        Regressor(),
        8,
        devices=6,
        callbacks=[KillAt(1, 3)],
        recovery_policy="reroute",
        device_memory_bytes=66_000,
        profile_path=PROFILE_ON_FULL_DEVICES,
    )
    [events] = tmp_path.glob(f"lightning_logs/version_0/{EVENTS_FILE}")
    steps, [recovery] = read_events(events)
    assert (recovery.removed, recovery.recovery_policy, recovery.copied_bytes) == ([[1, 0]], "reroute", 0)
    assert [s["generation"] for s in steps][-5:] == [recovery.generation] * 5, "steps 4-8 ran rerouted"
    assert_same_weights(weights, uninterrupted)
    # the run took the rerouting its profile plans: all on one helper
    profile = ModelProfile.load(
        tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=8.ckpt/profile.json"
    )
    assert profile == ModelProfile.load(PROFILE_ON_FULL_DEVICES)
    cluster = ClusterSpec(num_nodes=6, gpus_per_node=1, device_memory_bytes=66_000)
    rerouted = reroute(make_plan(profile, cluster, fault_tolerance=1, global_batch_size=16), [1])
    assert recovery.predicted_step_s == rerouted.iteration_time_s
    assert [r.helpers for r in rerouted.reroutes] == [(1,)]


class Stranger(threading.Thread):
    """A process on the job's network that knows nothing of it: every 20 ms it connects to every TCP port the
    job's coordinators (the active one, which the supervisor started, and the standbys its workers start)
    opened since the stranger started, and tries to write a key, to read the plan and to register as a
    worker, keeping each answer with its time."""

    ATTEMPTS = (
        b'{"op":"set","key":"oobleck/run0/stray","value":"eA=="}\n',
        b'{"op":"get","key":"oobleck/run0/plan","timeout_s":1}\n',
        b'{"op":"register","node":9,"device":0,"pid":1,"host":"elsewhere"}\n',
        b'{"op":"follow","address":"127.0.0.1:1"}\n',
    )

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.answers: list[tuple[float, int, bytes]] = []
        self.ports: set[int] = set()
        self.done = threading.Event()

    def run(self) -> None:
        before = self.listening_ports()  # not the job's: sockets earlier tests of this process left open
        while not self.done.wait(0.02):
            ports = self.listening_ports() - before
            self.ports |= ports
            for port in ports:
                for attempt in self.ATTEMPTS:
                    try:
                        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                            sock.sendall(attempt)
                            answer = sock.makefile("rb").readline()
                    except OSError:
                        answer = b""
                    self.answers.append((time.time(), port, answer))

    @staticmethod
    def listening_ports() -> set[int]:
        """The ports the coordinators among this process's descendants listen on."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
        descendants, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            descendants.append(pid)
            todo += children.get(pid, [])
        inodes = set()
        for pid in descendants:
            with contextlib.suppress(OSError):
                if b"lightning_oobleck.recovery" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                        inodes.add(link.removeprefix("socket:[").removesuffix("]"))
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for fields in (line.split() for line in Path(table).read_text().splitlines()[1:]):
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, a coordinator's
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports


@pytest.mark.timeout(240)
def test_a_hand_written_layout_recovers_while_a_stranger_at_every_port_reads_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """A pinned layout is profiled like an automatic plan: rank 0's loss at step 3 is recovered in place
    from the planner's templates. Through start-up, training, that failure and its recovery, a stranger
    knocks at the coordinators that serve the store (the active one and its standbys, on loopback only)
    with writes, reads, registrations and a request to follow: each is refused, and the run ends with the
    weights of the uninterrupted one."""
    monkeypatch.chdir(tmp_path)
    stranger = Stranger()
    stranger.start()
    try:
        survived = fit(Regressor(), 8, layout=[[0, 1, 4], [0, 1, 4]], callbacks=[KillAt(0, 3)])
    finally:
        stranger.done.set()
        stranger.join(timeout=10)
    assert_same_weights(survived, uninterrupted)
    [events] = tmp_path.glob(f"lightning_logs/version_0/{EVENTS_FILE}")
    [recovery] = read_events(events)[1]
    assert recovery.removed == [[0, 0]]
    answered = [(at, port, answer) for at, port, answer in stranger.answers if answer]
    # the active coordinator and its standbys: node 0, lost, hosted the first; another was started
    assert len({port for _, port, _ in answered}) >= 2, stranger.ports
    assert all(b"refused" in answer for _, _, answer in answered), {a for _, _, a in answered}
    assert any(at < recovery.detected_at for at, _, _ in answered)
    assert any(recovery.detected_at <= at <= recovery.resumed_at + 1 for at, _, _ in answered)


@pytest.mark.timeout(240)
def test_a_drill_armed_in_the_environment_is_survived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """As a user drills a job: ``OOBLECK_FAULTS`` set, the script unchanged. Node 1 dies in the backward
    of step 3 and node 2 once the state copy of that recovery is done, before its switch barrier."""
    monkeypatch.chdir(tmp_path)
    drill = [
        Fault(FaultPoint.BACKWARD, node=1, step=3).to_json(),
        Fault(FaultPoint.SWITCH, node=2, step=3).to_json(),
    ]
    monkeypatch.setenv(FAULTS_ENV, json.dumps(drill))
    assert_same_weights(fit(Regressor(), 8, devices=6, fault_tolerance=2), uninterrupted)
    events = [json.loads(line) for line in next(tmp_path.rglob(EVENTS_FILE)).read_text().splitlines()]
    removed = sorted(tuple(w) for e in events if e.get("kind") == "recovery" for w in e["removed"])
    assert removed == [(1, 0), (2, 0)]


@pytest.mark.timeout(120)
def test_a_drill_no_worker_could_read_is_refused_before_the_workers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(FAULTS_ENV, '[{"point": "backwards", "node": 1, "step": 3}]')
    with pytest.raises(ValueError, match=r"OOBLECK_FAULTS=.*'backwards' is not a valid FaultPoint"):
        fit(Regressor(), 2)
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("oobleck-events.jsonl"))


class SavesToItsOwnPath(L.Callback):
    """Every worker is given another path, as on nodes that do not share the directory."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 2:
            trainer.save_checkpoint(f"ckpt-{trainer.global_rank}")


class SeesTheRefusalLate(L.Callback):
    """A race, not a fault: worker ``rank`` sees the last barrier of a refused save complete only once a
    peer that passed it has left (as a loaded machine may): it must not take that peer for a failure, redo the
    save with the survivors and be stopped with a staging directory half written."""

    def __init__(self, rank: int, out: Path) -> None:
        self.rank, self.out = rank, out

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step != 2 or trainer.global_rank != self.rank:
            return
        strategy = trainer.strategy
        units = strategy._require_units()  # type: ignore[attr-defined]
        finish = units.finish

        def see_it_late(works: object, abort: threading.Event) -> None:
            (self.out / "lagging").touch()  # its peers leave meanwhile; the launcher then stops it
            abort.wait(timeout=10)
            raise PeerFailure("test: this worker saw the barrier complete only after a peer left")

        def finish_late() -> None:
            strategy.engine.groups.waiter.wait = see_it_late  # type: ignore[attr-defined]
            finish()

        units.finish = finish_late


@pytest.mark.timeout(240)
def test_a_checkpoint_whose_shards_are_elsewhere_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker refuses the save, at once, leaving no staging directory behind, even when one of them
    sees its peers' refusal late."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"the shards of worker\(s\) 1\.0 are missing from it"):
        fit(Regressor(), 4, callbacks=[SeesTheRefusalLate(1, tmp_path), SavesToItsOwnPath()])
    assert not list(tmp_path.glob("ckpt-*")) and not list(tmp_path.glob(".ckpt-*"))
    assert (tmp_path / "lagging").exists()
    [events] = tmp_path.glob(f"lightning_logs/version_0/{EVENTS_FILE}")
    assert read_events(events)[1] == [], "a refused save is the user's error, not a node failure"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_profile_saved_before_backward_peaks_were_measured_trains_and_says_so_once(tmp_path: Path) -> None:
    """``profile_path`` to a profile of the model without the backward peaks (as saved by an earlier version),
    in the user's script (the console as the user sees it, every worker's output included): the run trains,
    and rank 0 says once, under the plan, to profile again."""
    double = lambda: [layer.double() for layer in Regressor().configure_layers()]  # noqa: E731
    fresh = profile_layers(double, torch.zeros(2, 8, dtype=torch.float64), torch.device("cpu"))
    fields = ("backward_peak_bytes", "split_backward_peak_bytes", "weight_gradient_kept_bytes")
    old = replace(fresh, layers=tuple(replace(layer, **dict.fromkeys(fields)) for layer in fresh.layers))
    old.save(tmp_path / "old-profile.json")
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_user_defaults import Regressor, fit\n"
        "fit(Regressor(), 4, fault_tolerance=0, profile_path='old-profile.json')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=220, check=False
    )
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-3000:]
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt").exists()
    assert "Oobleck plan: " in console
    assert console.count("oobleck: warning: the profile has no backward peaks") == 1, console[-3000:]


@pytest.mark.timeout(240)
def test_a_configuration_the_planner_refuses_ends_the_run_in_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """f = 3 needs 4 pipelines of n0 = 2 nodes: every worker learns it from the plan, and the caller gets it
    once, naming the argument to change."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PlanFailure, match=r"the fault tolerance to 1 \(OobleckStrategy\(fault_tolerance=1\)"):
        fit(Regressor(), 2, fault_tolerance=3)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_validate_and_test_equal_one_device_on_the_same_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other entry points, with the defaults on: ``validate(model, ckpt_path=...)`` and then ``test()``
    with that run's module (``model=None``) on the pipelines equal one device on the consolidated file."""
    monkeypatch.chdir(tmp_path)
    fit(Regressor(), 4)
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt"
    strategy = OobleckStrategy(microbatch_size=2, planner={"cluster": {"device_memory_bytes": 75_000}})
    trainer = L.Trainer(strategy=strategy, devices=4, precision="64-true")
    assert_validate_and_test_equal_one_device(trainer, Regressor, checkpoint, tmp_path)


def assert_validate_and_test_equal_one_device(
    trainer: L.Trainer, module: Callable[[], L.LightningModule], checkpoint: Path, tmp_path: Path
) -> None:
    """``trainer.validate(module(), ckpt_path=checkpoint)``, then ``trainer.test()`` with that run's module,
    give one device's loss on the consolidated checkpoint."""
    validated = trainer.validate(module(), data(seed=1, workers=0), ckpt_path=checkpoint)
    tested = trainer.test(dataloaders=data(seed=1, workers=0))
    single = L.Trainer(devices=1, precision="64-true", strategy="auto")
    consolidated = consolidate_checkpoint(checkpoint, tmp_path / "model.ckpt")
    expected = single.validate(module(), data(seed=1, workers=0), ckpt_path=consolidated)
    assert validated[0]["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=0, abs=1e-9)
    assert tested[0]["test_loss"] == pytest.approx(expected[0]["val_loss"], rel=0, abs=1e-9)


class KeepsThePositive(Regressor):
    """A layer whose output shape depends on its input's values: no forward on the meta device."""

    def configure_layers(self) -> list[nn.Module]:
        return [*super().configure_layers(), Positive()]


class Positive(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


def test_the_model_summary_counts_the_whole_model_as_one_device_does() -> None:
    """The summary every worker prints (meta layers, the FLOPs of ``example_input_array`` counted on the
    meta device) and Lightning's own on one device (the layers materialised) agree."""
    one = Regressor()
    one.configure_model()
    expected = ModelSummary(one, max_depth=1)
    whole = PipelineSummary(Regressor(), max_depth=1)
    totals = ("total_parameters", "trainable_parameters", "total_flops", "total_training_modes")
    totals = tuple(total for total in totals if hasattr(expected, total))  # FLOPs from Lightning 2.6
    assert [getattr(whole, total) for total in totals] == [getattr(expected, total) for total in totals]
    assert whole.total_flops == 2 * (8 * 32 + 2 * 32 * 32 + 32)  # the four Linear layers, one sample
    assert [flops.strip() for flops in dict(whole.rows())["FLOPs"]] == ["512", "2.0 K", "2.0 K", "64"]
    # a forward that needs real values: FLOPs not counted, said as Lightning says it (n/a), nothing raised
    assert PipelineSummary(KeepsThePositive(), max_depth=1).total_flops == 0
    assert dict(PipelineSummary(KeepsThePositive(), max_depth=1).rows())["FLOPs"] == ["n/a"] * 5


def average_weights(**trainer: Any) -> dict[str, torch.Tensor]:
    """Three epochs, weights averaged from the second (Lightning's ``StochasticWeightAveraging``)."""
    module = Regressor()
    averaging = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)
    run = L.Trainer(
        max_epochs=3, precision="64-true", use_distributed_sampler=False, callbacks=[averaging], **trainer
    )
    run.fit(module, data(workers=0), data(seed=1, workers=0))
    return dict(module.state_dict())


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_stochastic_weight_averaging_equals_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker averages the layers it holds; the averaged model that comes back is one device's."""
    monkeypatch.chdir(tmp_path)
    strategy = OobleckStrategy(microbatch_size=2, planner={"cluster": {"device_memory_bytes": 75_000}})
    averaged = average_weights(strategy=strategy, devices=4)
    assert_same_weights(averaged, average_weights(strategy="auto", devices=1, enable_model_summary=False))


class FindsItsRate(Regressor):
    """A learning rate the finder can set (Lightning's convention: ``lr`` on the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 1e-2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def find_the_rate_then_fit(**trainer: Any) -> tuple[Any, FindsItsRate]:
    """As Lightning's docs: ``Tuner(trainer).lr_find(model)`` sets ``model.lr``; then ``trainer.fit(model)``
    on the same Trainer."""
    module = FindsItsRate()
    run = L.Trainer(max_steps=8, precision="64-true", use_distributed_sampler=False, **trainer)
    found = Tuner(run).lr_find(module, data(workers=0), data(seed=1, workers=0), num_training=30)
    run.fit(module, data(workers=0), data(seed=1, workers=0))
    return found, module


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_the_learning_rate_finder_and_the_fit_after_it_equal_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finder's run (a checkpoint before the first update, the range test, the restore) and the fit it
    prepares: the same losses, suggestion and weights as on one device (the loaders in their own order)."""
    monkeypatch.chdir(tmp_path)
    strategy = OobleckStrategy(microbatch_size=2, planner={"cluster": {"device_memory_bytes": 75_000}})
    found, trained = find_the_rate_then_fit(strategy=strategy, devices=4)
    expected, one = find_the_rate_then_fit(strategy="auto", devices=1, enable_model_summary=False)
    assert found.results["loss"] == pytest.approx(expected.results["loss"], rel=0, abs=1e-9)
    assert found.suggestion() == expected.suggestion() == trained.lr == one.lr != 1e-2
    assert_same_weights(dict(trained.state_dict()), dict(one.state_dict()))


class Data(L.LightningDataModule):
    """The loaders of :func:`data`, made in ``setup()`` as DataModules make them, after the strategy needs the
    global batch size: it comes from the ``batch_size`` hyperparameter (Lightning's convention)."""

    def __init__(self, batch_size: int | None = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.loaders = (data(), data(seed=1, workers=0))

    def train_dataloader(self) -> DataLoader:
        return self.loaders[0]

    def val_dataloader(self) -> DataLoader:
        return self.loaders[1]


@pytest.mark.timeout(240)
def test_a_datamodule_trains_the_same_weights_with_its_batch_size_as_the_global_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor]
) -> None:
    monkeypatch.chdir(tmp_path)
    strategy = OobleckStrategy(microbatch_size=2, planner={"cluster": {"device_memory_bytes": 75_000}})
    trainer = L.Trainer(strategy=strategy, devices=4, max_steps=8, precision="64-true")
    module = Regressor()
    trainer.fit(module, datamodule=Data())
    assert_same_weights(dict(module.state_dict()), uninterrupted)  # global batches of 16, in the same order

    # Without a batch size to take, one error that names both fixes, before any worker starts training.
    trainer = L.Trainer(strategy=OobleckStrategy(), devices=2, max_steps=8, precision="64-true")
    with pytest.raises(ValueError, match=r"global_batch_size=64\)\), or a batch_size attribute"):
        trainer.fit(Regressor(), datamodule=Data(batch_size=None))


class OnAPlateau(Regressor):
    """The learning rate halved whenever ``val_loss`` does not improve (the scheduler Lightning steps with
    a monitored metric)."""

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=5e-2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def fit_with_the_callbacks_users_add(
    root: Path, more: list[L.Callback], **trainer: Any
) -> tuple[L.Trainer, OnAPlateau]:
    """Early stopping, the best two checkpoints and the last, the learning rate logged every step, validation
    twice an epoch, the training loader's own order (``use_distributed_sampler=False``: under a distributed
    strategy Lightning shuffles training loaders, one device does not); ``trainer`` names the strategy and
    devices, ``more`` adds callbacks."""
    module = OnAPlateau()
    run = L.Trainer(
        default_root_dir=root,
        max_epochs=12,
        val_check_interval=4,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        precision="64-true",
        callbacks=[
            EarlyStopping("val_loss", patience=2),
            ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True),
            LearningRateMonitor("step"),
            *more,
        ],
        **trainer,
    )
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16, num_workers=1)
    run.fit(module, train, data(seed=1, workers=0))
    return run, module


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_early_stopping_best_checkpoints_and_a_plateau_schedule_equal_one_device(tmp_path: Path) -> None:
    """The callbacks users add, each deciding from the metrics the pipelines compute, decide as on one
    device, rank 0 SIGKILLed at step 10 included: the run stops at the same step, with the same learning
    rates, the same weights, and the same best checkpoints, whose weights are one device's; the caller's
    Trainer gets the callbacks' state back from a survivor."""
    strategy = OobleckStrategy(microbatch_size=2, planner={"cluster": {"device_memory_bytes": 75_000}})
    pipelines, trained = fit_with_the_callbacks_users_add(
        tmp_path / "pipelines", [KillAt(0, 10)], strategy=strategy, devices=4
    )
    # Lightning's own summary on one device would run the float32 example_input_array in float64 layers
    one, expected = fit_with_the_callbacks_users_add(
        tmp_path / "one", [], strategy="auto", devices=1, enable_model_summary=False
    )

    assert 0 < pipelines.global_step == one.global_step < 12 * 8  # stopped early, at the same step
    assert_same_weights(dict(trained.state_dict()), dict(expected.state_dict()))

    def logged(root: Path) -> list[tuple[str, str]]:
        lines = (root / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
        header = lines[0].split(",")
        rows = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]
        return [(row["step"], row["lr-AdamW"]) for row in rows if row["lr-AdamW"]]

    rates = logged(tmp_path / "one")
    assert len({rate for _, rate in rates}) > 1  # the plateau lowered the rate
    assert logged(tmp_path / "pipelines") == rates

    # The callbacks' state comes back to the caller's Trainer, the checkpoints' paths in the run's directory.
    def callbacks(trainer: L.Trainer, root: Path) -> dict[str, Any]:
        saved, stopped = trainer.checkpoint_callback, trainer.early_stopping_callback
        files = {
            "in": sorted(p.name for p in Path(saved.dirpath).iterdir()),
            "best": Path(saved.best_model_path).relative_to(root),
            "best k": sorted(Path(path).relative_to(root) for path in saved.best_k_models),
            "last": Path(saved.last_model_path).relative_to(root),
            "stopped": (stopped.stopped_epoch, stopped.wait_count),
        }
        scores = [float(saved.best_model_score), float(stopped.best_score)]
        return files, sorted(map(float, saved.best_k_models.values())) + scores

    (files, scores), (expected_files, expected_scores) = (
        callbacks(pipelines, tmp_path / "pipelines"),
        callbacks(one, tmp_path / "one"),
    )
    assert files == expected_files
    assert scores == pytest.approx(expected_scores, rel=0, abs=1e-9)
    assert len(files["in"]) == 3 and files["stopped"][0] > 0  # the best two, last.ckpt; stopped early
    best = Path(pipelines.checkpoint_callback.best_model_path)
    consolidated = torch.load(consolidate_checkpoint(best, tmp_path / "best.ckpt"), weights_only=False)
    reference = torch.load(one.checkpoint_callback.best_model_path, weights_only=False)
    assert_same_weights(consolidated["state_dict"], reference["state_dict"])


# The user's script of the console test: python test_user_defaults.py OUT [--kill-rank-0-at-step-3]
if __name__ == "__main__":
    kill = [KillAt(0, 3)] if "--kill-rank-0-at-step-3" in sys.argv else None
    # evaluation sets of 136 samples: 8 after the last global batch of 16
    torch.save(fit(Regressor(), 8, callbacks=kill, validation_samples=136), sys.argv[1])
    print(FIT_DONE, flush=True)
    print(FIT_DONE, file=sys.stderr, flush=True)
    strategy = OobleckStrategy(microbatch_size=2, planner={"cluster": {"device_memory_bytes": 75_000}})
    trainer = L.Trainer(strategy=strategy, devices=4, precision="64-true", default_root_dir="evaluation")
    trainer.validate(Regressor(), data(seed=1, workers=0, samples=136))
    trainer.test(Regressor(), data(seed=1, workers=0, samples=136))
