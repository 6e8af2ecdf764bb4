"""The one owner of torch.distributed state for one generation of a plan.

Every process that runs a worker of a plan creates one :class:`ProcessGroups`; it creates the generation's
*world* group over the plan's workers (rank = position in ``plan.workers``), one gradient group per
distinct set of layer owners (and of a tie's owners; at tensor parallelism ``t > 1``, per shard: the owners
of the same shard in every pipeline), and at ``t > 1`` one *tensor* group per stage (its ``t`` workers of one
node), hands them out (:attr:`ProcessGroups.world`, :meth:`ProcessGroups.grad_group`,
:meth:`ProcessGroups.device_mesh`, :meth:`ProcessGroups.tensor_mesh`) and issues the generation's
collectives through its abortable :class:`~lightning_oobleck.execution.comm.CommWaiter`. Every collective
and point-to-point call of the package names its group. After a failure, recovery calls
:meth:`ProcessGroups.abort` and creates the next generation in the same process; the generation prefixes
every key in the rendezvous store, so stale keys of an earlier generation can never be mistaken for new
ones. Its only ways out are :meth:`~ProcessGroups.abort` and :meth:`~ProcessGroups.destroy`;
:meth:`~ProcessGroups.errored` says why its communication failed.

**Why the world group is torch's default group.** torch can build a group that no registry knows
(``ProcessGroupGloo(store, rank, size)``), but nothing else can use it: ``DeviceMesh`` and DTensor (the
tensor-parallel layers) resolve groups through torch's registry, whose groups other than the default can
only be created through the default group (``new_group``), and Lightning and torchmetrics decide whether
to synchronise by ``torch.distributed.is_initialized()``. So the world group is created with
``init_process_group`` and left with ``destroy_process_group``, both public, and never by editing torch's
registry. This module is the only code that calls either. Leaving a failed generation must not wait for
operations stuck on a silent peer: since torch 2.13 (checked), ``destroy_process_group`` returns at
once with operations pending (the test ``test_abort_leaves_pending_operations`` fails on a torch where it
does not), but the last reference to a group runs its destructor, which does wait; so the groups of a
generation left by :meth:`~ProcessGroups.abort` stay referenced for the rest of the process
(:data:`_ABORTED`), their stuck operations timing out in the background.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.planning.plan import Plan
from lightning_oobleck.worker import Worker

_ABORTED: list[dist.ProcessGroup] = []
"""Groups of generations left by :meth:`ProcessGroups.abort`: a group's destructor waits for its pending
operations, so none may run while one is stuck on a silent peer."""


def backend_for(device: torch.device) -> str:
    """The process-group backend for a device: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class ProcessGroups:
    """The world group plus per-owner-set gradient groups of one plan and generation.

    ``timeout`` bounds every wait (and is the process groups' own timeout); ``slow_after``: with a failure
    detector, waits on live peers warn after it and go on (see :class:`CommWaiter`)."""

    def __init__(
        self,
        plan: Plan,
        worker: Worker,
        store: dist.Store,
        generation: int,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=60),
        slow_after: timedelta | None = None,
    ) -> None:
        workers = plan.workers
        if worker not in workers:
            raise ValueError(
                f"worker {worker} is not part of the plan, whose workers are {list(workers)}; "
                "pass the (node, device) this process runs, or a plan that includes it"
            )
        if dist.is_initialized():
            raise RuntimeError(
                "a generation's groups already exist in this process; abort() or destroy() the previous "
                "generation's ProcessGroups before creating the next one"
            )
        self.plan = plan
        self.worker = worker
        self.generation = generation
        self.backend = backend
        self.timeout = timeout
        self._ranks = {w: i for i, w in enumerate(workers)}
        self.rank = self._ranks[worker]
        self.world_size = len(workers)
        self._error: BaseException | None = None
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"gen{generation}/", store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        self.world: dist.ProcessGroup = dist.group.WORLD  # type: ignore[assignment]
        """The group of every worker of the generation (ranks: positions in ``plan.workers``)."""
        self._grad_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._all_groups: list[dist.ProcessGroup] = [self.world]
        role = plan.role(*worker)
        self.tensor_rank = role.tensor_rank
        """This worker's rank among its stage's ``t`` devices (0 at ``t = 1``)."""
        stage_workers = plan.pipelines[role.pipeline].workers_of_stage(role.stage)
        self.stage_worker = stage_workers[0]
        """The first worker of this worker's stage: the stage's name (in copies and checkpoint shards)."""
        stage_ranks = tuple(self._ranks[w] for w in stage_workers)
        self.tensor_group: dist.ProcessGroup | None = None
        """The group of this worker's stage (its ``t`` workers; ``None`` at ``t = 1``)."""
        try:
            for ranks in self._owner_rank_sets():
                # new_group is collective over the world group: every rank creates every group, same order.
                group = dist.new_group(list(ranks), timeout=timeout)
                self._all_groups.append(group)
                if self.rank in ranks:
                    self._grad_groups[ranks] = group
            for ranks in self._stage_rank_sets():
                # The layers' collectives on it are DTensor's, which no waiter bounds: a device whose stage
                # peer left for a recovery mid-collective is released by this timeout (see the engine).
                group = dist.new_group(list(ranks), timeout=slow_after or timeout)
                self._all_groups.append(group)
                if ranks == stage_ranks:
                    self.tensor_group = group
        except RuntimeError:  # a peer lost while connecting: leave without waiting for it
            _ABORTED.extend(self._all_groups)
            self._leave()
            raise
        self.slow_after = slow_after
        self.waiter = CommWaiter(timeout, slow_after=slow_after)
        self._destroyed = False

    def _owner_rank_sets(self) -> list[tuple[int, ...]]:
        plan = self.plan
        owner_sets = [
            owners
            for r in range(plan.tensor_parallel)
            for owners in [plan.layer_owners(layer, r) for layer in range(plan.num_layers)]
            + [plan.tie_owners(layers, r) for layers in plan.tied_layers]
        ]
        sets = {tuple(sorted(self._ranks[w] for w in owners)) for owners in owner_sets}
        return sorted(s for s in sets if len(s) > 1)

    def _stage_rank_sets(self) -> list[tuple[int, ...]]:
        """Every stage's ranks, for its tensor group (none at ``t = 1``)."""
        if self.plan.tensor_parallel == 1:
            return []
        return sorted(
            tuple(self._ranks[w] for w in p.workers_of_stage(s))
            for p in self.plan.pipelines
            for s in range(len(p.stages))
            if p.worker_of_stage(s).node not in self.plan.lost
        )

    def rank_of(self, worker: Worker) -> int:
        """Global rank of ``worker`` in this generation."""
        return self._ranks[worker]

    def grad_group(self, owners: tuple[Worker, ...]) -> dist.ProcessGroup | None:
        """The gradient group of the workers ``owners`` (``None`` for a single owner: nothing to sync)."""
        ranks = tuple(sorted(self._ranks[w] for w in owners))
        if len(ranks) == 1:
            return None
        if self.rank not in ranks:
            raise KeyError(f"worker {self.worker} is not among the owners {owners}")
        return self._grad_groups[ranks]

    def device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """A one-dimensional ``DeviceMesh`` over the generation's world group (for DTensor), on
        ``device_type`` (default: the backend's: ``cuda`` with NCCL, else ``cpu``)."""
        device_type = device_type or ("cuda" if self.backend == "nccl" else "cpu")
        return DeviceMesh.from_group(self.world, device_type, mesh_dim_names=(f"world{self.generation}",))

    def tensor_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """A one-dimensional ``DeviceMesh`` over this worker's stage (its tensor group), on which its layers
        are split (``torch.distributed.tensor.parallel``); at ``t = 1`` an error."""
        if self.tensor_group is None:
            raise ValueError("the plan runs each stage on one device: there is no tensor-parallel mesh")
        device_type = device_type or ("cuda" if self.backend == "nccl" else "cpu")
        # Named by generation: DTensor caches its plans by the mesh's value (ranks, names), and a later
        # generation's mesh over the same ranks must not reuse plans that name an earlier generation's group.
        return DeviceMesh.from_group(
            self.tensor_group, device_type, mesh_dim_names=(f"tensor{self.generation}",)
        )

    @property
    def destroyed(self) -> bool:
        """Whether the generation was left (:meth:`abort` or :meth:`destroy`)."""
        return self._destroyed

    def errored(self) -> BaseException | None:
        """Why the generation's communication failed (a lost peer, an abort, a timeout), or ``None``."""
        if self._error is None and self.waiter.broken is not None:
            self._error = PeerFailure(self.waiter.broken)
        return self._error

    def all_reduce(
        self, tensor: torch.Tensor, abort: threading.Event, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce ``tensor`` in place over every worker of the generation, bounded and abortable.

        Raises :class:`~lightning_oobleck.execution.errors.PeerFailure` when a peer is lost, ``abort`` is
        set or the generation's timeout passes.
        """
        with self.waiter.issuing():
            work = dist.all_reduce(tensor, op=op, group=self.world, async_op=True)
        self.waiter.wait([work], abort)
        return tensor

    def abort(self, reason: str = "aborted") -> None:
        """Leave this generation at once, without waiting for its pending operations (after a failure).

        With NCCL, every communicator is aborted first (``ProcessGroup.abort``), so that kernels waiting on
        a lost peer end; then the groups are destroyed and kept referenced (see the module's docstring):
        their stuck operations fail or time out in the background. A new generation may follow.
        """
        if self._destroyed:
            return
        self._error = self.errored() or PeerFailure(reason)
        self._destroyed = True
        self.waiter.close()
        if self.backend == "nccl":
            for group in reversed(self._all_groups):
                group.abort()
        _ABORTED.extend(self._all_groups)
        self._leave()

    def destroy(self) -> None:
        """Tear down every group of this generation (idempotent); a new generation may follow."""
        if self._destroyed:
            return
        self._destroyed = True
        self.waiter.close()
        self._leave()

    def _leave(self) -> None:
        self._grad_groups.clear()
        self._all_groups.clear()
        self.tensor_group = None
        if dist.is_initialized():
            dist.destroy_process_group()


def check_plan_size(plan: Plan, world_size: int) -> Plan:
    """``plan``, if it has one worker per launched process; else an error that says what to change."""
    if world_size != len(plan.workers):
        raise ValueError(
            f"the plan has {len(plan.workers)} workers but {world_size} processes were launched; "
            f"make a plan for {world_size} workers or launch {len(plan.workers)} processes"
        )
    return plan


def join_generation(
    plan: Plan,
    worker: Worker,
    store: dist.Store,
    generation: int,
    backend: str,
    timeout: timedelta,
    slow_after: timedelta | None = None,
) -> ProcessGroups:
    """:class:`ProcessGroups` of a generation whose members may fail while they connect: a peer lost then
    raises :class:`PeerFailure` (recovery moves on to the next generation) and leaves no default group."""
    try:
        return ProcessGroups(plan, worker, store, generation, backend, timeout, slow_after)
    except RuntimeError as e:  # gloo reports a peer lost while connecting as a plain RuntimeError
        raise PeerFailure(f"building the groups of generation {generation} failed: {e}") from e
