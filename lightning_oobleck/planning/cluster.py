"""The cluster the planner places a model on: node count, devices per node, memory and links."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClusterSpec:
    """N identical nodes of G identical devices.

    Defaults describe an A40-class node (48 GB devices, NVLink-class links inside a node, a 200 Gb/s
    network between nodes). Bandwidths are in bytes per second, latencies in seconds.

    ``device_memory_bytes`` is what the planner may fill with tensors, not the card's size: on an H200 the
    caching allocator reserved 1.16 times its tensors' peak and the CUDA context and libraries took 0.8 GB
    beside it (``benchmarks/gpu_check.py``), so about ``(card - 0.8 GB) / 1.16``: 68e9 for an 80 GB H100.
    """

    num_nodes: int = 1
    gpus_per_node: int = 1
    device_memory_bytes: float = 48e9
    intra_node_bandwidth: float = 100e9
    inter_node_bandwidth: float = 25e9
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    device_memory_bandwidth: float = 700e9
    """Device memory bandwidth: the optimizer step is bound by it."""
    tensor_parallel_bandwidth: float | None = None
    """The bus bandwidth of an all-reduce among devices of one node, per device (what NCCL's
    ``all_reduce_perf`` reports as ``busbw``): the tensor-parallel collectives of a stage split over ``t``
    devices run at it. ``None``: ``intra_node_bandwidth``. For example an H100 SXM node, whose NVLink 4 gives
    each GPU 450 GB/s in each direction through NVSwitch: ``tensor_parallel_bandwidth=450e9`` at most; set
    what ``all_reduce_perf`` measures on your nodes."""

    @property
    def collective_bandwidth(self) -> float:
        """:attr:`tensor_parallel_bandwidth`, or the intra-node link's where it is not set."""
        return self.tensor_parallel_bandwidth or self.intra_node_bandwidth

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that cannot describe a real cluster."""
        for name in ("num_nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "device_memory_bytes",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "device_memory_bandwidth",
            "tensor_parallel_bandwidth",
        ):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"cluster.{name} must be positive, got {getattr(self, name)}")
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster.{name} must not be negative, got {getattr(self, name)}")
