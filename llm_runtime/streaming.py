"""When a request's text goes out: streamed deltas coalesced by wall time.

Each streamed response crosses the ``llm`` stub's IPC, tritonserver (the
ensemble, gRPC), the gateway and the client: measured with the tiny
stand-in checkpoint (2.5 ms forward) at 16 streams, one response per token
cost about 0.6 ms of CPU across those processes and capped the served rate
at 0.17 of the same engine in-process.  A response per fixed number of
tokens ties the message rate to the step rate, which is what a faster
engine raises.  :class:`DeltaCoalescer` ties it to wall time instead: the
first delta goes out at once (time to first token waits for nothing), then
text is sent once ``interval_s`` has passed since the last response, and
the rest goes with the final one.  Behind a forward slower than the
interval (SmolLM2's 40-80 ms on this CPU) every token still goes out as
it comes; behind a GPU-speed forward a stream gets about ``1 / interval_s``
responses a second however many tokens that is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Final

from contract.reasoning import ReasoningSplitter

__all__ = ["MAX_STREAM_INTERVAL_MS", "DeltaCoalescer", "Outbox", "PartCoalescer"]

_log = logging.getLogger(__name__)

#: Largest ``stream_interval_ms`` (a second between streamed responses).
MAX_STREAM_INTERVAL_MS: Final = 1000


class _Pace:
    """When a stream's next response may go out: the first at once, then ``interval_s`` after the last."""

    __slots__ = ("_clock", "_interval", "_last")

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self._interval = interval_s
        self._clock = clock
        self._last: float | None = None  # when the last response went out (None: none yet)

    def due(self) -> bool:
        """Whether a response may go out now (if so, it counts as sent now)."""
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            return False
        self._last = now
        return True


class DeltaCoalescer:
    """Joins one request's text deltas into as few streamed responses as the interval allows.

    Parameters
    ----------
    interval_s : float
        Least time between two streamed responses after the first (0: every
        delta goes out as it comes).
    clock : callable
        Monotonic seconds (injectable for tests).
    """

    __slots__ = ("_pace", "_parts")

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._pace = _Pace(interval_s, clock)
        self._parts: list[str] = []

    def push(self, text: str) -> str | None:
        """Add a delta; returns the text to send now (``None``: hold it for later)."""
        if text:
            self._parts.append(text)
        if not self._parts or not self._pace.due():
            return None
        return self.take()

    def take(self) -> str:
        """Everything held (for the final response), and nothing held after."""
        text = "".join(self._parts)
        self._parts.clear()
        return text


class PartCoalescer:
    """:class:`DeltaCoalescer` for a request with a thinking section: its deltas split into thinking and answer.

    The split is :class:`contract.reasoning.ReasoningSplitter`'s (text that
    may still be a marker waits), on the text the generator streams, so it
    serves every engine alike; the timing is :class:`DeltaCoalescer`'s, one
    response carrying both parts.

    Parameters
    ----------
    interval_s : float
        As for :class:`DeltaCoalescer`.
    splitter : ReasoningSplitter
    clock : callable
    """

    __slots__ = ("_answer", "_pace", "_splitter", "_thinking")

    def __init__(self, interval_s: float, splitter: ReasoningSplitter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pace = _Pace(interval_s, clock)
        self._splitter = splitter
        self._thinking: list[str] = []
        self._answer: list[str] = []

    def push(self, text: str) -> tuple[str, str] | None:
        """Add a delta; returns ``(thinking, answer)`` to send now (``None``: hold them for later)."""
        thinking, answer = self._splitter.push(text)
        if thinking:
            self._thinking.append(thinking)
        if answer:
            self._answer.append(answer)
        if not (self._thinking or self._answer) or not self._pace.due():
            return None
        return self._take()

    def finish(self) -> tuple[str, str]:
        """Everything held, the splitter's undecided tail included (the end of the output: it is thinking)."""
        tail = self._splitter.finish()
        if tail:
            self._thinking.append(tail)
        return self._take()

    def _take(self) -> tuple[str, str]:
        out = "".join(self._thinking), "".join(self._answer)
        self._thinking.clear()
        self._answer.clear()
        return out


class Outbox:
    """One thread that runs every stream's sends, in order, off the decode loop.

    A decoupled model's ``ResponseSender.send`` in the Python backend of
    Triton 2.51 waits for tritonserver to take the response; measured with
    the tiny stand-in checkpoint at 16 streams, the sends made on the decode
    loop's thread took 47 % of its time, and the forward waited for them.
    Here the loop only queues a job (about a microsecond); the jobs run on
    this thread in the order they were queued, so each request's responses
    keep their order and its final response comes last.

    Parameters
    ----------
    name : str
        The thread's name.
    """

    def __init__(self, name: str = "llm-outbox") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (it must not raise: a job handles its own failures; a bug is logged)."""
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 -- a job's bug must not stop every other stream's sends; logged
                _log.exception("a streamed response could not be sent")

    def close(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then stop the thread.

        Raises
        ------
        TimeoutError
            The queued jobs did not finish within ``timeout_s``.
        """
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the outbox did not drain within {timeout_s} s")
