"""When streamed text goes out: deltas coalesced by wall time, sent in order off the decode loop."""

from __future__ import annotations

import functools
import logging
import threading

import pytest

from contract.finish import FinishEvent
from contract.reasoning import Reasoning
from llm_runtime.errors import CANCELLED
from llm_runtime.logprobs import TokenLogprobs
from llm_runtime.scheduler import TokenEvent
from llm_runtime.streaming import CANCEL_POLL_EVERY, DeltaCoalescer, Outbox, ResponseStream, StreamPart
from tests.support.poll import HANG_S


class Clock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("interval_s", "events", "sent", "rest"),
    [
        # (time, delta): the first goes at once, then one response per interval, the rest held.
        (0.05, [(0.0, "a"), (0.01, "b"), (0.02, "c"), (0.06, "d"), (0.07, "e")], ["a", "bcd"], "e"),
        (0.05, [(0.0, ""), (0.01, ""), (0.02, "x")], ["x"], ""),  # empty deltas send nothing
        (0.05, [(0.0, "a"), (0.01, "b"), (0.02, "c")], ["a"], "bc"),  # a burst: the rest goes with the last
        (0.0, [(0.0, "a"), (0.0, "b"), (0.0, "c")], ["a", "b", "c"], ""),  # 0: every delta
        (0.05, [(0.0, "a"), (0.08, "b"), (0.16, "c")], ["a", "b", "c"], ""),  # a slow forward: each as it comes
    ],
)
def test_deltas_go_out_by_wall_time(interval_s: float, events: list[tuple[float, str]], sent: list[str],
                                    rest: str) -> None:
    clock = Clock()
    coalescer = DeltaCoalescer(interval_s, clock)
    out = []
    for t, delta in events:
        clock.now = 100.0 + t
        text = coalescer.push(delta)
        if text is not None:
            out.append(text)
    assert out == sent
    assert coalescer.take() == rest and coalescer.take() == ""


def test_the_outbox_sends_in_order_off_the_callers_thread() -> None:
    outbox = Outbox("test-outbox")
    seen: list[tuple[int, str]] = []
    caller = threading.current_thread().name
    def job(i: int) -> None:
        seen.append((i, threading.current_thread().name))

    for i in range(200):
        outbox.put(functools.partial(job, i))
    outbox.close()
    assert [i for i, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"test-outbox"} != {caller}


def test_a_failing_job_is_logged_and_the_next_ones_run(caplog: pytest.LogCaptureFixture) -> None:
    outbox = Outbox()
    done: list[int] = []

    def broken() -> None:
        raise RuntimeError("a bug in one stream")

    with caplog.at_level(logging.ERROR, logger="llm_runtime.streaming"):
        outbox.put(broken)
        outbox.put(lambda: done.append(1))
        outbox.close()
    assert done == [1]
    assert [r.getMessage() for r in caplog.records] == ["a streamed response could not be sent"]
    assert "a bug in one stream" in (caplog.records[0].exc_text or "")


def test_close_waits_for_what_is_queued() -> None:
    outbox = Outbox()
    gate = threading.Event()

    def held() -> None:
        gate.wait(HANG_S)  # held until after the close below has given up, however slow the machine

    outbox.put(held)
    with pytest.raises(TimeoutError, match=r"^the outbox did not drain within 0\.1 s$"):
        outbox.close(timeout_s=0.1)
    gate.set()


class Sink:
    """What a model's sender was asked to send, and on which thread."""

    def __init__(self) -> None:
        self.sent: list[StreamPart | str] = []
        self.threads: set[str] = set()

    def send_part(self, part: StreamPart) -> None:
        self.threads.add(threading.current_thread().name)
        self.sent.append(part)

    def send_cancelled(self) -> None:
        self.sent.append("cancelled")

    def poll_cancel(self) -> None:
        self.sent.append("poll")


DONE = FinishEvent(finish_reason="stop", text="", prompt_tokens=1, completion_tokens=3)
LP = TokenLogprobs(token=7, logprob=-0.5, top=())


@pytest.mark.parametrize(
    ("reasoning", "logprobs", "deltas", "sent"),
    [
        # interval 0: every delta goes at once; the final carries what is left (nothing) and the state
        (None, False, ["a", "b"], [StreamPart("a"), StreamPart("b"), StreamPart("", final=DONE)]),
        (None, True, ["a"], [StreamPart("a", logprobs=[LP]), StreamPart("", logprobs=[], final=DONE)]),
        # a thinking section: its text apart from the answer's (markers left out)
        (Reasoning(end="</t>", start="<t>"), False, ["<t>hm", "</t>", "ok"],
         [StreamPart("", "hm"), StreamPart("ok"), StreamPart("", final=DONE)]),
    ],
    ids=["text", "logprobs", "thinking"],
)
def test_a_response_stream_sends_its_parts_in_order_on_the_outbox(
        reasoning: Reasoning | None, logprobs: bool, deltas: list[str], sent: list[StreamPart]) -> None:
    sink, outbox = Sink(), Outbox("test-outbox")
    stream = ResponseStream(sink, outbox, 0.0, reasoning=reasoning, logprobs=logprobs)
    for delta in deltas:
        stream(TokenEvent(delta, (7,), (LP,) if logprobs else None))
    stream(DONE)
    outbox.close()
    assert sink.sent == sent and sink.threads == {"test-outbox"}


def test_a_response_stream_polls_for_a_cancel_and_ends_a_cancelled_request_empty() -> None:
    sink, outbox = Sink(), Outbox("test-outbox")
    stream = ResponseStream(sink, outbox, 3600.0)  # one response at once, the rest held
    for _ in range(2 * CANCEL_POLL_EVERY):
        stream(TokenEvent("x", (7,)))
    stream(FinishEvent(finish_reason="error", text="", prompt_tokens=1, completion_tokens=0, status=CANCELLED))
    outbox.close()
    assert sink.sent == [StreamPart("x"), "poll", "poll", "cancelled"]
