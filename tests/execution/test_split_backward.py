"""Split backward: ``I`` then ``W`` gives exactly the gradients of one whole backward, each autograd node runs
once, parameters get theirs only in ``W`` (hooks fire there), and opted-out layers get theirs in ``I``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_oobleck.execution.backward import backward_input, backward_weight, splits_backward


@pytest.fixture(autouse=True)
def _float64():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        Counted.calls += 1
        return grad


class Shared(nn.Module):
    """One weight used twice, with counted nodes on the input path and on the weight path."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6) / 3)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = Counted.apply(self.weight)
        h = torch.tanh(Counted.apply(x @ w))
        return self.norm(h @ w + x)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6), nn.LayerNorm(6))


def _gpt2_block() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=16, n_head=2, n_layer=1, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    config._attn_implementation = "eager"
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config).double()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out

    return Block()


def _whole(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, list]:
    x = x.detach().requires_grad_()
    module(x).backward(grad)
    return x.grad, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize(
    ("make", "shape"),
    [(_mlp, (4, 6)), (_gpt2_block, (2, 5, 16)), (Shared, (4, 6))],
    ids=["mlp", "hf-gpt2-block", "shared-weight"],
)
def test_input_then_weight_gradients_equal_a_whole_backward(make, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    module = make()
    reference = copy.deepcopy(module)
    x = torch.randn(*shape, requires_grad=True)
    out = module(x)
    grad = torch.randn_like(out)
    expected_input, expected_params = _whole(reference, x, grad)
    Counted.calls = 0
    params = list(module.parameters())
    accumulated: list[str] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: accumulated.append(name))

    kept = backward_input([out], [grad], [x], params)
    torch.testing.assert_close(x.grad, expected_input, rtol=0, atol=1e-12)
    # a weight used at two depths of the input path cannot be split: it gets its gradient in I
    in_input_step = ["weight"] if make is Shared else []
    assert [name for name, p in module.named_parameters() if p.grad is not None] == in_input_step
    assert accumulated == in_input_step

    backward_weight(kept)
    for p, expected in zip(params, expected_params, strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-12)
    assert sorted(accumulated) == sorted(name for name, _ in module.named_parameters())
    if make is Shared:
        assert Counted.calls == 2  # each counted node ran once, as in a whole backward


def test_a_layer_that_opts_out_gets_its_gradients_in_the_input_step() -> None:
    torch.manual_seed(1)
    split, whole = _mlp(), _mlp()
    whole.split_backward = False
    assert splits_backward(split) and not splits_backward(whole)
    reference = copy.deepcopy(nn.Sequential(split, whole))
    x = torch.randn(4, 6, requires_grad=True)
    out = whole(split(x))
    grad = torch.randn_like(out)
    expected_input, expected_params = _whole(reference, x, grad)

    kept = backward_input([out], [grad], [x], list(split.parameters()), whole=list(whole.parameters()))
    torch.testing.assert_close(x.grad, expected_input, rtol=0, atol=1e-12)
    assert all(p.grad is None for p in split.parameters())
    assert all(p.grad is not None for p in whole.parameters())
    backward_weight(kept)
    params = [*split.parameters(), *whole.parameters()]
    for p, expected in zip(params, expected_params, strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-12)


def test_without_inputs_the_weight_step_runs_the_whole_backward() -> None:
    torch.manual_seed(2)
    module = _mlp()
    reference = copy.deepcopy(module)
    x = torch.randn(4, 6)
    out = module(x)
    grad = torch.randn_like(out)
    reference(x).backward(grad)

    kept = backward_input([out], [grad], [], list(module.parameters()))
    assert all(p.grad is None for p in module.parameters())
    backward_weight(kept)
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
