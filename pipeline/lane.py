"""A lane apart: heavy work items run on their own thread, in arrival order, behind a bounded queue.

Why: a Triton Python model instance serves its requests one at a time, so a
request that costs seconds (the meta-schema check of a 2 MB schema: about
4 s on one core, ``bench/compile_storm.py --burst``) holds every request
queued behind it.  The ``preprocessing`` model is decoupled: it answers light
requests at once on the stub's thread and hands heavy ones to a
:class:`HeavyLane`, whose thread answers them when done.

The lane orders and bounds the heavy requests; it does not do their work
in this process.  ``preprocessing``'s lane thread hands each check to a
child process at nice 19 (:mod:`pipeline.checker`) and waits: checked on
the thread itself, the checks' Python took a core from decoding at the
same priority (inter-token p99 5.2x quiet behind the burst), and at nice 19
the thread would hold the GIL while starved (priority inversion).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from contract.errors import RESOURCE_EXHAUSTED, UNAVAILABLE, ServingError

__all__ = ["HeavyLane", "LaneClosed", "LaneFull"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class LaneFull(ServingError):
    """The lane's queue is full: RESOURCE_EXHAUSTED (the client retries later)."""

    status = RESOURCE_EXHAUSTED


class LaneClosed(ServingError):
    """The lane is closed (the model is unloading): UNAVAILABLE (retry on another replica)."""

    status = UNAVAILABLE


class HeavyLane(Generic[T]):
    """One thread that runs ``run(item)`` for each submitted item, in arrival order.

    Parameters
    ----------
    name : str
        The thread's name and what :class:`LaneFull` names (e.g. ``"preprocessing"``).
    depth : int
        Items that may wait (the one running not counted); past it :meth:`submit` raises.
    run : callable
        Does the work and answers the item's request itself; it must not
        raise (an exception it lets out is logged, and the lane goes on).
    """

    def __init__(self, name: str, depth: int, run: Callable[[T], None]) -> None:
        if depth < 1:
            raise ValueError(f"{name}: the heavy lane's depth must be at least 1, got {depth}")
        self.name = name
        self.depth = depth
        self._run = run
        self._queue: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-heavy", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Items submitted and not yet started."""
        with self._cond:
            return len(self._queue)

    def submit(self, item: T) -> None:
        """Queue ``item``.

        Raises
        ------
        LaneFull
            ``depth`` items wait already.
        LaneClosed
            After :meth:`close`.
        """
        with self._cond:
            if self._closed:
                raise LaneClosed(self.closed_message)
            if len(self._queue) >= self.depth:
                raise LaneFull(f"{self.name}: {len(self._queue)} large constraints already wait to be checked "
                               "on this instance; retry later")
            self._queue.append(item)
            self._cond.notify()

    @property
    def closed_message(self) -> str:
        """What a request the closed lane cannot take is told."""
        return f"{self.name}: the server is shutting down; retry"

    def close(self, timeout_s: float) -> list[T]:
        """Stop taking items; wait up to ``timeout_s`` for the running one; return those never started."""
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return left

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                item = self._queue.popleft()
            try:
                self._run(item)
            except Exception:  # the lane outlives a bug in one item's answer; the bug is logged whole
                log.exception("%s: the heavy lane's work item failed", self.name)
