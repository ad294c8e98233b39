"""When a request's text goes out: streamed deltas coalesced by wall time.

Each streamed response crosses the ``llm`` stub's IPC, tritonserver (the
ensemble, gRPC), the gateway and the client, so one response per token caps
the served rate behind a fast forward (served / in-process at 16 streams of
the tiny stand-in: 0.22 at an interval of 0 against 0.65 at 50 ms,
``bench/path_bench.py --set STREAM_INTERVAL_MS=0``; docs/benchmarks.md).  A
response per fixed number of tokens ties the message rate to the step rate, which is what a faster
engine raises.  :class:`DeltaCoalescer` ties it to wall time instead: the
first delta goes out at once (time to first token waits for nothing), then
text is sent once ``interval_s`` has passed since the last response, and
the rest goes with the final one.  Behind a forward slower than the
interval (SmolLM2's on a CPU) every token still goes out as
it comes; behind a GPU-speed forward a stream gets about ``1 / interval_s``
responses a second however many tokens that is.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from contract.finish import FinishEvent
from contract.reasoning import Reasoning, ReasoningSplitter
from llm_runtime.errors import CANCELLED
from llm_runtime.logprobs import TokenLogprobs

__all__ = ["CANCEL_POLL_EVERY", "MAX_STREAM_INTERVAL_MS", "DeltaCoalescer", "Outbox", "PartCoalescer",
           "ResponseSink", "ResponseStream", "StreamPart"]

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


#: A stream asks whether its client left once per this many token events: the question is a
#: blocking round trip through the ``llm`` stub's one IPC thread, too dear per token.
CANCEL_POLL_EVERY: Final = 16


class _TokenEvent(Protocol):
    """What :class:`ResponseStream` reads of a generator's token event (``llm_runtime.scheduler.TokenEvent``)."""

    @property
    def text_delta(self) -> str: ...

    @property
    def logprobs(self) -> Sequence[TokenLogprobs] | None: ...


@dataclass(frozen=True)
class StreamPart:
    """What one streamed response carries.

    Attributes
    ----------
    text : str
        The answer's text since the previous response.
    thinking : str
        The thinking section's text since the previous response ("" without one).
    logprobs : list of TokenLogprobs or None
        The entries of the tokens delivered since the previous response (None: not asked).
    final : FinishEvent or None
        The request's final state, on its last response only.
    """

    text: str
    thinking: str = ""
    logprobs: list[TokenLogprobs] | None = None
    final: FinishEvent | None = None


class ResponseSink(Protocol):
    """Where a :class:`ResponseStream` sends, on the outbox's thread (the model's ``pb_utils`` side)."""

    def send_part(self, part: StreamPart) -> None:
        """Send one response (final when ``part.final`` is set)."""

    def send_cancelled(self) -> None:
        """End the request with an empty final response (its client left)."""

    def poll_cancel(self) -> None:
        """Ask whether the client left, and cancel the request if so."""


class ResponseStream:
    """One request's generator events as its streamed responses' parts, queued on the outbox.

    Called on the decode loop's thread: it only coalesces text (by wall time,
    split into thinking and answer where the request has a thinking section)
    and the log probabilities, and queues the sends; every ``sink`` call runs
    on the outbox's thread, in order, so the final response comes last.

    Parameters
    ----------
    sink : ResponseSink
    outbox : Outbox
    interval_s : float
        As for :class:`DeltaCoalescer`.
    reasoning : Reasoning or None
        The request's thinking section (None: none).
    logprobs : bool
        Whether the request asked for log probabilities.
    """

    __slots__ = ("_coalescer", "_events", "_lps", "_outbox", "_parts", "_sink")

    def __init__(self, sink: ResponseSink, outbox: Outbox, interval_s: float, *, reasoning: Reasoning | None = None,
                 logprobs: bool = False) -> None:
        self._sink = sink
        self._outbox = outbox
        self._coalescer = DeltaCoalescer(interval_s)
        self._parts = None if reasoning is None else PartCoalescer(interval_s, ReasoningSplitter(reasoning))
        self._events = 0
        # With log probabilities: the entries not sent yet; they go with the next response (None: not asked).
        self._lps: list[TokenLogprobs] | None = [] if logprobs else None

    def __call__(self, event: _TokenEvent | FinishEvent) -> None:
        """The generator's event callback."""
        if isinstance(event, FinishEvent):
            if event.status == CANCELLED:
                # Cancelled through CANCEL: the client has left, an empty final response ends the request.
                self._outbox.put(self._sink.send_cancelled)
            else:
                self.finish(event)
            return
        self._events += 1
        if self._events % CANCEL_POLL_EVERY == 0:
            self._outbox.put(self._sink.poll_cancel)
        if self._lps is not None and event.logprobs:
            self._lps.extend(event.logprobs)
        if self._parts is not None:
            parts = self._parts.push(event.text_delta)
            if parts is not None:
                self._queue(StreamPart(parts[1], parts[0], self._take_lps()))
            return
        text = self._coalescer.push(event.text_delta)
        if text is not None:
            self._queue(StreamPart(text, "", self._take_lps()))

    def finish(self, final: FinishEvent) -> None:
        """Queue the last response, with what was not sent yet."""
        thinking, text = self._parts.finish() if self._parts is not None else ("", self._coalescer.take())
        self._queue(StreamPart(text, thinking, self._take_lps(), final))

    def _queue(self, part: StreamPart) -> None:
        self._outbox.put(functools.partial(self._sink.send_part, part))

    def _take_lps(self) -> list[TokenLogprobs] | None:
        """The entries the next response carries (None: the request did not ask)."""
        lps = self._lps
        if lps is None:
            return None
        self._lps = []
        return lps


class Outbox:
    """One thread that runs every stream's sends, in order, off the decode loop.

    A decoupled model's ``ResponseSender.send`` in the Python backend of
    Triton 2.51 waits for tritonserver to take the response: at 16 streams of
    the tiny stand-in the sends made on the decode loop's thread took 47 % of
    its time, and the forward waited for them (docs/benchmarks.md, the serving
    path's first round; ``bench/path_bench.py`` is the load).  Here the loop
    only queues a job; the jobs run on
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
