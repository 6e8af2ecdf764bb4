"""The job's supervisor, run on the SLURM batch host: ``python -m lightning_oobleck.slurm.rendezvous``.

The batch script starts it in the background before ``srun`` and exports its two addresses to every task:
``OOBLECK_COORDINATOR_ADDR=host:port``, the recovery :class:`~lightning_oobleck.recovery.Coordinator` (the
failure detector and membership authority each task's ``WorkerAgent`` connects to), which also serves
``OOBLECK_STORE_ADDR``, the job's store (:mod:`lightning_oobleck.recovery.keystore`: the store all ranks
rendezvous through, generation after generation; read by :mod:`lightning_oobleck.lightning.environment`; it
answers only processes that present the job's secret, exported beside the addresses). It lives in a process
of its own, so that the loss of any training task, rank 0 included, leaves it running; a task of another
node starts its standby, which takes over if the batch host is lost.

Two ways to run it::

    python -m lightning_oobleck.slurm.rendezvous --watch-pid PID            # serve in the foreground
    exports=$(python -m lightning_oobleck.slurm.rendezvous --detach --watch-pid $$ --log FILE) || exit 1
    eval "$exports"

The first prints one line of shell,
``export OOBLECK_STORE_ADDR=host:port OOBLECK_COORDINATOR_ADDR=host:port``, then serves until process PID
(the batch shell) is gone or it receives SIGTERM/SIGINT. ``--detach`` starts the first form in a new session
with its output in FILE, prints that line once both listen, and returns. Batch
scripts ``eval`` the line rather than parse it, so that whatever this process comes to serve (and export)
needs no change to them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from lightning_oobleck.process import process_alive
from lightning_oobleck.slurm.join import JoinInfo, join_file, write_join_file

MODULE = "lightning_oobleck.slurm.rendezvous"
"""The entry point's module name (stable: batch scripts name it)."""
STORE_ADDR_VAR = "OOBLECK_STORE_ADDR"
WORLD_SIZE_VAR = "SLURM_NTASKS"
"""Where ``--world-size`` comes from by default: the job's task count, as the batch script sees it."""
STARTUP_TIMEOUT_S = 60.0
"""How long ``--detach`` waits for the server to listen (a cold ``import torch`` on a busy node is slow)."""


def serve(
    host: str,
    port: int,
    world_size: int,
    watch_pid: int | None,
    heartbeat_timeout_s: float,
    poll_s: float = 1.0,
    bind: str | None = None,
    command: Sequence[str] = (),
    setup: Sequence[str] = (),
) -> None:
    """Host the job's coordinator (its store too) for ``world_size`` workers on ``port`` (0: any free port),
    print the ``export`` line, write the job's join file (:mod:`~lightning_oobleck.slurm.join`: ``command``
    is the training's and ``setup`` its batch script's setup lines, for the join jobs; the coordinators keep
    its addresses current), serve until told to stop. It listens on ``bind`` (default: the address ``host``
    resolves to, the interface the tasks reach this host by). A worker of another node starts its standby."""
    # Imported here, not at the top: ``--detach`` returns the address sooner without these imports.
    from lightning_oobleck.recovery import ADDRESS_ENV, Coordinator
    from lightning_oobleck.recovery.coordinator import interface_of
    from lightning_oobleck.recovery.membership import MembershipSettings
    from lightning_oobleck.recovery.protocol import SECRET_ENV
    from lightning_oobleck.recovery.replica import ReplicaSettings

    # The coordinator's registrations, deaths and generations go to this process's log (``--log``).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    secret = secrets.token_hex(16)  # joiners read it from the join file, readable by the user only
    job_id = os.environ.get("SLURM_JOB_ID")
    joining = join_file(os.getcwd(), job_id) if job_id else None
    # Fenced workers on this host are SIGKILLed so that their gloo peers see them gone at once; tasks on
    # other hosts fence themselves.
    tasks_per_node = _env_int("SLURM_NTASKS_PER_NODE") or 1
    settings = MembershipSettings(
        heartbeat_timeout=heartbeat_timeout_s, devices_per_node=tasks_per_node, kill_fenced=True
    )
    coordinator = Coordinator(
        world_size,
        bind or interface_of(host),
        port,
        settings=settings,
        advertise_host=host,
        secret=secret,
        node=_env_int("SLURM_NODEID") or 0 if job_id else None,  # the batch host: the allocation's first node
        replica_settings=ReplicaSettings(join_file=str(joining) if joining else None),
    )
    exports = {
        STORE_ADDR_VAR: coordinator.address,  # the store is the coordinator's
        ADDRESS_ENV: coordinator.address,
        SECRET_ENV: secret,  # for the tasks: the batch script evals this line, never prints it
    }
    if joining is not None:
        info = JoinInfo(
            job_id,
            coordinator.address,
            coordinator.address,
            secret,
            tasks_per_node,
            tuple(command),
            tuple(setup),
        )
        write_join_file(joining, info)
    coordinator.start()
    print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items()), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(poll_s):
            if watch_pid is not None and not process_alive(watch_pid):
                break
    finally:
        if joining is not None:
            joining.unlink(missing_ok=True)
        coordinator.stop()


def detach(argv: Sequence[str], log_path: str, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """Start ``serve`` in a background process (own session, output to ``log_path``); return its line."""
    with open(log_path, "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", MODULE, *argv],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    assert child.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        line = child.stdout.readline().decode().strip() if sel.select(timeout_s) else ""
    if not line:
        exited = child.poll()
        child.kill()
        why = f"exited with status {exited}" if exited is not None else f"did not start in {timeout_s:.0f} s"
        raise RuntimeError(f"the rendezvous store {why}; see {log_path}")
    # The server prints nothing more on stdout; closing our end cannot stop it.
    child.stdout.close()
    return line


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description=f"Host the job's rendezvous store and recovery coordinator; print the line that "
        f"exports their addresses ({STORE_ADDR_VAR}, OOBLECK_COORDINATOR_ADDR).",
    )
    parser.add_argument("--host", default=socket.gethostname(), help="name the tasks reach this host by")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    parser.add_argument(
        "--bind",
        help="the coordinator's listening address (default: the address --host resolves to; 0.0.0.0: all)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=_env_int(WORLD_SIZE_VAR),
        help=f"worker processes at start (default: ${WORLD_SIZE_VAR})",
    )
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=5.0, help="seconds of silence after which a worker is dead"
    )
    parser.add_argument("--watch-pid", type=int, help="exit when this process (the batch shell) is gone")
    parser.add_argument(
        "--detach", action="store_true", help="serve in the background; print the export line"
    )
    parser.add_argument("--log", default=os.devnull, help="with --detach: the server's log file")
    parser.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line the batch script ran before the tasks (repeatable; join jobs run it too)",
    )
    parser.add_argument(
        "command", nargs="*", help="the training command the tasks run (for join jobs: oobleck join)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.world_size is None or args.world_size < 1:
        parser.error(
            f"no world size: pass --world-size N (the number of tasks) or run inside a job ({WORLD_SIZE_VAR})"
        )
    if args.detach:
        serve_argv = ["--host", args.host, "--port", str(args.port), "--world-size", str(args.world_size)]
        serve_argv += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
        if args.bind is not None:
            serve_argv += ["--bind", args.bind]
        if args.watch_pid is not None:
            serve_argv += ["--watch-pid", str(args.watch_pid)]
        serve_argv += [f"--setup={line}" for line in args.setup]
        serve_argv += ["--", *args.command]
        try:
            print(detach(serve_argv, args.log), flush=True)
        except RuntimeError as e:
            print(f"rendezvous: error: {e}", file=sys.stderr)
            return 1
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        serve(
            args.host,
            args.port,
            args.world_size,
            args.watch_pid,
            args.heartbeat_timeout,
            bind=args.bind,
            command=args.command,
            setup=args.setup,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
