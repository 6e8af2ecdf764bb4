"""OobleckLauncher with real worker processes, the job's real store and real signals.

Workers here run tiny functions (``fork``: no re-import of Lightning per worker); one test runs a real
``Trainer.fit`` through ``spawn`` to check what comes back into the caller's Trainer.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_oobleck.lightning.environment import LocalOobleckEnvironment
from lightning_oobleck.lightning.launcher import LaunchError, OobleckLauncher, Supervisor
from lightning_oobleck.recovery.keystore import KeyStoreClient, KeyStoreError
from lightning_oobleck.recovery.protocol import SECRET_ENV

STORE_TIMEOUT = timedelta(seconds=20)


class ExitRecorder:
    """A supervisor service that records exits and publishes them in the store for the workers to see."""

    def __init__(self) -> None:
        self.exits: list[tuple[int, int]] = []
        self.stopped = False
        self.store: KeyStoreClient | None = None

    def start(self, supervisor: Supervisor) -> None:
        self.store = KeyStoreClient(supervisor.store_addr, supervisor.secret, STORE_TIMEOUT)
        supervisor.worker_env["RECORDER_ADDR"] = f"recorder-of-{supervisor.world_size}"

    def worker_exited(self, rank: int, exitcode: int) -> None:
        self.exits.append((rank, exitcode))
        assert self.store is not None
        self.store.set(f"exited/{rank}", str(exitcode))

    def stop(self) -> None:
        self.stopped = True


def _store() -> KeyStoreClient:
    env = LocalOobleckEnvironment()
    return KeyStoreClient(env.store_address, env.secret, STORE_TIMEOUT)


def report_position() -> int:
    """Check in with the supervisor's store under this worker's environment; return the global rank."""
    env = LocalOobleckEnvironment()
    store = _store()
    position = f"{env.worker[0]},{env.worker[1]},{env.world_size()},{os.environ.get('RECORDER_ADDR')}"
    store.set(f"position/{env.global_rank()}", position)
    store.add("ready", 1)
    return env.global_rank() * 10


def victim_dies(victim: int, how: str) -> int:
    """All check in; ``victim`` then dies by ``how``; the others wait to hear of it from the supervisor."""
    rank = report_position() // 10
    store = _store()
    deadline = time.monotonic() + 60
    while store.add("ready", 0) < int(os.environ["OOBLECK_WORLD_SIZE"]):
        assert time.monotonic() < deadline, "peers never checked in"
        time.sleep(0.01)
    if rank == victim:
        if how == "raise":
            raise ValueError(f"boom on rank {rank}")
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(30)  # SIGSTOP: stays stopped until the supervisor kills it
    if how != "SIGSTOP":
        store.wait([f"exited/{victim}"])  # only the supervisor's notice releases the survivors
    return rank


def all_die(raiser: int) -> None:
    if int(os.environ["OOBLECK_RANK"]) == raiser:
        raise ValueError("boom")
    os.kill(os.getpid(), signal.SIGKILL)


def node_1_dies_one_worker_at_a_time() -> int:
    """Node 1 (ranks 2, 3) dies worker by worker, 1 s apart; the others finish once rank 3's exit was
    announced and a second replacement would have started."""
    rank = int(os.environ["OOBLECK_RANK"])
    store = _store()
    if rank in (2, 3):
        time.sleep(1.0 * (rank - 2))
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["exited/3"])
    time.sleep(1.0)
    return rank


def sleep_forever() -> None:
    time.sleep(600)


@pytest.mark.timeout(60)
def test_workers_get_positions_from_the_supervisor_store():
    recorder = ExitRecorder()
    launcher = OobleckLauncher(
        4, devices_per_node=2, start_method="forkserver", services=[recorder], timeout_s=40
    )
    positions: dict[int, str] = {}

    class ReadPositions(ExitRecorder):
        def stop(self) -> None:
            assert self.store is not None
            positions.update({r: self.store.get(f"position/{r}").decode() for r in range(4)})

    launcher.services.append(ReadPositions())
    assert launcher.launch(report_position) == 0
    # node = r // 2, device = r % 2, and the service's variable reached every worker
    assert positions == {r: f"{r // 2},{r % 2},4,recorder-of-4" for r in range(4)}
    assert sorted(recorder.exits) == [(r, 0) for r in range(4)] and recorder.stopped
    assert launcher.last_report is not None and launcher.last_report.finished == (0, 1, 2, 3)
    assert not launcher.last_report.lost


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_forked_workers_never_hang_connecting_to_the_store():
    # Forking while the store's server thread ran once deadlocked a worker's TCPStore client (under load,
    # a few launches in 30); workers are now forked before the store starts.
    for _ in range(15):
        launcher = OobleckLauncher(4, start_method="forkserver", timeout_s=20, finish_grace_s=5)
        assert launcher.launch(report_position) == 0
        assert launcher.last_report is not None and not launcher.last_report.lost


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [0, 2])
def test_sigkilled_worker_leaves_the_others_running(victim: int):
    recorder = ExitRecorder()
    launcher = OobleckLauncher(3, start_method="forkserver", services=[recorder], timeout_s=40)
    value = launcher.launch(victim_dies, victim, "SIGKILL")
    survivors = tuple(r for r in range(3) if r != victim)
    assert value == survivors[0]  # the lowest finished rank's return value
    report = launcher.last_report
    assert report is not None
    assert report.finished == survivors and report.result_rank == survivors[0]
    assert report.lost == {victim: "killed by SIGKILL"}
    assert report.exitcodes == {r: (-signal.SIGKILL if r == victim else 0) for r in range(3)}
    assert recorder.exits[0] == (victim, -signal.SIGKILL)  # the service heard of the death first


@pytest.mark.timeout(60)
def test_a_node_is_replaced_once_however_late_its_other_workers_die():
    # CI once saw two replacement nodes for one lost node: its second worker died after the first
    # replacement had started
    recorder = ExitRecorder()
    launcher = OobleckLauncher(
        4,
        devices_per_node=2,
        start_method="forkserver",
        services=[recorder],
        timeout_s=40,
        replace_failed_after_s=0.1,
    )
    launcher.launch(node_1_dies_one_worker_at_a_time)
    report = launcher.last_report
    assert report is not None and report.lost.keys() == {2, 3}
    assert sorted(launcher.procs) == [0, 1, 2, 3, 4, 5]  # one replacement node: ranks 4 and 5
    assert report.finished == (0, 1, 4, 5)


@pytest.mark.timeout(60)
def test_stopped_worker_is_killed_once_the_others_finished():
    launcher = OobleckLauncher(3, start_method="forkserver", timeout_s=40, finish_grace_s=1.0)
    start = time.monotonic()
    assert launcher.launch(victim_dies, 1, "SIGSTOP") == 0
    assert time.monotonic() - start < 20
    report = launcher.last_report
    assert report is not None and report.finished == (0, 2)
    assert report.lost == {1: "killed by the supervisor: still running 1.0 s after a worker finished"}


@pytest.mark.timeout(60)
def test_all_workers_dead_is_a_clear_error():
    launcher = OobleckLauncher(2, start_method="forkserver", timeout_s=40)
    with pytest.raises(LaunchError) as err:
        launcher.launch(all_die, 1)
    message = str(err.value)
    assert "no worker finished (2 started)" in message
    assert "rank 0: killed by SIGKILL" in message
    assert "rank 1: raised ValueError: boom" in message
    assert "traceback of rank 1" in message and "in all_die" in message


@pytest.mark.timeout(60)
def test_launch_timeout_kills_every_worker():
    launcher = OobleckLauncher(2, start_method="forkserver", timeout_s=1.0)
    start = time.monotonic()
    stuck = r"rank 0: killed by the supervisor: still running after timeout_s=1\.0; rank 1: "
    with pytest.raises(TimeoutError, match=stuck):
        launcher.launch(sleep_forever)
    assert time.monotonic() - start < 15
    assert all(not p.is_alive() for p in launcher.procs.values())


def _alive(pid: int) -> bool:
    """True for a running process; a zombie nobody reaped (no init in a container) counts as dead."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sigkilled_supervisor_leaves_no_orphan(tmp_path: Path, killed_process_env: dict[str, str]):
    script = tmp_path / "supervisor.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from lightning_oobleck.lightning.launcher import OobleckLauncher

            def work(pid_dir):
                open(os.path.join(pid_dir, str(os.getpid())), "w").close()
                time.sleep(600)

            if __name__ == "__main__":
                OobleckLauncher(2, start_method="forkserver", timeout_s=600).launch(work, sys.argv[1])
            """
        )
    )
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    stderr = tmp_path / "supervisor.err"
    with open(stderr, "w") as err:
        supervisor = subprocess.Popen(
            [sys.executable, str(script), str(pid_dir)], stderr=err, env=killed_process_env
        )
    try:
        # the supervisor and its fork server import Lightning first: 18-24 s alone, 39-85 s beside the
        # suite's other processes on 2 cores
        deadline = time.monotonic() + 200
        while len(list(pid_dir.iterdir())) < 2:
            assert time.monotonic() < deadline and supervisor.poll() is None, stderr.read_text()
            time.sleep(0.05)
        workers = [int(p.name) for p in pid_dir.iterdir()]
        assert all(_alive(pid) for pid in workers)
        supervisor.kill()
        supervisor.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in workers), "a worker outlived its supervisor"
    finally:
        supervisor.kill()
        supervisor.wait(timeout=10)
        for pid_file in pid_dir.iterdir():
            if _alive(int(pid_file.name)):
                os.kill(int(pid_file.name), signal.SIGKILL)


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="devices_per_node dividing the number of processes"):
        OobleckLauncher(3, devices_per_node=2)
    with pytest.raises(ValueError, match="one of forkserver, spawn, fork, got 'thread'"):
        OobleckLauncher(2, start_method="thread")  # type: ignore[arg-type]


def test_supervisor_store_serves_the_jobs_processes_only():
    with Supervisor(2) as supervisor:
        address = supervisor.store_addr
        assert address.startswith("127.0.0.1:")  # a local run: loopback only
        client = KeyStoreClient(address, supervisor.worker_env[SECRET_ENV], STORE_TIMEOUT)
        client.set("k", "v")
        assert KeyStoreClient(address, supervisor.secret, STORE_TIMEOUT).get("k") == b"v"
        with pytest.raises(KeyStoreError, match="refused this process: refused: the job's secret"):
            KeyStoreClient(address, "guessed", STORE_TIMEOUT)
        workdir = supervisor.coordinator.join_file.parent
        assert workdir.is_dir()
    with pytest.raises(RuntimeError, match="not started"):
        _ = supervisor.store_addr
    assert not workdir.exists()  # the folder it made for itself (none was given) goes with it


UNGUARDED_SCRIPT_TEXT = """
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_oobleck import OobleckStrategy, PipelineModule


class Regressor(PipelineModule, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.example_input_array = torch.zeros(1, 4)

    def configure_layers(self):
        return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)]

    def compute_loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# no `if __name__ == "__main__":`
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
trainer = L.Trainer(strategy=OobleckStrategy(microbatch_size=2), devices=3, max_steps=2)
trainer.fit(Regressor(), DataLoader(data, batch_size=8))
"""


@pytest.mark.timeout(120)
def test_a_script_without_the_main_guard_ends_in_one_error_that_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A user's script that calls ``Trainer.fit`` at its top level, run as ``python train.py`` runs it (the
    script is the main module). The workers import it (forkserver: multiprocessing runs the main module's
    file in each worker before it unpickles the fit), so the fit starts again in every worker: each exits at
    once, silently (not a traceback each), and the user's fit raises one error that says so and how to fix
    it (before: three tracebacks and a broken pipe)."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT_TEXT)
    with pytest.raises(LaunchError) as raised:
        runpy.run_path(str(script), run_name="__main__")
    assert str(raised.value) == (
        "your script starts training when it is imported: the workers (start_method='forkserver') import it "
        "to find its classes, so put the code that builds the Trainer and calls fit under "
        '`if __name__ == "__main__":` (as in the README\'s example)'
    )


def test_a_callback_state_that_cannot_be_pickled_stays_behind_with_a_warning():
    """A finished worker hands its callbacks' state back to the caller's Trainer; one whose state_dict()
    cannot be pickled must not fail the finished training: it stays behind, said once, the others go."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping

    from lightning_oobleck.lightning.results import _callback_states

    class Unpicklable(L.Callback):
        def state_dict(self) -> dict:
            return {"score": lambda: 0.0}

    stopping = EarlyStopping("val_loss", patience=3)
    trainer = L.Trainer(callbacks=[Unpicklable(), stopping], logger=False, enable_progress_bar=False)
    with pytest.warns(UserWarning, match=r"callback \S*Unpicklable does not come back.*cannot be pickled"):
        states = _callback_states(trainer)
    assert not [key for key in states if key.endswith("Unpicklable")]
    assert states[stopping.state_key]["patience"] == 3


def test_a_callback_state_that_does_not_load_in_the_caller_is_a_warning():
    """The caller's Trainer loads each callback's state from a finished worker, a step one device never
    takes: a callback whose load_state_dict() raises there gets a warning, the others their state."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping

    from lightning_oobleck.lightning.results import WorkerResult, restore_in_main_process

    class Strict(L.Callback):
        def load_state_dict(self, state_dict: dict) -> None:
            raise KeyError("version")

    strict, stopping = Strict(), EarlyStopping("val_loss", patience=3)
    trainer = L.Trainer(callbacks=[strict, stopping], logger=False, enable_progress_bar=False)
    states = {strict.state_key: {}, stopping.state_key: EarlyStopping("val_loss", patience=5).state_dict()}
    with pytest.warns(
        UserWarning, match=r"callback \S*Strict did not load.*KeyError.*training itself finished"
    ):
        restore_in_main_process(trainer, WorkerResult(0, None, callback_states=states), {})
    assert stopping.patience == 5
