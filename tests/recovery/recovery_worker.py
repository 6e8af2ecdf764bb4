"""A worker process for the recovery tests: a WorkerAgent and a fake training loop on real gloo.

Each step is one ``all_reduce`` of ``[1, stop, step]`` over the current generation's group, waited on
through an abortable wait (poll ``work.is_completed()``, check ``agent.abort``). The reduced vector
proves every member took part (``world``) at the same step. On an abort or a communication error the
worker agrees on the next generation with the coordinator, builds that generation's group on
``PrefixStore(f"gen{g}/", store)``, copies the "training state" (the step counter: the members agree on
the lowest one, i.e. the interrupted step is redone; a worker that joins takes theirs) and continues.
Rank 0 of the current generation writes the run's event file.

Old groups are kept referenced, not destroyed: destroying (or aborting) a gloo group while one of its
operations waits on a stopped peer blocks for the whole process-group timeout (measured: 29 s with a
30 s timeout), so a rebuild must never wait for it. The process ends with ``os._exit``.

Everything a test checks is appended as JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_oobleck.recovery import EventLog, Membership, RecoveryEvent, WorkerAgent
from lightning_oobleck.recovery.keystore import KeyStoreClient

GROUP_TIMEOUT = timedelta(seconds=10)
WAIT_TIMEOUT_S = 60.0


class Interrupted(Exception):
    """The current generation's communication was aborted or failed."""


def wait(work: dist.Work, abort: threading.Event) -> None:
    """Wait for ``work``, bounded, and interrupted as soon as ``abort`` is set."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not work.is_completed():
        if abort.is_set():
            raise Interrupted("aborted while the collective was pending")
        if time.monotonic() > deadline:
            raise Interrupted("collective timed out")
        time.sleep(0.002)
    try:
        work.wait()
    except RuntimeError as e:
        raise Interrupted(f"collective failed: {e}") from e


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.me = (args.node, args.device)
        self.out = open(args.out, "a", buffering=1)  # noqa: SIM115 (the process ends with os._exit)
        self.store = KeyStoreClient(args.store, args.store_secret, timeout=GROUP_TIMEOUT)
        self.agent = WorkerAgent(
            self.me, args.coordinator, connect_timeout=20.0, secret=args.store_secret
        ).start()
        self.events = EventLog(args.events) if args.events else None
        self.graveyard: list[dist.ProcessGroup] = []
        self.step = 0
        self.has_state = False

    def report(self, kind: str, **fields: Any) -> None:
        self.out.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")

    def join(self, after: int) -> tuple[Membership, Any, RecoveryEvent]:
        """Agree on the next generation, build its group, copy the state; retried on new failures."""
        while True:
            if after >= 0 and self.args.ready_delay:
                time.sleep(self.args.ready_delay)
            membership = self.agent.agree(after, timeout=WAIT_TIMEOUT_S)
            event = RecoveryEvent.from_membership(membership)
            event.mark("replanned")  # nothing to plan in this fake training
            rank = membership.rank(self.me)
            store = dist.PrefixStore(f"gen{membership.generation}/", self.store)
            try:
                group = dist.ProcessGroupGloo(store, rank, membership.world_size, GROUP_TIMEOUT)
                event.mark("rebuilt")
                joining = membership.generation > 0 and not self.has_state
                step = torch.tensor([math.inf if joining else float(self.step)])  # a joiner takes the others
                options = dist.AllreduceOptions()
                options.reduceOp = dist.ReduceOp.MIN
                wait(group.allreduce([step], options), self.agent.abort)
            except (Interrupted, RuntimeError) as e:
                self.report("interrupted_during_recovery", generation=membership.generation, error=str(e))
                after = membership.generation
                continue
            self.step, self.has_state = int(step.item()), True
            event.mark("state_copied")
            self.report(
                "generation",
                generation=membership.generation,
                workers=membership.workers,
                rank=rank,
                step=self.step,
            )
            return membership, group, event

    def train(self) -> None:
        membership, group, _ = self.join(after=-1)
        recovering: RecoveryEvent | None = None
        while True:
            started = time.time()
            stop = 1.0 if os.path.exists(self.args.stop_file) else 0.0
            vector = torch.tensor([1.0, stop, float(self.step)])
            work = group.allreduce([vector])
            try:
                wait(work, self.agent.abort)
            except Interrupted as e:
                self.report(
                    "abort",
                    generation=membership.generation,
                    aborted_at=self.agent.aborted_at,
                    noticed_at=time.time(),
                    pending=not work.is_completed(),
                    error=str(e),
                )
                self.graveyard.append(group)
                membership, group, recovering = self.join(after=membership.generation)
                continue
            world, stopping, step_sum = vector.tolist()
            self.report(
                "step", step=self.step, generation=membership.generation, world=world, step_sum=step_sum
            )
            leader = membership.workers[0] == self.me
            if recovering is not None:
                recovering.mark("resumed")
                if leader and self.events:
                    self.events.recovery(recovering, step=self.step)
                recovering = None
            if leader and self.events:
                self.events.step(
                    self.step, samples=8, duration_s=time.time() - started, generation=membership.generation
                )
            self.step += 1
            if stopping:
                break
            time.sleep(self.args.step_sleep)
            if self.agent.joiners:  # the step boundary: admit the nodes waiting to join
                self.agent.request_admission(membership.generation, self.agent.joiners, WAIT_TIMEOUT_S)
        self.report("done", step=self.step, generation=membership.generation)
        self.agent.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--store", required=True, help="the coordinator that serves the store")
    parser.add_argument("--store-secret", required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--events")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument(
        "--ready-delay", type=float, default=0.0, help="sleep before each recovery's agreement"
    )
    run = Run(parser.parse_args())
    run.train()
    run.out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
