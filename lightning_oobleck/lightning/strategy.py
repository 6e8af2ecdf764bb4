"""``OobleckStrategy``: heterogeneous pipelines inside Lightning's training loop.

How a training step maps onto Lightning's automatic optimisation (which runs ``training_step``, then
``zero_grad``, then ``backward``, so gradients made inside ``training_step`` would be wiped):

1. ``training_step`` -> :meth:`OobleckStrategy.pipeline_loss` runs this rank's part of the 1F1B schedule
   (forwards and backwards of every micro-batch plus the cross-pipeline gradient sync) and the step's
   commit, and then *moves* the finished gradients out of ``.grad`` (no copy); it returns the global mean
   loss, the same on every rank.
2. Lightning's ``zero_grad`` finds no gradients to clear.
3. :meth:`OobleckStrategy.backward` fires ``on_before_backward``, moves the gradients back into ``.grad``
   and fires ``on_after_backward``; ``on_before_optimizer_step``, clipping (by the global norm, each layer
   counted once) and the LR schedulers then run exactly as with DDP.

Every exchange with the peers (the steps above, evaluation steps, the collectives Lightning asks of the
strategy, checkpoint saves) is a recoverable unit of :mod:`~lightning_oobleck.lightning.units`. Checkpoints
are sharded (:mod:`lightning_oobleck.execution.checkpoint`): each layer once, loadable into any other
layout, committed atomically.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_oobleck.execution import PipelineEngine, ProcessGroups
from lightning_oobleck.execution.checkpoint import (
    PROFILE_FILE,
    PROFILE_KEY,
    load_metadata,
    load_sharded_model,
    load_sharded_optimizers,
)
from lightning_oobleck.execution.faults import from_environment, locate_coordinator
from lightning_oobleck.execution.process_groups import backend_for, check_plan_size
from lightning_oobleck.execution.stage import Tie, find_ties
from lightning_oobleck.execution.tensor_parallel import whole_values
from lightning_oobleck.lightning._internals import (
    is_dataloader_shuffled,
    logged_results,
    loop_data_source,
    optimizers_to_device,
    route_sigterm_check,
)
from lightning_oobleck.lightning.config import OobleckConfig, StartMethod, load_oobleck_config
from lightning_oobleck.lightning.console import (
    hide_untrue_lightning_warnings,
    print_start,
    show_warnings_on_rank_zero,
    use_step_lines,
)
from lightning_oobleck.lightning.data import (
    DataPosition,
    GlobalBatchSampler,
    PipelineDataLoader,
    wrap_dataloader,
)
from lightning_oobleck.lightning.environment import OobleckEnvironment, detect_environment
from lightning_oobleck.lightning.generation import (
    GenerationOptions,
    JobPlanner,
    first_generation,
    join_running_training,
)
from lightning_oobleck.lightning.module import (
    PipelineExecutor,
    PipelineModule,
    as_pipeline_module,
    layer_source,
    meta_layers,
)
from lightning_oobleck.lightning.plan_agreement import check_layout_size
from lightning_oobleck.lightning.precision import with_global_norm_clipping
from lightning_oobleck.lightning.summary import summarize_whole_model
from lightning_oobleck.lightning.units import (
    LOGGER_VERSIONS,
    LightningLoop,
    check_tied_parameter_groups,
    evaluation_loaders,
    host_key,
    logger_versions,
    set_logger_versions,
)
from lightning_oobleck.planning.plan import PLAN_CHECK_ENV, Plan, PlanChecked
from lightning_oobleck.recovery.agent import (
    WorkerAgent,
    close_process_agent,
    known_coordinators,
    process_agent,
)
from lightning_oobleck.recovery.joiner import Admission
from lightning_oobleck.recovery.keystore import KeyStoreClient
from lightning_oobleck.recovery.membership import MembershipSettings
from lightning_oobleck.recovery.protocol import ADDRESS_ENV, NODE_KEY_ENV, Timeouts, node_name
from lightning_oobleck.worker import Worker


class OobleckStrategy(ParallelStrategy, PipelineExecutor):
    """Train a :class:`~lightning_oobleck.lightning.module.PipelineModule` as Oobleck pipelines.

    The options are the fields of :class:`~lightning_oobleck.lightning.config.OobleckConfig`, which documents
    each (``OobleckStrategy.from_config`` reads them from a YAML file or an OmegaConf node):

    * the batch: ``global_batch_size`` (default: the loader's ``batch_size``), ``microbatch_size``;
    * the guarantee: ``fault_tolerance`` (node failures survived at once), ``devices_per_node`` (processes
      that fail together);
    * the plan: ``planner`` (e.g. ``{"cluster": {"device_memory_bytes": 80e9}}``), ``schedule``,
      ``tensor_parallel`` (each stage split over that many devices of a node, or ``"auto"``),
      ``activation_checkpointing``, ``profile_path``, ``profile_cache_dir``, ``plan_path``, ``layout`` and
      ``microbatches`` (your own stages, still recovered from the planner's templates);
    * failures: ``heartbeat_timeout_s`` < ``collective_timeout_s`` <= ``hang_timeout_s``, ``plan_timeout_s``,
      ``join_policy``, ``replace_failed_after_s``, ``recovery_policy`` (``"reinstantiate"``, ``"reroute"``
      or ``"auto"``) and ``failure_interval_s``;
    * the rest: ``seed`` (sample order), ``backend``, ``start_method`` (local launcher).
    """

    strategy_name = "oobleck"

    def __init__(
        self,
        *,
        global_batch_size: int | None = None,
        microbatch_size: int | None = None,
        fault_tolerance: int = 1,
        devices_per_node: int | None = None,
        seed: int = 0,
        backend: str | None = None,
        heartbeat_timeout_s: float = 5.0,
        collective_timeout_s: float = 60.0,
        hang_timeout_s: float = 1800.0,
        plan_timeout_s: float = 300.0,
        start_method: StartMethod = "forkserver",
        planner: Mapping[str, Any] | None = None,
        profile_path: str | Path | None = None,
        profile_cache_dir: str | Path | None = None,
        plan_path: str | Path | None = None,
        layout: Sequence[Sequence[int]] | None = None,
        activation_checkpointing: bool | Literal["auto"] = False,
        microbatches: Sequence[int] | None = None,
        schedule: Literal["1f1b", "zb-h1", "auto"] = "1f1b",
        tensor_parallel: int | Literal["auto"] = 1,
        join_policy: Literal["at_once", "whole_template", "hot_standby"] = "at_once",
        replace_failed_after_s: float | None = None,
        recovery_policy: Literal["reinstantiate", "reroute", "auto"] = "reinstantiate",
        failure_interval_s: float = 3600.0,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: OobleckEnvironment | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        options = {k: v for k, v in locals().items() if k in OobleckConfig.__dataclass_fields__}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or detect_environment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        options["planner"] = dict(planner or {})
        options["layout"] = None if layout is None else [list(bounds) for bounds in layout]
        options["microbatches"] = None if microbatches is None else list(microbatches)
        options.update({k: str(v) for k, v in options.items() if isinstance(v, Path)})
        self.config = load_oobleck_config(options)
        self.config.validate()
        self._num_nodes = 1
        self._groups: ProcessGroups | None = None
        self._engine: PipelineEngine | None = None
        self._in_flight = DataPosition()
        self._evaluating = (0, 0)
        self._checkpoint_path: Path | None = None
        self._stashed_grads: list[Tensor | None] | None = None
        self._store_client: KeyStoreClient | None = None
        self._store: dist.Store | None = None
        self._agent: WorkerAgent | None = None
        self._units: LightningLoop | None = None
        self.ties: tuple[Tie, ...] = ()
        """The model's tied parameters (known from ``setup_environment`` on)."""
        self._whole_state: dict[str, Any] | None = None
        """A split stage's state gathered whole at teardown (read by the launcher after the groups)."""
        self._admission: Admission | None = None
        """What this process received when it joined a running training (``OOBLECK_NODE_KEY``)."""
        self._unevaluated_warned: set[tuple[str, int]] = set()
        """The evaluation loaders (stage, index) whose left-out samples were warned of."""

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> OobleckStrategy:
        """From an OmegaConf node, a dict or a YAML path holding :class:`OobleckConfig` keys (unknown keys and
        wrong types refused with the valid keys named); ``kwargs``: the strategy's other arguments."""
        return cls(**_as_dict(load_oobleck_config(cfg)), **kwargs)

    # ------------------------------------------------------------------ topology
    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Lightning sizes the sampler it injects before process_dataloader replaces it: every worker is a
        # replica (a pipeline's share is cut by the global-batch sampler later).
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    @override
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def plan(self) -> Plan:
        """The plan this process runs (available after ``setup_environment``)."""
        return self._require_groups().plan

    @property
    def engine(self) -> PipelineEngine:
        if self._engine is None:
            raise RuntimeError("the pipeline engine exists only after the strategy's setup()")
        return self._engine

    @property
    def worker(self) -> Worker:
        """This process's worker ``(node, device)``: the node id is the launch's (``SLURM_NODEID``, the local
        launcher's node), or the coordinator's for a process that joined."""
        return self._environment().worker

    @property
    def generation(self) -> int:
        """The generation this process runs: 0 at the start, one more after every recovery or join."""
        return self._require_groups().generation

    @property
    def joined(self) -> bool:
        """Whether this process joined the running training (it was not launched with the job)."""
        return self._admission is not None

    @property
    def admission(self) -> Admission | None:
        """How this process joined the running training (its recovery event, the state it received), or
        ``None`` for a process launched with the job."""
        return self._admission

    @property
    def registered_at(self) -> float | None:
        """When this process registered with the coordinator (wall clock), if a coordinator runs."""
        return self._agent.registered_at if self._agent is not None else None

    @property
    def recovery_events(self) -> Path | None:
        """The JSONL file of this fit's step and recovery records (``oobleck timeline``), if recovery runs."""
        events = self._units.events if self._units is not None else None
        return events.path if events is not None else None

    @property
    def data_position(self) -> DataPosition:
        """The next training global batch (epoch, step): what a restart or a reconfiguration resumes from."""
        sampler = self._train_sampler()
        return sampler.position if sampler is not None else DataPosition()

    def _train_sampler(self) -> GlobalBatchSampler | None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        loader = trainer.train_dataloader if trainer is not None else None
        return loader.batch_sampler if isinstance(loader, PipelineDataLoader) else None

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this once devices and precision are known: refuse what cannot run before launching.
        self._check_precision()
        from_environment()  # a drill's OOBLECK_FAULTS that no worker could read
        self.config = replace(
            self.config, devices_per_node=self._environment().devices_per_node(self.config.devices_per_node)
        )
        if self.config.layout is not None:
            check_layout_size(self.config, self.num_processes * self.num_nodes)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            from lightning_oobleck.lightning.launcher import OobleckLauncher

            self._launcher = OobleckLauncher(
                self.num_processes * self.num_nodes,
                devices_per_node=self.config.devices_per_node,
                start_method=self.config.start_method,  # type: ignore[arg-type]
                replace_failed_after_s=self.config.replace_failed_after_s,
                preflight=self._refuse_before_launch,
                coordinator=MembershipSettings(heartbeat_timeout=self.config.heartbeat_timeout_s),
            )

    # ------------------------------------------------------------------ environment and setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        show_warnings_on_rank_zero()
        hide_untrue_lightning_warnings()
        environment = self._environment()
        module = self._pipeline_module()
        self.config = self.config.with_batch(self._loader_batch_size(), environment.world_size())
        layers, num_workers = meta_layers(module), environment.world_size()
        self.ties = find_ties(layers)
        tied_layers = tuple(tie.layers for tie in self.ties)
        if os.environ.get(PLAN_CHECK_ENV):  # a check before the job's tasks start: plan, then stop
            self._check_trainer(self.lightning_module.trainer, self.lightning_module)
            plan = self._planner(module).plan(len(layers), num_workers)
            raise PlanChecked(check_plan_size(replace(plan, tied_layers=tied_layers), num_workers))
        # Every run of the process (fit, then validate...) has its own keys: plans, generations, recovery.
        # The client is a Python store: held here, as C++ (PrefixStore) keeps only its native half alive.
        self._store_client = _connect_store(environment, self.config)
        store = self._store = dist.PrefixStore(f"oobleck/run{next(_RUNS)}/", self._store_client)

        def make_plan() -> Plan:
            plan = self._planner(module).plan(len(layers), num_workers)
            # The run's log directory travels with the plan: every worker (and whichever is rank 0 later)
            # writes logs and checkpoints under the versions the planning worker resolved.
            extra = {**plan.extra, LOGGER_VERSIONS: logger_versions(self.lightning_module.trainer)}
            return check_plan_size(replace(plan, tied_layers=tied_layers, extra=extra), num_workers)

        options = GenerationOptions.of(self.config, self.config.backend or backend_for(self.root_device))
        if environment.node_key is not None:
            self._join(environment, store, options)
        else:
            if os.environ.get(
                ADDRESS_ENV
            ):  # a coordinator runs: workers lost before the first step are survived
                self._agent = self._start_agent(environment.worker)
            plans = environment.global_rank() == 0
            self._groups = first_generation(
                environment.worker, store, make_plan, self.config.plan_timeout_s, options, self._agent, plans
            )
        environment.set_global_rank(self._groups.rank)
        environment.set_world_size(self._groups.world_size)
        rank_zero_only.rank = self._groups.rank
        store.set(host_key(self._groups.worker[0]), node_name())  # messages name lost nodes' hosts
        if (versions := self._groups.plan.extra.get(LOGGER_VERSIONS)) is not None:
            set_logger_versions(self.lightning_module.trainer, versions)
        use_step_lines(self.lightning_module.trainer)

    def _start_agent(self, worker: tuple[int | None, int], node_key: str | None = None) -> WorkerAgent:
        """This process's agent (registered once per process), with the job's failure-detector timeouts."""
        cfg = self.config
        timeouts = Timeouts(cfg.heartbeat_timeout_s, cfg.hang_timeout_s)
        agent = process_agent(
            worker, connect_timeout=cfg.plan_timeout_s, timeouts=timeouts, node_key=node_key
        )
        locate_coordinator(agent.coordinator_pid_here)  # drills of the coordinator loss
        return agent

    def _join(self, environment: OobleckEnvironment, store: dist.Store, options: GenerationOptions) -> None:
        """This process joins a running training (:func:`join_running_training`)."""
        if not os.environ.get(ADDRESS_ENV):
            raise RuntimeError(
                f"{NODE_KEY_ENV} is set (this process joins a running training) but {ADDRESS_ENV} is not: "
                "a joiner needs the running job's coordinator; start it with `oobleck join` (SLURM) or let "
                "the launcher replace a dead worker (replace_failed_after_s)"
            )
        cfg, module = self.config, self._pipeline_module()
        self._agent = agent = self._start_agent((None, environment.position.device), environment.node_key)
        environment.set_node(agent.worker.node)
        self._admission = join_running_training(
            agent, store, module, self.root_device, self.precision_plugin, options, cfg.hang_timeout_s
        )
        self._groups = self._admission.groups
        plan = self._groups.plan
        self.config = replace(
            cfg, global_batch_size=plan.global_batch_size, microbatch_size=plan.microbatch_size
        )

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._check_trainer(trainer, self.lightning_module)
        module = self._pipeline_module()
        self._engine = self._build_engine(module)
        module.layers = self._engine.module.layers
        summarize_whole_model(trainer)
        self.model_to_device()
        if self._engine.groups.tensor_group is not None:
            # Module.to swaps split (DTensor) parameters' tensors, which drops their gradient hooks: the
            # gradient sync registers its own again
            self._engine.reconfigure(self._engine.groups, self._engine.module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        # Clipping by norm must use the norm of the whole model, each layer once: the step's commit has it.
        self.precision_plugin = with_global_norm_clipping(
            self.precision_plugin, lambda: self._require_units().grad_norm_sq()
        )
        self._units = LightningLoop(self, trainer)
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
        if self._admission is not None:
            self._units.catch_up(self._admission.loop_state)
        if fitting and self._agent is not None:
            assert self._store is not None
            # before the first exchange, just below
            self._units.enable_recovery(self._agent, self._store, self._admission)
        if fitting:
            # Lightning broadcasts its SIGTERM flag on the default group before every batch; here the step's
            # commit carries it, so no collective runs outside the units.
            route_sigterm_check(trainer, self._units.check_sigterm)

    def _build_engine(self, module: PipelineModule) -> PipelineEngine:
        """Materialise the owned layers; weights the module already holds (a previous fit's) are kept."""
        with self.precision_plugin.tensor_init_context():
            engine = PipelineEngine(
                layer_source(module),
                module.compute_loss,
                self._require_groups(),
                self.root_device,
                seed=module.init_seed,
                abort=self._agent.abort if self._agent is not None else None,
                init=module.init_layer,
                module=self._admission.module if self._admission is not None else None,
                tensor_parallel_plan=module.tensor_parallel_plan,
            )
        held = getattr(module, "layers", None)
        if held is not None:
            owned = engine.module.layers
            owned.load_state_dict({k: v for k, v in held.state_dict().items() if k.split(".")[0] in owned})
        return engine

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state. During the run, a split stage's tensors as this device holds them: Lightning's
        checkpointing asks for it and drops it (the shards hold the weights), so nothing is gathered there.
        After the run, the whole state its teardown gathered (what the launcher hands back)."""
        if self._groups is None and self._whole_state is not None:
            return self._whole_state
        return super().lightning_module_state_dict()

    def _loader_batch_size(self) -> int | None:
        """``batch_size`` of the DataLoader this run trains (or evaluates) on, if it can be had yet; else
        (a DataModule makes its loaders in ``setup()``, which Lightning calls after the plan is needed) the
        ``batch_size`` attribute or hyperparameter of the module or its DataModule, Lightning's convention
        (its batch-size finder's)."""
        module = self.lightning_module
        trainer = module.trainer
        loop = {
            TrainerFn.FITTING: trainer.fit_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
        }.get(trainer.state.fn)
        source = loop_data_source(loop)
        try:
            loader = source.dataloader() if source is not None and source.is_defined() else None
        except Exception:  # a DataModule's loader before its setup()
            loader = None
        if (size := getattr(loader, "batch_size", None)) is not None:
            return size
        return lightning_getattr(module, "batch_size") if lightning_hasattr(module, "batch_size") else None

    def _planner(self, module: PipelineModule) -> JobPlanner:
        """What makes this job's plan, on the worker that plans it."""
        return JobPlanner(self.config, module, self.root_device, self.precision_plugin, self._profile_cache())

    def _profile_cache(self) -> Path:
        cfg = self.config
        return Path(
            cfg.profile_cache_dir or Path(self.lightning_module.trainer.default_root_dir) / PROFILE_CACHE
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # Lightning's own SIGTERM handler broadcasts on the default group from inside the handler (which
        # would interleave with the units) and its loop then stops the signalled rank alone; this one only
        # records the signal: the next commit shares it, and every worker stops at the same batch.
        signal.signal(signal.SIGTERM, self._require_units().record_sigterm)
        runner = self._require_units().runner
        if runner is not None:  # after a checkpoint restore: count steps as Lightning does
            runner.start_at(self.lightning_module.trainer.global_step)
        if rank_zero_only.rank == 0 and self._admission is None:  # (trainer.log_dir would be a collective)
            profiles = self._profile_cache()
            print_start(self.plan, self.recovery_events, profiles if profiles.is_dir() else None)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._require_units().flush_loggers()
        self._warn_of_unevaluated_samples()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._warn_of_unevaluated_samples()

    def _warn_of_unevaluated_samples(self) -> None:
        """Once per evaluation loader and process: the samples after its last whole global batch, which no
        evaluation step runs (every step is a global batch), unless ``limit_*_batches`` stops before them.
        Every worker records it, rank 0 prints it: a new rank 0 does not repeat it."""
        trainer = self.lightning_module.trainer
        if trainer.sanity_checking:
            return
        stage = "test" if trainer.testing else "val"
        loaders = evaluation_loaders(trainer)
        counts = trainer.num_test_batches if trainer.testing else trainer.num_val_batches
        for index, (loader, count) in enumerate(zip(loaders, counts, strict=False)):
            sampler = loader.batch_sampler if isinstance(loader, PipelineDataLoader) else None
            if sampler is None or not sampler.left_out or count < len(sampler):
                continue  # every sample evaluated, or limit_*_batches stops before the last ones
            if (stage, index) in self._unevaluated_warned:
                continue
            self._unevaluated_warned.add((stage, index))
            name = f"{stage}_dataloader" + f" {index}" * (len(loaders) > 1)
            size = sampler.global_batch_size
            rank_zero_warn(
                f"the {name}'s last {sampler.left_out} of {sampler.num_samples} samples are not evaluated: "
                f"every evaluation step is a global batch of {size} samples. Make the evaluation set a "
                f"multiple of {size} samples to evaluate them all"
            )

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        units = self._require_units()
        units.finish()
        units.flush_loggers()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """This worker failed (a bug, out of memory): its peers must see it lost now, not a worker that left
        normally, so its agent closes unfinished and they recover without it."""
        close_process_agent(finished=False)
        self._agent = None

    @override
    def teardown(self) -> None:
        if self._groups is not None:
            groups = self._require_groups()
            # gathered while the stage's group exists: the launcher reads the weights after teardown
            split = groups.tensor_group is not None and not groups.destroyed
            self._whole_state = whole_values(super().lightning_module_state_dict()) if split else None
            groups.destroy()
            self._groups = None
        self._agent = None  # the process keeps it for its next run (close_process_agent at its end)
        self._engine = None
        self._units = None
        super().teardown()

    # ------------------------------------------------------------------ the step
    @override
    def pipeline_loss(self, module: PipelineModule, batch: Any, train: bool) -> Tensor:
        units = self._require_units()
        if train:
            # The previous step's gradients are still in .grad (Lightning zeroes them only after
            # training_step); the schedule accumulates into .grad, so it must start from nothing.
            self._take_grads()
            loss = units.train_step(module, batch, self._in_flight)
            self._stashed_grads = self._take_grads()
            return loss.requires_grad_()
        return units.eval_step(module, batch, self._evaluating[0], self._evaluating[1])

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """Fire the backward hooks around handing back the gradients the schedule already computed."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._restore_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The batch in flight; after its optimizer step the position moves past it (see optimizer_step).
        self._in_flight = DataPosition(self.lightning_module.current_epoch, batch_idx)
        self._weigh_logged_values()
        self._require_units().flush_loggers()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._start_evaluation_step(*args, **kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._start_evaluation_step(*args, **kwargs)
        return super().test_step(*args, **kwargs)

    def _start_evaluation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluating = (batch_idx, dataloader_idx)
        self._weigh_logged_values()

    def _weigh_logged_values(self) -> None:
        """Every value this batch logs stands for the whole global batch (``pipeline_loss`` returns the
        global mean on every rank): weigh it by the global batch size on every rank, so that epoch means
        synced over the ranks equal a single device's whatever the pipelines' shares and their changes."""
        results = logged_results(self.lightning_module.trainer)
        if results is not None:
            results.batch_size = self.config.global_batch_size

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = self._require_units().optimizer_step(
            lambda: super(OobleckStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)
        )
        sampler = self._train_sampler()
        if sampler is not None:
            sampler.advance(self._in_flight.epoch, self._in_flight.step + 1)
        return output

    def _params(self) -> list[Tensor]:
        return list(self.engine.module.parameters())

    def _take_grads(self) -> list[Tensor | None]:
        """Move the gradients out of ``.grad`` (no copy)."""
        params = self._params()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    def _restore_grads(self) -> None:
        if self._stashed_grads is None:
            raise RuntimeError(
                "backward() without a pipeline step: under the oobleck strategy the loss must come from "
                "self.pipeline_loss(batch) inside training_step"
            )
        for p, grad in zip(self._params(), self._stashed_grads, strict=True):
            p.grad = grad
        self._stashed_grads = None

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Replace the sampler: each rank loads its pipeline's share of every global batch."""
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"the oobleck strategy needs DataLoaders over map-style datasets, got {type(dataloader)}"
            )
        try:
            num_samples = len(dataloader.dataset)  # type: ignore[arg-type]
        except TypeError as e:
            raise TypeError(
                "the oobleck strategy needs a map-style dataset (with __len__ and __getitem__) so that every "
                "pipeline can load its share of each global batch"
            ) from e
        groups = self._require_groups()
        pipeline = groups.plan.role(*groups.worker).pipeline
        share = self._engine.samples if self._engine is not None else groups.plan.samples(pipeline)
        sampler = GlobalBatchSampler(
            num_samples,
            self.config.global_batch_size,
            seed=self.config.seed,
            # Lightning asks for shuffling exactly as it would with DDP (training loaders by default).
            shuffle=_shuffles(dataloader),
            share=share,
        )
        return wrap_dataloader(dataloader, sampler)

    # ------------------------------------------------------------------ sharded checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights load into the layers this rank owns, which exist only once setup() built the engine.
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Collective: each layer's weights and optimizer state once, Lightning's metadata, committed
        atomically (a directory at ``filepath`` is always a complete checkpoint)."""
        self._require_units().save_checkpoint(checkpoint, filepath)

    def checkpoint_metadata(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """What a sharded checkpoint stores beside its shards: Lightning's ``checkpoint`` minus tensors, and
        the layer profile the plan was made from (also written as ``profile.json``)."""
        metadata = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # Lightning insists on the key when it restores; the optimizer state itself lives in the shards.
        metadata["optimizer_states"] = []
        if (profile := self.plan.extra.get("profile")) is not None:
            metadata[PROFILE_KEY] = profile
        return metadata

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self._checkpoint_path = Path(checkpoint_path)
        metadata = load_metadata(checkpoint_path)
        planned_from = self.plan.extra.get("profile")
        if (
            (saved := metadata.get(PROFILE_KEY)) is not None
            and planned_from is not None
            and saved != planned_from
        ):
            rank_zero_warn(
                f"this run planned from another layer profile than the run that wrote {checkpoint_path}: the "
                "layout may differ (the weights do not). To plan as that run, pass "
                f"OobleckStrategy(profile_path='{Path(checkpoint_path) / PROFILE_FILE}')"
            )
        return metadata

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._admission is None:  # a joiner's layers came from its peers
            load_sharded_model(self._require_checkpoint_path(), self.engine.module)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._admission is None:  # a joiner's optimizer state came from its peers
            load_sharded_optimizers(self._require_checkpoint_path(), self.engine.module, self.optimizers)

    def _require_checkpoint_path(self) -> Path:
        if self._checkpoint_path is None:
            raise RuntimeError("load_checkpoint() must come first: it names the sharded checkpoint")
        return self._checkpoint_path

    # ------------------------------------------------------------------ collectives Lightning asks for
    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over every worker (``"mean"`` by default, in floating point); recovered like every unit."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            raise ValueError(
                "the oobleck strategy reduces over every worker of the current generation: sync_dist_group "
                "(a process group of your own) is not supported, since groups are rebuilt after failures"
            )
        return self._require_units().all_reduce(tensor, "mean" if reduce_op is None else reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._units is not None:
            self._units.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return self._units.broadcast(obj, src) if self._units is not None else obj

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if group is not None or sync_grads:
            raise ValueError(
                "the oobleck strategy gathers over every worker without gradients: pass neither group nor "
                "sync_grads=True to all_gather"
            )
        return self._require_units().all_gather(tensor)

    # ------------------------------------------------------------------ checks
    def _environment(self) -> OobleckEnvironment:
        environment = self.cluster_environment
        if not isinstance(environment, OobleckEnvironment):
            raise TypeError(
                f"the oobleck strategy needs an OobleckEnvironment (local or SLURM), not {type(environment)};"
                " leave cluster_environment unset to detect it"
            )
        return environment

    def _pipeline_module(self) -> PipelineModule:
        return as_pipeline_module(self.lightning_module)

    def _check_trainer(self, trainer: Trainer, module: Any) -> None:
        """Refuse what the strategy cannot run; called in the launching process before any worker starts
        (:meth:`_refuse_before_launch`), and by every worker."""
        if trainer.state.fn == TrainerFn.PREDICTING:
            raise NotImplementedError(
                "trainer.predict is not supported by the oobleck strategy: each worker holds only its own "
                "stages. Consolidate a checkpoint (`oobleck consolidate CKPT OUT.ckpt`, or "
                "lightning_oobleck.consolidate_checkpoint) and predict on one device with strategy='auto'"
            )
        as_pipeline_module(module)
        if not module.automatic_optimization:
            raise ValueError(
                "the oobleck strategy supports automatic optimisation only: remove "
                "self.automatic_optimization = False (the pipeline schedule runs the backward passes)"
            )
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            factor = trainer.accumulate_grad_batches
            raise ValueError(
                f"accumulate_grad_batches={factor} is not supported by the oobleck strategy: a step already "
                "accumulates over its micro-batches. Remove it and make "
                f"OobleckStrategy(global_batch_size=...) {factor}x the samples per step (the same update)"
            )

    def _refuse_before_launch(self, trainer: Trainer, args: tuple[Any, ...]) -> None:
        """The launcher's check of ``trainer.fit/validate/test/predict(model, ...)``, before workers start
        (``model=None``: the module of an earlier run of this Trainer)."""
        self._check_trainer(trainer, args[0] if args and args[0] is not None else trainer.lightning_module)

    def _check_precision(self) -> None:
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                "precision='16-mixed' needs a gradient scaler around a backward that the pipeline schedule "
                "runs itself; use precision='bf16-mixed' (no scaler needed) or '32-true'"
            )

    def _check_optimizers(self) -> None:
        for optimizer in self.optimizers:
            check_tied_parameter_groups(self.lightning_module, optimizer, self.engine.module)
        owned = {id(p) for p in self._params()}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                if any(id(p) not in owned for p in group["params"]):
                    raise ValueError(
                        "configure_optimizers must optimise self.parameters() (the layers held here): "
                        "an optimizer holds a parameter outside self.layers"
                    )

    def _require_units(self) -> LightningLoop:
        if self._units is None:
            raise RuntimeError("the oobleck strategy exchanges with its peers only after its setup()")
        return self._units

    def _require_groups(self) -> ProcessGroups:
        """The groups of the generation this process runs: the engine's once it exists (a recovery switches
        it to the next generation's), before that the first generation's."""
        if self._engine is not None:
            return self._engine.groups
        if self._groups is None:
            raise RuntimeError("the process groups exist only after the strategy's setup_environment()")
        return self._groups

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Oobleck: fault-tolerant heterogeneous pipelines"
        )


_RUNS = itertools.count()
"""Runs of this process: every worker runs the same entry points in the same order."""

PROFILE_CACHE = "oobleck-profiles"
"""Default profile cache, in the Trainer's ``default_root_dir``."""


def _as_dict(config: OobleckConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in OobleckConfig.__dataclass_fields__}


def _shuffles(loader: DataLoader) -> bool:
    sampler = loader.sampler
    return sampler.shuffle if isinstance(sampler, DistributedSampler) else is_dataloader_shuffled(loader)


def _connect_store(environment: OobleckEnvironment, config: OobleckConfig) -> KeyStoreClient:
    """The job's store, served by its coordinators: those the environment names, then those this process's
    agent learns of (a standby started later, which may take over)."""
    timeout = timedelta(seconds=config.plan_timeout_s)
    return KeyStoreClient(environment.store_address, environment.secret, timeout, more=known_coordinators)
