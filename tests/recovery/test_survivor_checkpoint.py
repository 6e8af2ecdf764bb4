"""More failures than a pipeline survives, through ``Trainer.fit``: the survivors checkpoint, stop, and a
new allocation resumes from it.

With n0 raised to 3 in the plan of 3 pipelines of 2 nodes (layers 0-2 | 3-5), nodes 1, 2, 4 and 5 are
SIGKILLed together in the middle of step ``KILL_STEP``: nodes 0 (layers 0-2) and 3 (layers 3-5) still
hold every layer but cannot form a pipeline. The fit must end with an error naming the survivors'
checkpoint and ``ckpt_path=``; ``Trainer.fit(ckpt_path=...)`` on another layout must then redo exactly the
interrupted step and train to ``max_steps``: weights equal to single-process Lightning training (1e-9),
every sample of every global batch fed exactly once over the two runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_fault_matrix import (  # puts tests/lightning (pipeline_testing) on the path
    FORWARD,
    GLOBAL_BATCH,
    MICRO,
    SAMPLES,
    SEED,
    STEPS,
    Fault,
    Faults,
    TinyNet,
    dataset,
    planned,
    reference,  # noqa: F401  (the fixture)
    trainer_kwargs,
)
from torch.utils.data import DataLoader

from lightning_oobleck.lightning import GlobalBatchSampler, OobleckStrategy
from lightning_oobleck.recovery.errors import UnrecoverableFailure

KILL_STEP = 2
KILLED = (1, 2, 4, 5)
RESUME_LAYOUT = [[0, 3, 6], [0, 6]]
"""3 processes: a 2-stage pipeline beside a 1-stage one (the first run had 3 pipelines of 2 stages)."""


class KillTogether(Faults):
    """The first of ``nodes`` SIGKILLs all of them, itself last, a few layers into step ``step``."""

    def __init__(self, out: Path, step: int, nodes: tuple[int, ...]) -> None:
        super().__init__(out, {(nodes[0], step): Fault(signal.SIGKILL, FORWARD)})
        self.others, self.armed_step = nodes[1:], step

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_fit_start(trainer, module)
        (self.out / f"pid-{self.name}").write_text(str(os.getpid()))
        self.workers = len(trainer.strategy.plan.workers)  # one record file each

    def _record(self, fault: Any) -> None:
        # A worker may still be between the last step's commit and its record of that step (written
        # after its optimizer step): wait for every worker's record before the kill.
        done = self.armed_step - 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            records = [path.read_text() for path in self.out.glob("fed-*.jsonl")]
            if len(records) == self.workers and all(f'"step": {done},' in r for r in records):
                break
            time.sleep(0.01)
        for node in self.others:
            (self.out / f"fault-{node}.0.json").write_text(json.dumps(fault.to_json()))
            os.kill(int((self.out / f"pid-{node}.0").read_text()), signal.SIGKILL)
        super()._record(fault)


def fit(out: Path, faults: Faults, ckpt_path: str | None = None, **strategy: Any) -> L.Trainer:
    """Train ``TinyNet`` as the fault matrix does, on ``strategy``'s layout."""
    processes = strategy.pop("processes")
    oobleck = OobleckStrategy(
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICRO,
        seed=SEED,
        start_method="forkserver",
        collective_timeout_s=20,
        heartbeat_timeout_s=4.0,
        **strategy,
    )
    loader = DataLoader(dataset(SAMPLES, seed=1, dtype=torch.float64), batch_size=GLOBAL_BATCH, shuffle=True)
    trainer = L.Trainer(devices=processes, strategy=oobleck, **trainer_kwargs(out, [faults]))
    trainer.fit(TinyNet(), loader, ckpt_path=ckpt_path)
    return trainer


def fed_steps(*runs: Path) -> dict[int, list[tuple[float, ...]]]:
    """The samples fed at each counted step, by every first stage of ``runs``."""
    fed: dict[int, list[tuple[float, ...]]] = {}
    for path in (p for run in runs for p in run.glob("fed-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            fed.setdefault(record["step"], []).extend(map(tuple, record["rows"]))
    return fed


@pytest.mark.timeout(300)
def test_survivors_checkpoint_then_resume_on_another_layout(
    tmp_path: Path,
    reference: dict[str, torch.Tensor],  # noqa: F811
) -> None:
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir()
    resumed.mkdir()
    plan_path = first / "plan.json"
    plan_path.write_text(dataclasses.replace(planned(6), n0=3).to_json())
    checkpoint = first / "oobleck-survivors" / f"survivors-step{KILL_STEP}"

    with pytest.raises(UnrecoverableFailure) as error:  # raised once, not per survivor
        fit(
            first,
            KillTogether(first, KILL_STEP, KILLED),
            processes=6,
            plan_path=str(plan_path),
            fault_tolerance=2,
        )
    message = str(error.value)
    assert "no pipeline fits" in message, message
    # and why: the nodes lost, each with its cause
    lost = message.split("[lost: ")[1].split("]")[0].split("; ")
    assert sorted(cause.split(")")[0] + ")" for cause in lost) == [f"({n}, 0)" for n in KILLED], message
    assert all(cause.endswith("the process died") for cause in lost), message
    assert f"Trainer.fit(ckpt_path={str(checkpoint)!r})" in message, message
    assert {p.name for p in first.glob("fault-*.json")} == {f"fault-{n}.0.json" for n in KILLED}
    assert not list(first.glob("final-*.pt"))

    trainer = fit(
        resumed,
        Faults(resumed, {}),
        ckpt_path=str(checkpoint),
        processes=3,
        layout=RESUME_LAYOUT,
        fault_tolerance=0,
    )
    assert trainer.state.finished and trainer.global_step == STEPS
    finals = sorted(resumed.glob("final-*.pt"))
    assert len(finals) == 3
    for path in finals:
        for name, value in torch.load(path).items():
            torch.testing.assert_close(
                value, reference[name], rtol=0, atol=1e-9, msg=f"{name} in {path.name}"
            )
    # The first run counted the steps before the kill, the resumed one redid the interrupted step and went
    # on: every sample of every global batch fed exactly once over both.
    data = dataset(SAMPLES, seed=1, dtype=torch.float64).tensors[0]
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    fed, fed_after = fed_steps(first, resumed), fed_steps(resumed)
    assert sorted(fed) == list(range(STEPS)) and min(fed_after) == KILL_STEP
    for step in range(STEPS):
        epoch, index = divmod(step, len(sampler))
        expected = sorted(tuple(data[i].tolist()) for i in sampler.global_batch(epoch, index))
        assert sorted(fed[step]) == expected, f"step {step}"
