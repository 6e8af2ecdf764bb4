"""Helpers for multi-process tests: a pool of worker processes sharing the job's store, and hand-made plans.

A :class:`WorkerPool` starts its processes once (forked from a server that imported torch); tests send
them picklable tasks ``fn(store, state, *args)`` (``state`` is a dict that lives as long as the
process), so several layouts and generations run in the same processes. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from lightning_oobleck.lightning.launcher import FORKSERVER_PRELOAD
from lightning_oobleck.planning.plan import Pipeline, PipelineTemplate, Plan, Stage
from lightning_oobleck.recovery.coordinator import Coordinator
from lightning_oobleck.recovery.keystore import KeyStoreClient
from lightning_oobleck.recovery.replica import ReplicaSettings

Task = Callable[..., Any]
SECRET = "the-tests-job"
"""The secret of the tests' stores (:mod:`~lightning_oobleck.recovery.keystore`)."""


def _serve(conn: Connection, address: str, sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    store = KeyStoreClient(address, SECRET, timeout=timedelta(seconds=60))
    state: dict[str, Any] = {}
    while (task := conn.recv()) is not None:
        fn, args = task
        try:
            conn.send(("ok", fn(store, state, *args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class WorkerPool:
    """``size`` worker processes that run tasks on request."""

    def __init__(self, size: int) -> None:
        # forkserver: torch is imported once in the server, each worker is a cheap fork of it. The server is
        # one per process and later tests launch Lightning workers from it: preload what they need too.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, "lightning_oobleck.execution"])
        self.store = Coordinator(
            1, "127.0.0.1", secret=SECRET, replica_settings=ReplicaSettings(standby=False)
        )
        self.store.start()
        self._conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for _ in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.store.address, list(sys.path)), daemon=True)
            proc.start()
            self._conns.append(parent)
            self.procs.append(proc)

    def submit(self, worker: int, fn: Task, *args: Any) -> None:
        self._conns[worker].send((fn, args))

    def _receive(self, worker: int, timeout: float) -> tuple[str, Any]:
        conn = self._conns[worker]
        if not conn.poll(timeout):
            return "error", f"no result within {timeout} s"
        return conn.recv()

    def run(self, tasks: dict[int, tuple[Task, tuple[Any, ...]]], timeout: float) -> dict[int, Any]:
        """Run ``tasks[i] = (fn, args)`` on process ``i`` concurrently; return their results.

        If any task fails, raise with every failing worker's traceback (the first failure is often
        only the consequence of another).
        """
        for worker, (fn, args) in tasks.items():
            self.submit(worker, fn, *args)
        replies = {worker: self._receive(worker, timeout) for worker in tasks}
        errors = [
            f"worker process {w} failed:\n{value}" for w, (status, value) in replies.items() if status != "ok"
        ]
        if errors:
            raise RuntimeError("\n".join(errors))
        return {worker: value for worker, (_, value) in replies.items()}

    def signal(self, worker: int, sig: signal.Signals) -> None:
        pid = self.procs[worker].pid
        assert pid is not None
        os.kill(pid, sig)

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a worker the test killed
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self.store.stop()


def _run_script(
    script: str, argv: list[str], log: str, env: dict[str, str], cwd: str, sys_path: list[str]
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = [os.path.dirname(script), *sys_path]
    sys.argv = [script, *argv]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    runpy.run_path(script, run_name="__main__")


class ScriptProcess:
    """``python SCRIPT ARGS`` with its output appended to ``log``, as ``subprocess.Popen`` runs it, but forked
    from the harness's fork server (torch already imported: a start costs milliseconds, not the seconds of an
    import per process that 6-8 workers of a test pay on 2 cores). The script sees this process's
    environment, directory and ``sys.path`` as of the call, and its own directory first on the path. The
    interface is ``Popen``'s: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``."""

    def __init__(
        self, script: str | os.PathLike[str], args: Sequence[str], log: str | os.PathLike[str]
    ) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, "lightning_oobleck.execution"])
        self._proc = ctx.Process(
            target=_run_script,
            args=(str(script), list(args), str(log), dict(os.environ), os.getcwd(), list(sys.path)),
        )
        self._proc.start()
        self.pid: int = self._proc.pid  # type: ignore[assignment]

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, signum: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def set_index(store: dist.Store, state: dict[str, Any], index: int) -> int:
    """A task: the worker's index in the plans the next tasks are given (``state["index"]``)."""
    state["index"] = index
    return index


@contextlib.contextmanager
def indexed_pool(size: int) -> Iterator[WorkerPool]:
    """A :class:`WorkerPool` of ``size`` workers, worker ``i`` at index ``i``; closed afterwards."""
    workers = WorkerPool(size)
    try:
        workers.run({i: (set_index, (i,)) for i in range(size)}, timeout=120)
        yield workers
    finally:
        workers.close()


def plan_from_splits(
    pipelines: Sequence[Sequence[tuple[int, int]]],
    microbatches: Sequence[int],
    microbatch_size: int,
    gpus_per_node: int = 1,
    tensor_parallel: int = 1,
) -> Plan:
    """A plan whose pipeline ``i`` has stages ``pipelines[i]`` (``(first, end)`` layer ranges).

    Stage ``k`` of a pipeline runs on ``tensor_parallel`` devices from ``(k % (G / t)) * t`` of the pipeline's
    node ``k // (G / t)`` (``G = gpus_per_node``); cluster node ids are handed out in pipeline order.
    """
    built, templates, next_node = [], {}, 0
    for splits, m in zip(pipelines, microbatches, strict=True):
        per_node = gpus_per_node // tensor_parallel
        if len(splits) % per_node:
            raise ValueError(f"{len(splits)} stages do not fill nodes of {per_node} stages")
        stages = tuple(
            Stage(a, b, k // per_node, (k % per_node) * tensor_parallel) for k, (a, b) in enumerate(splits)
        )
        num_nodes = len(splits) // per_node
        template = templates.setdefault(
            stages,
            PipelineTemplate(
                num_nodes, gpus_per_node, stages, tuple(1.0 for _ in stages), tensor_parallel=tensor_parallel
            ),
        )
        built.append(Pipeline(template, tuple(range(next_node, next_node + num_nodes)), m))
        next_node += num_nodes
    return Plan(
        num_layers=pipelines[0][-1][1],
        gpus_per_node=gpus_per_node,
        fault_tolerance=max(len(pipelines) - 1, 0),
        n0=min(p.template.num_nodes for p in built),
        microbatch_size=microbatch_size,
        global_batch_size=microbatch_size * sum(microbatches),
        templates=tuple(templates.values()),
        pipelines=tuple(built),
    )
