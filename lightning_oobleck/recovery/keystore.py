"""The job's rendezvous store as torch sees it: :class:`KeyStoreClient`, a ``torch.distributed.Store`` served
by the job's coordinators, which answer only processes that present the job's secret.

torch's ``TCPStore`` takes any client and listens on every interface; what the job keeps in its store decides
what it does (the plan, the data positions handed to a recovering worker, the finished flags, every
generation's process-group rendezvous), so a stranger that can reach it could steer or stall the run. The
coordinators serve the operations ``ProcessGroupGloo``, ``PrefixStore`` and the recovery use
(:class:`~lightning_oobleck.recovery.keytable.KeyTable` decides every answer; wire format there), and the
active one replicates every write to its standby before answering it. So when the active coordinator is
lost, a client carries on with the one that took over: it sends its request again there, and a write that
was already applied is answered as it was, not applied twice.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_oobleck.recovery.keytable import MAX_MESSAGE_BYTES, decode, encode
from lightning_oobleck.recovery.protocol import parse_address, parse_addresses

FAILOVER_WAIT_S = 60.0
"""How long a request waits by default, beyond its own timeout, for a coordinator to take over the store."""
_ANSWER_S = 10.0
"""How long a coordinator may take to answer beyond a wait's own time before it is taken for lost (a silent
one; a dead one's connection ends at once)."""


class KeyStoreError(RuntimeError):
    """The store refused a request, timed out waiting for a key, or could not be reached."""


class _Refused(Exception):
    """A coordinator refused the client (wrong secret): no other will accept it."""


class KeyStoreClient(dist.Store):
    """A ``torch.distributed.Store`` on the job's coordinators: usable as ``init_process_group(store=...)``
    and inside ``PrefixStore``. Each thread has its own connection (gloo's threads, the recovery agent and
    the training loop call it at once; a blocking ``get`` on one never holds up another).

    ``addresses``: the coordinators (``host:port``, comma-separated, the active first); ``more``: where to
    find the ones started since (the process's agent, which the active coordinator tells of its standby).
    The first connection is made now: a wrong address or secret fails here, once.
    """

    def __init__(
        self,
        addresses: str,
        secret: str,
        timeout: timedelta = timedelta(seconds=300),
        more: Callable[[], list[str]] | None = None,
    ) -> None:
        super().__init__()
        self.addresses = parse_addresses(addresses)
        self.failover_s = FAILOVER_WAIT_S
        """How long a request waits, beyond its own timeout, for a coordinator to take over the store."""
        self._addresses_lock = threading.Lock()
        self._more = more
        self._secret = secret
        self.set_timeout(timeout)
        self._local = threading.local()
        self._connection(time.monotonic() + self._timeout_s())

    # ----------------------------------------------------------------------------- the Store API
    def set(self, key: str, value: str | bytes) -> None:
        self._call({"op": "set", "key": key, "value": encode(_bytes(value))})

    def get(self, key: str) -> bytes:
        return decode(self._call({"op": "get", "key": key}, wait=self._timeout_s())["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call({"op": "add", "key": key, "amount": int(amount)})["value"])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        message = {"op": "compare_set", "key": key, "expected": encode(_bytes(expected))}
        return decode(self._call({**message, "desired": encode(_bytes(desired))})["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)})["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self._timeout_s() if timeout is None else timeout.total_seconds()
        self._call({"op": "wait", "keys": list(keys)}, wait=timeout_s)

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key})["value"])

    def num_keys(self) -> int:
        return int(self._call({"op": "num_keys"})["value"])

    # ----------------------------------------------------------------------------- transport
    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def _call(self, message: dict[str, Any], wait: float | None = None) -> dict[str, Any]:
        """Send ``message`` (numbered: sent again unchanged after a failover) and return its answer; a
        ``get``/``wait`` waits ``wait`` seconds at most for its keys, across coordinators."""
        local = self._local
        local.seq = getattr(local, "seq", 0) + 1
        message = {**message, "cid": self._cid(), "seq": local.seq}
        give_up = time.monotonic() + (wait or 0.0) + self.failover_s
        wait_until = time.monotonic() + (wait or 0.0)
        while True:
            sock, reader, address = self._connection(give_up)
            if wait is not None:
                message["timeout_s"] = max(0.0, wait_until - time.monotonic())
            sock.settimeout(message.get("timeout_s", 0.0) + min(self._timeout_s(), _ANSWER_S))
            try:
                sock.sendall(_line(message))
                answer = json.loads(reader.readline(MAX_MESSAGE_BYTES) or b"null")
            except (OSError, ValueError):
                answer = None
            if answer is None:  # the coordinator is gone: the one that takes over answers the same request
                self._drop(address)
                if time.monotonic() > give_up:
                    raise KeyStoreError(
                        f"the job's store at {address} is unreachable; no coordinator took over"
                    )
                continue
            if "error" in answer:
                raise (_timeout_error if answer.get("timeout") else KeyStoreError)(answer["error"])
            return answer

    def _cid(self) -> str:
        cid = getattr(self._local, "cid", None)
        if cid is None:
            cid = self._local.cid = f"{os.getpid()}-{uuid.uuid4().hex}"
        return cid

    def _drop(self, address: str) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection[0].close()
        self._local.connection = None
        with self._addresses_lock:
            if address in self.addresses:  # the lost one is tried last from now on
                self.addresses.remove(address)
                self.addresses.append(address)

    def _connection(self, give_up: float) -> tuple[socket.socket, Any, str]:
        """This thread's connection to the active coordinator: the known ones are tried in turn (a standby
        answers that it is not the active one) until ``give_up``."""
        connection = getattr(self._local, "connection", None)
        active = self._more() if self._more else []
        if connection is not None and active and connection[2] != active[0]:
            self._drop(connection[2])  # the agent has seen this one lost and another take over: go there
            connection = None
        if connection is not None:
            return connection
        errors: dict[str, str] = {}
        for attempt in itertools.count():
            with self._addresses_lock:  # the agent's view first: it follows the coordinators' failovers
                known = list(dict.fromkeys((self._more() if self._more else []) + self.addresses))
            for address in known:
                try:
                    connection = self._hello(address)
                except _Refused as e:
                    raise KeyStoreError(f"the job's store at {address} refused this process: {e}") from None
                except OSError as e:
                    errors[address] = str(e)
                    continue
                self._local.connection = connection
                return connection
            if time.monotonic() > give_up:
                tried = "; ".join(f"{a}: {why}" for a, why in errors.items())
                raise KeyStoreError(f"cannot reach the job's store ({tried})")
            time.sleep(min(0.5, 0.02 * (attempt + 1)))
        raise AssertionError("unreachable")

    def _hello(self, address: str) -> tuple[socket.socket, Any, str]:
        sock = socket.create_connection(parse_address(address), timeout=min(self._timeout_s(), _ANSWER_S))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = sock.makefile("rb")
            sock.sendall(_line({"op": "hello", "secret": self._secret}))
            answer = json.loads(reader.readline(MAX_MESSAGE_BYTES) or b"null")
        except (OSError, ValueError) as e:
            sock.close()
            raise OSError(f"no answer to hello ({e})") from e
        if answer and answer.get("ok"):
            with self._addresses_lock:
                self.addresses += [a for a in answer.get("replicas", []) if a not in self.addresses]
            return sock, reader, address
        sock.close()
        if answer and answer.get("redirect"):
            raise OSError(answer["error"])
        raise _Refused("it closed the connection" if not answer else answer.get("error"))


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _timeout_error(message: str) -> Exception:
    """A wait that timed out, as torch's stores raise it (``DistStoreError``, a ``RuntimeError``)."""
    return dist.DistStoreError(message)
