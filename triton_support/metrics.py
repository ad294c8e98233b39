"""The Prometheus metrics the Triton models export: one catalog, one publishing rule.

Every metric the ``grammar``, ``llm`` and ``postprocessing`` models put on
Triton's metrics endpoint (port 8002, through ``pb_utils.MetricFamily``) is
declared once in :data:`METRICS`; the Grafana dashboard, the
prometheus-adapter rule and the HorizontalPodAutoscaler under ``deploy/k8s``
name metrics from it (a test checks that they name nothing else).

Publishing costs an IPC from the model's stub to the server per value, so the
models never publish per token: they keep cumulative counters and rolling
windows in-process and hand a :class:`Snapshot` to :class:`Publisher` at
most every ``min_interval_s``, and soon after a gauge changes, but never
within :data:`PUBLISH_MIN_GAP_S` of the last publication: the stub's metric
calls hold the GIL while they wait for tritonserver, so a model that
published on every gauge change (each request's start and end) spent 5-9 %
of its time there at 16 streams of the tiny stand-in (``py-spy record --gil``
on the stubs under ``make bench-path``), time its decode loop or step thread
could not run.  Counters go out as increments (their delta since the last
publication), gauges as values.  Latencies are exported summary-style:
``<name>{quantile="0.5"|"0.99"}`` gauges over the values seen since the last
publication, plus ``<name>_sum`` / ``<name>_count`` counters (rate(sum) /
rate(count) is the mean).

This module is pure Python (no Triton import); the models apply the
:class:`Update` s it returns.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final, Literal

from telemetry import PUBLISH_MIN_GAP_S, Labels, Snapshot

__all__ = [
    "METRICS",
    "MetricSpec",
    "MetricsPump",
    "Publisher",
    "TritonMetrics",
    "Update",
    "metric_names",
]

_log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family.

    Attributes
    ----------
    name : str
        Prometheus name.
    kind : {"counter", "gauge"}
    help : str
    model : str
        The Triton model that exports it.
    labels : tuple of str
        Label names (values are set per series).
    """

    name: str
    kind: Kind
    help: str
    model: str
    labels: tuple[str, ...] = ()


def _latency(name: str, help_text: str, model: str) -> tuple[MetricSpec, ...]:
    return (
        MetricSpec(name, "gauge", f"{help_text}: quantiles since the last publication (seconds)", model, ("quantile",)),
        MetricSpec(f"{name}_sum", "counter", f"{help_text}: total seconds", model),
        MetricSpec(f"{name}_count", "counter", f"{help_text}: observations", model),
    )


def _by_backend(name: str, kind: Kind, help_text: str) -> MetricSpec:
    """A grammar-model metric of one compile cache: labelled with its ``backend``."""
    return MetricSpec(name, kind, help_text, "grammar", ("backend",))


METRICS: Final[tuple[MetricSpec, ...]] = (
    # grammar model
    MetricSpec("grammar_active_sequences", "gauge", "Sequences holding a matcher now", "grammar"),
    # The compile caches, one per grammar backend (backend: xgrammar | llguidance, contract.BACKENDS).
    _by_backend("grammar_cache_bytes", "gauge", "Bytes of compiled grammars in the compile cache"),
    _by_backend("grammar_cache_entries", "gauge", "Compiled grammars in the compile cache"),
    _by_backend("grammar_compiles_in_flight", "gauge", "Compiles running or queued now"),
    _by_backend("grammar_cache_hits_total", "counter", "Starts served from the compile cache"),
    _by_backend("grammar_cache_misses_total", "counter", "Starts that needed a compile (or the store)"),
    _by_backend("grammar_cache_evictions_total", "counter", "Compiled grammars evicted by the byte bound"),
    _by_backend("grammar_compiles_total", "counter", "Compiles finished (successful or not)"),
    _by_backend("grammar_compile_failures_total", "counter", "Compiles that failed (bad constraint, limits)"),
    _by_backend("grammar_compile_timeouts_total", "counter", "Starts that gave up waiting for a compile"),
    _by_backend("grammar_compile_seconds_total", "counter", "Seconds spent compiling"),
    # The on-disk store of xgrammar's compiled grammars (grammar_service.cache.GrammarStore).
    MetricSpec("grammar_store_hits_total", "counter", "Misses served from the on-disk grammar store", "grammar"),
    MetricSpec("grammar_store_bytes", "gauge",
               "Bytes of the on-disk grammar store's files (this replica's last count of a shared folder)", "grammar"),
    MetricSpec("grammar_store_evictions_total", "counter",
               "Store files this replica removed to keep the store within its bound", "grammar"),
    MetricSpec("grammar_store_write_failures_total", "counter",
               "Store writes that failed (op: save, touch, remove; reason: errno name such as ENOSPC or EROFS); "
               "the request was served", "grammar", ("op", "reason")),
    MetricSpec("grammar_store_read_failures_total", "counter",
               "Store reads that failed (reason: corrupt, stale or an errno name); a miss, compiled again",
               "grammar", ("reason",)),
    MetricSpec("grammar_starts_total", "counter", "Sequences started, by the grammar backend that serves them",
               "grammar", ("backend",)),
    MetricSpec("grammar_backend_fallbacks_total", "counter",
               "backend auto: starts the first backend refused or did not compile in time", "grammar"),
    MetricSpec("grammar_auto_switches_total", "counter",
               "backend auto: first outputs of JSON constraints llguidance served, replayed on xgrammar (outcome: "
               "switched to xgrammar's cheaper fill, slower, keywords, refused, compile_failed, busy, error)",
               "grammar", ("outcome",)),
    MetricSpec("grammar_value_retries_total", "counter",
               "Completed values that broke the schema and were dropped to be generated again", "grammar"),
    MetricSpec("grammar_value_unfixed_total", "counter",
               "Completed values that broke the schema with no choice left to retry (post-validation flags them)",
               "grammar"),
    *_latency("grammar_step_seconds", "Grammar step per batch (accept tokens + fill the masks)", "grammar"),
    # llm model
    MetricSpec("llm_live_requests", "gauge", "Requests not finished now (compiling, waiting or decoding)", "llm"),
    MetricSpec("llm_batch_size", "gauge", "Sequences in the decode batch now", "llm"),
    MetricSpec("llm_waiting_requests", "gauge", "Requests compiling or waiting for a batch slot now", "llm"),
    MetricSpec("llm_constrained_sequences", "gauge", "Constrained sequences in the decode batch now", "llm"),
    MetricSpec("llm_steps_total", "counter", "Decode steps run", "llm"),
    MetricSpec("llm_draft_tokens_total", "counter", "Prompt-lookup draft tokens fed to the forward (speculation)",
               "llm"),
    MetricSpec("llm_draft_tokens_kept_total", "counter",
               "Prompt-lookup draft tokens kept: output tokens without a forward of their own", "llm"),
    *_latency("llm_step_seconds", "Decode step (forward + mask wait)", "llm"),
    *_latency("llm_grammar_roundtrip_seconds", "Grammar request per step (round trip over the grammar channel)",
              "llm"),
    *_latency("llm_mask_wait_seconds", "Part of the grammar round trip not hidden behind the forward", "llm"),
    *_latency("llm_grammar_loop_seconds",
              "Decode loop's own time per step on the grammar work (request, mask wait, reading, masking)", "llm"),
    # postprocessing model
    MetricSpec("constrained_llm_outputs_total", "counter", "Finished outputs by finish reason and constraint kind",
               "postprocessing", ("finish_reason", "kind")),
    MetricSpec("constrained_llm_closed_outputs_total", "counter", "Outputs closed early by the grammar side",
               "postprocessing", ("close_reason", "kind")),
    MetricSpec("constrained_llm_postvalidation_failures_total", "counter",
               "JSON outputs that ended cleanly but fail to parse or validate against the schema",
               "postprocessing", ("kind",)),
)


def metric_names(model: str | None = None) -> tuple[str, ...]:
    """The names of :data:`METRICS` (of one model's, when given)."""
    return tuple(m.name for m in METRICS if model is None or m.model == model)


@dataclass(frozen=True)
class Update:
    """One value to put on the endpoint: ``set`` a gauge or ``increment`` a counter."""

    name: str
    labels: Labels
    op: Literal["set", "increment"]
    value: float


class Publisher:
    """Turns snapshots into the updates that make the endpoint match them.

    Parameters
    ----------
    specs : iterable of MetricSpec
        The metrics this publisher may update (a snapshot naming another
        metric, or a label set that does not match, is a bug: ``ValueError``).
    """

    def __init__(self, specs: Iterable[MetricSpec]) -> None:
        self.specs: dict[str, MetricSpec] = {s.name: s for s in specs}
        self._published: dict[tuple[str, Labels], float] = {}

    def updates(self, snapshot: Snapshot) -> list[Update]:
        """The updates since the previous call (gauges that changed, counters that grew)."""
        out: list[Update] = []
        for (name, labels), value in snapshot.values.items():
            spec = self.specs.get(name)
            if spec is None:
                raise ValueError(f"metric {name!r} is not in this publisher's catalog")
            if tuple(k for k, _ in labels) != tuple(sorted(spec.labels)):
                raise ValueError(f"metric {name!r} takes labels {spec.labels}, got {dict(labels)}")
            before = self._published.get((name, labels))
            if spec.kind == "gauge":
                if before != value:
                    out.append(Update(name, labels, "set", value))
            else:
                delta = value - (before or 0.0)
                if delta < 0:
                    raise ValueError(f"counter {name!r} went down ({before} -> {value})")
                if delta > 0:
                    out.append(Update(name, labels, "increment", delta))
            self._published[(name, labels)] = value
        return out


class TritonMetrics:
    """One model's metric families on Triton's endpoint, fed with snapshots.

    Parameters
    ----------
    pb_utils : module
        ``triton_python_backend_utils`` (passed in: only importable inside the stub).
    model : str
        The model whose :data:`METRICS` to create.
    min_interval_s : float
        :meth:`publish` without ``force`` does nothing more often than this.
    clock : callable
        Monotonic clock.

    Notes
    -----
    Thread-safe.  :meth:`close` must run in ``finalize``: metrics before their
    families, while the stub still runs (the stub segfaulted when interpreter
    teardown freed them).
    """

    def __init__(self, pb_utils: ModuleType, model: str, min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        specs = [m for m in METRICS if m.model == model]
        if not specs:
            raise ValueError(f"no metrics are declared for model {model!r}")
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        self._families: dict[str, Any] = {s.name: pb_utils.MetricFamily(s.name, s.help, kinds[s.kind]) for s in specs}
        # Unlabelled series exist from the start (0), so rate() and absent() work before any traffic.
        self._series: dict[tuple[str, Labels], Any] = {
            (s.name, ()): self._families[s.name].Metric(labels={}) for s in specs if not s.labels}
        self._publisher = Publisher(specs)
        self._lock = threading.Lock()
        self._interval = min_interval_s
        self._clock = clock
        self._last = -math.inf

    def due(self) -> bool:
        """Whether ``min_interval_s`` has passed since the last publication."""
        return self._clock() - self._last >= self._interval

    def publish(self, snapshot: Snapshot | Callable[[], Snapshot], *, force: bool = False) -> None:
        """Put the snapshot's changes on the endpoint (when due, or always with ``force``).

        Pass the function that takes the snapshot where several threads
        publish (the grammar model's start threads and step channel): it is
        called under this object's lock, so snapshots reach the endpoint in
        the order they were taken and a counter never seems to go down.
        """
        with self._lock:
            if not force and not self.due():
                return
            self._last = self._clock()
            snap = snapshot() if callable(snapshot) else snapshot
            for u in self._publisher.updates(snap):
                series = self._series.get((u.name, u.labels))
                if series is None:
                    series = self._families[u.name].Metric(labels=dict(u.labels))
                    self._series[(u.name, u.labels)] = series
                if u.op == "set":
                    series.set(u.value)
                else:
                    series.increment(u.value)

    def close(self) -> None:
        """Free every series, then the families."""
        with self._lock:
            self._series.clear()
            self._families.clear()


class MetricsPump:
    """Publishes one model's snapshots from a thread of its own: soon after a change, and every interval.

    For a model with no loop of its own (the ``grammar`` model serves its
    channel and BLS requests on several threads): :meth:`changed` costs an
    event set, and the publication (a snapshot and its IPC with
    tritonserver) runs here, at most once per :data:`PUBLISH_MIN_GAP_S`,
    so a burst of starts and ends is one publication.

    Parameters
    ----------
    metrics : TritonMetrics
        Where the snapshots go.
    snapshot : callable
        Takes a snapshot (called on this thread; it must be thread-safe).
    interval_s : float
        Longest time between two publications (latency windows and counters
        that moved without a gauge).
    min_gap_s : float
        Shortest time between two publications.
    """

    def __init__(self, metrics: TritonMetrics, snapshot: Callable[[], Snapshot], interval_s: float = 1.0,
                 min_gap_s: float = PUBLISH_MIN_GAP_S) -> None:
        self._metrics = metrics
        self._snapshot = snapshot
        self._interval = interval_s
        self._gap = min_gap_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-pump", daemon=True)
        self._thread.start()

    def changed(self) -> None:
        """A gauge may have moved: publish within ``min_gap_s``."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._metrics.publish(self._snapshot, force=True)
            except Exception:  # noqa: BLE001 -- metrics must never stop serving; logged, the next one retries
                _log.exception("publishing metrics failed")
            self._stop.wait(self._gap)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (no publication after this returns)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
