"""The one owner of torch.distributed state for one generation of a plan.

Every process that runs a worker of a plan creates one :class:`ProcessGroups`; it initialises the
default group over the plan's workers (rank = position in ``plan.workers``) and one gradient group per
distinct set of layer owners (and of a tie's owners), and issues the generation's collectives through its
abortable :class:`~lightning_oobleck.execution.comm.CommWaiter` (:meth:`ProcessGroups.all_reduce`). After a
failure, recovery calls :meth:`ProcessGroups.abort` and creates the next generation in the same process; the
generation prefixes every key in the rendezvous store, so stale keys of an earlier generation can never be
mistaken for new ones. This module is the only code that touches torch.distributed's private state
(:func:`_forget_all_groups`).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_oobleck.execution.comm import CommWaiter
from lightning_oobleck.execution.errors import PeerFailure
from lightning_oobleck.planning.plan import Plan

Worker = tuple[int, int]
"""A ``(node, device)`` pair."""


def backend_for(device: torch.device) -> str:
    """The process-group backend for a device: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class ProcessGroups:
    """Default group plus per-owner-set gradient groups of one plan and generation.

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
                "a default process group already exists in this process; destroy() the previous "
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
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"gen{generation}/", store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        self._grad_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in self._owner_rank_sets():
            # new_group is collective over the default group: every rank creates every group, same order.
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self._grad_groups[ranks] = group
        self.slow_after = slow_after
        self.waiter = CommWaiter(timeout, slow_after=slow_after)
        self._destroyed = False

    def _owner_rank_sets(self) -> list[tuple[int, ...]]:
        plan = self.plan
        owner_sets = [plan.layer_owners(layer) for layer in range(plan.num_layers)]
        owner_sets += [plan.tie_owners(layers) for layers in plan.tied_layers]
        sets = {tuple(sorted(self._ranks[w] for w in owners)) for owners in owner_sets}
        return sorted(s for s in sets if len(s) > 1)

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

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def all_reduce(
        self, tensor: torch.Tensor, abort: threading.Event, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce ``tensor`` in place over every worker of the generation, bounded and abortable.

        Raises :class:`~lightning_oobleck.execution.errors.PeerFailure` when a peer is lost, ``abort`` is
        set or the generation's timeout passes.
        """
        with self.waiter.issuing():
            work = dist.all_reduce(tensor, op=op, async_op=True)
        self.waiter.wait([work], abort)
        return tensor

    def abort(self) -> list[dist.ProcessGroup]:
        """Leave this generation at once, without waiting for its pending operations (after a failure).

        gloo's shutdown (in :meth:`destroy`, and in a group's destructor) waits for every pending
        operation, and one blocked on a live peer that is itself stuck ends only at the group timeout.
        This unregisters the groups without shutting them down and returns them: the caller must keep
        them referenced for the rest of the process (their operations fail or time out in the
        background). With NCCL, the communicators are aborted first (``ProcessGroup.abort``), so that
        kernels waiting on a lost peer end.
        """
        if self._destroyed:
            return []
        self._destroyed = True
        self.waiter.close()
        if not dist.is_initialized():
            return []
        kept = [c10d._get_default_group(), *self._grad_groups.values()]
        self._grad_groups.clear()
        if self.backend == "nccl":  # untested here: no GPU; ProcessGroup.abort is public API
            for group in kept:
                group.abort()
        _forget_all_groups()
        return kept

    def destroy(self) -> None:
        """Tear down every group of this generation (idempotent); a new generation may follow."""
        if self._destroyed:
            return
        self._destroyed = True
        self.waiter.close()
        self._grad_groups.clear()
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
        if dist.is_initialized():
            dist.destroy_process_group()
        raise PeerFailure(f"building the groups of generation {generation} failed: {e}") from e


def _forget_all_groups() -> None:
    """Unregister every process group of this process without shutting any down.

    torch.distributed has no public API for this (``destroy_process_group`` shuts groups down, which
    waits for operations stuck on silent peers), so it edits the process-group registry directly.
    """
    c10d._update_default_pg(None)
    world = c10d._world
    for registry in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
