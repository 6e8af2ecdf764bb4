"""Cluster environments: launch positions, shrinking, the store address, and Lightning's requeue kept off."""

from __future__ import annotations

import signal

import lightning as L
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_oobleck.lightning.environment import (
    LocalOobleckEnvironment,
    OobleckSLURMEnvironment,
    detect_environment,
    local_worker_env,
    parse_store_address,
)

SLURM_TASK_5_OF_6 = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "3",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[001-003]",
    "SLURM_JOB_NAME": "train",
}


@pytest.fixture
def slurm_task(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SLURM_TASK_5_OF_6.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OOBLECK_STORE_ADDR", "batchhost:29500")


@pytest.fixture(autouse=True)
def _restore_rank_zero_only():
    rank = rank_zero_only.rank
    yield
    rank_zero_only.rank = rank


def test_local_worker_position_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch):
    for name, value in local_worker_env(5, 6, 2, "127.0.0.1:1234").items():
        monkeypatch.setenv(name, value)
    env = LocalOobleckEnvironment()
    assert (env.global_rank(), env.world_size(), env.node_rank(), env.local_rank()) == (5, 6, 2, 1)
    assert env.worker == (2, 1)  # node = 5 // 2, device = 5 % 2
    assert env.store_address == "127.0.0.1:1234"
    assert (env.main_address, env.main_port) == ("127.0.0.1", 1234)
    assert env.creates_processes_externally  # a worker never launches workers of its own


def test_local_supervisor_side_launches_and_has_no_store_yet(monkeypatch: pytest.MonkeyPatch):
    for name in local_worker_env(0, 1, 1, "h:1"):
        monkeypatch.delenv(name, raising=False)
    env = LocalOobleckEnvironment()
    assert not env.creates_processes_externally
    assert (env.global_rank(), env.world_size()) == (0, 1)
    with pytest.raises(RuntimeError, match=r"OOBLECK_STORE_ADDR is not set.*export OOBLECK_STORE_ADDR"):
        _ = env.store_address


def test_slurm_position_is_read_once_and_the_ranks_can_shrink(slurm_task, monkeypatch: pytest.MonkeyPatch):
    env = OobleckSLURMEnvironment()
    assert (env.global_rank(), env.world_size(), env.node_rank(), env.local_rank()) == (5, 6, 2, 1)
    assert env.store_address == "batchhost:29500" and env.main_port == 29500
    assert env.job_id == "4242" and env.nodelist == "node[001-003]"
    monkeypatch.setenv("SLURM_PROCID", "0")  # stale or changed variables after the start are never read
    monkeypatch.setenv("SLURM_NTASKS", "99")
    assert (env.global_rank(), env.world_size()) == (5, 6)

    env.set_world_size(4)  # node 0 died: the survivors are renumbered
    env.set_global_rank(3)
    assert (env.global_rank(), env.world_size()) == (3, 4)
    assert rank_zero_only.rank == 3
    assert env.worker == (2, 1)  # the failure-domain identity does not move


def test_lightning_slurm_environment_cannot_shrink(slurm_task):
    # Why we need our own: Lightning's SLURMEnvironment ignores the setters.
    env = SLURMEnvironment()
    env.set_world_size(4)
    env.set_global_rank(3)
    assert (env.global_rank(), env.world_size()) == (5, 6)


def test_slurm_errors_name_the_problem_and_the_fix(slurm_task, monkeypatch: pytest.MonkeyPatch):
    env = OobleckSLURMEnvironment()
    with pytest.raises(ValueError, match="set devices=2 or submit with --ntasks-per-node=4"):
        env.validate_settings(num_devices=4, num_nodes=3)
    with pytest.raises(ValueError, match="set num_nodes=3 or submit with --nodes=2"):
        env.validate_settings(num_devices=2, num_nodes=2)
    env.validate_settings(num_devices=2, num_nodes=3)
    with pytest.raises(RuntimeError, match=r"needs SLURM_PROCID, SLURM_LOCALID.*srun"):
        OobleckSLURMEnvironment({"SLURM_NTASKS": "2", "SLURM_NODEID": "0"})
    monkeypatch.setenv("OOBLECK_STORE_ADDR", "batchhost")
    with pytest.raises(ValueError, match="OOBLECK_STORE_ADDR='batchhost' is not 'host:port'"):
        _ = env.store_address
    monkeypatch.setenv("OOBLECK_STORE_ADDR", "batchhost:29500,node002")  # the coordinators, one of them bad
    with pytest.raises(ValueError, match="OOBLECK_STORE_ADDR='node002' is not 'host:port'"):
        _ = env.store_address


def test_store_address_forms():
    assert parse_store_address("node001:29500") == ("node001", 29500)
    assert parse_store_address("[::1]:29500") == ("::1", 29500)
    for bad in ("node001:", ":29500", "node001:port", "node001:70000"):
        with pytest.raises(ValueError, match="is not 'host:port'"):
            parse_store_address(bad)


def test_detect_environment(slurm_task, monkeypatch: pytest.MonkeyPatch):
    assert isinstance(detect_environment(), OobleckSLURMEnvironment)
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # salloc + bash: processes are ours to start
    assert isinstance(detect_environment(), LocalOobleckEnvironment)
    monkeypatch.delenv("SLURM_NTASKS")
    assert isinstance(detect_environment(), LocalOobleckEnvironment)


def _trainer(strategy: Strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, num_nodes=3, strategy=strategy, logger=False, enable_progress_bar=False
    )


def _sigusr1_handler_after_signal_setup(trainer: L.Trainer) -> object:
    """Let the Trainer install its signal handlers, as ``fit`` does; return SIGUSR1's handler."""
    connector = trainer._signal_connector
    connector.register_signal_handlers()
    try:
        return signal.getsignal(signal.SIGUSR1)
    finally:
        connector.teardown()


def test_lightning_auto_requeue_stays_off_under_slurm(slurm_task):
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    # Lightning's own SLURM environment requeues the job (scontrol requeue) on SIGUSR1 ...
    lightning_slurm = _trainer(DDPStrategy(cluster_environment=SLURMEnvironment()))
    assert _sigusr1_handler_after_signal_setup(lightning_slurm) != signal.SIG_DFL
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    # ... ours installs nothing, so neither a requeue nor a checkpoint-and-exit can undo in-process recovery.
    ours = _trainer(DDPStrategy(cluster_environment=OobleckSLURMEnvironment()))
    assert _sigusr1_handler_after_signal_setup(ours) == signal.SIG_DFL


def test_oobleck_strategy_under_slurm_detects_our_environment(slurm_task):
    from lightning_oobleck.lightning import OobleckStrategy

    trainer = _trainer(OobleckStrategy(global_batch_size=4))
    assert isinstance(trainer.strategy.cluster_environment, OobleckSLURMEnvironment)
    assert trainer.strategy.launcher is None  # srun started the processes: no local launcher
    assert _sigusr1_handler_after_signal_setup(trainer) == signal.SIG_DFL


def test_oobleck_strategy_locally_gets_the_supervising_launcher(monkeypatch: pytest.MonkeyPatch):
    from lightning_oobleck.lightning import OobleckStrategy
    from lightning_oobleck.lightning.launcher import OobleckLauncher

    for name in ("SLURM_NTASKS", *local_worker_env(0, 1, 1, "h:1")):
        monkeypatch.delenv(name, raising=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=OobleckStrategy(global_batch_size=4), logger=False
    )
    assert isinstance(trainer.strategy.cluster_environment, LocalOobleckEnvironment)
    launcher = trainer.strategy.launcher
    assert isinstance(launcher, OobleckLauncher) and launcher.num_processes == 4


def test_a_node_of_the_slurm_job_is_the_failure_domain(slurm_task):
    """2 tasks on each of 3 nodes: ``devices_per_node`` follows SLURM; a contradicting value names the key;
    Lightning's sampler is sized for all 6 workers (rank 5 is valid)."""
    from lightning_oobleck.lightning import OobleckStrategy

    trainer = _trainer(OobleckStrategy(global_batch_size=12))
    strategy = trainer.strategy
    assert strategy.config.devices_per_node == 2
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 5}
    with pytest.raises(ValueError, match=r"devices_per_node=1\) but SLURM runs 2 task\(s\) per node"):
        _trainer(OobleckStrategy(global_batch_size=12, devices_per_node=1))


def test_locally_each_process_stands_for_a_node(monkeypatch: pytest.MonkeyPatch):
    assert LocalOobleckEnvironment().devices_per_node(None) == 1
    assert LocalOobleckEnvironment().devices_per_node(2) == 2
