"""A generation's process groups: left at once with operations pending on a silent peer, the next one built
in the same processes, a ``DeviceMesh`` handed out, and no code of the package touching torch's registry."""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import ScriptProcess, plan_from_splits

import lightning_oobleck

WORKER = Path(__file__).with_name("generation_worker.py")
PACKAGE = Path(lightning_oobleck.__file__).parent


def _abort_with_a_silent_peer(tmp_path: Path, backend: str, world: int) -> list[dict]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [
        ScriptProcess(
            WORKER, [str(r), str(world), str(store.port), backend, str(out)], out.with_suffix(".log")
        )
        for r, out in enumerate(outs)
    ]
    try:
        deadline = time.monotonic() + 90
        for proc in procs[:-1]:
            assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    return [json.loads(out.read_text()) for out in outs[:-1]]


def _check(results: list[dict], survivors: int) -> None:
    for result in results:
        assert result["abort_s"] < 2.0, result  # not the group timeout (60 s)
        assert "a peer hangs" in result["errored"] or "aborted" in result["errored"]
        assert result["initialized_after_abort"] is False and result["pending_completed"] is False
        assert result["next_sum"] == survivors  # the next generation, over the survivors only
        assert result["next_generation_s"] < 30.0


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_abort_leaves_pending_operations_gloo(tmp_path: Path) -> None:
    """Three workers; the third hangs (SIGSTOP). The two others see their all-reduce aborted, leave
    generation 0 with a receive from the hung peer still pending, in well under a second (since torch
    2.13, ``destroy_process_group`` does not wait for it), and all-reduce in generation 1.
    On a torch where leaving waits, this fails: recovery would stall for the group timeout."""
    _check(_abort_with_a_silent_peer(tmp_path, "gloo", 3), survivors=2)


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two ranks needs 2 GPUs")
def test_abort_leaves_pending_operations_nccl(tmp_path: Path) -> None:
    """The same sequence with NCCL: the communicators are aborted (``ProcessGroup.abort``) before the
    groups are destroyed; the survivor goes on alone."""
    _check(_abort_with_a_silent_peer(tmp_path, "nccl", 2), survivors=1)


def test_no_module_touches_torch_distributed_internals() -> None:
    """Groups are created and left through public torch API only (no ``c10d._world`` edits)."""
    private = re.compile(r"distributed_c10d|\bc10d\._|_world\b|_unregister|_update_default_pg")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not offenders, offenders


def test_every_collective_and_transfer_names_its_group() -> None:
    """No collective or point-to-point call of the package runs on an implicit default group."""
    call = re.compile(r"dist\.(all_reduce|broadcast|barrier|all_gather\w*|isend|irecv|send|recv|P2POp)\(")
    implicit = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for match in call.finditer(text):
            depth, end = 0, match.end() - 1
            for end in range(match.end() - 1, len(text)):  # the call's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            arguments = text[match.end() : end]
            if not re.search(r"\bgroup=", arguments):
                implicit.append(f"{path.relative_to(PACKAGE)}: {match.group(0)}{arguments})")
    assert not implicit, implicit


def test_a_generation_hands_out_a_device_mesh_over_its_world() -> None:
    """DTensor runs on the mesh the generation hands out, over its world group."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_oobleck.execution import ProcessGroups
    from lightning_oobleck.planning.plan import Plan

    plan: Plan = plan_from_splits([[(0, 2)]], [1], 1)
    groups = ProcessGroups(plan, (0, 0), dist.HashStore(), generation=0)
    try:
        mesh = groups.device_mesh()
        assert mesh.size() == 1 and mesh.get_group() is groups.world and mesh.device_type == "cpu"
        values = torch.arange(6.0).reshape(3, 2)
        for placement in (Replicate(), Shard(0)):
            assert torch.equal(distribute_tensor(values, mesh, [placement]).full_tensor(), values)
    finally:
        groups.destroy()
    assert not dist.is_initialized()
