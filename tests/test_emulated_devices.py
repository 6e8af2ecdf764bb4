"""Emulated layers compute exactly (``y = x + bias``), keep the input and weight gradients apart, and their
profile states their real sizes."""

from __future__ import annotations

import pytest
import torch

from lightning_oobleck.execution import profile_layers
from lightning_oobleck.testing import DeviceTimes, EmulatedLayer, emulated_layers, emulated_profile

TIMES = DeviceTimes(0.0, 0.0, 0.0)


def test_an_emulated_layer_adds_its_bias_and_its_gradients_are_exact() -> None:
    layer = EmulatedLayer(4, TIMES).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
    y = layer(x)
    torch.testing.assert_close(y, x + layer.bias)
    (y * y).sum().backward()
    torch.testing.assert_close(x.grad, 2 * y)
    torch.testing.assert_close(layer.bias.grad, (2 * y).sum(dim=(0, 1)))


def test_the_input_and_weight_gradients_are_separate_graph_nodes() -> None:
    """A split backward can compute the input's gradient without the weight's."""
    layer = EmulatedLayer(4, TIMES)
    x = torch.randn(2, 4, requires_grad=True)
    (input_node, _), (weight_node, _) = layer(x).grad_fn.next_functions
    assert {type(input_node).__name__, type(weight_node).__name__} == {"_TimedBackward"}
    assert input_node is not weight_node
    (dx,) = torch.autograd.grad(layer(x).sum(), x)  # the weight's node is not needed for this
    torch.testing.assert_close(dx, torch.ones_like(x))
    assert layer.bias.grad is None


def test_the_profile_states_the_layers_real_sizes_and_the_configured_times() -> None:
    times = DeviceTimes(0.01, 0.02, 0.03)
    layers = emulated_layers(3, 16, times)
    profile = emulated_profile(3, 16, times, microbatch_size=4, sequence=8)
    output = layers[0](torch.zeros(4, 8, 16))
    for index, (layer, entry) in enumerate(zip(layers, profile.layers, strict=True)):
        assert entry.parameter_bytes == sum(p.numel() * p.element_size() for p in layer.parameters())
        assert entry.output_activation_bytes == output.numel() * output.element_size()
        # the first layer is fed the data, which needs no gradient: its backward is the weight's alone
        backward = 0.03 if index == 0 else 0.05
        assert (entry.forward_s, entry.backward_s, entry.weight_grad_s) == (
            0.01,
            pytest.approx(backward),
            0.03,
        )


def test_the_profiler_measures_the_configured_times() -> None:
    """The profiler times an emulated layer's forward, input gradient and weight gradient apart, like any
    layer's: never below the sleeps, and close above them (Python and autograd add little)."""
    times = DeviceTimes(0.01, 0.02, 0.03)
    profile = profile_layers(lambda: emulated_layers(2, 16, times), torch.zeros(4, 16), torch.device("cpu"))
    for index, entry in enumerate(profile.layers):
        assert entry.weight_grad_s is not None
        input_grad = entry.backward_s - entry.weight_grad_s
        configured = (0.01, 0.0 if index == 0 else 0.02, 0.03)
        for measured, expected in zip(
            (entry.forward_s, input_grad, entry.weight_grad_s), configured, strict=True
        ):
            assert expected <= measured < expected + 0.008, (index, measured, expected)


def test_negative_times_are_refused() -> None:
    with pytest.raises(ValueError, match="emulated compute times must be >= 0"):
        DeviceTimes(0.01, -1.0, 0.0)
