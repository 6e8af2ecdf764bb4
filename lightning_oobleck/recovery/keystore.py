"""The job's rendezvous store, which only the job can use: a key-value server that answers only connections
presenting the job's secret, and the ``torch.distributed.Store`` that speaks to it.

torch's ``TCPStore`` takes any client and listens on every interface; what the job keeps in its store
decides what it does (the plan, the data positions handed to a recovering worker, the finished flags,
every generation's process-group rendezvous), so a stranger that can reach it could steer or stall the
run. :class:`KeyStoreServer` serves the same operations (those ``ProcessGroupGloo``, ``PrefixStore`` and
the recovery use) to clients that first present the secret, and :class:`KeyStoreClient` is accepted
wherever a store is (``init_process_group(store=...)``, ``PrefixStore``). A local run binds it to the
loopback interface only.

Wire: one TCP connection per client thread; every message is one JSON line. The first is
``{"op": "hello", "secret": ...}``, answered ``{"ok": true}``, or ``{"error": ...}`` and the connection
closed. Then one request at a time, ``{"op", ...}`` answered by ``{"value"}`` or ``{"error"}``; values
travel in base64. ``get`` and ``wait`` are answered when their keys exist or their ``timeout_s`` passes.

:class:`KeyTable` holds the keys and decides every answer, including which waits a write completes and
which have timed out, without sockets: the server only moves its messages.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_oobleck.recovery.protocol import accept

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
"""A plan for thousands of nodes is megabytes; a line longer than this is not from the job."""


class KeyStoreError(RuntimeError):
    """The store refused a request, timed out waiting for a key, or could not be reached."""


@dataclass
class _Waiter:
    client: int
    keys: tuple[str, ...]
    deadline: float
    reply_value: bool
    """``get``: answer with the key's value; ``wait``: with nothing."""


@dataclass
class KeyTable:
    """The store's keys and the clients waiting for some: every answer the server sends comes from here.

    ``request(client, message, now)`` returns the answers due now (to this client and to any other whose
    wait the request completed), as ``(client, answer)`` pairs; ``expire(now)`` the answers of waits that
    timed out; ``next_deadline`` when to call it next."""

    data: dict[str, bytes] = field(default_factory=dict)
    waiters: list[_Waiter] = field(default_factory=list)

    def request(self, client: int, message: dict[str, Any], now: float) -> list[tuple[int, dict[str, Any]]]:
        try:
            op = message["op"]
            if op == "set":
                self.data[message["key"]] = _decode(message["value"])
                return [(client, {}), *self._wake()]
            if op == "get":
                return self._wait(client, (message["key"],), now + float(message["timeout_s"]), True)
            if op == "wait":
                return self._wait(client, tuple(message["keys"]), now + float(message["timeout_s"]), False)
            if op == "add":
                value = int(self.data.get(message["key"], b"0")) + int(message["amount"])
                self.data[message["key"]] = str(value).encode()
                return [(client, {"value": value}), *self._wake()]
            if op == "compare_set":
                key, expected = message["key"], _decode(message["expected"])
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self.data[key] = current = _decode(message["desired"])
                    woken = self._wake()
                else:
                    woken = []
                    current = expected if current is None else current
                return [(client, {"value": _encode(current)}), *woken]
            if op == "check":
                return [(client, {"value": all(k in self.data for k in message["keys"])})]
            if op == "delete":
                return [(client, {"value": self.data.pop(message["key"], None) is not None})]
            if op == "num_keys":
                return [(client, {"value": len(self.data)})]
        except (KeyError, TypeError, ValueError) as e:
            return [(client, {"error": f"malformed {message.get('op')!r} request: {e!r}"})]
        return [(client, {"error": f"unknown operation {op!r}"})]

    def expire(self, now: float) -> list[tuple[int, dict[str, Any]]]:
        late = [w for w in self.waiters if w.deadline <= now]
        self.waiters = [w for w in self.waiters if w.deadline > now]
        return [
            (w.client, {"error": f"timeout waiting for {', '.join(w.keys)}", "timeout": True}) for w in late
        ]

    def forget(self, client: int) -> None:
        """``client`` disconnected: its waits are dropped."""
        self.waiters = [w for w in self.waiters if w.client != client]

    @property
    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self.waiters), default=None)

    def _wait(
        self, client: int, keys: tuple[str, ...], deadline: float, reply_value: bool
    ) -> list[tuple[int, dict[str, Any]]]:
        waiter = _Waiter(client, keys, deadline, reply_value)
        if all(k in self.data for k in keys):
            return [(client, self._answer(waiter))]
        self.waiters.append(waiter)
        return []

    def _wake(self) -> list[tuple[int, dict[str, Any]]]:
        ready = [w for w in self.waiters if all(k in self.data for k in w.keys)]
        self.waiters = [w for w in self.waiters if w not in ready]
        return [(w.client, self._answer(w)) for w in ready]

    def _answer(self, waiter: _Waiter) -> dict[str, Any]:
        return {"value": _encode(self.data[waiter.keys[0]])} if waiter.reply_value else {}


def _encode(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _decode(value: str) -> bytes:
    return base64.b64decode(value.encode(), validate=True)


@dataclass(eq=False)
class _Client:
    id: int
    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    authenticated: bool = False


class KeyStoreServer:
    """Serves a :class:`KeyTable` to clients that present ``secret``, from a daemon thread.

    ``host``: the interface to listen on (a local run: ``127.0.0.1``); ``port`` 0 takes a free one
    (:attr:`port`). A client whose first message does not carry the secret is answered with a refusal and
    disconnected, having read and written nothing."""

    def __init__(self, secret: str, host: str = "127.0.0.1", port: int = 0) -> None:
        if not secret:
            raise ValueError(
                "the key store needs the job's secret: a store anyone can use is what it replaces"
            )
        self._secret = secret.encode()
        self.table = KeyTable()
        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        self.port: int = self._server.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._clients: dict[int, _Client] = {}
        self._next_id = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="oobleck-keystore", daemon=True)

    def start(self) -> KeyStoreServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                deadline = self.table.next_deadline
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                for key, events in self._selector.select(timeout):
                    if key.fileobj is self._server:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif events & selectors.EVENT_READ:
                        self._read(key.data)
                    if (
                        events & selectors.EVENT_WRITE
                        and key.data is not None
                        and key.data.id in self._clients
                    ):
                        self._flush(key.data)
                self._send(self.table.expire(time.monotonic()))
        finally:
            for client in list(self._clients.values()):
                self._close(client)
            self._selector.close()
            self._server.close()

    def _accept(self) -> None:
        if (accepted := accept(self._server)) is None:
            return
        client = _Client(self._next_id, accepted[0])
        self._next_id += 1
        self._clients[client.id] = client
        self._selector.register(client.sock, selectors.EVENT_READ, client)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(client)
            return
        client.buffer += data
        *lines, rest = client.buffer.split(b"\n")
        if len(rest) > MAX_MESSAGE_BYTES:
            self._refuse(client, "message too long: not a client of this job")
            return
        client.buffer = bytearray(rest)
        for line in lines:
            try:
                message = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                message = None
            if not isinstance(message, dict):  # anything else would end this thread, the job's store
                self._refuse(client, "not a key store message")
                return
            if not client.authenticated:
                secret = message.get("secret")
                if message.get("op") != "hello" or not isinstance(secret, str):
                    self._refuse(client, "present the job's secret first")
                    return
                if not hmac.compare_digest(secret.encode(), self._secret):
                    self._refuse(client, "wrong secret: this store serves one job only")
                    return
                client.authenticated = True
                self._send([(client.id, {"ok": True})])
                continue
            self._send(self.table.request(client.id, message, time.monotonic()))

    def _refuse(self, client: _Client, reason: str) -> None:
        log.warning("key store: refused a connection: %s", reason)
        try:
            client.sock.setblocking(True)
            client.sock.settimeout(1.0)
            client.sock.sendall(_line({"error": f"refused: {reason}"}))
        except OSError:
            pass
        self._close(client)

    def _send(self, answers: list[tuple[int, dict[str, Any]]]) -> None:
        for client_id, answer in answers:
            client = self._clients.get(client_id)
            if client is None:
                continue
            client.outbox += _line(answer)
            self._flush(client)

    def _flush(self, client: _Client) -> None:
        try:
            sent = client.sock.send(client.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(client)
            return
        del client.outbox[:sent]
        self._selector.modify(
            client.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0), client
        )

    def _close(self, client: _Client) -> None:
        if self._clients.pop(client.id, None) is None:
            return
        self.table.forget(client.id)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        client.sock.close()


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


class KeyStoreClient(dist.Store):
    """A ``torch.distributed.Store`` on a :class:`KeyStoreServer`: usable as ``init_process_group(store=...)``
    and inside ``PrefixStore``. Each thread has its own connection (gloo's threads, the recovery agent and the
    training loop call it at once; a blocking ``get`` on one never holds up another)."""

    def __init__(
        self, host: str, port: int, secret: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        self.host, self.port = host, port
        self._secret = secret
        self.set_timeout(timeout)
        self._local = threading.local()
        self._connection()  # the first connection now: a wrong address or secret fails here, once

    # ----------------------------------------------------------------------------- the Store API
    def set(self, key: str, value: str | bytes) -> None:
        self._call({"op": "set", "key": key, "value": _encode(_bytes(value))})

    def get(self, key: str) -> bytes:
        return _decode(
            self._call({"op": "get", "key": key, "timeout_s": self._timeout_s()}, wait=True)["value"]
        )

    def add(self, key: str, amount: int) -> int:
        return int(self._call({"op": "add", "key": key, "amount": int(amount)})["value"])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        message = {"op": "compare_set", "key": key, "expected": _encode(_bytes(expected))}
        return _decode(self._call({**message, "desired": _encode(_bytes(desired))})["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)})["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self._timeout_s() if timeout is None else timeout.total_seconds()
        self._call({"op": "wait", "keys": list(keys), "timeout_s": timeout_s}, wait=True)

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key})["value"])

    def num_keys(self) -> int:
        return int(self._call({"op": "num_keys"})["value"])

    # ----------------------------------------------------------------------------- transport
    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def _call(self, message: dict[str, Any], wait: bool = False) -> dict[str, Any]:
        sock, reader = self._connection()
        sock.settimeout(self._timeout_s() + 30 if wait else self._timeout_s())
        try:
            sock.sendall(_line(message))
            answer = json.loads(reader.readline(MAX_MESSAGE_BYTES) or b"null")
        except (OSError, ValueError) as e:
            self._local.connection = None
            raise KeyStoreError(f"the job's store at {self.host}:{self.port} is unreachable: {e}") from e
        if answer is None:
            self._local.connection = None
            raise KeyStoreError(f"the job's store at {self.host}:{self.port} closed the connection")
        if "error" in answer:
            raise (_timeout_error if answer.get("timeout") else KeyStoreError)(answer["error"])
        return answer

    def _connection(self) -> tuple[socket.socket, Any]:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self._timeout_s())
            except OSError as e:
                raise KeyStoreError(f"cannot reach the job's store at {self.host}:{self.port}: {e}") from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = sock.makefile("rb")
            sock.sendall(_line({"op": "hello", "secret": self._secret}))
            answer = json.loads(reader.readline(MAX_MESSAGE_BYTES) or b"null")
            if not answer or not answer.get("ok"):
                sock.close()
                reason = "it closed the connection" if not answer else answer.get("error")
                raise KeyStoreError(
                    f"the job's store at {self.host}:{self.port} refused this process: {reason}"
                )
            connection = self._local.connection = (sock, reader)
        return connection


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _timeout_error(message: str) -> Exception:
    """A wait that timed out, as torch's stores raise it (``DistStoreError``, a ``RuntimeError``)."""
    return dist.DistStoreError(message)
