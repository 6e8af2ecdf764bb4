"""Wrong use of the strategy fails with a message that names the problem and the fix.

Configuration mistakes are caught when the strategy or the Trainer is built, and the module and the
Trainer's loop flags when ``fit``/``predict`` is called, all in the launching process before any worker
starts; mistakes only visible inside a worker reach the caller through the launcher's error with the
worker's message.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from pipeline_testing import GLOBAL_BATCH, MICRO, TinyNet, train_loader
from torch import nn

from lightning_oobleck.lightning import MissingPipelineHookError, OobleckStrategy, PipelineModule
from lightning_oobleck.lightning.callbacks import KillAt
from lightning_oobleck.lightning.config import OobleckConfig
from lightning_oobleck.lightning.launcher import LaunchError
from lightning_oobleck.lightning.module import meta_layers
from lightning_oobleck.lightning.plan_agreement import layout_plan

TWO_PIPELINES = [[0, 3, 6], [0, 3, 6]]


def strategy(**overrides: object) -> OobleckStrategy:
    options = dict(global_batch_size=GLOBAL_BATCH, microbatch_size=MICRO, start_method="forkserver")
    return OobleckStrategy(**{**options, **overrides})


def trainer(devices: int, strategy: OobleckStrategy, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"global_batch_size": 0}, "global_batch_size must be positive"),
        (
            {"microbatch_size": 3},
            "does not divide global_batch_size=8: pick a divisor, e.g. microbatch_size=2",
        ),
        ({"start_method": "thread"}, "start_method must be one of forkserver, spawn, fork"),
        ({"microbatches": [2, 2]}, "only meaningful with layout"),
        ({"activation_checkpointing": "sometimes"}, "activation_checkpointing must be false, true or 'auto'"),
        (
            {"activation_checkpointing": "auto", "layout": [[0, 6]]},
            "'auto' lets the planner choose where to recompute; with a fixed layout or plan_path give true",
        ),
        ({"schedule": "gpipe"}, "schedule must be one of 1f1b, zb-h1 or 'auto', got 'gpipe'"),
        (
            {"schedule": "auto", "layout": [[0, 6]]},
            "schedule='auto' lets the planner choose; with a fixed layout name the schedule: 1f1b or zb-h1",
        ),
        (
            {"heartbeat_timeout_s": 60, "collective_timeout_s": 30},
            r"the timeouts must rise: 0 < heartbeat_timeout_s \(60\) < collective_timeout_s \(30\)",
        ),
    ],
)
def test_bad_options_are_refused_when_the_strategy_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strategy(**options)


def test_registered_name_and_config_file_build_the_same_strategy(tmp_path) -> None:
    path = tmp_path / "strategy.yaml"
    path.write_text(
        "global_batch_size: 16\nmicrobatch_size: 4\nfault_tolerance: 2\nplanner: {exact_limit: 10}\n"
    )
    from_file = OobleckStrategy.from_config(path)
    assert from_file.config == OobleckConfig(
        global_batch_size=16, microbatch_size=4, fault_tolerance=2, planner={"exact_limit": 10}
    )
    by_name = L.Trainer(accelerator="cpu", devices=2, strategy="oobleck", logger=False)
    assert isinstance(by_name.strategy, OobleckStrategy)


def test_devices_not_matching_the_layout_fail_when_the_trainer_is_built() -> None:
    with pytest.raises(
        ValueError, match=r"the layout has 4 stages in all but .* gives 3 processes: .* devices=4"
    ):
        trainer(3, strategy(layout=TWO_PIPELINES))


def test_layouts_that_break_the_guarantee_or_the_plan_are_refused() -> None:
    config = OobleckConfig(
        global_batch_size=GLOBAL_BATCH, microbatch_size=MICRO, fault_tolerance=1, devices_per_node=1
    )
    config.layout = [[0, 2, 4, 6]]
    with pytest.raises(ValueError, match="fault_tolerance=1 needs at least 2: add pipelines or lower"):
        layout_plan(config, 6, 3)
    config.layout = [[0, 2, 6], [0, 4, 6]]
    with pytest.raises(ValueError, match="one template per node count"):
        layout_plan(config, 6, 4)
    config.layout = [[0, 2, 5], [0, 6]]
    with pytest.raises(ValueError, match=r"must rise strictly from 0 to the number of layers \(6\)"):
        layout_plan(config, 6, 3)


def test_sixteen_bit_with_a_grad_scaler_is_refused_with_the_alternative() -> None:
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="use precision='bf16-mixed'"):
        trainer(4, strategy(layout=TWO_PIPELINES), plugins=[scaled])


class NoLayers(PipelineModule, L.LightningModule):
    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.mean()


class NotAPipeline(L.LightningModule):
    """A plain LightningModule: a complete one, for a single device."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0].float()), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_missing_layer_hook_shows_the_fix() -> None:
    with pytest.raises(
        MissingPipelineHookError, match=r"(?s)must implement configure_layers\(\).*class MyModel"
    ):
        meta_layers(NoLayers())


class ManualOptimisation(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda t: t.fit(NotAPipeline(), train_loader()), TypeError, "mix PipelineModule into it"),
        (
            lambda t: t.fit(TinyNet(), train_loader()),
            ValueError,
            r"accumulate_grad_batches=2 .*OobleckStrategy\(global_batch_size=...\) 2x the samples per step",
        ),
        (lambda t: t.fit(ManualOptimisation(), train_loader()), ValueError, "automatic optimisation only"),
        (lambda t: t.predict(TinyNet(), train_loader()), NotImplementedError, "oobleck consolidate"),
    ],
)
def test_what_cannot_run_is_refused_in_the_launching_process_before_any_worker_starts(
    call: Callable[[L.Trainer], object], error: type[Exception], message: str
) -> None:
    t = trainer(2, strategy(layout=[[0, 6], [0, 6]]), accumulate_grad_batches=2)
    started = time.monotonic()
    with pytest.raises(error, match=message):
        call(t)
    assert not t.strategy.launcher.procs  # no worker was started
    assert time.monotonic() - started < 5


class ScaleBlock(nn.Module):
    """A block that returns a Python number beside its tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return torch.tanh(self.fc(x)), 0.5


class ScaledHead(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 3)

    def forward(self, x: tuple[torch.Tensor, float]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x[0] * x[1])


class ScaleNet(TinyNet):
    def configure_layers(self) -> list[nn.Module]:
        return [nn.Linear(4, 8), ScaleBlock(), ScaledHead()]


@pytest.mark.timeout(120)
def test_a_layer_output_that_cannot_cross_a_stage_boundary_is_refused_by_name() -> None:
    with pytest.raises(LaunchError, match=r"layer 1 returned float values inside its output.*only tensors"):
        trainer(2, strategy(layout=[[0, 2, 3]], fault_tolerance=0)).fit(
            ScaleNet(), train_loader(torch.float32)
        )


class ClipsInAnotherHook(TinyNet):
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")


@pytest.mark.timeout(120)
def test_clipping_by_norm_outside_its_hook_is_refused_not_done_with_a_wrong_norm() -> None:
    """The step computes the model's gradient norm only when the run clips by norm (the Trainer's
    ``gradient_clip_val``, or ``configure_gradient_clipping``): a clip elsewhere would have no norm."""
    with pytest.raises(RuntimeError, match=r"clipped by norm outside `configure_gradient_clipping`"):
        trainer(2, strategy(layout=[[0, 6], [0, 6]])).fit(ClipsInAnotherHook(), train_loader(torch.float32))


def test_batch_sizes_default_to_the_loaders_batch_and_two_microbatches_per_process() -> None:
    config = OobleckConfig().with_batch(loader_batch_size=48, num_workers=4)
    assert (config.global_batch_size, config.microbatch_size) == (48, 6)
    assert OobleckConfig(microbatch_size=4).with_batch(48, 4).microbatch_size == 4
    assert OobleckConfig(global_batch_size=7).with_batch(48, 4).microbatch_size == 1
    hint = r"found no training DataLoader batch_size .*OobleckStrategy\(global_batch_size=64\)"
    with pytest.raises(ValueError, match=hint):
        OobleckConfig().with_batch(None, 4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"by": "exception", "after_s": 2.0}, "only a SIGKILL can come later"),
        ({"after_s": -1.0}, "a delay must be >= 0"),
        ({"by": "oom"}, "choose 'sigkill' or 'exception'"),
    ],
)
def test_a_fault_drill_that_cannot_happen_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KillAt(1, 5, **options)


def test_every_setting_is_a_typed_keyword_argument_with_the_configs_default() -> None:
    """What an IDE completes and ``help()`` shows: OobleckConfig's fields, their defaults the same."""
    parameters = inspect.signature(OobleckStrategy).parameters
    for field in dataclasses.fields(OobleckConfig):
        parameter = parameters[field.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.annotation is not None
        default = {} if field.default is dataclasses.MISSING else field.default
        assert (parameter.default or {} if field.name == "planner" else parameter.default) == default, (
            field.name
        )
    assert OobleckStrategy(layout=((0, 3, 6), (0, 6))).config.layout == [[0, 3, 6], [0, 6]]
