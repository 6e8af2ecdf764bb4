"""Execution engine: heterogeneous 1F1B pipelines with layer-wise gradient sync on torch.distributed.

A :class:`~lightning_oobleck.planning.plan.Plan` says which worker runs which layers of which pipeline;
this package turns it into running code: :class:`ProcessGroups` owns every process group of one
generation, :func:`build_stage` materialises only the layers a worker owns, :class:`PipelineEngine` runs
one training or evaluation step, and :func:`profile_layers` measures the per-layer profile the planner
needs.
"""

from lightning_oobleck.execution.engine import PipelineEngine, pipeline_batch_slice
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.execution.process_groups import ProcessGroups
from lightning_oobleck.execution.profiler import profile_layers
from lightning_oobleck.execution.stage import StageModule, build_reference_model, build_stage

__all__ = [
    "PeerFailure",
    "PipelineEngine",
    "ProcessGroups",
    "StageModule",
    "build_reference_model",
    "build_stage",
    "pipeline_batch_slice",
    "profile_layers",
]
