"""The user contract on one process: the same PipelineModule trains without the oobleck strategy."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from pipeline_testing import TinyNet, reference_train_loader
from torch import nn

from lightning_oobleck.execution.stage import build_reference_model
from lightning_oobleck.lightning import MissingPipelineHookError, PipelineModule


def test_single_process_module_holds_every_layer_under_global_names_and_runs_them_in_order() -> None:
    model = TinyNet()
    model.configure_model()
    assert list(model.layers.keys()) == [str(i) for i in range(6)]
    expected = build_reference_model(model.configure_layers, torch.device("cpu"), seed=model.init_seed)
    torch.testing.assert_close(model.state_dict(), expected.state_dict(), rtol=0, atol=0)
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)


def test_the_default_steps_train_with_the_default_strategy() -> None:
    model = TinyNet()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, reference_train_loader(seed=0))
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_a_fresh_module_loads_a_full_state_dict_with_its_dtype() -> None:
    trained = TinyNet()
    trained.configure_model()
    state = {k: v.double() + 1 for k, v in trained.state_dict().items()}
    fresh = TinyNet()
    fresh.load_state_dict(state)
    for key, value in state.items():
        assert fresh.state_dict()[key].dtype == torch.float64
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)


class NoLoss(PipelineModule, L.LightningModule):
    def configure_layers(self) -> list[nn.Module]:
        return [nn.Linear(4, 3)]


def test_missing_loss_hook_and_unusual_batches_explain_the_fix() -> None:
    model = NoLoss()
    model.configure_model()
    hint = r"(?s)implement compute_loss\(output, target\).*class"
    with pytest.raises(MissingPipelineHookError, match=hint):
        model.pipeline_loss((torch.randn(2, 4), torch.tensor([0, 1])))
    with pytest.raises(TypeError, match=r"override split_batch\(self, batch\) -> \(inputs, targets\)"):
        model.pipeline_loss({"x": torch.randn(2, 4)})


class OwnInitNet(TinyNet):
    """TinyNet initialised its own way (GPT-2's normal 0.02, zero biases) through ``init_layer``."""

    def init_layer(self, layer: nn.Module, index: int) -> None:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_the_models_own_init_gives_the_same_weights_on_one_device_and_on_a_heterogeneous_layout(
    recompute: bool,
) -> None:
    """Also with activation recomputation on every stage: the same weights either way."""
    from pipeline_testing import train_loader

    from lightning_oobleck.lightning import OobleckStrategy

    kwargs = dict(
        accelerator="cpu", precision="64-true", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    initial = OwnInitNet()
    initial.configure_model()
    assert initial.layers["0"].weight.std().item() < 0.06  # normal(0.02) of 32 values, not kaiming (~0.29)
    assert not initial.layers["5"].bias.any()
    single = OwnInitNet()  # built by the Trainer, in float64 like the workers' layers
    L.Trainer(devices=1, **kwargs).fit(single, reference_train_loader(seed=0))

    strategy = OobleckStrategy(
        layout=[[0, 3, 6], [0, 6]],
        fault_tolerance=1,
        global_batch_size=8,
        microbatch_size=2,
        activation_checkpointing=recompute,
    )
    piped = OwnInitNet()
    L.Trainer(devices=3, strategy=strategy, **kwargs).fit(piped, train_loader())
    for name, value in single.state_dict().items():
        torch.testing.assert_close(piped.state_dict()[name], value, rtol=0, atol=1e-10, msg=name)
