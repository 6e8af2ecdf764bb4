"""A stand-in for the real training in the SLURM tests: gloo all-reduce "steps" that survive a lost node.

Each task (started by ``srun``, one per node) joins a gloo group through the job's rendezvous store
(``OOBLECK_STORE_ADDR``) and runs ``steps`` steps; a step all-reduces ``rank + 1``, so its result proves which
ranks took part. When a peer dies the collective fails; the survivors agree through the store on a new
generation (members and the step to redo), rebuild the group and go on. Deliberately simple (the real
in-process recovery lives in the strategy): the first survivor to report is the leader, and it closes the
membership once no other survivor has reported for ``settle_s``; a later one is fenced and exits.

Usable as a script (the ``sbatch slurm/oobleck.sbatch`` test; one JSON log per rank in ``--out``) and as a
function (the submitit test: :func:`train` returns the log).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

PG_TIMEOUT = datetime.timedelta(seconds=10)


def train(steps: int, step_s: float, out: str, settle_s: float = 1.5) -> dict:
    """Run the steps; return (and write to ``out/rank{R}.json``) this rank's log of completed steps."""
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    host, port = os.environ["OOBLECK_STORE_ADDR"].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    members, generation, step, log = list(range(world)), 0, 0, []
    _join(store, generation, members, rank)
    while step < steps:
        try:
            value = torch.tensor([float(rank + 1)], dtype=torch.float64)
            dist.all_reduce(value)
        except RuntimeError:  # a peer died: gloo reports it as a RuntimeError (DistBackendError)
            dist.destroy_process_group()
            generation += 1
            members, step = _agree(store, generation, rank, step, len(members), settle_s)
            log = [entry for entry in log if entry["step"] < step]  # the interrupted step is redone
            _join(store, generation, members, rank)
            continue
        log.append(
            {
                "step": step,
                "generation": generation,
                "members": members,
                "sum": value.item(),
                "t": time.time(),
            }
        )
        if rank == members[0]:
            Path(out, "progress").write_text(str(step))
        step += 1
        time.sleep(step_s)
    dist.destroy_process_group()
    result = {"rank": rank, "node": os.environ.get("SLURMD_NODENAME"), "log": log}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    return result


def _join(store: dist.Store, generation: int, members: list[int], rank: int) -> None:
    prefix = dist.PrefixStore(f"gen{generation}/pg", store)
    dist.init_process_group(
        "gloo", store=prefix, rank=members.index(rank), world_size=len(members), timeout=PG_TIMEOUT
    )


def _agree(
    store: dist.Store, generation: int, rank: int, step: int, previous: int, settle_s: float
) -> tuple[list[int], int]:
    """Survivors report (rank, step); the first reporter decides members and the step to resume at."""
    key = f"gen{generation}"
    slot = store.add(f"{key}/arrived", 1)
    store.set(f"{key}/slot{slot}", json.dumps([rank, step]))
    if slot == 1:
        arrived, last_change = 1, time.monotonic()
        while arrived < previous and time.monotonic() - last_change < settle_s:
            time.sleep(0.05)
            now = store.add(f"{key}/arrived", 0)
            if now != arrived:
                arrived, last_change = now, time.monotonic()
        reports = [json.loads(store.get(f"{key}/slot{i}")) for i in range(1, arrived + 1)]
        decision = {"members": sorted(r for r, _ in reports), "step": min(s for _, s in reports)}
        store.set(f"{key}/decision", json.dumps(decision))
    store.wait([f"{key}/decision"], datetime.timedelta(seconds=60))
    decision = json.loads(store.get(f"{key}/decision"))
    if rank not in decision["members"]:
        print(f"rank {rank}: fenced out of generation {generation}", file=sys.stderr)
        sys.exit(3)
    return decision["members"], decision["step"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.25)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    train(args.steps, args.step_s, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
