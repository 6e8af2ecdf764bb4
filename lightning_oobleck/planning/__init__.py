"""The planner: pipeline templates, instantiation with the f+1 guarantee, batch distribution, replanning.

Pure Python + NumPy/SciPy (no torch). Entry points: :func:`make_plan` for a fresh cluster,
:func:`reconfigure` (:func:`after_failures`, :func:`after_joins`) for the next plan when nodes fail or join,
:func:`reroute` for ReCycle's rerouting instead, :func:`choose_recovery` for the choice between the two.
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
from lightning_oobleck.planning.rerouting import RECOVERY_POLICIES, NotReroutable, choose_recovery, reroute

__all__ = [
    "RECOVERY_POLICIES",
    "ClusterSpec",
    "LayerCopy",
    "LayerProfile",
    "ModelProfile",
    "NotReroutable",
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
    "choose_recovery",
    "make_plan",
    "reconfigure",
    "reroute",
    "synthetic_gpt_profile",
]
