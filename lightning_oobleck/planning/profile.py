"""Per-layer profile: the planner's only view of the model and the device.

A profile is measured for one micro-batch size on one kind of device
(``lightning_oobleck.execution.profiler``) or generated synthetically (:func:`synthetic_gpt_profile`) to
size clusters without hardware. Device memory and bandwidths are not part of a profile: they describe
the cluster (:class:`lightning_oobleck.planning.cluster.ClusterSpec`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
"""Bytes per element of the dtypes a profile may name."""


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
    weight_grad_s: float | None = None
    """The part of ``backward_s`` that computes the parameters' gradients (``W`` of a split backward; the
    rest is ``I``, the input's gradient). ``None`` in profiles measured before the split was profiled."""


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

    @property
    def dtype_bytes(self) -> int:
        """Bytes per parameter element (``dtype``); unknown dtypes count as 4 bytes."""
        return DTYPE_BYTES.get(self.dtype, 4)

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
            return cls(
                layers,
                int(d["microbatch_size"]),
                str(d.get("device", "")),
                str(d.get("dtype", "")),
                dict(d.get("meta", {})),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"not a layer profile ({e}); expected the JSON written by ModelProfile.save"
            ) from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def synthetic_gpt_profile(
    num_layers: int,
    hidden: int = 2048,
    seq_len: int = 2048,
    microbatch_size: int = 1,
    device_flops: float = 1.0e14,
    *,
    heads: int | None = None,
    vocab_size: int = 50257,
    dtype: str = "float16",
) -> ModelProfile:
    """A GPT-like profile from closed-form formulas, for planning without hardware.

    Layer 0 is the token + position embedding, layers ``1..num_layers-2`` are transformer blocks and the
    last layer is the final norm + LM head (untied) + loss, so ``num_layers >= 3``. With ``b`` the
    micro-batch size, ``s`` the sequence length, ``h`` the hidden size, ``a`` the heads, ``V`` the
    vocabulary and ``e`` the dtype's bytes:

    * block forward FLOPs ``24 b s h^2 + 4 b s^2 h`` (QKV, projection, 4h MLP, attention scores);
      backward is twice the forward, half of it the weights' gradients (as many FLOPs as the input's
      for a matrix product); times are FLOPs / ``device_flops`` (achieved FLOP/s);
    * block parameters ``12 h^2 + 13 h`` elements;
    * block activation memory per in-flight micro-batch ``s b h (34 + 5 a s / h) * e / 2`` bytes
      (Korthikanti et al., no recomputation);
    * every layer but the last outputs ``b s h`` elements; the head's logits (``b s V``, kept in
      float32 for the loss) are its activation memory and its output is the scalar loss.
    """
    if num_layers < 3:
        raise ValueError(
            f"a synthetic GPT profile needs at least 3 layers (embedding, one block, head), got {num_layers}"
        )
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    if min(hidden, seq_len, microbatch_size) <= 0 or device_flops <= 0:
        raise ValueError("hidden, seq_len, microbatch_size and device_flops must be positive")
    a = heads or max(1, hidden // 128)
    e = DTYPE_BYTES[dtype]
    b, s, h, v = microbatch_size, seq_len, hidden, vocab_size
    tokens_out = b * s * h * e

    block_flops = 24 * b * s * h * h + 4 * b * s * s * h
    block = LayerProfile(
        forward_s=block_flops / device_flops,
        backward_s=2 * block_flops / device_flops,
        parameter_bytes=(12 * h * h + 13 * h) * e,
        output_activation_bytes=tokens_out,
        activation_bytes=int(s * b * h * (34 + 5 * a * s / h) * e / 2),
        weight_grad_s=block_flops / device_flops,
    )
    embedding_flops = 2 * b * s * h
    embedding = LayerProfile(
        forward_s=embedding_flops / device_flops,
        backward_s=2 * embedding_flops / device_flops,
        parameter_bytes=(v + s) * h * e,
        output_activation_bytes=tokens_out,
        activation_bytes=tokens_out,
        weight_grad_s=2 * embedding_flops / device_flops,
    )
    head_flops = 2 * b * s * h * v
    head = LayerProfile(
        forward_s=head_flops / device_flops,
        backward_s=2 * head_flops / device_flops,
        parameter_bytes=(h * v + 2 * h) * e,
        output_activation_bytes=4,
        activation_bytes=b * s * v * 4 + tokens_out,
        weight_grad_s=head_flops / device_flops,
    )
    return ModelProfile(
        layers=(embedding, *([block] * (num_layers - 2)), head),
        microbatch_size=microbatch_size,
        device="synthetic",
        dtype=dtype,
        meta={
            "hidden": hidden,
            "seq_len": seq_len,
            "heads": a,
            "vocab_size": v,
            "device_flops": device_flops,
        },
    )
