"""The job's rendezvous store as a table without sockets: :class:`KeyTable` holds the keys and decides every
answer, including which waits a write completes, which have timed out, and what a client that sends a write
again (after a coordinator failed over) is answered.

The store is served by the job's coordinator replicas (:mod:`~lightning_oobleck.recovery.replica`): the
active one answers, and replicates every write to its standby before the answer leaves, so that whatever a
client was told survives the active's loss. A client numbers its requests (``cid``, ``seq``); a write that
comes again with a number already answered is answered the same way and not applied twice (an ``add`` that
gloo's rendezvous counts with must not count twice). No torch here: the replicas import it without torch.

Wire (:class:`~lightning_oobleck.recovery.keystore.KeyStoreClient`): one TCP connection per client thread;
every message is one JSON line. The first is ``{"op": "hello", "secret": ...}``, answered ``{"ok": true}``,
or ``{"error": ...}`` and the connection closed. Then one request at a time, ``{"op", ...}`` answered by
``{"value"}`` or ``{"error"}``; values travel in base64. ``get`` and ``wait`` are answered when their keys
exist or their ``timeout_s`` passes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

MAX_MESSAGE_BYTES = 256 << 20
"""A plan for thousands of nodes is megabytes; a line longer than this is not from the job."""

WRITES = frozenset({"set", "add", "compare_set", "delete"})
"""The operations that change the table: replicated, and answered once per request number."""


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
    timed out; ``next_deadline`` when to call it next. ``client`` is the server's name for a connection;
    ``message["cid"]``/``message["seq"]``, when given, the client's own name and request number, under which
    a write's answer is remembered."""

    data: dict[str, bytes] = field(default_factory=dict)
    waiters: list[_Waiter] = field(default_factory=list)
    answered: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    """Client name -> (request number, answer) of its newest write: a write sent again gets this answer."""

    def request(self, client: int, message: dict[str, Any], now: float) -> list[tuple[int, dict[str, Any]]]:
        cid, seq = message.get("cid"), message.get("seq")
        if cid is not None and (done := self.answered.get(str(cid))) is not None and done[0] == seq:
            return [(client, done[1])]
        answers = self._request(client, message, now)
        if cid is not None and message.get("op") in WRITES and "error" not in answers[0][1]:
            self.answered[str(cid)] = (seq, answers[0][1])  # type: ignore[assignment]
        return answers

    def _request(self, client: int, message: dict[str, Any], now: float) -> list[tuple[int, dict[str, Any]]]:
        try:
            op = message["op"]
            if op == "set":
                self.data[message["key"]] = decode(message["value"])
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
                key, expected = message["key"], decode(message["expected"])
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self.data[key] = current = decode(message["desired"])
                    woken = self._wake()
                else:
                    woken = []
                    current = expected if current is None else current
                return [(client, {"value": encode(current)}), *woken]
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
        return {"value": encode(self.data[waiter.keys[0]])} if waiter.reply_value else {}


def encode(value: bytes) -> str:
    return base64.b64encode(value).decode()


def decode(value: str) -> bytes:
    return base64.b64decode(value.encode(), validate=True)
