"""The job's store: its table answers as torch's stores do (read as a table, without sockets), and the
coordinator that serves it answers only clients that present the job's secret: a stranger reads nothing,
writes nothing and holds up nobody."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_oobleck.recovery.coordinator import Coordinator
from lightning_oobleck.recovery.keystore import KeyStoreClient, KeyStoreError
from lightning_oobleck.recovery.keytable import KeyTable
from lightning_oobleck.recovery.protocol import SECRET_ENV, parse_address

SECRET = "the-job"


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def test_the_table_answers_as_torchs_stores_do() -> None:
    table = KeyTable()
    assert table.request(1, {"op": "set", "key": "a", "value": b64(b"x")}, 0.0) == [(1, {})]
    assert table.request(1, {"op": "get", "key": "a", "timeout_s": 1}, 0.0) == [(1, {"value": b64(b"x")})]
    assert table.request(1, {"op": "add", "key": "n", "amount": 2}, 0.0) == [(1, {"value": 2})]
    assert table.request(1, {"op": "add", "key": "n", "amount": 3}, 0.0) == [(1, {"value": 5})]
    # compare_set: set when the value is the expected one (a missing key is expected as b""), else answer it
    cas = {"op": "compare_set", "key": "c"}
    assert table.request(1, {**cas, "expected": b64(b"q"), "desired": b64(b"d")}, 0) == [
        (1, {"value": b64(b"q")})
    ]
    assert "c" not in table.data
    assert table.request(1, {**cas, "expected": "", "desired": b64(b"d")}, 0) == [(1, {"value": b64(b"d")})]
    assert table.request(1, {**cas, "expected": b64(b"z"), "desired": b64(b"e")}, 0) == [
        (1, {"value": b64(b"d")})
    ]
    assert table.request(1, {"op": "check", "keys": ["a", "c"]}, 0) == [(1, {"value": True})]
    assert table.request(1, {"op": "check", "keys": ["a", "nope"]}, 0) == [(1, {"value": False})]
    assert table.request(1, {"op": "num_keys"}, 0) == [(1, {"value": 3})]
    assert table.request(1, {"op": "delete", "key": "a"}, 0) == [(1, {"value": True})]
    assert table.request(1, {"op": "delete", "key": "a"}, 0) == [(1, {"value": False})]
    assert "unknown operation" in table.request(1, {"op": "drop_all"}, 0)[0][1]["error"]
    assert (
        "malformed" in table.request(1, {"op": "set", "key": "k", "value": "not base64!"}, 0)[0][1]["error"]
    )


def test_waits_are_answered_by_the_write_that_completes_them_or_time_out() -> None:
    table = KeyTable()
    assert table.request(1, {"op": "get", "key": "k", "timeout_s": 5}, 0.0) == []
    assert table.request(2, {"op": "wait", "keys": ["k", "j"], "timeout_s": 1}, 0.0) == []
    assert table.request(3, {"op": "wait", "keys": ["j"], "timeout_s": 9}, 0.0) == []
    table.forget(3)  # its client left: never answered
    assert table.next_deadline == 1.0
    # setting k answers the get (with k's value), not the wait, which needs j too
    assert table.request(4, {"op": "set", "key": "k", "value": b64(b"v")}, 0.5) == [
        (4, {}),
        (1, {"value": b64(b"v")}),
    ]
    assert table.expire(0.9) == []
    [(client, answer)] = table.expire(1.0)
    assert client == 2 and answer["timeout"] and "k, j" in answer["error"]
    assert table.waiters == [] and table.next_deadline is None
    # an add completes a wait as a set does
    table.request(5, {"op": "wait", "keys": ["n"], "timeout_s": 1}, 2.0)
    assert table.request(6, {"op": "add", "key": "n", "amount": 1}, 2.1) == [(6, {"value": 1}), (5, {})]


def _raw(address: str, *messages: object) -> list[dict | None]:
    """A client that speaks the store's wire without the client class: the answers to ``messages``."""
    answers: list[dict | None] = []
    with socket.create_connection(parse_address(address), timeout=5) as sock:
        reader = sock.makefile("rb")
        for message in messages:
            try:
                sock.sendall((json.dumps(message) + "\n").encode())
                line = reader.readline()
            except OSError:
                line = b""
            answers.append(json.loads(line) if line else None)
    return answers


@pytest.mark.timeout(30)
def test_a_client_without_the_secret_reads_nothing_writes_nothing_and_holds_up_nobody() -> None:
    server = Coordinator(1, "127.0.0.1", secret=SECRET).start()
    try:
        job = KeyStoreClient(server.address, SECRET, timedelta(seconds=5))
        job.set("plan", b"the plan")
        waited: list[bytes] = []
        waiter = threading.Thread(target=lambda: waited.append(job.get("go")))  # its own connection
        waiter.start()
        strangers = [
            _raw(server.address, {"op": "get", "key": "plan", "timeout_s": 1}),
            _raw(server.address, {"op": "set", "key": "go", "value": b64(b"stranger")}),
            _raw(server.address, {"op": "hello"}, {"op": "get", "key": "plan", "timeout_s": 1}),
            _raw(
                server.address,
                {"op": "hello", "secret": "guess"},
                {"op": "set", "key": "go", "value": "eA=="},
            ),
            _raw(server.address, {"op": "hello", "secret": SECRET[:-1]}),
            _raw(server.address, ["not", "an", "object"]),  # once ended the server's thread
            _raw(server.address, "hello"),
        ]
        for answers in strangers:
            assert answers[0] is not None and answers[0]["error"].startswith("refused")
            assert all(a is None for a in answers[1:])  # disconnected after the refusal
        with pytest.raises(KeyStoreError, match="refused this process: refused: the job's secret"):
            KeyStoreClient(server.address, "guess", timedelta(seconds=5))
        assert server.replica.table.data == {"plan": b"the plan"}  # nothing written, the waiter still waits
        job.set("go", b"1")
        waiter.join(timeout=5)
        assert waited == [b"1"]
        with pytest.raises(dist.DistStoreError, match="timeout waiting for never"):
            job.wait(["never"], timedelta(seconds=0.1))
        assert job.get("plan") == b"the plan"  # the connection is still in step after a timeout
    finally:
        server.stop()


def test_a_coordinator_refuses_to_start_without_the_jobs_secret() -> None:
    """A store anyone could use is what the job's store replaces: the coordinator's command needs the
    secret in its environment (never on its command line)."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_oobleck.recovery", "--host", "127.0.0.1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and f"{SECRET_ENV} is not set" in done.stderr
