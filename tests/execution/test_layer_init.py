"""A model's own initialisation survives being cut into stages: a wrapper's ``reset_parameters`` decides
for its whole subtree, a custom :data:`LayerInit` (``_init_weights``-style) replaces the default, and
layer ``i`` gets the same weights whatever else a process builds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_oobleck.execution.stage import build_reference_model, build_stage

CPU = torch.device("cpu")


class ScaledBlock(nn.Module):
    """A wrapper that initialises its children itself (GPT-2 style: normal 0.02, scaled projection)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc.weight, std=0.02)
        nn.init.normal_(self.proj.weight, std=0.02 / 8)
        nn.init.zeros_(self.fc.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


def gpt2_init(module: nn.Module) -> None:
    """What Hugging Face's ``GPT2PreTrainedModel._init_weights`` does for these module types."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def layers() -> list[nn.Module]:
    return [nn.Embedding(100, 64), ScaledBlock(), ScaledBlock(), nn.LayerNorm(64), nn.Linear(64, 100)]


def test_a_wrapper_initialises_its_subtree_and_its_children_are_not_reset_after_it() -> None:
    model = build_reference_model(layers, CPU, seed=3)
    block = model.layer(1)
    assert block.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.proj.weight.std().item() == pytest.approx(0.02 / 8, rel=0.05)
    assert not block.fc.bias.any()


def test_a_custom_init_replaces_the_default_and_every_layout_gets_the_same_weights() -> None:
    def init(layer: nn.Module, index: int) -> None:
        layer.apply(gpt2_init)

    whole = build_reference_model(layers, CPU, seed=3, init=init)
    assert whole.layer(0).weight.std().item() == pytest.approx(0.02, rel=0.05)  # not N(0, 1)
    assert whole.layer(4).weight.std().item() == pytest.approx(0.02, rel=0.05)  # not kaiming
    assert not torch.equal(whole.layer(1).fc.weight, whole.layer(2).fc.weight)  # seeded per layer
    for owned in ([4], [1, 2], [0, 3]):
        part = build_stage(layers, owned, CPU, seed=3, init=init)
        for i in owned:
            for (name, value), expected in zip(
                part.layer(i).state_dict().items(), whole.layer(i).state_dict().values(), strict=True
            ):
                assert torch.equal(value, expected), f"layer {i} {name} with layers {owned}"


def test_an_init_that_misses_a_parameter_is_refused_by_name() -> None:
    def only_weights(layer: nn.Module, index: int) -> None:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    with pytest.raises(
        ValueError, match=r"layer 4 \(Linear\): \['bias'\] are not initialised by .*only_weights"
    ):
        build_stage(layers, [4], CPU, init=only_weights)


def tied_layers() -> list[nn.Module]:
    """``layers`` with the output projection tied to the embedding."""
    model = layers()
    model[-1].weight = model[0].weight
    return model


@pytest.mark.parametrize("source", [layers, tied_layers], ids=["untied", "tied"])
def test_the_profiler_materialises_one_layer_at_a_time(source: Any) -> None:
    """A model larger than the device can be profiled: never two of its layers exist at once, a tied head's
    embedding included."""
    import gc
    import weakref

    from lightning_oobleck.execution.profiler import profile_layers
    from lightning_oobleck.execution.stage import reset_parameters

    live: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    most = 0

    def counting(layer: nn.Module, index: int) -> None:
        nonlocal most
        reset_parameters(layer, index)
        gc.collect()
        live.add(layer)
        most = max(most, len(live))

    profile = profile_layers(source, torch.randint(0, 100, (4,)), CPU, repeat=1, warmup=0, init=counting)
    assert profile.num_layers == 5 and most == 1
    assert profile.layers[4].parameter_bytes == (64 * 100 + 100) * 4
