"""End the process without Python's finalisation while a thread is stuck in an abandoned gloo wait.

After a failure, the waiter thread of the broken generation (:class:`~lightning_oobleck.execution.comm.
CommWaiter`) may stay blocked in ``Work.wait()`` (C++, GIL released) until gloo gives up on a silent peer,
which can outlast the training. If the interpreter finalises meanwhile and that wait then returns (for
instance because the peer process exits too), the daemon thread re-acquires the GIL during finalisation and
CPython ends it with ``pthread_exit``; the forced unwinding through torch's ``noexcept`` C++ frames calls
``std::terminate`` ("terminate called without an active exception", exit status 134) although the run
succeeded. So once such a thread exists, the process ends at exit with ``os._exit`` (after flushing its
logs and streams): status 1 if an exception went uncaught, else 0. A ``sys.exit(n)`` code is not seen by
``atexit`` handlers and becomes 0 or 1 likewise.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType


class _ExitGuard:
    """Process-wide by nature (one exit per process): the stuck threads the exit must not wait for, and
    whether a run failed."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._failed = False
        self._previous_hook = sys.excepthook
        self._before_exit: list[Callable[[bool], object]] = []

    def watch(self, thread: threading.Thread) -> None:
        if not self._threads:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self._exit)
        self._threads.append(thread)

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, traceback: TracebackType | None
    ) -> None:
        self._failed = True
        self._previous_hook(kind, value, traceback)

    def before_exit(self, callback: Callable[[bool], object]) -> None:
        if callback not in self._before_exit:
            self._before_exit.append(callback)

    def _exit(self) -> None:
        if not any(thread.is_alive() for thread in self._threads):
            return  # every stuck wait ended: a normal exit is safe
        for callback in self._before_exit:  # the exit handlers registered before this one would not run
            with contextlib.suppress(Exception):
                callback(self._failed)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(1 if self._failed else 0)


_GUARD = _ExitGuard()


def exit_past_stuck_thread(thread: threading.Thread) -> None:
    """Make the process exit without finalisation if ``thread`` (stuck in a C++ wait) is alive at exit."""
    _GUARD.watch(thread)


def before_exit(callback: Callable[[bool], object]) -> None:
    """Call ``callback(failed)`` before the guard ends the process without finalisation: exit handlers that
    were registered before the guard's (a worker's goodbye to its coordinator) would not run then."""
    _GUARD.before_exit(callback)
