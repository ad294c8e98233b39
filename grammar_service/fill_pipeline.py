"""The first rows of a grammar step filled on a thread of their own while the step thread plans the rest.

A step (:meth:`grammar_service.engine.GrammarEngine.step`) plans each row in
Python (its tokens accepted, value checks, closing) and then fills every
row's mask in one batched call.  Both backends' batched fills let go of the
GIL (``bench/grammar_step_bench.py --fill-states``, "the fill beside the step
thread's Python": both at once take 0.56-0.67 of the sum of the two apart),
so the rows planned first can be filled while the step thread plans the
others: the step costs ``plan(head) + max(plan(tail), fill(head)) +
fill(tail)`` instead of ``plan + fill``.  One fill runs at a time (the
step thread fills the tail once the head is done), so the batched fill
keeps its ``fill_threads``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from grammar_backend.bitmask import BitmaskBuffer, Matcher
from grammar_backend.errors import GrammarError

#: How often a hand-over checks that the fill thread is still there (a hang-only deadline: it is taken at once).
_TAKEN_POLL_S = 1.0


class FillPipeline:
    """A thread that fills a step's first rows (:meth:`BitmaskBuffer.fill_rows`) while the step thread goes on.

    Parameters
    ----------
    bitmask : BitmaskBuffer
        The engine's buffer; :meth:`BitmaskBuffer.prepare` has chosen the rows a step writes before
        :meth:`submit`.
    """

    def __init__(self, bitmask: BitmaskBuffer) -> None:
        self._bitmask = bitmask
        self._jobs: queue.SimpleQueue[tuple[Sequence[Matcher | None], int] | None] = queue.SimpleQueue()
        self._taken = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._fill_s = 0.0
        self._thread = threading.Thread(target=self._run, name="grammar-fill", daemon=True)
        self._thread.start()

    def submit(self, matchers: Sequence[Matcher | None], start: int) -> None:
        """Fill rows ``start..start + len(matchers)`` on the fill thread; returns once it has taken them.

        Waiting for the thread to take the job hands it the GIL now: were the step thread to go on at once,
        the fill thread would wait for the GIL (up to the interpreter's switch interval, 5 ms) before its
        fill could begin.  One job at a time: :meth:`wait` before the next.
        """
        if not self._thread.is_alive():
            raise GrammarError("fill pipeline: closed")
        self._idle.clear()
        self._jobs.put((matchers, start))
        while not self._taken.wait(_TAKEN_POLL_S):
            if not self._thread.is_alive():  # closed while this job waited behind its stop
                self._idle.set()
                raise GrammarError("fill pipeline: closed")
        self._taken.clear()

    def wait(self) -> float:
        """Wait for the submitted rows (none: at once); the seconds the fill thread spent on them.

        Raises
        ------
        BaseException
            What the fill raised, on the step thread.
        """
        self._idle.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error
        seconds, self._fill_s = self._fill_s, 0.0
        return seconds

    def close(self) -> None:
        """Stop the thread (after the job it has, if any); a later :meth:`submit` raises."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._taken.set()
            t0 = time.perf_counter()
            try:
                self._bitmask.fill_rows(job[0], job[1], one_call=True)
            except BaseException as err:  # noqa: BLE001 -- raised again on the step thread by wait()
                self._error = err
            # Not held while waiting for the next job: ended sequences' matchers go now (an llguidance copy's
            # finalizer gives its template back, grammar_service.llg_spread).
            job = None
            self._fill_s = time.perf_counter() - t0
            self._idle.set()
