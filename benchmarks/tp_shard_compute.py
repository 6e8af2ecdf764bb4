"""How a transformer block's compute scales when its width is split over t devices (Megatron's shards).

One device runs what one rank of a t-way tensor-parallel stage computes: attention with n_heads/t heads, a
QKV projection of 3d/t columns, an output projection of d/t rows, an MLP of 4d/t. Forward + backward, bf16,
timed with CUDA events (median of 10 after 3 warm-ups). efficiency = time(1) / (t * time(t)): 1.0 is perfect
1/t scaling.

    python benchmarks/tp_shard_compute.py --out results.json
    python benchmarks/tp_shard_compute.py --profiler --out results.json   # through the package's profiler

``--profiler`` measures the same thing the way the planner sees it: the example GPT (hidden 4096, sequence
2048, bf16) profiled by :func:`~lightning_oobleck.execution.profile_layers` at tensor parallelism 1, 2, 4
and 8 (each layer split by its plan, one rank timed on this device, torch's fake process group answering
the others), and prints each layer kind's time per rank with the efficiency against ``t = 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch import nn


class ShardBlock(nn.Module):
    def __init__(self, d: int, heads: int, t: int) -> None:
        super().__init__()
        self.local_heads = heads // t
        self.head_dim = d // heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d // t)
        self.proj = nn.Linear(d // t, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d // t)
        self.out = nn.Linear(4 * d // t, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def time_block(d: int, heads: int, seq: int, mb: int, t: int) -> float:
    block = ShardBlock(d, heads, t).cuda().to(torch.bfloat16)
    x = torch.randn(mb, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        block(x).sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def profiled(out: str | None) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
    from model import GPTConfig, gpt_layers  # examples/gpt

    from lightning_oobleck.execution import profile_layers

    config = GPTConfig(vocab_size=50304, seq_len=2048, d_model=4096, n_heads=32, n_blocks=2)
    ids = torch.zeros(1, config.seq_len, dtype=torch.long)
    profile = profile_layers(
        lambda: gpt_layers(config), ids, torch.device("cuda"), torch.bfloat16, tensor_parallel=(2, 4, 8)
    )
    rows = []
    for index, kind in ((0, "embedding"), (1, "block"), (3, "head")):
        base = profile.at(1).layers[index]
        for t in profile.tensor_parallel_degrees:
            layer = profile.at(t).layers[index]
            step = layer.forward_s + layer.backward_s
            efficiency = (base.forward_s + base.backward_s) / (t * step)
            rows.append({"layer": kind, "t": t, "ms": step * 1e3, "efficiency": efficiency,
                         "parameter_bytes": layer.parameter_bytes, "activation_bytes": layer.activation_bytes,
                         "all_reduce_bytes": sum(layer.tensor_parallel_forward_bytes)
                         + sum(layer.tensor_parallel_backward_bytes)})  # fmt: skip
            mib = {k: v / 2**20 for k, v in rows[-1].items() if k.endswith("bytes")}
            print(f"{kind} t={t}: {step * 1e3:8.3f} ms  efficiency {efficiency:.3f}  params "
                  f"{mib['parameter_bytes']:.1f} MiB  kept {mib['activation_bytes']:.1f} MiB  all-reduced "
                  f"{mib['all_reduce_bytes']:.1f} MiB", flush=True)  # fmt: skip
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--profiler", action="store_true")
    args = parser.parse_args()
    if args.profiler:
        profiled(args.out)
        return
    rows = []
    for d, heads, seq in ((4096, 32, 2048), (8192, 64, 4096)):
        for mb in (1, 4):
            base = None
            for t in (1, 2, 4, 8):
                ms = time_block(d, heads, seq, mb, t)
                base = base or ms
                rows.append({"d": d, "seq": seq, "mb": mb, "t": t, "ms": ms, "efficiency": base / (t * ms)})
                print(
                    f"d={d} seq={seq} mb={mb} t={t}: {ms:8.3f} ms  efficiency {base / (t * ms):.3f}",
                    flush=True,
                )
    print(torch.cuda.get_device_name())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
