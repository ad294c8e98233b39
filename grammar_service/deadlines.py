"""One timer thread for many per-request deadlines.

A start that waits for a compile must answer at its deadline even though no
thread waits for it (the grammar model serves starts asynchronously, so a
slow compile holds no thread).  A ``threading.Timer`` per waiting start would
be a thread per request in a storm; this is one thread and a heap.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Deadline:
    """A scheduled call; :meth:`cancel` makes it a no-op."""

    __slots__ = ("cancelled", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        """Do not run this call (harmless after it ran)."""
        self.cancelled = True


class Deadlines:
    """Runs each scheduled call at its time, on one daemon thread started on first use.

    Calls must be short: they run one after another on the timer thread.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Deadline:
        """Run ``fn`` after ``delay_s`` seconds unless the returned entry is cancelled first."""
        entry = Deadline(fn)
        with self._cv:
            if self._closed:
                raise RuntimeError("deadlines: closed")
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._order), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-deadlines", daemon=True)
                self._thread.start()
            self._cv.notify()
        return entry

    def close(self) -> None:
        """Stop the thread; pending calls never run."""
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, entry = heapq.heappop(self._heap)
            if entry.cancelled:
                continue
            try:
                entry.fn()
            except Exception:
                log.exception("deadlines: a scheduled call failed")
