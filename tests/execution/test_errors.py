"""Which communication errors mean "a peer was lost" (and are recovered from) and which do not."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_oobleck.execution.errors import is_peer_lost


@pytest.mark.parametrize(
    "error",
    [
        dist.DistNetworkError("connection to rank 3 failed"),
        dist.DistBackendError("NCCL communicator was aborted"),
        TimeoutError("store wait"),
        RuntimeError(
            "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:18627: Connection reset by peer"
        ),
        RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:56479"),
        RuntimeError("Application timeout caused pair closure"),
        RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"),
    ],
)
def test_a_lost_peer_is_recognised_by_type_or_gloos_message(error: BaseException) -> None:
    assert is_peer_lost(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 4x3)"),
        RuntimeError("Input type (float) and bias type (double) should be the same"),
        ValueError("connection reset"),  # a user's error that happens to say it: not a communication error
    ],
)
def test_other_errors_are_not_peer_failures(error: BaseException) -> None:
    assert not is_peer_lost(error)
