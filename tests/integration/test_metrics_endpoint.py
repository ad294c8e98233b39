"""The grammar, llm and postprocessing metrics on Triton's endpoint move with the load and return to idle.

Eight requests whose regex cannot be finished in their budget (so all eight run
to ``max_tokens`` together) are held live while the gauges are read: they
must show the eight of now, not a high-water mark or the state at the last
finish; afterwards every gauge reads its idle value and the counters have
grown by exactly what ran.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from client import Client, Constraint
from deploy.drain import Series, drain, scrape, value
from deploy.server import TritonServer
from telemetry import QUANTILES
from tests.support.poll import HANG_S, poll
from triton_support.metrics import METRICS, metric_names

pytestmark = [pytest.mark.triton, pytest.mark.e2e]


def scrape_until(server: TritonServer, check: Callable[[Series], bool], timeout_s: float = HANG_S) -> Series:
    """The metrics once ``check`` accepts them, or as they are after ``timeout_s``."""
    return poll(lambda: scrape(server.metrics_url), check, timeout_s, interval_s=0.1)


GAUGES = ("llm_live_requests", "llm_batch_size", "llm_waiting_requests", "llm_constrained_sequences",
          "grammar_active_sequences")


def idle(series: Series) -> bool:
    """Every gauge at 0, and the step counter and step histogram agree: they are separate updates (an
    IPC each), and scrapes between them saw 65 steps with 64 timings, and 2 steps ahead at idle."""
    return all(value(series, g) == 0 for g in GAUGES) and (
        value(series, "llm_steps_total") == value(series, "llm_step_seconds_count"))


def test_metrics_move_with_the_load_and_return_to_idle(server: TritonServer) -> None:
    with Client(server.grpc_url) as c:  # warm: compile once, every model has published
        c.generate("Hi.", constraint=Constraint.regex("[a-z]{2}"), max_tokens=8, require_complete=False)
    before = scrape_until(server, idle)
    assert [g for g in GAUGES if value(before, g) != 0] == []

    never_done = Constraint.regex("[a-z]{300}").with_policies(on_budget="truncate")
    first = threading.Barrier(9)
    release = threading.Event()
    results: list[Any] = []

    def run(i: int) -> None:
        with Client(server.grpc_url) as c:
            stream = c.stream(f"Letters {i}:", constraint=never_done, max_tokens=64, require_complete=False)
            for n, chunk in enumerate(stream):
                if n == 0:
                    first.wait(HANG_S)
                    release.wait(HANG_S)
                del chunk
            results.append(stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    first.wait(HANG_S)  # every stream has its first token: all eight are live
    # One publication is several updates (an IPC each): wait until a scrape sees all of them.  The eight
    # stay live for 63 more steps each, and a moved gauge is published at the first step boundary
    # PUBLISH_MIN_GAP_S (0.25 s) after the last publication: a few steps here, fewer on a slower machine.
    live_gauges = ("llm_live_requests", "llm_batch_size", "llm_constrained_sequences", "grammar_active_sequences")
    during = scrape_until(server, lambda s: all(value(s, g) == 8 for g in live_gauges))
    release.set()
    for t in threads:
        t.join(HANG_S)
    assert [value(during, g) for g in live_gauges] == [8, 8, 8, 8]
    assert value(during, "llm_waiting_requests") == 0
    assert len(results) == 8

    after = scrape_until(server, idle)
    assert {g: value(after, g) for g in GAUGES} == dict.fromkeys(GAUGES, 0.0)
    grew = {name: value(after, name) - value(before, name) for name in (
        "llm_steps_total", "llm_step_seconds_count", "grammar_step_seconds_count")}
    # The compile caches are counted per backend: a regex goes to xgrammar first (backend auto).
    cache = {(name, b): value(after, name, backend=b) - value(before, name, backend=b)
             for name in ("grammar_cache_hits_total", "grammar_cache_misses_total") for b in ("xgrammar", "llguidance")}
    assert cache == {("grammar_cache_hits_total", "xgrammar"): 7, ("grammar_cache_misses_total", "xgrammar"): 1,
                     ("grammar_cache_hits_total", "llguidance"): 0, ("grammar_cache_misses_total", "llguidance"): 0}
    assert grew["llm_steps_total"] == grew["llm_step_seconds_count"] >= 64
    assert grew["grammar_step_seconds_count"] >= 64
    assert value(after, "constrained_llm_outputs_total", finish_reason="length", kind="regex") - value(
        before, "constrained_llm_outputs_total", finish_reason="length", kind="regex") == 8
    for q in QUANTILES:
        assert value(after, "llm_grammar_roundtrip_seconds", quantile=q) > 0
        assert value(after, "grammar_step_seconds", quantile=q) > 0
    # Every unlabelled metric of the catalog is on the endpoint (from 0), and the labelled
    # ones this run touched.
    exported = {name for name, _ in after}
    labelled = {s.name for s in METRICS if s.labels} - {"llm_grammar_roundtrip_seconds", "grammar_step_seconds",
                                                        "llm_step_seconds", "llm_mask_wait_seconds",
                                                        "llm_grammar_loop_seconds"}
    assert [n for n in metric_names() if n not in exported and n not in labelled] == []
    # The preStop drain of deploy/k8s returns at once on an idle server.
    assert drain(server.metrics_url, settle_s=0, timeout_s=HANG_S, log=lambda _: None) == 0
