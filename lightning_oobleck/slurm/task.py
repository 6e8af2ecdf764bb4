"""What a task runs for a training script under SLURM: ``python -m lightning_oobleck.slurm.task SCRIPT
[ARGS]`` (the batch template's ``srun`` line), or :class:`ScriptTask` (submitit). Its own module, light to
import, so that a task announces itself to the coordinator before the script's imports begin.

``python -m lightning_oobleck.slurm.task --check --log FILE SCRIPT [ARGS]`` runs on the batch host before
the tasks start (:func:`check_script`): the script runs until the strategy has made the job's plan for the
allocation, so that a missing file, a configuration error or a plan that cannot exist ends the job in one
line instead of once per task.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import runpy
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from lightning_oobleck.recovery.agent import (
    STANDBY_MODULE_ENV,
    CoordinatorLost,
    TrainingFinished,
    announce_presence,
    known_coordinators,
    lost_coordinator,
)
from lightning_oobleck.recovery.protocol import (
    ADDRESS_ENV,
    NODE_KEY_ENV,
    SECRET_ENV,
    parse_address,
    parse_addresses,
)
from lightning_oobleck.recovery.replica import ENDED_KEY
from lightning_oobleck.slurm import cluster

MODULE = "lightning_oobleck.slurm.task"
"""The entry point's module name (stable: batch scripts name it)."""
COORDINATOR_MODULE = "lightning_oobleck.slurm.coordinator"
"""What a task runs to host a coordinator (:mod:`lightning_oobleck.slurm.coordinator`)."""
STORE_ADDR_VAR = "OOBLECK_STORE_ADDR"
TTY_COMPATIBLE_ENV = "TTY_COMPATIBLE"
"""``0``: the output is no terminal, whatever ``isatty()`` says (``srun --unbuffered`` gives the tasks a
pseudo-terminal that ends in the job's output file). Rich reads it; so does
:func:`~lightning_oobleck.lightning.console.output_is_terminal`."""


_PROBE_TIMEOUT_S = 5.0
"""How long a failed task waits for the coordinator to take a connection (a crashed host never refuses), and
for the lock on the job's output file."""


def announce_slurm_task() -> bool:
    """Announce this task as worker (``SLURM_NODEID``, ``SLURM_LOCALID``) on a presence connection (see
    :func:`~lightning_oobleck.recovery.agent.announce_presence`): if it dies before it registers, the start
    goes on without it at once. Returns whether it was announced (not outside a job with a coordinator)."""
    if "SLURM_NODEID" not in os.environ or "SLURM_LOCALID" not in os.environ:
        return False
    return announce_presence((int(os.environ["SLURM_NODEID"]), int(os.environ["SLURM_LOCALID"])))


def limit_threads() -> None:
    """One CPU thread per task unless the user chose (``OMP_NUM_THREADS``, or ``--cpus-per-task``), before
    torch is imported: tasks share a node's cores, and torch's default of a thread per core on every task
    oversubscribes them (a step 20x slower was measured on 2 tasks per node)."""
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))


def run_script(script: str, args: Sequence[str], join: bool = False) -> None:
    """Limit the threads (:func:`limit_threads`), mark the output as no terminal (:data:`TTY_COMPATIBLE_ENV`,
    unless ``srun --pty``), announce this task, then run ``script`` as ``__main__`` as ``python SCRIPT ARGS``
    would: with ``sys.argv = [script, *args]`` and the script's directory first on
    ``sys.path`` (so that it imports its neighbours).

    ``join``: the task joins a running training (a join job's, :mod:`~lightning_oobleck.slurm.join`): its
    node is named by this job and its node index (``OOBLECK_NODE_KEY``), never by ``SLURM_NODEID``, which
    starts at 0 in every job; if the training ends before it was admitted, the script stops there and the
    task ends with status 0."""
    limit_threads()
    if "SLURM_PTY_PORT" not in os.environ:  # not `srun --pty`: the output goes to the job's file
        os.environ.setdefault(TTY_COMPATIBLE_ENV, "0")
    if join:
        os.environ[NODE_KEY_ENV] = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_NODEID']}"
    else:
        announce_slurm_task()
        # a coordinator this task hosts (a standby, which may take over) ends the job if the batch host died
        os.environ[STANDBY_MODULE_ENV] = COORDINATOR_MODULE
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except TrainingFinished as e:
        print(f"oobleck: {e}: nothing to do", file=sys.stderr)
    except SystemExit as e:
        if e.code in (None, 0) and not join:
            atexit.register(report_end)
        raise
    except BaseException:
        if "SLURM_JOB_ID" in os.environ and (lost := batch_host_lost()) is not None:
            end_job(os.environ["SLURM_JOB_ID"], f"ends now: {lost}", completed=False)
        raise
    else:
        if not join:
            atexit.register(report_end)  # after this process's agent said goodbye: last registered, first run


def report_end() -> None:
    """At the task's exit (its results written, its agent not yet closed): count it in the job's store
    (:data:`~lightning_oobleck.recovery.replica.ENDED_KEY`). A coordinator that took over from a lost batch
    host ends the job once every task that finished did (:mod:`lightning_oobleck.slurm.coordinator`). Best
    effort, bounded: a job whose coordinators are gone ends with its batch script, or at its time limit."""
    from lightning_oobleck.recovery.keystore import KeyStoreClient

    addresses = os.environ.get(STORE_ADDR_VAR)
    if "SLURM_JOB_ID" not in os.environ or not addresses:
        return
    with contextlib.suppress(Exception):
        timeout = timedelta(seconds=_PROBE_TIMEOUT_S)
        store = KeyStoreClient(addresses, os.environ[SECRET_ENV], timeout, more=known_coordinators)
        store.failover_s = _PROBE_TIMEOUT_S
        store.add(ENDED_KEY, 1)


def batch_host_lost() -> CoordinatorLost | None:
    """Why the job's batch host is gone, if it is: this process's agent lost its coordinators, or the batch
    host's coordinator (the first of ``OOBLECK_COORDINATOR_ADDR``, the rendezvous) no longer takes
    connections. It serves until the batch script ends, which is after every task: while a task runs, a
    rendezvous that does not answer is a lost batch host."""
    if (lost := lost_coordinator()) is not None:
        return lost
    address = os.environ.get(ADDRESS_ENV)
    if not address:
        return None
    first = parse_addresses(address)[0]
    try:
        socket.create_connection(parse_address(first), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as e:
        return CoordinatorLost(f"lost the oobleck coordinator at {first}: it takes no connection ({e})")
    return None


def end_job(job_id: str, what: str, completed: bool) -> None:
    """End a job whose batch host is gone: SLURM would keep it RUNNING, its nodes idle, until ``--time``.
    ``what``: how it ends (``completed``: the training did, on the surviving nodes, with a standby
    coordinator; else it cannot go on, and resumes from its last checkpoint). Says so in the job's output
    file (the tasks' own output went to the lost batch host's ``srun``), once whoever gets here, records it
    beside the job's files (``oobleck-JOBID-end.json``, which ``oobleck submit`` reads: SLURM shows the job
    CANCELLED), then cancels the job."""
    line = (
        f"oobleck: job {job_id} {what}. The batch host was lost; SLURM cannot end the job without its batch "
        "script: cancelling it (scancel) rather than leaving its nodes idle until its time limit"
    )
    with contextlib.suppress(Exception):  # the reason is best effort; the cancel is what matters
        output = cluster.job_fields(job_id).get("StdOut", "")
        end = end_file(Path(output).parent if output else Path.cwd(), job_id)
        end.write_text(json.dumps({"completed": completed, "reason": line}))
        if output and Path(output).is_file():
            _append_once(Path(output), line)
    with contextlib.suppress(Exception):
        cluster.run("scancel", job_id)
    print(line, file=sys.stderr, flush=True)


def end_file(directory: Path, job_id: str) -> Path:
    """Where a job whose batch host was lost records how it ended: beside its output file (the working
    directory of an sbatch job, submitit's job folder)."""
    return directory / f"oobleck-{job_id}-end.json"


def _append_once(path: Path, line: str) -> None:
    """Append ``line`` to ``path`` unless another task of the job did (under a lock, waited for at most
    :data:`_PROBE_TIMEOUT_S`: the line is best effort, the cancel after it is not)."""
    with open(path, "a+") as f:
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        if line.split(". ", 1)[0] not in f.read():
            f.write("\n" + line + "\n")


@dataclass(frozen=True)
class ScriptTask:
    """Runs a training script in a submitit task (:func:`run_script`). Returns 0 when the script ends
    normally or with ``sys.exit(0)``; another exit status is raised as an error, so that submitit records the
    task as failed.
    """

    script: str
    args: tuple[str, ...] = ()

    def __call__(self) -> int:
        try:
            run_script(self.script, self.args)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise RuntimeError(f"{self.script} exited with status {e.code}") from None
        return 0


def check_script(script: str, args: Sequence[str], log: str | Path) -> int:
    """Run ``script`` as a task would, with :data:`~lightning_oobleck.planning.plan.PLAN_CHECK_ENV` set, until
    the strategy made the job's plan (it raises :class:`~lightning_oobleck.planning.plan.PlanChecked` in
    place of training). Everything the script prints goes to ``log``; what is printed here is one line, also
    the log's last: the plan, or the error and its fix. Returns 0 (the plan exists, or the script ended
    before ``Trainer.fit``) or 2 (it cannot start: nothing else of the job should run)."""
    if not Path(script).is_file():
        where = f"{Path.cwd()} (a path relative to the job's working directory, sbatch --chdir)"
        return _verdict(f"{CHECK_ERROR} no training script {script} in {where}", log)
    from lightning_oobleck.planning.plan import PLAN_CHECK_ENV, PlanChecked

    os.environ[PLAN_CHECK_ENV] = "1"
    try:
        with _output_to(log):
            run_script(script, args)
    except PlanChecked as checked:
        return _verdict(f"oobleck: {checked} (checked before the tasks start)", log)
    except SystemExit as e:
        if e.code in (None, 0):
            return 0
        reason = e.code if isinstance(e.code, str) else f"it exited with status {e.code}"
        return _verdict(f"{CHECK_ERROR} {script} cannot start: {reason} (its output: {log})", log)
    except Exception as e:  # the script's own error, before any task started: reported once, here
        message = " ".join(str(e).split()) or "no message"
        error = f"{type(e).__name__}: {message}"
        return _verdict(f"{CHECK_ERROR} {script} cannot start: {error} (its output: {log})", log)
    return 0


CHECK_ERROR = "oobleck: error:"
"""How :func:`check_script`'s line starts when the job cannot start."""


def _verdict(line: str, log: str | Path) -> int:
    """Print the check's one line (stderr for an error), append it to ``log``; the check's exit status."""
    failed = line.startswith(CHECK_ERROR)
    print(line, file=sys.stderr if failed else sys.stdout, flush=True)
    with open(log, "a") as f:
        f.write(line + "\n")
    return 2 if failed else 0


@contextlib.contextmanager
def _output_to(path: str | Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors: native code and loggers bound at import
    included) to ``path``, then restore them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_oobleck.slurm.task [--join] SCRIPT [ARGS]``: :func:`run_script`, its exit
    status the process's; ``--check --log FILE SCRIPT [ARGS]``: :func:`check_script`."""
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: python -m {MODULE} [--join | --check --log FILE] SCRIPT [ARGS]"
    if argv[:1] == ["--check"]:
        if len(argv) < 4 or argv[1] != "--log":
            sys.exit(usage)
        sys.exit(check_script(argv[3], argv[4:], argv[2]))
    join = argv[:1] == ["--join"]
    argv = argv[join:]
    if not argv:
        sys.exit(usage)
    run_script(argv[0], argv[1:], join)


if __name__ == "__main__":
    main()
