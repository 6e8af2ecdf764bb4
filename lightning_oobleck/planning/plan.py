"""The plan: which pipelines run, on which nodes, with which layers and how many micro-batches.

A :class:`Plan` is the contract between the planner (which makes it), the execution engine (which runs
it) and recovery (which replaces it after failures). It is pure data: no torch, no torch.distributed.

Identities used throughout the project:

* a *node* is a failure domain, named by a stable integer id (``0..N-1`` at launch; ids of dead nodes
  are never reused, nodes added later get fresh ids);
* a *worker* is one device of one node, named ``(node, device)`` with ``0 <= device < gpus_per_node``;
  one process drives one worker;
* a *stage* runs on ``t`` workers of one node (its tensor-parallel degree, :attr:`Plan.tensor_parallel`),
  devices ``stage.device .. stage.device + t - 1``; at ``t = 1``, on one;
* layer indices are global (``0..num_layers-1``), so a layer keeps its name in every layout.

The JSON form (:meth:`Plan.to_dict`) is the schema printed by ``oobleck plan --json`` and read back by
``oobleck replan --plan``; it is documented in docs/planning.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from lightning_oobleck.worker import Worker


@dataclass(frozen=True)
class Stage:
    """Contiguous layers ``[first_layer, end_layer)`` run by one device of one node of a template."""

    first_layer: int
    end_layer: int
    node: int
    """Node index inside the template (``0..template.num_nodes-1``)."""
    device: int = 0
    """Device index inside that node (``0..gpus_per_node-1``): the first of the stage's ``t`` devices."""
    recompute: bool = False
    """Activation recomputation: each layer keeps only its input per in-flight micro-batch and runs its
    forward again in the backward (``torch.utils.checkpoint``)."""

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)


@dataclass(frozen=True)
class PipelineTemplate:
    """A complete pipeline layout for exactly ``num_nodes`` nodes.

    ``stage_times_s[s]`` is the predicted steady-state time of stage ``s`` for one micro-batch
    (forward + backward + its outgoing point-to-point transfers); the planner's cost model turns these
    into the pipeline's iteration time for any micro-batch count (:meth:`iteration_time_s`).
    """

    num_nodes: int
    gpus_per_node: int
    stages: tuple[Stage, ...]
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...] = ()
    microbatches: int = 0
    """The micro-batch count the split was optimised for (0: unknown)."""
    schedule_fit_s: tuple[float, float] | None = None
    """``(a, c)`` of :meth:`iteration_time_s` under a schedule other than 1F1B, fitted by the planner to the
    event simulation of that schedule's action lists (``None``: 1F1B)."""
    tensor_parallel: int = 1
    """``t``: the devices of one node that each stage runs on, its layers split over them."""
    stage_tensor_parallel_s: tuple[float, ...] = ()
    """The part of each stage's time spent in tensor-parallel all-reduces (empty at ``t = 1``)."""

    def __post_init__(self) -> None:
        if len(self.stage_times_s) != len(self.stages):
            raise ValueError("a template needs one stage time per stage")
        if self.gpus_per_node % self.tensor_parallel:
            raise ValueError(
                f"tensor parallelism {self.tensor_parallel} does not divide {self.gpus_per_node} GPUs a node"
            )
        object.__setattr__(self, "_hash", hash((self.num_nodes, self.stages, self.stage_times_s)))

    def __hash__(self) -> int:
        """Hashed once: the planner keys its dicts and sets by templates of up to hundreds of stages."""
        return self._hash  # type: ignore[attr-defined]

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end_layer

    @property
    def fill_s(self) -> float:
        """``a`` in ``T(m) = a + (m - 1) * c``: under 1F1B the sum of the stage times."""
        return sum(self.stage_times_s) if self.schedule_fit_s is None else self.schedule_fit_s[0]

    @property
    def slope_s(self) -> float:
        """``c`` in ``T(m) = a + (m - 1) * c``: under 1F1B the slowest stage's time."""
        return max(self.stage_times_s) if self.schedule_fit_s is None else self.schedule_fit_s[1]

    def time_split(self, microbatches: int) -> tuple[float, float, float]:
        """Shares of :meth:`iteration_time_s` at ``microbatches``: the slowest stage's compute (its
        point-to-point sends included), its tensor-parallel all-reduces, and the bubble (the rest: the time
        that stage waits while the pipeline fills and drains)."""
        total = self.iteration_time_s(microbatches)
        if total <= 0:
            return 0.0, 0.0, 0.0
        slowest = max(range(len(self.stages)), key=self.stage_times_s.__getitem__)
        busy = min(microbatches * self.stage_times_s[slowest], total)
        tensor = microbatches * self.stage_tensor_parallel_s[slowest] if self.stage_tensor_parallel_s else 0.0
        return (busy - tensor) / total, tensor / total, 1 - busy / total

    def iteration_time_s(self, microbatches: int) -> float:
        """Iteration time for ``microbatches`` micro-batches.

        ``T(m) = a + (m - 1) * c``: the first micro-batch crosses every stage once (fill and drain,
        ``a`` = :attr:`fill_s`), every further one costs the steady state's time per micro-batch
        (``c`` = :attr:`slope_s`, the slowest stage's time under 1F1B).
        """
        if microbatches <= 0:
            return 0.0
        return self.fill_s + (microbatches - 1) * self.slope_s


@dataclass(frozen=True)
class Pipeline:
    """One instantiated template: template node ``i`` runs on cluster node ``nodes[i]``."""

    template: PipelineTemplate
    nodes: tuple[int, ...]
    microbatches: int

    def __post_init__(self) -> None:
        if len(self.nodes) != self.template.num_nodes:
            raise ValueError(
                f"a pipeline of a {self.template.num_nodes}-node template needs "
                f"{self.template.num_nodes} nodes, got {len(self.nodes)}"
            )

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.template.stages

    def worker_of_stage(self, stage: int) -> Worker:
        """The ``(node, device)`` worker that runs stage ``stage`` of this pipeline (its first of ``t``)."""
        s = self.template.stages[stage]
        return Worker(self.nodes[s.node], s.device)

    def workers_of_stage(self, stage: int) -> tuple[Worker, ...]:
        """The ``t`` workers of one node that run stage ``stage``, in tensor-parallel rank order."""
        first = self.worker_of_stage(stage)
        return tuple(Worker(first.node, first.device + r) for r in range(self.template.tensor_parallel))

    def iteration_time_s(self) -> float:
        return self.template.iteration_time_s(self.microbatches)


@dataclass(frozen=True)
class WorkerRole:
    """What one worker does under a plan: stage ``stage`` of pipeline ``pipeline``."""

    pipeline: int
    stage: int
    layers: range
    tensor_rank: int = 0
    """The worker's rank among the stage's ``t`` devices."""


@dataclass(frozen=True)
class LayerCopy:
    """After a reconfiguration, worker ``(to_node, to_device)`` must newly hold ``layer`` (parameters and
    optimizer state); worker ``(from_node, from_device)`` held a replica under the previous plan."""

    layer: int
    to_node: int
    from_node: int
    to_device: int = 0
    from_device: int = 0
    replicas: tuple[Worker, ...] = ()
    """Every surviving worker that sends a share of the layer, the one above first (it also describes the
    layer's optimizer state): the copy is striped over them by bytes. Empty: the one above alone."""

    @property
    def sources(self) -> tuple[Worker, ...]:
        """The workers that send a share of the layer, the describing one first."""
        return self.replicas or (Worker(self.from_node, self.from_device),)

    @property
    def receiver(self) -> Worker:
        """The worker that newly holds the layer."""
        return Worker(self.to_node, self.to_device)

    def at_tensor_rank(self, rank: int) -> LayerCopy:
        """The same copy between the devices of tensor rank ``rank`` of the stages involved (a copy names each
        stage by its first device): at tensor parallelism ``t > 1`` each shard moves between counterparts."""
        if rank == 0:
            return self
        return LayerCopy(
            self.layer,
            self.to_node,
            self.from_node,
            self.to_device + rank,
            self.from_device + rank,
            tuple(Worker(w.node, w.device + rank) for w in self.replicas),
        )


@dataclass(frozen=True)
class Reroute:
    """ReCycle's rerouting of one lost stage: stage ``stage`` of pipeline ``pipeline`` ran on a node that is
    gone; the pipeline keeps its other stages, and the lost stage's layers run, for its micro-batches, on the
    workers of the pipelines ``helpers`` that hold them (micro-batch ``k`` of the pipeline on
    ``helpers[k % len(helpers)]``), at layer granularity (:mod:`lightning_oobleck.planning.rerouting`)."""

    pipeline: int
    stage: int
    helpers: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """A full training layout for one cluster membership."""

    num_layers: int
    gpus_per_node: int
    fault_tolerance: int
    n0: int
    microbatch_size: int
    global_batch_size: int
    templates: tuple[PipelineTemplate, ...]
    pipelines: tuple[Pipeline, ...]
    iteration_time_s: float = 0.0
    planning_s: float = 0.0
    warnings: tuple[str, ...] = ()
    """Planner notes a user must see (e.g. a fault tolerance lowered after failures)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Planner inputs needed to replan from JSON alone (profile, options); opaque to execution."""
    tied_layers: tuple[tuple[int, ...], ...] = ()
    """The model's tied parameters, each as the layers that share it: a tie's gradient is summed over
    every worker holding any of them (:meth:`tie_owners`)."""
    schedule: str = "1f1b"
    """The pipeline schedule every pipeline runs (:data:`~lightning_oobleck.planning.schedules.SCHEDULES`)."""
    lost: tuple[int, ...] = ()
    """Nodes of :attr:`pipelines` that are gone, their stages rerouted (:attr:`reroutes`): a rerouted plan
    keeps the pipelines as they were and names what they lost."""
    reroutes: tuple[Reroute, ...] = ()
    """Where the lost stages' layers run (:class:`Reroute`), one per lost stage."""

    def __post_init__(self) -> None:
        if len({t.tensor_parallel for t in self.templates}) > 1:
            raise ValueError(
                "a plan's templates must share one tensor-parallel degree: a layer's gradient is summed "
                "shard by shard over the pipelines holding it, which needs the same shards in each"
            )

    # ------------------------------------------------------------------ derived views
    @property
    def tensor_parallel(self) -> int:
        """``t``: the devices of one node each stage runs on, the same in every template."""
        return self.templates[0].tensor_parallel if self.templates else 1

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    @property
    def nodes(self) -> tuple[int, ...]:
        """All live cluster node ids this plan uses, sorted (not a rerouted plan's :attr:`lost` nodes)."""
        return tuple(sorted(n for p in self.pipelines for n in p.nodes if n not in self.lost))

    @property
    def workers(self) -> tuple[Worker, ...]:
        """All ``(node, device)`` workers, sorted: the rank order of a process group for this plan."""
        return tuple(Worker(n, d) for n in self.nodes for d in range(self.gpus_per_node))

    def microbatch_range(self, pipeline: int) -> range:
        """Global micro-batch indices given to ``pipeline`` (consecutive, in pipeline order).

        Micro-batch ``k`` of a step holds samples ``[k*b, (k+1)*b)`` of the global batch, so every
        sample goes to exactly one pipeline.
        """
        start = sum(p.microbatches for p in self.pipelines[:pipeline])
        return range(start, start + self.pipelines[pipeline].microbatches)

    def samples(self, pipeline: int) -> range:
        """The offsets in every global batch of the samples ``pipeline`` trains on: its micro-batches'."""
        mbs = self.microbatch_range(pipeline)
        return range(mbs.start * self.microbatch_size, mbs.stop * self.microbatch_size)

    @cached_property
    def _roles(self) -> dict[Worker, WorkerRole]:
        return {
            w: WorkerRole(pi, si, s.layers, w.device - s.device)
            for pi, p in enumerate(self.pipelines)
            for si, s in enumerate(p.stages)
            for w in p.workers_of_stage(si)
        }

    def role(self, node: int, device: int = 0) -> WorkerRole:
        """The single stage that worker ``(node, device)`` runs."""
        try:
            return self._roles[Worker(node, device)]
        except KeyError:
            raise KeyError(f"worker (node={node}, device={device}) has no stage in this plan") from None

    def layer_owners(self, layer: int, tensor_rank: int = 0) -> tuple[Worker, ...]:
        """The workers holding a replica of ``layer``, one per pipeline, in pipeline order: at tensor
        parallelism ``t > 1``, those holding its ``tensor_rank``-th shard (the same in every pipeline)."""
        return tuple(
            w
            for p in self.pipelines
            for si in self._stages_of(p, layer)
            if (w := p.workers_of_stage(si)[tensor_rank]).node not in self.lost
        )

    def tie_owners(self, layers: Sequence[int], tensor_rank: int = 0) -> tuple[Worker, ...]:
        """The workers holding any of ``layers`` (a tie), in rank order (of the ``tensor_rank``-th shard)."""
        return tuple(sorted({w for layer in layers for w in self.layer_owners(layer, tensor_rank)}))

    def choices(self) -> tuple[str, ...]:
        """Why the plan has its degree and schedule, where the planner chose them (``"auto"``): a line per
        choice naming each alternative's predicted step, or why it had no plan, e.g. ``tensor parallel: t=1:
        none (the model ... does not fit ...); t=2: 0.047 s/step``."""
        lines = []
        for key, what in (("tensor_parallel_choices", "tensor parallel"), ("schedule_choices", "schedule")):
            if alternatives := self.extra.get(key):
                lines.append(f"{what}: " + "; ".join(map(_choice, alternatives)))
        return tuple(lines)

    @staticmethod
    def _stages_of(p: Pipeline, layer: int) -> Iterator[int]:
        for si, s in enumerate(p.stages):
            if s.first_layer <= layer < s.end_layer:
                yield si

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "gpus_per_node": self.gpus_per_node,
            "n0": self.n0,
            "fault_tolerance": self.fault_tolerance,
            "microbatch_size": self.microbatch_size,
            "global_batch_size": self.global_batch_size,
            "templates": [_template_to_dict(t) for t in self.templates],
            "pipelines": [
                {
                    "template_nodes": p.template.num_nodes,
                    "nodes": list(p.nodes),
                    "microbatches": p.microbatches,
                    "iteration_time_s": p.iteration_time_s(),
                }
                for p in self.pipelines
            ],
            "iteration_time_s": self.iteration_time_s,
            "planning_s": self.planning_s,
            "warnings": list(self.warnings),
            "schedule": self.schedule,
            "tensor_parallel": self.tensor_parallel,
            **({"tied_layers": [list(t) for t in self.tied_layers]} if self.tied_layers else {}),
            **({"extra": self.extra} if self.extra else {}),
            **(
                {
                    "lost": list(self.lost),
                    "reroutes": [
                        {"pipeline": r.pipeline, "stage": r.stage, "helpers": list(r.helpers)}
                        for r in self.reroutes
                    ],
                }
                if self.lost
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        gpus = int(d["gpus_per_node"])
        templates = tuple(_template_from_dict(t, gpus) for t in d["templates"])
        by_size = {t.num_nodes: t for t in templates}
        pipelines = []
        for p in d["pipelines"]:
            size = int(p["template_nodes"])
            if size not in by_size:
                raise ValueError(f"pipeline refers to a {size}-node template that the plan does not have")
            pipelines.append(
                Pipeline(by_size[size], tuple(int(n) for n in p["nodes"]), int(p["microbatches"]))
            )
        return cls(
            num_layers=int(d["num_layers"]),
            gpus_per_node=gpus,
            fault_tolerance=int(d["fault_tolerance"]),
            n0=int(d["n0"]),
            microbatch_size=int(d["microbatch_size"]),
            global_batch_size=int(d["global_batch_size"]),
            templates=templates,
            pipelines=tuple(pipelines),
            iteration_time_s=float(d.get("iteration_time_s", 0.0)),
            planning_s=float(d.get("planning_s", 0.0)),
            warnings=tuple(str(w) for w in d.get("warnings", ())),
            extra=dict(d.get("extra", {})),
            tied_layers=tuple(tuple(int(i) for i in t) for t in d.get("tied_layers", ())),
            schedule=str(d.get("schedule", "1f1b")),
            lost=tuple(int(n) for n in d.get("lost", ())),
            reroutes=tuple(
                Reroute(int(r["pipeline"]), int(r["stage"]), tuple(int(h) for h in r["helpers"]))
                for r in d.get("reroutes", ())
            ),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`to_json` (``oobleck plan --json``)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(
                f"{path} is not a plan ({e!r} missing or malformed): write one with `oobleck plan --json`"
            ) from e


def _choice(choice: dict[str, Any]) -> str:
    """One alternative the planner weighed: a degree ``t=...`` or a schedule, and its plan's step."""
    name = choice["schedule"] if "schedule" in choice else f"t={choice['tensor_parallel']}"
    if "infeasible" in choice:
        return f"{name}: none ({choice['infeasible']})"
    return f"{name}: {choice['iteration_time_s']:.3g} s/step"


def _template_to_dict(t: PipelineTemplate) -> dict[str, Any]:
    return {
        "nodes": t.num_nodes,
        "stages": [
            {
                "layers": [s.first_layer, s.end_layer],
                "node": s.node,
                "device": s.device,
                "recompute": s.recompute,
            }
            for s in t.stages
        ],
        "stage_times_s": list(t.stage_times_s),
        "stage_memory_bytes": list(t.stage_memory_bytes),
        "microbatches": t.microbatches,
        "iteration_time_s": t.iteration_time_s(t.microbatches or len(t.stages)),
        **({"schedule_fit_s": list(t.schedule_fit_s)} if t.schedule_fit_s is not None else {}),
        **(
            {"tensor_parallel": t.tensor_parallel, "stage_tensor_parallel_s": list(t.stage_tensor_parallel_s)}
            if t.tensor_parallel > 1
            else {}
        ),
    }


def _pair(values: Sequence[float]) -> tuple[float, float]:
    a, c = values
    return float(a), float(c)


def _template_from_dict(d: dict[str, Any], gpus_per_node: int) -> PipelineTemplate:
    stages = tuple(
        Stage(
            int(s["layers"][0]),
            int(s["layers"][1]),
            int(s["node"]),
            int(s.get("device", 0)),
            bool(s.get("recompute", False)),
        )
        for s in d["stages"]
    )
    return PipelineTemplate(
        num_nodes=int(d["nodes"]),
        gpus_per_node=gpus_per_node,
        stages=stages,
        stage_times_s=tuple(float(x) for x in d["stage_times_s"]),
        stage_memory_bytes=tuple(float(x) for x in d.get("stage_memory_bytes", ())),
        microbatches=int(d.get("microbatches", 0)),
        schedule_fit_s=None if d.get("schedule_fit_s") is None else _pair(d["schedule_fit_s"]),
        tensor_parallel=int(d.get("tensor_parallel", 1)),
        stage_tensor_parallel_s=tuple(float(x) for x in d.get("stage_tensor_parallel_s", ())),
    )


PLAN_CHECK_ENV = "OOBLECK_PLAN_CHECK"
"""Set in a process that only checks a job before its tasks start (``python -m lightning_oobleck.slurm.task
--check``): the strategy makes the job's plan and raises :class:`PlanChecked` in place of training."""


class PlanChecked(Exception):
    """The plan a job would start with, raised in place of training under :data:`PLAN_CHECK_ENV`."""

    def __init__(self, plan: Plan) -> None:
        stages = ", ".join(str(len(p.stages)) for p in plan.pipelines)
        super().__init__(
            f"the plan: {len(plan.pipelines)} pipeline(s) of {stages} stage(s) over {len(plan.nodes)} "
            f"node(s) x {plan.gpus_per_node} device(s), fault tolerance {plan.fault_tolerance}"
        )
        self.plan = plan
