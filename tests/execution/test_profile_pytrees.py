"""The profiler runs layers that pass pytrees and take side inputs, and counts what really crosses a stage
boundary: every tensor of a layer's output, whatever its dtype."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_oobleck.execution.profiler import profile_layers

CPU = torch.device("cpu")
B, WIDTH, LENGTH = 4, 8, 5


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        return {"hidden": self.fc(x), "mask": attention_mask.bool(), "ids": attention_mask.long()}


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2)

    def forward(self, x: dict[str, Tensor], attention_mask: Tensor) -> Tensor:
        assert torch.equal(x["mask"], attention_mask.bool())  # the context reaches every layer that names it
        return self.fc(x["hidden"] * x["mask"].unsqueeze(-1))


def test_pytree_outputs_are_profiled_at_their_real_size_with_the_context() -> None:
    x = torch.randn(B, LENGTH, WIDTH, dtype=torch.float64)
    mask = torch.ones(B, LENGTH, dtype=torch.int32)
    profile = profile_layers(
        [Split(), Join()], x, CPU, torch.float64, warmup=0, repeat=1, example_context={"attention_mask": mask}
    )
    hidden, flags, ids = B * LENGTH * WIDTH * 8, B * LENGTH * 1, B * LENGTH * 8
    assert profile.layers[0].output_activation_bytes == hidden + flags + ids
    assert profile.layers[1].output_activation_bytes == B * LENGTH * 2 * 8
    assert profile.layers[0].activation_bytes > 0 and profile.layers[1].activation_bytes > 0
