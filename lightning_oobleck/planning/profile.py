"""Per-layer profile: the planner's only view of the model and the device.

A profile is measured for one micro-batch size on one kind of device
(``lightning_oobleck.execution.profiler``) or generated synthetically (:func:`synthetic_gpt_profile`) to
size clusters without hardware. Device memory and bandwidths are not part of a profile: they describe
the cluster (:class:`lightning_oobleck.planning.cluster.ClusterSpec`).

Tensor parallelism. A stage may run on ``t`` devices of one node, each layer split over them by its
tensor-parallel plan (Megatron-LM's column- and row-parallel matrix products). A profile then describes one
*rank* of such a stage: each layer's time, parameters and saved tensors on one device at ``t``, and the
all-reduces among the ``t`` devices that the split adds (:attr:`LayerProfile.tensor_parallel_forward_bytes`,
:attr:`LayerProfile.tensor_parallel_backward_bytes`), which the cost model charges at the cluster's
``tensor_parallel_bandwidth``. The profile for ``t = 1`` carries those for the other degrees it knows
(:attr:`ModelProfile.sharded`, read with :meth:`ModelProfile.at`); a model whose layers have no
tensor-parallel plan has none, and plans at ``t = 1`` only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
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
    tensor_parallel_forward_bytes: tuple[int, ...] = ()
    """At ``t > 1``: the size of each all-reduce among the stage's devices in the layer's forward (the output
    of every row-parallel product). Empty at ``t = 1``."""
    tensor_parallel_backward_bytes: tuple[int, ...] = ()
    """At ``t > 1``: the size of each all-reduce in the layer's backward (the input gradient of every
    column-parallel product); it is on the input gradient's path (``I``), not the weights' (``W``)."""
    backward_peak_bytes: int | None = None
    """How far the layer's backward of one micro-batch raises the bytes alive, run whole (1F1B's ``B``), once
    its parameters have gradients: the gradient arriving at its output, its intermediate and input gradients,
    each parameter's new gradient before it is added to the one the earlier micro-batches left, less the saved
    tensors it frees on the way. On top of every in-flight micro-batch's activations. ``None`` in synthetic
    profiles and in those measured before the profiler measured it (counted as 0), as the two below."""
    split_backward_peak_bytes: int | None = None
    """The same, the backward split as ZB-H1 runs it: ``I`` (the graph kept for ``W``), then ``W``."""
    weight_gradient_kept_bytes: int | None = None
    """What the layer's ``I`` keeps for its ``W`` (each weight's output gradient) beyond the micro-batch's
    activations, from one to the other: under ZB-H1 a stage keeps it for several micro-batches at once."""


@dataclass(frozen=True)
class ModelProfile:
    """The profile of a whole model: its layers in order, plus what they were measured for."""

    layers: tuple[LayerProfile, ...]
    microbatch_size: int
    device: str = "synthetic"
    dtype: str = "float32"
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    tensor_parallel: int = 1
    """The tensor-parallel degree ``t`` that :attr:`layers` describe one rank of."""
    sharded: dict[int, tuple[LayerProfile, ...]] = field(default_factory=dict, compare=False, hash=False)
    """The layers at other degrees ``t`` (of the ``t = 1`` profile): every layer split by its plan."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """Every degree ``t`` this profile describes, ascending."""
        return tuple(sorted({self.tensor_parallel, *self.sharded}))

    def at(self, tensor_parallel: int) -> ModelProfile:
        """The profile of one rank of a stage split over ``tensor_parallel`` devices."""
        if tensor_parallel == self.tensor_parallel:
            return self
        if tensor_parallel not in self.sharded:
            known = ", ".join(map(str, self.tensor_parallel_degrees))
            raise ValueError(
                f"the profile has no layers at tensor parallelism {tensor_parallel} (it has {known}): "
                + (
                    "the model's layers declare no tensor-parallel plan, so its stages run on one device each"
                    + (f" ({self.meta['tensor_parallel']})" if "tensor_parallel" in self.meta else "")
                    + ": declare one per layer (PipelineModule.tensor_parallel_plan), or tensor_parallel=1"
                    if not self.sharded
                    else f"choose one of {known}, or profile the model at {tensor_parallel}"
                )
            )
        return replace(
            self, layers=self.sharded[tensor_parallel], tensor_parallel=tensor_parallel, sharded={}
        )

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
            "layers": [_layer_dict(layer) for layer in self.layers],
            **({"tensor_parallel": self.tensor_parallel} if self.tensor_parallel != 1 else {}),
            **(
                {
                    "sharded": {
                        str(t): [_layer_dict(la) for la in layers] for t, layers in self.sharded.items()
                    }
                }
                if self.sharded
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        try:
            return cls(
                _layers(d["layers"]),
                int(d["microbatch_size"]),
                str(d.get("device", "")),
                str(d.get("dtype", "")),
                dict(d.get("meta", {})),
                int(d.get("tensor_parallel", 1)),
                {int(t): _layers(layers) for t, layers in d.get("sharded", {}).items()},
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


_COLLECTIVES = ("tensor_parallel_forward_bytes", "tensor_parallel_backward_bytes")


def _layer_dict(layer: LayerProfile) -> dict[str, Any]:
    """A layer as JSON: its collectives as lists, left out where it has none."""
    row = {f.name: getattr(layer, f.name) for f in fields(layer)}  # flat: asdict's deep copy is 10x slower
    for name in _COLLECTIVES:
        row[name] = list(row[name])
        if not row[name]:
            del row[name]
    return row


def _layers(rows: list[dict[str, Any]]) -> tuple[LayerProfile, ...]:
    return tuple(
        LayerProfile(**{**row, **{name: tuple(row.get(name, ())) for name in _COLLECTIVES}}) for row in rows
    )


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
    tensor_parallel: Sequence[int] | None = None,
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

    At each ``t`` of ``tensor_parallel`` (default: those of 1, 2, 4 and 8 that divide ``a``) the layers are
    split as Megatron-LM splits them, without sequence parallelism: a block's QKV and first MLP products by
    columns, its attention by heads, its output products by rows, so one rank computes ``1/t`` of the FLOPs at
    the same achieved FLOP/s, holds ``(12 h^2 + 7 h) / t + 6 h`` parameters (norms and the row-parallel
    biases whole), keeps ``s b h (10 + 24 / t + 5 a s / (h t)) * e / 2`` bytes (Korthikanti et al.) and
    all-reduces ``b s h`` elements twice forward and twice backward; the embedding splits the vocabulary
    (one all-reduce forward); the head splits the vocabulary's logits and computes a vocabulary-parallel
    cross-entropy (three all-reduces of ``b s`` float32 forward, the input's gradient backward). ``1/t`` of
    the FLOPs at the same FLOP/s is optimistic for small products (``docs/planning.md`` shows a device's).
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

    def layers(t: int) -> tuple[LayerProfile, ...]:
        ar = (tokens_out,) if t > 1 else ()
        block_flops = (24 * b * s * h * h + 4 * b * s * s * h) / t
        block = LayerProfile(
            forward_s=block_flops / device_flops,
            backward_s=2 * block_flops / device_flops,
            parameter_bytes=int(((12 * h * h + 7 * h) / t + 6 * h) * e),
            output_activation_bytes=tokens_out,
            activation_bytes=int(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * e / 2),
            weight_grad_s=block_flops / device_flops,
            tensor_parallel_forward_bytes=ar * 2,
            tensor_parallel_backward_bytes=ar * 2,
        )
        embedding_flops = 2 * b * s * h / t
        embedding = LayerProfile(
            forward_s=embedding_flops / device_flops,
            backward_s=2 * embedding_flops / device_flops,
            parameter_bytes=(-(-v // t) + s) * h * e,
            output_activation_bytes=tokens_out,
            activation_bytes=tokens_out,
            weight_grad_s=2 * embedding_flops / device_flops,
            tensor_parallel_forward_bytes=ar,
        )
        head_flops = 2 * b * s * h * v / t
        head = LayerProfile(
            forward_s=head_flops / device_flops,
            backward_s=2 * head_flops / device_flops,
            parameter_bytes=(h * -(-v // t) + 2 * h) * e,
            output_activation_bytes=4,
            activation_bytes=b * s * -(-v // t) * 4 + tokens_out,
            weight_grad_s=head_flops / device_flops,
            tensor_parallel_forward_bytes=(b * s * 4,) * 3 if t > 1 else (),
            tensor_parallel_backward_bytes=ar,
        )
        return (embedding, *([block] * (num_layers - 2)), head)

    if tensor_parallel is None:
        tensor_parallel = [t for t in (1, 2, 4, 8) if a % t == 0]
    if any(t < 1 or a % t for t in tensor_parallel):
        raise ValueError(f"tensor_parallel degrees {tuple(tensor_parallel)} must divide the {a} heads")
    return ModelProfile(
        layers=layers(1),
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
        sharded={t: layers(t) for t in sorted(set(tensor_parallel)) if t > 1},
    )
