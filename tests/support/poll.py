"""Event-based waits and counter reads for tests against a live server.

A deadline here only bounds a hang: it is generous (many times what the
event takes on a loaded 2-core machine), so a slow machine never fails a test
that a broken server would.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from client import Client, Constraint
from deploy.drain import scrape
from deploy.server import TritonServer
from tests.integration.served import grammar_active, metric

#: Outputs that reached postprocessing, whatever their finish reason (a cancelled request never does).
OUTPUTS = "constrained_llm_outputs_total"
#: A regex SmolLM2-135M cannot finish within 1,000 tokens: no token of its vocabulary holds both a
#: letter and a newline, so 600 "letter, newline" pairs take 1,200 tokens.  Use it with
#: on_repeat "continue" (a loop on one letter is not closed either): only a cancel ends it early.
NEVER_ENDS = r"([a-z]\n){600}"


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    """Poll ``condition`` until it holds; the seconds it took.

    Raises
    ------
    TimeoutError
        When it does not hold within ``timeout_s`` (the message names ``what``).
    """
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)
    return time.monotonic() - start


def counter_sum(metrics_url: str, name: str) -> float:
    """The sum of every series of ``name`` (all label sets) on a Prometheus endpoint; 0 when none is exported."""
    return sum(v for (n, _), v in scrape(metrics_url).items() if n == name)


def sequences_freed(server: TritonServer) -> bool:
    """No sequence left: the grammar model's own count and both per-sequence gauges read 0."""
    return (grammar_active(server), metric(server, "grammar_active_sequences"),
            metric(server, "llm_live_requests")) == (0, 0.0, 0.0)


def assert_cancelled(server: TritonServer, outputs_before: float) -> None:
    """A departed request was cancelled inside the server, not decoded to its end.

    ``outputs_before`` is :data:`OUTPUTS` read before the request started.  Once
    every sequence is freed, one short request runs to its end: the counter
    grows by exactly that one (a request that ended by itself, even at
    max_tokens, was counted before its sequence was freed, so before this one).
    """
    wait_for(lambda: sequences_freed(server), 120, "sequences freed after the client left")
    with Client(server.grpc_url) as sdk:
        assert sdk.generate("Pick one.", constraint=Constraint.choice(["yes", "no"]), max_tokens=5).complete
    assert counter_sum(server.metrics_url, OUTPUTS) == outputs_before + 1
