"""Per-layer profile: the planner's only view of the model and the device.

A profile is measured for one micro-batch size on one kind of device (``lightning_oobleck.execution.profiler``)
or generated synthetically (``synthetic_gpt_profile``) to size clusters without hardware.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LayerProfile:
    """Cost of one layer for one micro-batch."""

    forward_s: float
    backward_s: float
    parameter_bytes: int
    output_activation_bytes: int
    """Bytes of the layer's output for one micro-batch: what crosses a stage boundary after it."""
    activation_bytes: int
    """Memory the layer keeps alive per in-flight micro-batch (saved tensors for its backward)."""


@dataclass(frozen=True)
class ModelProfile:
    """The profile of a whole model: its layers in order, plus what they were measured for."""

    layers: tuple[LayerProfile, ...]
    microbatch_size: int
    device: str = "synthetic"
    dtype: str = "float32"
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "microbatch_size": self.microbatch_size,
            "device": self.device,
            "dtype": self.dtype,
            "meta": self.meta,
            "layers": [asdict(layer) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        try:
            layers = tuple(LayerProfile(**layer) for layer in d["layers"])
            return cls(layers, int(d["microbatch_size"]), str(d.get("device", "")), str(d.get("dtype", "")),
                       dict(d.get("meta", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a layer profile ({e}); expected the JSON written by ModelProfile.save") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))
