"""triton_support.metrics: the catalog, the publishing rule, the latency windows; and the scheduler's snapshots."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from telemetry import PUBLISH_MIN_GAP_S, QUANTILES, LatencyWindow, Snapshot
from tests.support.poll import HANG_S, wait_for
from triton_support.metrics import METRICS, MetricsPump, Publisher, TritonMetrics, Update, metric_names

REPO = Path(__file__).resolve().parents[2]
XGR = (("backend", "xgrammar"),)


def test_catalog_names_are_unique_and_prometheus_shaped() -> None:
    names = metric_names()
    assert len(names) == len(set(names))
    for spec in METRICS:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", spec.name), spec.name
        assert spec.model in ("grammar", "llm", "postprocessing")
        assert spec.name.endswith(("_total", "_sum", "_count")) == (spec.kind == "counter"), spec.name


def test_every_model_that_exports_metrics_builds_them_from_the_catalog() -> None:
    for model in ("grammar", "llm", "postprocessing"):
        source = (REPO / "model_repository" / model / "1" / "model.py").read_text()
        assert f'TritonMetrics(pb_utils, "{model}")' in source
        assert "MetricFamily(" not in source, f"{model} declares a metric outside triton_support.metrics"


@pytest.mark.parametrize(
    ("snapshots", "expected"),
    [
        # gauges: set on change only
        ([{("grammar_active_sequences", ()): 2.0}, {("grammar_active_sequences", ()): 2.0},
          {("grammar_active_sequences", ()): 0.0}],
         [[Update("grammar_active_sequences", (), "set", 2.0)], [], [Update("grammar_active_sequences", (), "set", 0.0)]]),
        # counters: increments by the growth of the cumulative value
        ([{("llm_steps_total", ()): 3.0}, {("llm_steps_total", ()): 3.0},
          {("llm_steps_total", ()): 7.0}],
         [[Update("llm_steps_total", (), "increment", 3.0)], [],
          [Update("llm_steps_total", (), "increment", 4.0)]]),
        # labelled series are independent
        ([{("constrained_llm_outputs_total", (("finish_reason", "stop"), ("kind", "regex"))): 1.0,
           ("constrained_llm_outputs_total", (("finish_reason", "length"), ("kind", "regex"))): 2.0}],
         [[Update("constrained_llm_outputs_total", (("finish_reason", "stop"), ("kind", "regex")), "increment", 1.0),
           Update("constrained_llm_outputs_total", (("finish_reason", "length"), ("kind", "regex")), "increment", 2.0)]]),
    ],
)
def test_publisher_updates(snapshots: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]],
                           expected: list[list[Update]]) -> None:
    pub = Publisher(METRICS)
    assert [pub.updates(Snapshot(dict(s))) for s in snapshots] == expected


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({("no_such_metric", ()): 1.0}, "metric 'no_such_metric' is not in this publisher's catalog"),
        ({("constrained_llm_outputs_total", (("kind", "regex"),)): 1.0}, "takes labels"),
    ],
)
def test_publisher_refuses_what_the_catalog_does_not_declare(values: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                                                             message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Publisher(METRICS).updates(Snapshot(values))


def test_a_counter_never_goes_down() -> None:
    pub = Publisher(METRICS)
    pub.updates(Snapshot({("llm_steps_total", ()): 5.0}))
    with pytest.raises(ValueError, match=r"counter 'llm_steps_total' went down \(5.0 -> 4.0\)"):
        pub.updates(Snapshot({("llm_steps_total", ()): 4.0}))


class _Family:
    """``pb_utils.MetricFamily`` as TritonMetrics uses it: series that record what was set or added."""

    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str]) -> _Series:
        return _Series()


class _Series:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value += value


class _Pb:
    MetricFamily = _Family


def test_snapshots_taken_on_several_threads_reach_the_endpoint_in_order() -> None:
    """The grammar model publishes from its start threads and its channel: the snapshot is taken under
    the publisher's lock, so a later count is never published before an earlier one (which raised)."""
    metrics = TritonMetrics(_Pb, "grammar")  # type: ignore[arg-type]
    count = [0]
    lock = threading.Lock()

    def snapshot() -> Snapshot:
        with lock:
            count[0] += 1
            return Snapshot({("grammar_compiles_total", XGR): float(count[0])})

    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(300):
                metrics.publish(snapshot, force=True)
        except BaseException as err:  # noqa: BLE001 -- re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[0]
    assert metrics._series[("grammar_compiles_total", XGR)].value == 1200.0
    metrics.close()


def test_snapshot_add_accumulates_per_label_set() -> None:
    snap = Snapshot()
    snap.add("constrained_llm_outputs_total", finish_reason="stop", kind="regex")
    snap.add("constrained_llm_outputs_total", finish_reason="stop", kind="regex")
    snap.add("constrained_llm_outputs_total", kind="regex", finish_reason="length")
    assert snap.values == {
        ("constrained_llm_outputs_total", (("finish_reason", "stop"), ("kind", "regex"))): 2.0,
        ("constrained_llm_outputs_total", (("finish_reason", "length"), ("kind", "regex"))): 1.0,
    }


def test_latency_window_quantiles_reset_per_publication_sums_do_not() -> None:
    w = LatencyWindow(capacity=8)
    assert w.quantiles() is None
    for v in (1.0, 2.0, 3.0, float("nan"), float("inf")):
        w.add(v)
    assert w.quantiles() == pytest.approx((2.0, 2.98))
    assert w.quantiles() is None  # a new window
    for v in range(20):  # more than the ring holds: the newest 8 are kept
        w.add(float(v))
    assert w.quantiles() is not None
    assert (w.count, w.total_s) == (23, 6.0 + sum(range(20)))
    snap = Snapshot()
    snap.put_latency("llm_step_seconds", w)
    assert set(snap.values) == {("llm_step_seconds_sum", ()), ("llm_step_seconds_count", ())}
    w.add(0.5)
    snap.put_latency("llm_step_seconds", w)
    assert {k for k in snap.values if k[0] == "llm_step_seconds"} == {
        ("llm_step_seconds", (("quantile", q),)) for q in QUANTILES}


#: The compile-cache series of triton_support.service.GrammarService.metrics_snapshot, one per backend.
CACHE_SERIES = ("grammar_cache_hits_total", "grammar_cache_misses_total", "grammar_compiles_total",
                "grammar_compile_failures_total", "grammar_compile_timeouts_total", "grammar_cache_evictions_total",
                "grammar_cache_entries", "grammar_cache_bytes", "grammar_compiles_in_flight")


def _by_backend(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], backend: str) -> dict[str, float]:
    return {name: values[(name, (("backend", backend),))] for name in CACHE_SERIES}


def test_cache_metrics_count_every_backend(qwen_tokenizer: Any, qwen_info: Any) -> None:
    """llguidance starts move the llguidance-labelled cache series (they read 0 unlabelled before); xgrammar's stay 0."""
    from grammar_backend.llg import LlgBackend
    from grammar_backend.spec import parse_constraint
    from grammar_service.engine import GrammarEngine, GrammarEngineConfig
    from triton_support.service import GrammarService

    stops = [int(t) for t in qwen_info.stop_token_ids]
    llg = LlgBackend(qwen_tokenizer, 151_936, stops)
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=8), llg=llg)
    try:
        specs = [parse_constraint("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}'),
                 parse_constraint("regex", "[a-z]{3}", {"backend": "llguidance"})]
        sid = 0
        for spec, n in zip(specs, (3, 2), strict=True):  # the JSON one through backend auto: llguidance first
            for _ in range(n):
                sid += 1
                eng.start(sid, spec)
                assert eng.table.get(sid).backend == "llguidance"
        snap = GrammarService(eng).metrics_snapshot().values
        expected_bytes = sum(llg.compile(spec).memory_size_bytes for spec in specs)
        assert _by_backend(snap, "llguidance") == {
            "grammar_cache_hits_total": 3.0, "grammar_cache_misses_total": 2.0, "grammar_compiles_total": 2.0,
            "grammar_compile_failures_total": 0.0, "grammar_compile_timeouts_total": 0.0,
            "grammar_cache_evictions_total": 0.0, "grammar_cache_entries": 2.0,
            "grammar_cache_bytes": float(expected_bytes), "grammar_compiles_in_flight": 0.0}
        assert _by_backend(snap, "xgrammar") == dict.fromkeys(CACHE_SERIES, 0.0)
        assert snap[("grammar_compile_seconds_total", (("backend", "llguidance"),))] > 0
        assert [k for k in snap if k[0] in CACHE_SERIES and not k[1]] == []  # no unlabelled cache series left
        assert Publisher(METRICS).updates(GrammarService(eng).metrics_snapshot())  # the catalog takes them
    finally:
        eng.end(list(range(1, sid + 1)))
        eng.close()


def test_store_metrics_report_a_failing_store(tmp_path: Path, tiny_info: Any) -> None:
    """A store folder replaced by a file: the start is served; the snapshot counts the failed read and write."""
    import shutil

    from grammar_backend.spec import parse_constraint
    from grammar_service.cache import CacheConfig
    from grammar_service.engine import GrammarEngine, GrammarEngineConfig
    from triton_support.service import GrammarService

    root = tmp_path / "store"
    eng = GrammarEngine(tiny_info, "fp", GrammarEngineConfig(max_batch=2, cache=CacheConfig(store_dir=str(root))))
    try:
        shutil.rmtree(root)
        root.write_text("")
        eng.start(1, parse_constraint("regex", "a+"))
        eng.start(2, parse_constraint("regex", "a+"))
        snap = GrammarService(eng).metrics_snapshot().values
        assert {k: v for k, v in snap.items() if k[0].startswith("grammar_store_")} == {
            ("grammar_store_hits_total", ()): 0.0,
            ("grammar_store_bytes", ()): 0.0,
            ("grammar_store_evictions_total", ()): 0.0,
            ("grammar_store_write_failures_total", (("op", "save"), ("reason", "ENOTDIR"))): 1.0,
            ("grammar_store_read_failures_total", (("reason", "ENOTDIR"),)): 1.0,
        }
        assert _by_backend(snap, "xgrammar")["grammar_cache_misses_total"] == 1.0
        assert _by_backend(snap, "xgrammar")["grammar_cache_hits_total"] == 1.0
        assert _by_backend(snap, "xgrammar")["grammar_compile_failures_total"] == 0.0
        Publisher(METRICS).updates(GrammarService(eng).metrics_snapshot())  # labels match the catalog
    finally:
        eng.end([1, 2])
        eng.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_scheduler_snapshots_show_the_present(tmp_path: Path) -> None:
    """While requests run the llm gauges count them; once they finish every gauge reads 0 again."""
    from llm_runtime.engine import TorchEngine, TorchEngineConfig
    from llm_runtime.scheduler import (
        FinishEvent,
        GenerationRequest,
        Scheduler,
        SchedulerConfig,
        TokenEvent,
    )
    from standins.tiny_model import build_tiny_llama
    tiny = build_tiny_llama(tmp_path / "m", num_layers=1)
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=4, max_seq_len=128))
    snaps: list[dict[str, float]] = []
    lock = threading.Lock()

    published: list[float] = []

    def on_metrics(snap: Snapshot) -> None:
        with lock:
            published.append(time.monotonic())
            snaps.append({name: v for (name, labels), v in snap.values.items() if not labels})

    done = threading.Semaphore(0)
    streaming: set[int] = set()
    held = threading.Event()

    def on_event_of(i: int) -> Callable[[TokenEvent | FinishEvent], None]:
        def on_event(event: TokenEvent | FinishEvent) -> None:
            if isinstance(event, FinishEvent):
                done.release()
                return
            streaming.add(i)
            # The three may join in different steps, and a run can end within one publication gap:
            # once all three stream (so the loop is stepping them together), hold the loop thread
            # once until the gap has passed, so that the publication after this step must show them.
            if len(streaming) == 3 and not held.is_set():
                held.set()
                with lock:
                    last = published[-1] if published else -math.inf
                time.sleep(max(0.0, last + PUBLISH_MIN_GAP_S + 0.01 - time.monotonic()))
        return on_event

    class NoGrammar:  # unconstrained requests never reach the provider
        def start(self, *a: object) -> None:
            raise AssertionError("no constraint was sent")

        step = end = start

    def idle_published() -> bool:
        with lock:
            return bool(snaps) and snaps[-1]["llm_live_requests"] == 0

    with Scheduler(engine, NoGrammar(), SchedulerConfig(metrics_interval_s=0.01), on_metrics=on_metrics) as s:  # type: ignore[arg-type]
        t0 = time.perf_counter()
        for i in range(3):
            s.submit(GenerationRequest(engine.tokenizer.encode("hello").ids, max_tokens=40, temperature=1.0, seed=i),
                     on_event_of(i))
        for _ in range(3):
            assert done.acquire(timeout=HANG_S)
        # The loop publishes the idle values right after the last finish (once the gap has passed).
        wait_for(idle_published, HANG_S, "the idle values published", interval_s=0.01)
        ran_s = time.perf_counter() - t0
        summary = s.summary()
    # Equal-work figures: steps at the full batch of 3 free rows, none constrained.
    assert summary["steps_b3_free"] >= 30 and summary["step_s_p50_b3_free"] > 0
    assert "step_s_p50_b3_constrained" not in summary
    # Publications keep the gap (their snapshots take a few microseconds after the loop's clock read).
    assert min(np.diff(published)) >= PUBLISH_MIN_GAP_S - 0.01
    assert max(s["llm_live_requests"] for s in snaps) == 3
    assert max(s["llm_batch_size"] for s in snaps) == 3
    last = snaps[-1]
    assert (last["llm_live_requests"], last["llm_batch_size"], last["llm_waiting_requests"]) == (0, 0, 0)
    assert last["llm_steps_total"] == last["llm_step_seconds_count"] >= 40
    assert 0.0 < last["llm_step_seconds_sum"] <= ran_s  # the steps' own time, within the run's
    # Every other unlabelled series reads exactly 0 once idle: nothing was constrained, so no grammar round trip.
    timed = {"llm_steps_total", "llm_step_seconds_sum", "llm_step_seconds_count"}
    assert {name: v for name, v in last.items() if name not in timed} == {
        "llm_live_requests": 0.0, "llm_batch_size": 0.0, "llm_waiting_requests": 0.0, "llm_constrained_sequences": 0.0,
        "llm_grammar_roundtrip_seconds_sum": 0.0, "llm_grammar_roundtrip_seconds_count": 0.0,
        "llm_mask_wait_seconds_sum": 0.0, "llm_mask_wait_seconds_count": 0.0,
        "llm_grammar_loop_seconds_sum": 0.0, "llm_grammar_loop_seconds_count": 0.0,
        "llm_draft_tokens_total": 0.0, "llm_draft_tokens_kept_total": 0.0,
    }
    # Plain finite floats (no numpy scalars, no nan): JSON gives back exactly what went in.
    assert {type(v) for v in last.values()} == {float}
    assert json.loads(json.dumps(last, allow_nan=False)) == last


def test_the_pump_publishes_a_burst_of_changes_once_and_each_interval() -> None:
    """MetricsPump: changed() costs an event; bursts publish once per gap; with no change, once per interval."""
    metrics = TritonMetrics(_Pb, "grammar")  # type: ignore[arg-type]
    taken: list[float] = []
    published = threading.Semaphore(0)
    publishing, release = threading.Event(), threading.Event()

    def snapshot() -> Snapshot:
        taken.append(time.monotonic())
        if len(taken) == 1:  # the first publication is held until the second burst is in
            publishing.set()
            assert release.wait(HANG_S)
        published.release()
        return Snapshot({("grammar_active_sequences", ()): float(len(taken))})

    pump = MetricsPump(metrics, snapshot, interval_s=HANG_S, min_gap_s=0.2)
    try:
        for _ in range(100):  # a burst of starts and ends
            pump.changed()
        assert publishing.wait(HANG_S)
        # While the first publication runs (whatever of the first burst came after its start included):
        # one more publication after the gap, not a hundred.
        for _ in range(100):
            pump.changed()
        release.set()
        assert published.acquire(timeout=HANG_S)
        assert published.acquire(timeout=HANG_S)
        assert len(taken) == 2 and taken[1] - taken[0] >= 0.2
        assert metrics._series[("grammar_active_sequences", ())].value == 2.0
    finally:
        pump.close()
    assert not pump._thread.is_alive()
    pump.changed()  # after close: no publication
    assert not published.acquire(timeout=0.3) and len(taken) == 2
    metrics.close()


def test_the_pump_publishes_each_interval_without_a_change() -> None:
    metrics = TritonMetrics(_Pb, "grammar")  # type: ignore[arg-type]
    published = threading.Semaphore(0)

    def snapshot() -> Snapshot:
        published.release()
        return Snapshot({("grammar_active_sequences", ()): 0.0})

    pump = MetricsPump(metrics, snapshot, interval_s=0.05, min_gap_s=0.01)
    try:
        for _ in range(3):  # nobody calls changed()
            assert published.acquire(timeout=30)
    finally:
        pump.close()
    metrics.close()

