"""The planner: pipeline templates, instantiation with the f+1 guarantee, batch distribution, replanning.

Pure Python + NumPy/SciPy (no torch). Entry points: :func:`make_plan` for a fresh cluster,
:func:`reconfigure` (:func:`after_failures`, :func:`after_joins`) for the next plan when nodes fail or join.
"""

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.plan import LayerCopy, Pipeline, PipelineTemplate, Plan, Stage, WorkerRole
from lightning_oobleck.planning.planner import PlanningError, make_plan
from lightning_oobleck.planning.profile import LayerProfile, ModelProfile, synthetic_gpt_profile
from lightning_oobleck.planning.reconfigure import (
    Reconfiguration,
    ReconfigurationError,
    after_failures,
    after_joins,
    reconfigure,
)

__all__ = [
    "ClusterSpec",
    "LayerCopy",
    "LayerProfile",
    "ModelProfile",
    "Pipeline",
    "PipelineTemplate",
    "Plan",
    "PlanningError",
    "Reconfiguration",
    "ReconfigurationError",
    "Stage",
    "WorkerRole",
    "after_failures",
    "after_joins",
    "make_plan",
    "reconfigure",
    "synthetic_gpt_profile",
]
