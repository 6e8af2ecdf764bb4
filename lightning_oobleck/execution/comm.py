"""Bounded, abortable waits on torch.distributed work.

With gloo, a rank blocked on a peer that is alive but silent (stopped, or itself blocked) waits for the
whole process-group timeout, and a gloo point-to-point ``Work`` can neither be polled (``is_completed``
stays false) nor be waited on with a short timeout without poisoning the whole group. So the blocking
``Work.wait()`` runs on one helper thread per generation, and the caller waits on a
:class:`threading.Event` in short slices, checking an ``abort`` event set by recovery's heartbeat
thread. Once a wait is aborted or timed out the waiter is *broken*: its thread may stay blocked in gloo
until the groups are destroyed, and every later wait raises :class:`PeerFailure` at once.

When ``abort`` comes from a failure detector (the recovery coordinator), a wait that runs long is not a
failure: every peer still sends heartbeats, so one is slow (a long callback on rank 0, a slow upload).
The waiter then logs a warning every ``slow_after`` and goes on waiting, up to ``timeout`` (the hang
limit, for a peer whose main thread is deadlocked while its heartbeats go on).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

from torch.distributed import Work

from lightning_oobleck.execution.errors import PeerFailure, is_peer_lost
from lightning_oobleck.execution.exit_guard import exit_past_stuck_thread

log = logging.getLogger(__name__)


class _Request:
    __slots__ = ("done", "error", "works")

    def __init__(self, works: Sequence[Work]) -> None:
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except BaseException as e:  # handed to the waiting caller, which re-raises it
            self.error = e
        finally:
            self.works = ()  # a work holds its tensors: the helper thread keeps this request until the next
            self.done.set()


class CommWaiter:
    """Waits for works on behalf of the caller; the caller's wait is bounded and abortable.

    ``timeout``: the longest a single :meth:`wait` may take; ``poll_s``: how often the caller checks
    the abort event (the abort latency); ``slow_after``: with a failure detector setting ``abort``, how
    long a wait runs before each warning that a live peer is slow (``None``: no failure detector).
    """

    def __init__(self, timeout: timedelta, poll_s: float = 0.01, slow_after: timedelta | None = None) -> None:
        self.timeout_s = timeout.total_seconds()
        self.slow_after_s = slow_after.total_seconds() if slow_after is not None else None
        self.poll_s = poll_s
        self.broken: str | None = None
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="oobleck-comm-waiter", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            request.run()

    @contextmanager
    def issuing(self) -> Iterator[None]:
        """Issue operations inside this block: gloo may report a lost peer when an op is issued, too."""
        self._check()
        try:
            yield
        except RuntimeError as e:
            self._reraise(e)

    def _check(self) -> None:
        if self.broken is not None:
            raise PeerFailure(f"communication of this generation already failed ({self.broken})")

    def wait(self, works: Sequence[Work], abort: threading.Event) -> None:
        """Return once every work completed; raise :class:`PeerFailure` on abort, timeout or lost peer."""
        self._check()
        if abort.is_set():
            self._break("aborted")
        if not works:
            return
        if all(work.is_completed() for work in works):  # collectives done already: no thread hand-off
            self._finish(works)
            return
        request = _Request(works)
        self._requests.put(request)
        started = time.monotonic()
        warn_at = started + self.slow_after_s if self.slow_after_s is not None else None
        while not request.done.wait(self.poll_s):
            if abort.is_set():
                self._break("aborted")
            now = time.monotonic()
            if now - started > self.timeout_s:
                alive = " although every peer sends heartbeats (a deadlock?)" if warn_at is not None else ""
                self._break(f"no progress from peers within {self.timeout_s:.1f} s{alive}")
            if warn_at is not None and now > warn_at:
                assert self.slow_after_s is not None
                warn_at += self.slow_after_s
                log.warning(
                    "waited %.0f s for peers that are all alive: a slow peer is waited for, not failed "
                    "(collective_timeout_s=%g; hang_timeout_s=%g ends this wait)",
                    now - started,
                    self.slow_after_s,
                    self.timeout_s,
                )
        if request.error is not None:
            self._reraise(request.error)

    def _finish(self, works: Sequence[Work]) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            self._reraise(e)

    def _reraise(self, error: BaseException) -> None:
        """A lost peer becomes :class:`PeerFailure` (and breaks the waiter); other errors stay as they are."""
        if is_peer_lost(error):
            self.broken = f"peer lost: {error}"
            raise PeerFailure(f"a peer was lost: {error}") from error
        raise error

    def _break(self, reason: str) -> None:
        self.broken = reason
        raise PeerFailure(f"communication {reason}")

    def close(self) -> None:
        """Stop the helper thread (it ends at once unless it is stuck in a wait of a broken waiter)."""
        self._requests.put(None)
        if self.broken is None:
            self._thread.join(timeout=self.timeout_s)
        else:
            exit_past_stuck_thread(self._thread)
