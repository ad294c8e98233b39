"""Do slow compiles starve other requests?  Inter-token latency of ordinary streams, quiet vs storm.

Usage (from the repository root, after ``make model``)::

    .venv/bin/python bench/compile_storm.py             # ~5 min on 2 shared cores
    .venv/bin/python bench/compile_storm.py --quick     # ~2 min
    .venv/bin/python bench/compile_storm.py --url 127.0.0.1:8001   # against a running server

What it does:

1. Starts its own server (rendered like ``make render``) unless ``--url``.
2. Quiet phase: ``--streams`` threads each stream ``--requests`` ordinary
   requests (one small JSON schema, compiled once at warm-up, greedy,
   ``--max-tokens``).  Records the time of every streamed chunk.
3. Storm phase: the same ordinary requests again, while ``--storm`` threads
   send never-seen slow constraints back to back (each made distinct, so
   none is a cache or negative-cache hit): a 100k-item enum, an object with
   5,000 required properties, a 20,000-fold bounded repetition regex, a
   4,096-entry choice.  Their outcomes are counted by status (most are
   refused at a worker limit, by the bounded compile queue, or time out).
4. Prints inter-token latency (gaps between consecutive chunks of one
   stream) p50/p99 and time to first token p50/p99 for both phases, the
   storm/quiet ratios, the storm's outcomes, and the peak resident memory
   of the ``grammar`` stub and of its compile workers when the server is
   local.

With ``--burst`` it measures the issue's storm instead (issue 49 part 6):
``--heavy`` (10) heavy but legal constraints, each a fresh cache key (a
100k-item enum, 4,096 long choices, ``.{100000}``, a 1.9 MB object of 16,000
described properties, a 0.7 MB ``anyOf`` of 1,500 objects), all sent at
once; one second later ``--streams`` (6) ordinary streams of ``--requests``
requests with the cached schema.  The quiet phase is the same streams
without the burst.  It prints the same table, each heavy request's outcome
and seconds, and a last line ``burst: first requests' TTFT p50 storm/quiet
X, TTFT p99 Y, inter-token p99 storm/quiet Z`` (the first requests are each
stream's first: sent together, one second after the burst).  The server is launched as ``make serve`` runs it
(``python -m deploy``: the gateway in the path).

Nothing here asserts a time; read ratios from one run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import psutil
from e2e_bench import PERSON_SCHEMA, PROMPTS, pct
from harness import MODEL_DIR

from client import Client, ClientError, Constraint, ServerBusy


def slow_constraint(kind: str, n: int) -> Constraint:
    """A never-seen slow constraint of ``kind``; ``n`` makes it distinct."""
    tag = f"storm-{n}"
    if kind == "enum":
        return Constraint.json_schema({"description": tag, "enum": [f"value-{i}" for i in range(100_000)]})
    if kind == "required":
        props = {f"p{i}": {"type": "integer"} for i in range(5_000)}
        return Constraint.json_schema({"description": tag, "type": "object", "properties": props,
                                       "required": list(props)})
    if kind == "regex":
        return Constraint.regex(f"{tag}[a-z]{{1,20000}}")
    return Constraint.choice([f"{tag}-{i:04d}" for i in range(4_096)])


STORM_KINDS: Final = ("enum", "required", "regex", "choice")


def heavy_constraint(kind: str, n: int) -> Constraint:
    """A never-seen heavy but legal constraint of ``kind`` (issue 49 part 6); ``n`` makes it distinct.

    Each is within the request's limits (:data:`contract.MAX_CONSTRAINT_BYTES`,
    the depth limit), so preprocessing accepts it; a compile limit may still
    refuse it (the 1.9 MB object runs past xgrammar's 30 s of CPU and
    llguidance refuses it; llguidance's lexer refuses the enum).
    """
    tag = f"burst-{n}"
    if kind == "enum":  # 1.3 MB
        return Constraint.json_schema({"description": tag, "enum": [f"value-{i}" for i in range(100_000)]})
    if kind == "choices":  # 4,096 choices of 160 characters: 0.7 MB
        return Constraint.choice([f"{tag}-{i:04d}-" + "long choice text " * 9 for i in range(4_096)])
    if kind == "regex":
        return Constraint.regex(f"{tag}.{{100000}}")
    if kind == "wide":  # 16,000 described properties: 1.9 MB
        props = {f"property_{i}": {"type": "string", "description": f"property number {i} of {tag}, "
                                   "a described field of a wide record"} for i in range(16_000)}
        return Constraint.json_schema({"description": tag, "type": "object", "properties": props})
    variants = [{"type": "object", "properties": {f"v{i}_{j}": {"type": "integer", "minimum": j}
                                                  for j in range(12)}, "required": [f"v{i}_0"]}
                for i in range(1_500)]  # 0.7 MB
    return Constraint.json_schema({"description": tag, "anyOf": variants})


HEAVY_KINDS: Final = ("enum", "choices", "regex", "wide", "anyof")
STREAMS_DEFAULT: Final = 4


def ordinary(client: Client, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """One ordinary streamed request: (TTFT, inter-chunk gaps)."""
    t0 = time.perf_counter()
    times: list[float] = []
    for chunk in client.stream(prompt, constraint=Constraint.json_schema(PERSON_SCHEMA), max_tokens=max_tokens,
                               temperature=0.0, require_complete=False):
        if chunk.text:
            times.append(time.perf_counter())
    if not times:
        raise RuntimeError("an ordinary request streamed no text")
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)]


def phase(url: str, streams: int, requests: int, max_tokens: int) -> dict[str, list[float]]:
    """Run ``streams`` threads of ``requests`` ordinary requests; raise on any failure."""
    ttfts: list[float] = []
    firsts: list[float] = []  # each stream's first request: sent together, one second after a --burst
    gaps: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(idx: int) -> None:
        with Client(url) as client:
            for r in range(requests):
                try:
                    ttft, g = ordinary(client, PROMPTS[(idx + r) % len(PROMPTS)], max_tokens)
                except BaseException as err:  # noqa: BLE001 - re-raised below: a failed request fails the run
                    with lock:
                        errors.append(err)
                    return
                with lock:
                    ttfts.append(ttft)
                    if r == 0:
                        firsts.append(ttft)
                    gaps.extend(g)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} ordinary request(s) failed; first: {errors[0]!r}") from errors[0]
    return {"ttft": ttfts, "first_ttft": firsts, "gap": gaps}


def storm(url: str, threads: int, stop: threading.Event, outcomes: Counter[str]) -> list[threading.Thread]:
    """Start ``threads`` senders of slow constraints; they run until ``stop``.

    The constraints are built first (a 1.5 MB schema costs the client about
    0.4 s to check, on the same cores as the server), and a sender refused
    with RESOURCE_EXHAUSTED backs off for 5 s, as a client should: the storm
    is a steady load of about ``threads`` slow compiles in flight, not a
    parse flood (every refused 1.5 MB request still costs the server about
    0.8 s of parsing in preprocessing and grammar).
    """
    pending = [slow_constraint(STORM_KINDS[n % len(STORM_KINDS)], n) for n in range(threads * 8)]
    order = itertools.count()
    lock = threading.Lock()

    def run() -> None:
        with Client(url, timeout_s=600) as client:
            while not stop.is_set():
                n = next(order)
                if n >= len(pending):
                    return
                kind = STORM_KINDS[n % len(STORM_KINDS)]
                try:
                    client.generate("x", constraint=pending[n], max_tokens=1, require_complete=False)
                    status = "OK"
                except ServerBusy as err:
                    status = err.status or type(err).__name__
                    stop.wait(5.0)
                except ClientError as err:
                    status = err.status or type(err).__name__
                with lock:
                    outcomes[f"{kind}:{status}"] += 1

    started = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for t in started:
        t.start()
    return started


def burst(url: str, count: int, results: list[tuple[str, str, float]]) -> list[threading.Thread]:
    """Send ``count`` heavy constraints at once, one thread each; each appends (kind, status, seconds).

    The constraints are built before any is sent (a 1.9 MB schema costs the
    client a second to check), so they arrive together.
    """
    pending = [(HEAVY_KINDS[n % len(HEAVY_KINDS)], heavy_constraint(HEAVY_KINDS[n % len(HEAVY_KINDS)], n))
               for n in range(count)]
    lock = threading.Lock()
    go = threading.Barrier(count)

    def run(kind: str, constraint: Constraint) -> None:
        with Client(url, timeout_s=600) as client:
            go.wait()
            t0 = time.perf_counter()
            try:
                client.generate("x", constraint=constraint, max_tokens=4, require_complete=False)
                status = "OK"
            except ClientError as err:
                status = err.status or type(err).__name__
            with lock:
                results.append((kind, status, time.perf_counter() - t0))

    started = [threading.Thread(target=run, args=p, daemon=True) for p in pending]
    for t in started:
        t.start()
    return started


class PeakRss:
    """Samples the resident memory of the grammar stub and its compile workers."""

    def __init__(self) -> None:
        self.peak = {"grammar stub": 0, "compile workers": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            sums = {"grammar stub": 0, "compile workers": 0}
            for proc in psutil.process_iter():
                try:
                    cmd = " ".join(proc.cmdline())
                    rss = int(proc.memory_info().rss) // 1024  # KiB, as the report prints it
                except psutil.NoSuchProcess:
                    continue  # exited since the listing (or a zombie)
                if "triton_python_backend_stub" in cmd and "grammar_0" in cmd:
                    sums["grammar stub"] += rss
                elif "grammar_service.compile_worker" in cmd:
                    sums["compile workers"] += rss
            for key, value in sums.items():
                self.peak[key] = max(self.peak[key], value)


def report(quiet: dict[str, list[float]], loud: dict[str, list[float]], outcomes: Counter[str],
           rss: dict[str, int] | None) -> None:
    def ms(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x * 1e3:.0f} ms"

    print(f"\n{'':24s}{'quiet':>12s}{'storm':>12s}{'storm/quiet':>13s}")
    for name, key, q in (("inter-token p50", "gap", 50), ("inter-token p99", "gap", 99),
                         ("time to first token p50", "ttft", 50), ("time to first token p99", "ttft", 99),
                         ("first requests' TTFT p50", "first_ttft", 50)):
        a, b = pct(quiet[key], q), pct(loud[key], q)
        print(f"{name:24s}{ms(a):>12s}{ms(b):>12s}{b / a:>12.2f}x")
    print(f"samples: {len(quiet['gap'])} / {len(loud['gap'])} gaps, {len(quiet['ttft'])} / {len(loud['ttft'])} requests")
    print("storm outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    if rss is not None:
        print("peak RSS during the storm: " + ", ".join(f"{k} {v / 1024:.0f} MiB" for k, v in rss.items()))
    print(f"inter-token p99 storm/quiet: {pct(loud['gap'], 99) / pct(quiet['gap'], 99):.2f}")


def run_burst(url: str, args: argparse.Namespace, local: bool) -> dict[str, Any]:
    """The issue's storm: ordinary streams one second after a burst of heavy constraints."""
    with Client(url) as client:  # warm-up: compiles the ordinary schema once
        ordinary(client, PROMPTS[0], 4)
    quiet = phase(url, args.streams, args.requests, args.max_tokens)
    print(f"quiet phase done: {len(quiet['ttft'])} requests", flush=True)
    heavy: list[tuple[str, str, float]] = []
    peak = PeakRss() if local else None
    if peak is not None:
        peak.start()
    try:
        senders = burst(url, args.heavy, heavy)
        time.sleep(1.0)
        loud = phase(url, args.streams, args.requests, args.max_tokens)
        print(f"storm phase done: {len(loud['ttft'])} requests; waiting for the heavy requests", flush=True)
        for t in senders:
            t.join(timeout=600)
    finally:
        if peak is not None:
            peak.stop()
    outcomes = Counter(f"{kind}:{status}" for kind, status, _ in heavy)
    report(quiet, loud, outcomes, peak.peak if peak else None)
    print("heavy requests: " + ", ".join(f"{kind} {status} {s:.1f} s" for kind, status, s in sorted(heavy)))
    print(f"burst: first requests' TTFT p50 storm/quiet {pct(loud['first_ttft'], 50) / pct(quiet['first_ttft'], 50):.2f}, "
          f"TTFT p99 {pct(loud['ttft'], 99) / pct(quiet['ttft'], 99):.2f}, "
          f"inter-token p99 storm/quiet {pct(loud['gap'], 99) / pct(quiet['gap'], 99):.2f}")
    return {"quiet": quiet, "storm": loud, "heavy": heavy, "peak_rss_kib": peak.peak if peak else None}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = harness.bench_parser(__doc__, whole_doc=True)
    ap.add_argument("--url", help="a running server's gRPC address (default: start one)")
    ap.add_argument("--streams", type=int, default=STREAMS_DEFAULT, help="ordinary streams (--burst: 6)")
    ap.add_argument("--requests", type=int, default=6, help="ordinary requests per stream and phase")
    ap.add_argument("--storm", type=int, default=10, help="threads sending slow constraints")
    ap.add_argument("--burst", action="store_true",
                    help="the issue's storm: --heavy heavy constraints at once, then the ordinary streams")
    ap.add_argument("--heavy", type=int, default=10, help="heavy constraints of --burst")
    harness.add_max_tokens(ap, 48)
    harness.add_quick(ap, "2 streams x 3 requests (--burst: 2 requests a stream)")
    harness.add_json(ap)
    return ap.parse_args(argv)


def run(url: str, args: argparse.Namespace, local: bool) -> dict[str, Any]:
    with Client(url) as client:  # warm-up: compiles the ordinary schema once
        ordinary(client, PROMPTS[0], 4)
    quiet = phase(url, args.streams, args.requests, args.max_tokens)
    print(f"quiet phase done: {len(quiet['ttft'])} requests", flush=True)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    peak = PeakRss() if local else None
    senders = storm(url, args.storm, stop, outcomes)
    try:
        if peak is not None:
            peak.start()
        time.sleep(3.0)  # let the storm fill the compile workers and queue
        loud = phase(url, args.streams, args.requests, args.max_tokens)
    finally:
        stop.set()
        if peak is not None:
            peak.stop()
    print(f"storm phase done: {len(loud['ttft'])} requests; waiting for the storm senders", flush=True)
    for t in senders:
        t.join(timeout=120)
    report(quiet, loud, outcomes, peak.peak if peak else None)
    return {"quiet": quiet, "storm": loud, "outcomes": dict(outcomes), "peak_rss_kib": peak.peak if peak else None}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    if args.burst and args.streams == STREAMS_DEFAULT:
        args.streams = 6
    if args.quick:
        if args.burst:
            args.requests = 2
        else:
            args.streams, args.requests, args.storm = 2, 3, 6
    measure = run_burst if args.burst else run
    if args.url:
        figures = measure(args.url, args, local=False)
    else:
        with harness.serve(harness.render_values(MODEL_DIR), prefix="compile-storm-", launcher=args.burst) as server:
            figures = measure(server.url, args, local=True)
    if args.json is not None:
        harness.write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
