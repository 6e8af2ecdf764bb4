"""The cost model: predicted times and memory of stages, pipelines and gradient synchronisation.

All costs derive from a :class:`ModelProfile` (per-layer times and bytes for one micro-batch) and a
:class:`ClusterSpec` (memory, bandwidths, latencies). Layer ranges are half-open ``[i, j)``.

Pipeline iteration time (1F1B). A pipeline of ``S`` stages with per-micro-batch stage times
``t_0..t_{S-1}`` (forward + backward + the stage's outgoing point-to-point transfers) runs ``m``
micro-batches in::

    T(m) = sum_s t_s + (m - 1) * max_s t_s

the first micro-batch crosses every stage once (pipeline fill and drain), every further one adds the
slowest stage's time (steady state). This is :meth:`PipelineTemplate.iteration_time_s`.

Other schedules (``schedule="zb-h1"``). Their iteration time is the event simulation of their action
lists (:func:`lightning_oobleck.planning.schedules.simulate`) with each stage's forward, input-gradient and
weight-gradient times from the profile, and the transfers as link delays (:meth:`simulated_time_s`). The
planner keeps the linear form ``T(m) = a + (m - 1) * c`` for instantiation and batch distribution, with
``a`` and ``c`` the line through the simulation at ``m = S`` and ``m = 2 S``
(:meth:`schedule_fits_s`): once every stage is busy (``m >= S``) each further micro-batch adds a constant
time, and the line matches the simulation (within 0.3% up to ``m = 4 S`` on the synthetic GPT profiles).
Below ``S`` ZB-H1 never reaches its steady state, each micro-batch adds only about ``F + I`` of the slowest
stage, and the line is optimistic (0.64 of the simulation at ``m = 1`` on 8 stages); the planner does not
model that range separately.

Memory of stage ``s`` of ``S``: ``(parameter bytes) * state_factor`` for parameters, gradients and
optimizer state, plus the larger of two: the activations of the micro-batches the schedule keeps in flight
on that stage (:func:`~lightning_oobleck.planning.schedules.in_flight_limit`: ``min(S - s, m)`` for 1F1B,
where stage 0 holds the most; ``min(S, m)`` on every stage for ZB-H1), and the optimizer step's temporaries
(:data:`OPTIMIZER_STEP_TEMPORARIES` times the parameter bytes; the step runs once every activation is
freed). The activations are alive at once with a backward's own allocations: the most any layer of the
stage raises the bytes alive in its backward (``LayerProfile.backward_peak_bytes``: the gradients of its
output, intermediates and input, each parameter's new gradient before it is added to the one kept; under
ZB-H1 the split backward's, ``split_backward_peak_bytes``). Under ZB-H1 a stage also keeps what each
``I`` keeps for its ``W`` (``weight_gradient_kept_bytes``) for the
:func:`~lightning_oobleck.planning.schedules.pending_weight_limit` micro-batches whose ``W`` trails
(``min(s + 1, m)`` on stage ``s``, at the moment it holds ``min(S, m)`` in flight).
A micro-batch in flight keeps what the stage's layers save for the backward and the stage's output,
which the executor keeps as the root of the micro-batch's backward (the last stage keeps the loss instead,
whose saved tensors its profile counts). Templates are checked with ``m >= S`` (the worst case), so they
stay feasible whatever batch they are given later.

Activation recomputation (``activation_checkpointing``): a recomputing stage keeps, per in-flight
micro-batch, only each layer's input (the output of the layer before it; the pipeline's own input is not
counted) and the stage's output (on the last stage, the logits the loss keeps) instead of every tensor its
layers save, plus the saved tensors of the one layer being recomputed at a time and its backward's peak; it
runs each forward twice (``compute + forward``). ``True`` recomputes on every stage, ``"auto"`` only on the
stages of a split that would not fit the device otherwise (per stage, in the template search), ``False``
never.

Tensor parallelism (a profile at ``t > 1``, :meth:`ModelProfile.at`): a stage runs on ``t`` devices of one
node, ``G / t`` stages per node, and every time and byte above is one rank's. A layer's time adds its
all-reduces among the ``t`` devices, each a ring over the node's links::

    tensor_allreduce(bytes, t) = 2 (t - 1) / t * bytes / tensor_parallel_bandwidth + 2 (t - 1) * intra_latency

forward ones to its forward, backward ones to its input gradient (``I``). Activations cross a stage
boundary from each rank to its counterpart in the next stage (``t`` sends over ``t`` links at once: the time
of one). Each rank sums its own shard of the gradients with its counterparts in the other pipelines.

Gradient synchronisation: each layer's gradient is all-reduced across the ``k`` pipelines holding a
replica (ring all-reduce over the inter-node network)::

    allreduce(bytes, k) = 2 (k - 1) / k * bytes / inter_bw + 2 (k - 1) * inter_latency

A device runs the all-reduces of its own layers one after the other, then its optimizer step, which
reads and writes the parameter state once (``2 * bytes * state_factor / memory_bandwidth``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from lightning_oobleck.planning.cluster import ClusterSpec
from lightning_oobleck.planning.plan import PipelineTemplate
from lightning_oobleck.planning.profile import DTYPE_BYTES, ModelProfile
from lightning_oobleck.planning.schedules import (
    check_schedule_name,
    in_flight_limit,
    pending_weight_limit,
    pipeline_times_s,
)


def default_state_factor(profile: ModelProfile) -> float:
    """Bytes of parameter + gradient + Adam state per byte of parameters.

    A synthetic profile (sizing a cluster, as the paper does) assumes Megatron-style mixed precision for
    16-bit parameters: 2 + 2 (param, grad) + 12 (float32 master, m, v) = 16 bytes per 2-byte parameter, a
    factor of 8; full precision: param, grad, m, v, a factor of 4.

    A measured profile describes a run of this package: torch's optimizers keep their state in the
    parameters' dtype (AdamW: param, grad, m, v, a factor of 4 whatever the dtype), and under autocast
    (``meta["autocast"]``, a ``"bf16-mixed"`` run) each parameter also has one cached 16-bit cast for the
    step (:mod:`lightning_oobleck.execution.memory`): 2 more bytes per 4-byte parameter, 4.5.
    """
    if profile.device == "synthetic":
        return 8.0 if profile.dtype in ("float16", "bfloat16") else 4.0
    autocast = profile.meta.get("autocast")
    cast = DTYPE_BYTES[autocast] / profile.dtype_bytes if autocast in DTYPE_BYTES else 0.0
    return 4.0 + cast


OPTIMIZER_STEP_TEMPORARIES = 1.0
"""Bytes the optimizer step allocates for its duration, per parameter byte: AdamW's multi-tensor step
(``foreach``, torch's default on GPUs) computes the denominator ``sqrt(v) + eps`` of every parameter at once,
one temporary as large as the parameters (measured with :class:`~lightning_oobleck.testing.LiveTensorMeter`
on torch 2.11 and 2.13: 1.0 for float32 and bfloat16 parameters; 0.5 with the per-parameter step of the CPU's
default, for four parameters of one size). ``benchmarks/gpu_check.py`` measures it on a GPU."""


_CHOICES_KEPT_BYTES = 2**27
"""How much of :meth:`CostModel.stage_choices`' bands a cost model keeps for reuse (128 MiB)."""

ActivationCheckpointing = bool | Literal["auto"]
"""Whether stages recompute activations: never, always, or where a split would not fit otherwise."""


class StageChoices(NamedTuple):
    """For each stage ``s`` of a split into ``S`` stages and each layer range it may hold: its time and memory
    (``inf`` time where it does not fit the device) and whether it recomputes activations.

    Only the ranges that leave every other stage a layer are held, a band of width ``W = L - S + 1`` per
    stage: ``[s, a, b]`` is the range ``[s + a, s + 1 + b)`` (``inf`` time where ``b < a``). :meth:`at`
    reads one range by its layers.
    """

    times: np.ndarray
    memory: np.ndarray
    recompute: np.ndarray

    def at(self, stage: int, first: int, end: int) -> tuple[float, float, bool]:
        """Time, memory and recomputation of ``[first, end)`` as stage ``stage``."""
        a, b = first - stage, end - stage - 1
        return (
            float(self.times[stage, a, b]),
            float(self.memory[stage, a, b]),
            bool(self.recompute[stage, a, b]),
        )


class CostModel:
    """Predicted costs for one model on one cluster, with prefix sums for O(1) layer-range queries."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        state_factor: float | None = None,
        activation_checkpointing: ActivationCheckpointing = False,
        schedule: str = "1f1b",
    ) -> None:
        self.schedule = check_schedule_name(schedule)
        if schedule != "1f1b" and any(layer.weight_grad_s is None for layer in profile.layers):
            raise ValueError(
                f"the {schedule!r} schedule splits the backward, but the profile has no weight-gradient "
                "times (it was measured before the profiler timed them): profile the model again"
            )
        if activation_checkpointing not in (False, True, "auto"):
            raise ValueError(
                f"activation_checkpointing must be false, true or 'auto', got {activation_checkpointing!r}"
            )
        if cluster.gpus_per_node % profile.tensor_parallel:
            raise ValueError(
                f"tensor parallelism {profile.tensor_parallel} does not divide the {cluster.gpus_per_node} "
                "GPUs of a node: a stage's devices must be on one node and every device used"
            )
        self.profile = profile
        self.cluster = cluster
        self.tensor_parallel = profile.tensor_parallel
        self.stages_per_node = cluster.gpus_per_node // profile.tensor_parallel
        self.activation_checkpointing = activation_checkpointing
        self.state_factor = default_state_factor(profile) if state_factor is None else state_factor
        layers = profile.layers

        def prefix(values: list[float]) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))

        tp_forward = [self.tensor_allreduce_s(la.tensor_parallel_forward_bytes) for la in layers]
        tp_backward = [self.tensor_allreduce_s(la.tensor_parallel_backward_bytes) for la in layers]
        self._tensor = prefix([f + b for f, b in zip(tp_forward, tp_backward, strict=True)])
        self._compute = prefix([la.forward_s + la.backward_s for la in layers]) + self._tensor
        self._params = prefix([la.parameter_bytes for la in layers])
        self._activations = prefix([la.activation_bytes for la in layers])
        self._outputs = np.asarray([la.output_activation_bytes for la in layers], dtype=np.float64)
        self._forward = prefix([la.forward_s + f for la, f in zip(layers, tp_forward, strict=True)])
        self._backward = prefix([la.backward_s + b for la, b in zip(layers, tp_backward, strict=True)])
        self._weight = prefix([la.weight_grad_s or 0.0 for la in layers])
        # the input each layer keeps when recomputing: the output of the layer before it
        self._inputs = prefix([0.0] + [la.output_activation_bytes for la in layers[:-1]])
        self._saved = np.asarray([la.activation_bytes for la in layers], dtype=np.float64)
        whole = np.asarray([la.backward_peak_bytes or 0 for la in layers], dtype=np.float64)
        split = np.asarray([la.split_backward_peak_bytes or 0 for la in layers], dtype=np.float64)
        self._backward_peak = _range_max(whole)
        self._split_backward_peak = _range_max(split) if self.schedule == "zb-h1" else self._backward_peak
        self._recomputing_peak = _range_max(self._saved + whole)  # a recomputing stage does not split
        self._weight_kept = prefix([la.weight_gradient_kept_bytes or 0 for la in layers])
        # the output a stage ending before layer j keeps per in-flight micro-batch (indexed by j)
        self._kept_output = np.concatenate(([0.0], self._outputs[:-1], [0.0]))
        self._kept_output_recomputing = np.concatenate(([0.0], self._outputs))
        self._choices: dict[int, StageChoices] = {}

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    # ------------------------------------------------------------------ scalar queries
    def tensor_allreduce_s(self, sizes: tuple[int, ...]) -> float:
        """All-reduces of ``sizes`` bytes among the ``t`` devices of a stage, one after the other."""
        t = self.tensor_parallel
        if t == 1 or not sizes:
            return 0.0
        c = self.cluster
        return 2 * (t - 1) / t * sum(sizes) / c.collective_bandwidth + len(sizes) * 2 * (t - 1) * (
            c.intra_node_latency_s
        )

    def compute_s(self, first: int, end: int) -> float:
        """Forward + backward time of layers ``[first, end)`` for one micro-batch, their tensor-parallel
        all-reduces included."""
        return float(self._compute[end] - self._compute[first])

    def tensor_parallel_s(self, first: int, end: int) -> float:
        """The part of :meth:`compute_s` spent in tensor-parallel all-reduces."""
        return float(self._tensor[end] - self._tensor[first])

    def parameter_bytes(self, first: int, end: int) -> float:
        return float(self._params[end] - self._params[first])

    def _link(self, same_node: bool) -> tuple[float, float]:
        c = self.cluster
        if same_node:
            return c.intra_node_latency_s, c.intra_node_bandwidth
        return c.inter_node_latency_s, c.inter_node_bandwidth

    def p2p_s(self, nbytes: float, same_node: bool) -> float:
        """Time to send ``nbytes`` to a neighbouring stage on the same node or on another node."""
        latency, bandwidth = self._link(same_node)
        return latency + nbytes / bandwidth

    def stage_time_s(self, first: int, end: int, stage: int, num_stages: int) -> float:
        """Per-micro-batch time of stage ``stage`` holding ``[first, end)``: compute + outgoing sends.

        Forward it sends its output to the next stage; backward it sends the gradient of its input
        (the size of layer ``first - 1``'s output) to the previous stage. Stage ``s`` runs on template
        node ``s // (G / t)``, so a boundary crosses nodes exactly when the next stage index is a multiple of
        ``G / t``.
        """
        g = self.stages_per_node
        t = self.compute_s(first, end)
        if stage < num_stages - 1:
            t += self.p2p_s(self._outputs[end - 1], same_node=(stage + 1) % g != 0)
        if stage > 0:
            t += self.p2p_s(self._outputs[first - 1], same_node=stage % g != 0)
        return t

    def stage_memory_bytes(
        self, first: int, end: int, stage: int, num_stages: int, microbatches: int | None = None
    ) -> float:
        """Peak memory of stage ``stage`` of ``num_stages``; ``microbatches=None`` means ``m >= S``."""
        m = microbatches or num_stages
        in_flight = in_flight_limit(self.schedule, num_stages, stage, m)
        params = self.parameter_bytes(first, end)
        held = (
            self.held_bytes(first, end) * in_flight
            + self.weight_kept_bytes(first, end, stage)
            * pending_weight_limit(self.schedule, num_stages, stage, m)
            + self.backward_peak_bytes(first, end, stage)
        )
        return float(params * self.state_factor + max(held, self.step_bytes(params)))

    def backward_peak_bytes(self, first: int, end: int, stage: int, recompute: bool = False) -> float:
        """How far a backward of ``[first, end)`` as stage ``stage`` raises the bytes alive, run as the
        schedule runs it (split under ZB-H1 but on the first stage, whose ``I`` has no input gradient to
        compute and whose ``W`` runs the whole backward; whole when ``recompute``, the layer's forward
        recomputed first): its largest layer's."""
        if recompute:
            return float(self._recomputing_peak[first, end])
        peaks = self._split_backward_peak if stage > 0 else self._backward_peak
        return float(peaks[first, end])

    def weight_kept_bytes(self, first: int, end: int, stage: int) -> float:
        """What the ``I`` of ``[first, end)`` as stage ``stage`` keeps for its ``W``, per micro-batch (nothing
        on the first stage); a stage keeps it for :func:`pending_weight_limit` micro-batches."""
        return float(self._weight_kept[end] - self._weight_kept[first]) if stage > 0 else 0.0

    def held_bytes(self, first: int, end: int, recompute: bool = False) -> float:
        """Bytes one in-flight micro-batch keeps on a stage holding ``[first, end)``: every tensor its layers
        save for the backward, or, recomputing, each layer's input (see the module docstring)."""
        if recompute:
            return float(self._inputs[end] - self._inputs[first] + self._kept_output_recomputing[end])
        return float(self._activations[end] - self._activations[first] + self._kept_output[end])

    @staticmethod
    def step_bytes(parameter_bytes: ArrayLike) -> np.ndarray:
        """The optimizer step's temporaries for ``parameter_bytes`` of parameters."""
        return np.asarray(parameter_bytes) * OPTIMIZER_STEP_TEMPORARIES

    @staticmethod
    def pipeline_time_s(stage_times: np.ndarray | list[float], microbatches: int) -> float:
        """1F1B iteration time ``sum_s t_s + (m - 1) max_s t_s`` (see the module docstring)."""
        t = np.asarray(stage_times, dtype=np.float64)
        return float(t.sum() + (microbatches - 1) * t.max()) if microbatches > 0 else 0.0

    def stage_phases_s(
        self, first: int, end: int, stage: int, recompute: bool = False
    ) -> tuple[float, float, float]:
        """``(F, I, W)`` of a stage holding ``[first, end)`` for one micro-batch, as the executor splits them:
        a pipeline's first stage has no input gradient (its ``W`` is the whole backward), a recomputing
        stage does not split (its ``I`` is the whole backward, forward included)."""
        forward = float(self._forward[end] - self._forward[first])
        backward = float(self._backward[end] - self._backward[first]) + (forward if recompute else 0.0)
        weight = float(self._weight[end] - self._weight[first])
        if stage == 0:
            return forward, 0.0, backward
        if recompute:
            return forward, backward, 0.0
        return forward, backward - weight, weight

    def _simulated(self, template: PipelineTemplate, microbatches: int) -> tuple[list, list, int]:
        """``template``'s stages as :func:`~.schedules.pipeline_times_s` takes them."""
        stages, g = template.stages, self.stages_per_node
        phases = [
            self.stage_phases_s(s.first_layer, s.end_layer, k, s.recompute) for k, s in enumerate(stages)
        ]
        delays = [
            self.p2p_s(self._outputs[s.end_layer - 1], same_node=(k + 1) % g != 0)
            for k, s in enumerate(stages)
        ]
        return phases, delays, microbatches

    def simulated_time_s(
        self, template: PipelineTemplate, microbatches: int, schedule: str | None = None
    ) -> float:
        """The iteration time of one pipeline of ``template`` running ``microbatches`` micro-batches under
        ``schedule`` (default: the model's), by event simulation of its action lists."""
        return float(
            pipeline_times_s(schedule or self.schedule, [self._simulated(template, microbatches)])[0]
        )

    def schedule_fits_s(self, templates: Sequence[PipelineTemplate]) -> list[tuple[float, float] | None]:
        """``(a, c)`` of ``T(m) = a + (m - 1) * c`` for each template under the model's schedule (``None`` for
        1F1B, whose closed form is exact): the line through the simulation at ``m = S`` and ``m = 2 S``, all
        templates simulated together."""
        if self.schedule == "1f1b":
            return [None] * len(templates)
        runs = [self._simulated(t, m * len(t.stages)) for t in templates for m in (1, 2)]
        times = pipeline_times_s(self.schedule, runs).reshape(-1, 2)
        fits = []
        for template, (t1, t2) in zip(templates, times, strict=True):
            m1 = len(template.stages)
            c = float(t2 - t1) / m1
            fits.append((float(t1) - (m1 - 1) * c, c))
        return fits

    def allreduce_s(self, nbytes: ArrayLike, replicas: ArrayLike) -> np.ndarray:
        """Ring all-reduce of ``nbytes`` across ``replicas`` pipelines (0 for a single replica)."""
        k = np.maximum(np.asarray(replicas, dtype=np.float64), 1.0)
        c = self.cluster
        return (
            2 * (k - 1) / k * np.asarray(nbytes) / c.inter_node_bandwidth
            + 2 * (k - 1) * c.inter_node_latency_s
        )

    def optimizer_step_s(self, parameter_bytes: ArrayLike) -> np.ndarray:
        """Optimizer step over ``parameter_bytes`` of parameters: read and write their state once."""
        return 2 * np.asarray(parameter_bytes) * self.state_factor / self.cluster.device_memory_bandwidth

    def template_tails_s(self, template: PipelineTemplate, replicas: ArrayLike) -> np.ndarray:
        """Gradient sync + optimizer step of the template's slowest device, for each replica count.

        A device all-reduces its layers one after the other (one latency term per layer), then steps.
        """
        k = np.atleast_1d(np.asarray(replicas, dtype=np.float64))[:, None]
        first = np.array([s.first_layer for s in template.stages])
        end = np.array([s.end_layer for s in template.stages])
        params = (self._params[end] - self._params[first])[None, :]
        sync = self.allreduce_s(params, k) + (end - first - 1)[None, :] * self.allreduce_s(0.0, k)
        return (sync + self.optimizer_step_s(params)).max(axis=1)

    # ------------------------------------------------------------------ bands for the template search
    def _band(self, num_stages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The coordinates of :class:`StageChoices`' band: stage ``(S, 1, 1)``, first ``(S, W, 1)`` and end
        ``(S, 1, W)`` layers, broadcasting to ``(S, W, W)``."""
        w = self.num_layers - num_stages + 1
        stage = np.arange(num_stages)[:, None, None]
        return stage, stage + np.arange(w)[None, :, None], stage + 1 + np.arange(w)[None, None, :]

    def stage_time_band(self, num_stages: int) -> np.ndarray:
        """:meth:`stage_time_s` of every range of the band (:class:`StageChoices`), ``inf`` where empty."""
        _, first, end = self._band(num_stages)
        times = np.where(end > first, self._compute[end] - self._compute[first], np.inf)
        boundary = np.concatenate(([0.0], self._outputs))  # bytes crossing the boundary before layer j
        g = self.stages_per_node
        # each stage's links: (latency, bandwidth) out to the next stage and in from the previous one, none
        # (0, inf) at the pipeline's ends
        out = np.array([self._link((s + 1) % g != 0) for s in range(num_stages - 1)] + [(0.0, np.inf)])
        into = np.array([(0.0, np.inf)] + [self._link(s % g != 0) for s in range(1, num_stages)])
        times = times + (out[:, :1, None] + boundary[end] / out[:, 1:, None])
        return times + (into[:, :1, None] + boundary[first] / into[:, 1:, None])

    def stage_choices(self, num_stages: int) -> StageChoices:
        """Each stage's time and memory under ``activation_checkpointing``, ``inf`` where it does not fit.

        Kept for the next call with the same ``num_stages`` (the planner asks once whether a size is feasible,
        then for its template) up to :data:`_CHOICES_KEPT_BYTES` in all."""
        if num_stages in self._choices:
            return self._choices[num_stages]
        choices = self._stage_choices(num_stages)
        if sum(c.times.nbytes * 2 for c in self._choices.values()) < _CHOICES_KEPT_BYTES:
            self._choices[num_stages] = choices
        return choices

    def _stage_choices(self, num_stages: int) -> StageChoices:
        cap = self.cluster.device_memory_bytes
        plain_t, plain_m = self.stage_time_band(num_stages), self.stage_memory_band(num_stages)
        plain_t = np.where(plain_m <= cap, plain_t, np.inf)
        if self.activation_checkpointing is False:
            return StageChoices(plain_t, plain_m, np.zeros(plain_t.shape, dtype=bool))
        _, first, end = self._band(num_stages)
        forward = np.where(end > first, self._forward[end] - self._forward[first], 0.0)
        re_t = self.stage_time_band(num_stages) + forward  # inf stays inf where the range is empty
        re_m = self.recompute_memory_band(num_stages)
        re_t = np.where(re_m <= cap, re_t, np.inf)
        if self.activation_checkpointing is True:
            return StageChoices(re_t, re_m, np.ones(re_t.shape, dtype=bool))
        use = ~np.isfinite(plain_t) & np.isfinite(re_t)
        return StageChoices(np.where(use, re_t, plain_t), np.where(use, re_m, plain_m), use)

    def recompute_memory_band(self, num_stages: int) -> np.ndarray:
        """Peak memory of every range of the band as its stage with ``m >= S``, recomputing."""
        _, first, end = self._band(num_stages)
        params = self._params[end] - self._params[first]
        inputs = self._inputs[end] - self._inputs[first] + self._kept_output_recomputing[end]
        held = inputs * self._in_flight(num_stages) + self._recomputing_peak[first, end]
        return params * self.state_factor + np.maximum(held, self.step_bytes(params))

    def stage_memory_band(self, num_stages: int) -> np.ndarray:
        """:meth:`stage_memory_bytes` of every range of the band (:class:`StageChoices`) with ``m >= S``."""
        stage, first, end = self._band(num_stages)
        params = self._params[end] - self._params[first]
        activations = self._activations[end] - self._activations[first] + self._kept_output[end]
        kept = self._weight_kept[end] - self._weight_kept[first]
        # the first stage's I keeps nothing and its W runs the whole backward
        pending = [
            pending_weight_limit(self.schedule, num_stages, s, num_stages) * (s > 0)
            for s in range(num_stages)
        ]
        peaks = np.where(stage > 0, self._split_backward_peak[first, end], self._backward_peak[first, end])
        held = (
            activations * self._in_flight(num_stages)
            + kept * np.asarray(pending, dtype=np.float64)[:, None, None]
            + peaks
        )
        return params * self.state_factor + np.maximum(held, self.step_bytes(params))

    def _in_flight(self, num_stages: int) -> np.ndarray:
        """Micro-batches in flight on each stage with ``m >= S``, shaped to broadcast over ``[s, i, j]``."""
        limits = [in_flight_limit(self.schedule, num_stages, s, num_stages) for s in range(num_stages)]
        return np.asarray(limits, dtype=np.float64)[:, None, None]


def _range_max(values: np.ndarray) -> np.ndarray:
    """``m[i, j]``: the largest of ``values[i:j]`` (0 where the range is empty), for every range."""
    n = len(values) + 1
    m = np.zeros((n, n))
    for i in range(n - 1):
        m[i, i + 1 :] = np.maximum.accumulate(values[i:])
    return m
