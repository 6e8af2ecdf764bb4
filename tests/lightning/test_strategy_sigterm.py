"""A SIGTERM to one worker stops every worker at the start of the same batch, as Lightning does with DDP.

Lightning checks a SIGTERM flag shared by all ranks before every batch (with DDP: a broadcast on the default
group, and another one from inside its signal handler). Under the oobleck strategy the step's commit carries
the flag, so no collective runs outside the recoverable units; each worker must still raise
``SIGTERMException`` at the same batch.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException
from pipeline_testing import GLOBAL_BATCH, MICRO, TinyNet, train_loader

from lightning_oobleck.lightning import OobleckStrategy
from lightning_oobleck.lightning.launcher import LaunchError

SIGNALLED_NODE, SIGNAL_AFTER_STEP = 2, 2


class SigtermAfter(L.Callback):
    """Node ``SIGNALLED_NODE`` sends itself SIGTERM after step ``SIGNAL_AFTER_STEP``; every worker records
    the last step it completed."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        node, _ = trainer.strategy.worker
        (self.out / f"last-step-{node}.json").write_text(json.dumps(trainer.global_step))
        if node == SIGNALLED_NODE and trainer.global_step == SIGNAL_AFTER_STEP:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.timeout(120)
def test_sigterm_to_one_worker_stops_every_worker_at_the_same_batch(tmp_path: Path) -> None:
    strategy = OobleckStrategy(
        global_batch_size=GLOBAL_BATCH, microbatch_size=MICRO, layout=[[0, 3, 6], [0, 6]], microbatches=[2, 2]
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        precision="64-true",
        strategy=strategy,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SigtermAfter(tmp_path)],
        default_root_dir=tmp_path,
    )
    with pytest.raises(LaunchError) as error:
        trainer.fit(TinyNet(), train_loader())
    for rank in range(3):
        assert f"rank {rank}: raised {SIGTERMException.__module__}.{SIGTERMException.__name__}" in str(
            error.value
        )
    # the signal arrives after step 2's commit: step 3's commit carries it, every worker stops before step 4
    assert [json.loads((tmp_path / f"last-step-{n}.json").read_text()) for n in range(3)] == [3, 3, 3]
