"""The ``grammar`` model's step at a large batch, BLS included, next to raw xgrammar and the in-process engine.

Usage (from the repository root, after ``make model tokenizers``)::

    .venv/bin/python bench/grammar_step_bench.py                  # ~3 min on 2 shared cores
    .venv/bin/python bench/grammar_step_bench.py --rows 64 --rounds 3 --json /tmp/step.json
    .venv/bin/python bench/grammar_step_bench.py --sweep          # make bench-step: GPU batch sizes
    .venv/bin/python bench/grammar_step_bench.py --fill-states --threads 2   # fill threads, fixed states

Three ways to get the masks of B sequences (default 64) at every step of
real token paths (four schemas: person, order, weather tool, an open object;
row ``r`` follows schema ``r % 4``; Qwen3's 151,936-token vocabulary), in
one run, interleaved by round:

* ``raw``: the backend alone in this process: ``accept_token`` per row, then
  one batched fill (xgrammar's ``BatchGrammarMatcher``, or llguidance's
  ``fill_next_token_bitmask_par`` with ``--backend llguidance``; ``raw
  fill`` is the fill call alone); ``floor``: the same on new matchers, each
  row also looked up by its id, counted and its end checked: the least a
  grammar step written in Python does beside the backend's calls;
* ``local``: :class:`llm_runtime.local_mask.LocalMaskProvider` over
  :class:`grammar_service.engine.GrammarEngine` in this process (what the decode
  loop calls when both live in one process); ``local checked``: the same
  with value checks on (:mod:`grammar_backend.values`, as the embedded
  decode loop starts its sequences: every token scanned, anchored values
  validated as they complete);
* ``bls tensor`` and ``channel``: the served ``grammar`` model (rendered with the Qwen3 tokenizer,
  ``MAX_BATCH`` = B), called by a bench-only Triton model
  (``bench/triton/grammar_driver``) through the same
  :class:`llm_runtime.remote_mask.RemoteMaskProvider` the ``llm`` model uses: the
  round trip the decode loop waits on; ``bls tensor``: each step over BLS,
  the masks back as a BLS output tensor; ``channel``: each step over the
  grammar channel (:mod:`grammar_service.transport.channel`) with the masks in the
  caller's shared-memory buffer (:mod:`grammar_service.transport.maskbuf`), what the
  ``llm`` model uses; ``arrival``: the same channel steps from the send to the
  reply's arrival (the kernel's receive stamp), what the ``llm`` model's decode
  loop waits on when it reads the answer after its forward (the channel's
  figure adds the blocked driver thread's wake-up and the answer's decoding).

Every figure is per step (all B rows).  The ratios ``bls / raw fill`` and
``bls / local`` are the cost of the engine's bookkeeping and of the separate
model.  ``--threads`` is the fill's thread count (``GRAMMAR_FILL_THREADS``
of the served model, the engine's and the raw backend's); ``--backend
auto`` serves as the server's default does, its raw fill on the backend
``auto`` picks first for JSON.

``--sweep`` measures what a GPU host's batch meets: 64 and 256 rows, each
backend and ``auto`` (settled: each case's first complete output replayed on
xgrammar first, :mod:`grammar_service.auto_switch`), 1 and ``--threads`` fill
threads, the served step over
the channel beside the raw fill (one served ``grammar`` model per row count
and thread count), p50, p99 and max, and ends with the line ``step at 64
rows: channel/raw fill X (xgrammar), Y (llguidance), step by step (...); p99
A ms (auto)``, the parenthesis holding the same ratios for the reply's
arrival, the raw step (the backend's part of any grammar step) and the
floor; ``--plot PATH`` draws each mode over the raw fill as a PNG.
Nothing here asserts a time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import numpy as np
import tritonclient.grpc as grpcclient
import xgrammar as xgr
from harness import BENCH, OWN_SCHEMAS, QWEN_DIR, QWEN_VOCAB

from deploy.drain import scrape, value
from deploy.server import TritonServer
from grammar_backend.backends import auto_order
from grammar_backend.compile import json_format_kwargs
from grammar_backend.llg import LlgBackend
from grammar_backend.spec import ConstraintOptions, ConstraintSpec, parse_constraint
from grammar_backend.tokenizer import load_tokenizer
from grammar_service.auto_switch import OUTCOMES
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from grammar_service.llg_spread import TemplateSpread
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest

#: (schema, a valid output): the token path each row follows.
CASES: Final[tuple[tuple[str, str], ...]] = (
    ("person", '{"name":"Ada King Lovelace","age":36,"email":"augusta.ada.king.lovelace@analytical-engine.example.org"}'),
    ("order", ('{"id":"ABC-1234","items":[{"sku":"pen-blue","qty":3},{"sku":"ink","qty":1}],'
               '"status":"paid","express":true}')),
    ("tool_weather", '{"city":"Santa Cruz de la Sierra, Bolivia, near the airport","unit":"celsius"}'),
    ("open_object", '{"a":7,"note":"kept open","tags":[1,2],"extra":{"k":true}}'),
)


def constraints(backend: str) -> list[tuple[str, str, str]]:
    options = json.dumps({"backend": backend})
    return [("json_schema", (OWN_SCHEMAS / f"{name}.json").read_text(), options) for name, _ in CASES]


def paths(encode: Any) -> list[list[int]]:
    """Each case's output as Qwen3 tokens, cut to the shortest (every row steps the same number of times)."""
    ids = [list(encode(text)) for _, text in CASES]
    n = min(len(p) for p in ids)
    return [p[:n] for p in ids]


def raw_backend(cons: list[tuple[str, str, str]]) -> str:
    """The backend the rows' raw fill runs on: theirs, or the one ``auto`` serves them with first."""
    backend = json.loads(cons[0][2])["backend"]
    if backend != "auto":
        return str(backend)
    spec: ConstraintSpec = parse_constraint(*cons[0])
    return auto_order(spec)[0]


def xgrammar_grammars(info: xgr.TokenizerInfo, cons: list[tuple[str, str, str]]) -> list[Any]:
    """Each constraint compiled by xgrammar alone, with the engine's default JSON options (compact
    separators, non-strict): the grammars the engine serves."""
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    kwargs: Any = json_format_kwargs(ConstraintOptions())
    return [compiler.compile_json_schema(p, **kwargs) for _, p, _ in cons]


def llguidance_grammars(llg: LlgBackend, cons: list[tuple[str, str, str]], threads: int = 1) -> list[Any]:
    """Each constraint compiled by llguidance, as the engine compiles it for ``threads`` fill threads."""
    return [llg.compile(parse_constraint(k, p, json.dumps({"backend": "llguidance"})), threads) for k, p, _ in cons]


def llguidance_rows(llg: LlgBackend, compiled: list[Any], rows: int) -> tuple[list[Any], list[tuple[Any, int]]]:
    """``rows`` llguidance matchers started as a warm server starts them, and the executor's ``(matcher, row)``
    list grouped by template, as the engine's fill hands it over (``BitmaskBuffer.fill``).

    Warm: rounds of ``rows`` starts (``TemplateSpread``), each let go once the further templates it asked for
    are built, until a round builds none.
    """
    spread = TemplateSpread(llg)

    def starts() -> list[Any]:
        return [spread.matcher(compiled[r % len(compiled)]) for r in range(rows)]

    sizes: list[int] = []
    while sizes != [len(c.templates) for c in compiled]:
        sizes = [len(c.templates) for c in compiled]
        held = starts()
        spread.drain(600)
        del held  # each copy gives its template back
    matchers = starts()
    spread.close()
    targets = sorted(((m.inner, r) for r, m in enumerate(matchers)), key=lambda t: matchers[t[1]].family)
    return [m.inner for m in matchers], targets


#: A backend's rows along the paths: matchers, accept(matcher, token), ended(matcher), the batched fill.
RawRows = tuple[list[Any], Callable[[Any, int], bool], Callable[[Any], bool], Callable[[], object]]


def time_raw(info: xgr.TokenizerInfo, llg: LlgBackend | None, cons: list[tuple[str, str, str]],
             toks: list[list[int]], rows: int, threads: int = 1, floor: bool = False) -> dict[str, list[float]]:
    """The backend alone along the paths: ``raw fill`` (the fill call) and ``raw`` (each row's accept, then the
    fill); with ``floor``, also ``floor``: the same on new matchers with the least a grammar step in Python
    keeps beside them (:func:`_time_path`)."""
    if llg is not None:
        compiled = llguidance_grammars(llg, cons, threads)

        def make() -> RawRows:
            import llguidance
            import llguidance.numpy

            matchers, targets = llguidance_rows(llg, compiled, rows)
            executor = llguidance.LLExecutor(threads)
            bitmask = llguidance.numpy.allocate_token_bitmask(rows, QWEN_VOCAB)
            return (matchers, lambda m, t: bool(m.consume_token(t)), lambda m: bool(m.is_stopped()),
                    lambda: llguidance.numpy.fill_next_token_bitmask_par(executor, targets, bitmask))
    else:
        compiled = xgrammar_grammars(info, cons)

        def make() -> RawRows:
            matchers = [xgr.GrammarMatcher(compiled[r % len(compiled)]) for r in range(rows)]
            batch = xgr.BatchGrammarMatcher(threads)
            bitmask = xgr.allocate_token_bitmask(rows, info.vocab_size)
            return (matchers, lambda m, t: bool(m.accept_token(t)), lambda m: bool(m.is_terminated()),
                    lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask))

    times = _time_path(*make(), toks)
    if floor:
        times["floor"] = _time_path(*make(), toks, floor=True)["raw"]
    return times


def _time_path(matchers: list[Any], accept: Callable[[Any, int], bool], ended: Callable[[Any], bool],
               fill: Callable[[], object], toks: list[list[int]], floor: bool = False) -> dict[str, list[float]]:
    """Step every row along its token path: accept one token per row, then one batched fill; both timed.

    ``floor``: each row is also what any grammar step in Python keeps of a sequence at least: looked up by its
    id in a table, its tokens counted, its end checked (``ended``).  The engine's policies (closing, value
    checks, an error per row) and its transport come on top of that.
    """
    fills: list[float] = []
    steps: list[float] = []
    table = {r + 1: [m, 0] for r, m in enumerate(matchers)} if floor else {}
    ids = list(table)
    for i in range(len(toks[0]) + 1):
        t0 = time.perf_counter()
        if floor:
            for r, seq in enumerate(ids):
                row = table[seq]
                if i:
                    if not accept(row[0], toks[r % len(toks)][i - 1]):
                        raise RuntimeError(f"floor: row {r} rejected its token at step {i}")
                    row[1] += 1
                if ended(row[0]) and i < len(toks[0]):
                    raise RuntimeError(f"floor: row {r} ended before its path did, at step {i}")
        elif i:
            for r, m in enumerate(matchers):
                if not accept(m, toks[r % len(toks)][i - 1]):
                    raise RuntimeError(f"raw: row {r} rejected its token at step {i}")
        t1 = time.perf_counter()
        fill()
        t2 = time.perf_counter()
        fills.append(t2 - t1)
        steps.append(t2 - t0)
    return {"raw fill": fills, "raw": steps}


def host_parallelism(threads: int, repeats: int = 7) -> float:
    """What this host gives a second thread: the time of ``threads`` SHA-256 passes over 16 MB run on ``threads``
    Python threads (hashlib releases the GIL) over the same passes on one, median of ``repeats``.

    ``1 / threads`` where the cores are real and idle: the floor the fill-thread ratios are read against.  This
    2-vCPU host gives 0.53-0.55 for two threads when quiet and about 1.0 beside a running test, so a fill
    ratio is only read where this line is near its floor in the same run.
    """
    data = bytes(16 << 20)

    def work() -> None:
        hashlib.sha256(data).digest()

    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(threads):
            work()
        one = time.perf_counter() - t0
        pool = [threading.Thread(target=work) for _ in range(threads - 1)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        work()
        for t in pool:
            t.join()
        ratios.append((time.perf_counter() - t0) / one)
    return float(np.median(ratios))


def beside_python(fill: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """The median ms of ``fill`` alone, of a pure-Python loop of about its length alone, and of the two at once
    (``fill`` on a second thread, the loop on this one, as the step thread's per-row work would run beside it).

    Both at once near the sum: the fill holds the GIL, and no per-row Python can run beside it in this
    process; near the longer of the two: it lets go, and the step could overlap the two.
    """

    def timed(work: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
        return float(np.median(times) * 1e3)

    def spin(n: int) -> None:
        total = 0
        for i in range(n):
            total += i

    fill_ms = timed(fill)
    loop = max(1, int(fill_ms / timed(functools.partial(spin, 10_000)) * 10_000))
    go, started, done, stop = threading.Event(), threading.Event(), threading.Event(), False

    def worker() -> None:
        while True:
            go.wait()
            go.clear()
            if stop:
                return
            started.set()
            fill()
            done.set()

    def both() -> None:
        go.set()
        started.wait()
        started.clear()
        spin(loop)
        done.wait()
        done.clear()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        both_ms = timed(both)
    finally:
        stop = True
        go.set()
        thread.join()
    return fill_ms, timed(functools.partial(spin, loop)), both_ms


def fill_states(info: xgr.TokenizerInfo, llg: LlgBackend, toks: list[list[int]], rows: int, threads: int,
                states: Sequence[int] = (2, 10, 14), repeats: int = 30) -> dict[tuple[str, int, int], float]:
    """``--fill-states``: the raw batched fill alone, every row held at step ``s`` of its path, on 1 and
    ``threads`` fill threads; the median ms of ``repeats`` fills of the same states, the thread counts taken
    fill by fill in turn (what the threads do with cheap and with costly rows, apart from the path's mix).
    At the middle state, the one-thread fill
    beside a Python loop on this thread (:func:`beside_python`; ``-2`` in the keys: both at once over the
    sum of the two apart, 1.0 where the fill holds the GIL).  Then the in-process engine's step along
    the whole paths, value checks on, on 1 and ``threads`` fill threads (``-1`` in the keys: ms a path),
    and pipelined on 1 (``-3``)."""
    import llguidance
    import llguidance.numpy

    cons = constraints("xgrammar")
    xgrammars = xgrammar_grammars(info, cons)
    bitmask = llguidance.numpy.allocate_token_bitmask(rows, QWEN_VOCAB)
    out: dict[tuple[str, int, int], float] = {}
    beside: dict[str, tuple[float, float, float]] = {}
    counts = sorted({1, threads})
    for state in states:
        xms = [xgr.GrammarMatcher(xgrammars[r % len(cons)]) for r in range(rows)]
        for r in range(rows):
            for t in toks[r % len(toks)][:state]:
                if not xms[r].accept_token(t):
                    raise RuntimeError(f"fill states: row {r} rejected its token")
        fills: dict[str, list[Callable[[], object]]] = {"xgrammar": [], "llguidance": []}
        for n in counts:
            # llguidance's rows as the engine makes them for n fill threads: a template per thread.
            lms, targets = llguidance_rows(llg, llguidance_grammars(llg, cons, n), rows)
            for r in range(rows):
                for t in toks[r % len(toks)][:state]:
                    if not lms[r].consume_token(t):
                        raise RuntimeError(f"fill states: row {r} rejected its token")
            fills["xgrammar"].append(functools.partial(xgr.BatchGrammarMatcher(n).batch_fill_next_token_bitmask,
                                                       xms, bitmask))
            fills["llguidance"].append(functools.partial(llguidance.numpy.fill_next_token_bitmask_par,
                                                         llguidance.LLExecutor(n), targets, bitmask))
        for backend, by_count in fills.items():
            # The thread counts fill by fill in turn: this host's speed drifts within seconds, and two runs of
            # `repeats` fills one after the other gave ratios that moved with it.
            turns: list[list[float]] = [[] for _ in counts]
            for fill in by_count:
                fill()
            for _ in range(repeats):
                for taken, fill in zip(turns, by_count):
                    t0 = time.perf_counter()
                    fill()
                    taken.append(time.perf_counter() - t0)
            for n, taken in zip(counts, turns):
                out[(backend, state, n)] = float(np.median(taken) * 1e3)
            if state == states[len(states) // 2]:
                beside[backend] = beside_python(by_count[0], repeats)
    print(f"== raw fill, {rows} rows held at one step of their paths, median of {repeats} fills taken in turn "
          f"(ms) ==")
    print(f"  host: the same GIL-free work on {threads} threads / 1 thread {host_parallelism(threads):.2f} "
          f"({1 / threads:.2f} on {threads} real idle cores)")
    for backend in ("xgrammar", "llguidance"):
        for state in states:
            one, many = out[(backend, state, 1)], out[(backend, state, threads)]
            print(f"  {backend:10} after {state:2d} tokens: 1 thread {one:.3f}, {threads} threads {many:.3f}, "
                  f"ratio {many / one:.2f}")
    print(f"== the fill beside the step thread's Python, 1 thread, {rows} rows after "
          f"{states[len(states) // 2]} tokens, median ms (both at once near the sum: the fill holds the GIL) ==")
    for backend, (fill_ms, loop_ms, both_ms) in beside.items():
        print(f"  {backend:10} fill {fill_ms:.3f}, Python loop {loop_ms:.3f}, both at once {both_ms:.3f}: "
              f"{both_ms / (fill_ms + loop_ms):.2f} of the sum, {both_ms / max(fill_ms, loop_ms):.2f} of the longer")
        out[(backend, -2, 1)] = both_ms / (fill_ms + loop_ms)
    # Held states fill from warm caches; along the paths each step meets new states (llguidance's lexer
    # grows), as a served batch does: the in-process engine's whole step, its rows started as it starts them.
    # And on one thread, the pipelined fill (grammar_service.fill_pipeline, every step: pipeline_rows 1) beside
    # the step that plans, then fills (pipeline_rows 0, as the thread counts are compared).  Every engine is
    # warm (its compile workers started, its grammars compiled) before any is timed, and the modes alternate
    # by round: a compile worker still starting takes a core from whatever is timed beside it.
    rounds = max(1, repeats // 6)
    print(f"== in-process engine step along the paths, {rows} rows, ms a path, median of {rounds} alternating "
          f"rounds (value checks on, as served) ==")
    modes = sorted({(1, False), (threads, False), (1, True)})
    for backend in ("xgrammar", "llguidance"):
        cons = constraints(backend)
        engines = {(n, piped): GrammarEngine(info, "bench", GrammarEngineConfig(
            max_batch=rows, fill_threads=n, pipeline_rows=1 if piped else 0), llg=llg) for n, piped in modes}
        paths: dict[tuple[int, bool], list[float]] = {mode: [] for mode in modes}
        try:
            for engine in engines.values():
                engine.warm_up()
                time_local(engine, cons, toks, rows, False, True)  # compiles and first states
            for r in range(rounds):
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    paths[mode].append(sum(time_local(engines[mode], cons, toks, rows, False, True)[1:]))
        finally:
            for engine in engines.values():
                engine.close()
        for (n, piped), times in paths.items():
            out[(backend, -3 if piped else -1, n)] = float(np.median(times) * 1e3)
        one, many, piped_ms = out[(backend, -1, 1)], out[(backend, -1, threads)], out[(backend, -3, 1)]
        print(f"  {backend:10} 1 thread {one:.1f}, {threads} threads {many:.1f}, ratio {many / one:.2f}; "
              f"1 thread pipelined {piped_ms:.1f}, ratio {piped_ms / one:.2f}")
    return out


def time_local(engine: GrammarEngine, cons: list[tuple[str, str, str]], toks: list[list[int]], rows: int,
               jump: bool, checks: bool = False, drafts: int = 0) -> list[float]:
    """In-process steps along the paths; ``drafts``: each step also carries the path's next ``drafts``
    tokens as draft tokens (all of them the grammar's: the masks of every draft position are made)."""
    provider = LocalMaskProvider(engine)
    ids = np.arange(1, rows + 1, dtype=np.uint64) + np.uint64(10**6 * (1 + int(time.monotonic())))
    for r in range(rows):
        kind, payload, options = cons[r % len(cons)]
        provider.start(int(ids[r]), ConstraintRequest(kind, payload, options, value_checks=checks))
    tokens = np.zeros((rows, 1), np.int32)
    counts = np.zeros(rows, np.int32)
    ahead = np.zeros((rows, drafts), np.int32)
    ahead_counts = np.zeros(rows, np.int32)
    out: list[float] = []
    try:
        for i in range(len(toks[0]) + 1):
            if drafts:
                for r in range(rows):
                    nxt = toks[r % len(toks)][i : i + drafts]
                    ahead[r, : len(nxt)] = nxt
                    ahead_counts[r] = len(nxt)
            t0 = time.perf_counter()
            step = provider.step(ids, tokens, counts, jump_forward=jump, drafts=ahead if drafts else None,
                                 draft_counts=ahead_counts if drafts else None)
            out.append(time.perf_counter() - t0)
            if any(e is not None for e in step.errors):
                raise RuntimeError(f"local step {i}: {step.errors}")
            if i < len(toks[0]):
                tokens[:, 0] = [toks[r % len(toks)][i] for r in range(rows)]
                counts.fill(1)
    finally:
        provider.end([int(s) for s in ids])
    return out


def time_bls(server: TritonServer, cons: list[tuple[str, str, str]], toks: list[list[int]], rows: int, jump: bool,
             buffer: bool) -> dict[str, list[float]]:
    """The driver's steps: ``step_s`` (each call until its answer is read) and ``arrival_s`` (each send until
    its reply arrived: what the llm model's decode loop waits on after its forward)."""
    # The driver feeds token i at step i + 1 and stops after the last path token is fed,
    # so its step count equals the other modes' (paths + the first, empty step).
    doc = {"constraints": cons, "paths": [[*p, p[-1]] for p in toks], "rows": rows, "jump_forward": jump,
           "buffer": buffer}
    # Straight to tritonserver (the gateway serves streaming models only).
    with grpcclient.InferenceServerClient(server.internal_grpc_url) as client:
        inp = grpcclient.InferInput("CONFIG", [1], "BYTES")
        inp.set_data_from_numpy(np.array([json.dumps(doc).encode()], np.object_))
        result = client.infer("grammar_driver", [inp], client_timeout=600, headers=server.internal_headers)
    doc = json.loads(bytes(result.as_numpy("RESULT")[0]))
    return {"step_s": list(doc["step_s"]), "arrival_s": list(doc["arrival_s"])}


def settle_auto(served: Any, cons: list[tuple[str, str, str]], bundle: Any) -> dict[str, int]:
    """``backend: auto`` as a server serves a constraint after its first output: one complete output of each
    case through the served model, then a wait until each was replayed on xgrammar
    (:mod:`grammar_service.auto_switch`, its counter on the metrics endpoint); returns the outcomes."""
    stop = int(bundle.stop_token_ids[0])
    for con, (_, text) in zip(cons, CASES, strict=True):
        time_bls(served.triton, [con], [[*bundle.encode(text), stop]], 1, False, True)
    deadline = time.monotonic() + 600
    while True:
        series = scrape(served.metrics_url)
        outcomes = {o: int(value(series, "grammar_auto_switches_total", outcome=o)) for o in OUTCOMES}
        if sum(outcomes.values()) >= len(cons):
            return {o: n for o, n in outcomes.items() if n}
        if time.monotonic() > deadline:
            raise RuntimeError(f"backend auto: {len(cons)} replays not counted after 600 s: {outcomes}")
        time.sleep(0.5)


def summary(times: Sequence[float]) -> dict[str, float]:
    """p50, p99, max and mean of a mode's steps, in ms (each run's first step is left out by its caller)."""
    a = np.asarray(times)
    return {"p50_ms": float(np.percentile(a, 50) * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3),
            "max_ms": float(a.max() * 1e3), "mean_ms": float(a.mean() * 1e3)}


def paired(times: Sequence[float], floor: Sequence[float], steps: int) -> dict[str, float]:
    """``times`` over ``floor`` step by step: both hold rounds of the same ``steps`` path steps, in order.

    Each step's median over the rounds, then the ratio at each step: ``p50`` of those ratios, and
    ``total`` (the sums' ratio, what a whole output costs).  The paths' steps cost either about 1 ms or
    about 6 ms at 64 rows (llguidance's bounded strings, xgrammar's email format: docs/benchmarks.md),
    so a p50 over all steps lands in either group as a few steps move, and a ratio of two such p50s
    moved by 2x between runs; the step-by-step ratio compares each state with itself.
    """
    a = np.median(np.asarray(times).reshape(-1, steps), axis=0)
    b = np.median(np.asarray(floor).reshape(-1, steps), axis=0)
    return {"p50": float(np.median(a / b)), "total": float(a.sum() / b.sum())}


def served_values(rows: int, threads: int) -> dict[str, str]:
    """The grammar model alone (MODEL_DIR: the Qwen3 tokenizer), ``rows`` a step, filled on ``threads``."""
    return harness.render_values(QWEN_DIR, {"VOCAB_SIZE": str(QWEN_VOCAB), "MAX_BATCH": str(rows),
                                            "GRAMMAR_FILL_THREADS": str(threads)})


Config = tuple[int, int, str, str]  # rows, fill threads, backend, mode
#: The sweep's modes drawn over the raw fill (``--plot``).
PLOTTED: Final = ("raw", "floor", "arrival", "channel")
#: Issue 49's goal for the served step over the raw fill, drawn as a line.
STEP_GOAL: Final = 1.15


def sweep(bundle: Any, llg: LlgBackend, toks: list[list[int]], threads: int, rounds: int,
          jump: bool) -> dict[Config, dict[str, float]]:
    """``--sweep``: raw fill, raw step and channel step for each row count, thread count and backend."""
    figures: dict[Config, dict[str, float]] = {}
    switches: dict[tuple[int, int], dict[str, int]] = {}
    for rows in (64, 256):
        for n in sorted({1, threads}):
            with harness.serve(served_values(rows, n), prefix="grammar-step-", models=("grammar", "grammar_driver"),
                               prune=True, extra_models=(BENCH / "triton" / "grammar_driver",)) as served:
                server = served.triton
                if server is None:
                    raise RuntimeError("the grammar driver is called on tritonserver's own endpoint")
                for backend in ("xgrammar", "llguidance", "auto"):
                    cons = constraints(backend)
                    raw_llg = llg if raw_backend(cons) == "llguidance" else None
                    time_bls(server, cons, toks, rows, jump, True)  # warm-up: compiles
                    if backend == "auto":
                        switches[(rows, n)] = settle_auto(served, cons, bundle)
                    times: dict[str, list[float]] = {"raw fill": [], "raw": [], "floor": [], "channel": [],
                                                     "arrival": []}
                    for r in range(rounds):
                        for mode in ("channel", "raw") if r % 2 == 0 else ("raw", "channel"):
                            if mode == "channel":
                                called = time_bls(server, cons, toks, rows, jump, True)
                                times["channel"] += called["step_s"][1:]
                                times["arrival"] += called["arrival_s"][1:]
                            else:
                                for k, v in time_raw(bundle.info, raw_llg, cons, toks, rows, n, True).items():
                                    times[k] += v[1:]
                    for mode, values in times.items():
                        figures[(rows, n, backend, mode)] = summary(values)
                    for mode in ("raw", "floor", "channel", "arrival"):
                        figures[(rows, n, backend, mode)].update(
                            {f"over raw fill {k}": v for k, v in paired(times[mode], times["raw fill"],
                                                                           len(toks[0])).items()})
    print(f"== grammar step at GPU batch sizes, Qwen3 vocabulary, {len(toks[0])} steps x {rounds} rounds, "
          f"jump-forward {'on' if jump else 'off'} (ms per step) ==")
    print("  raw: each row's accept, then the fill; floor: the same with each row looked up, counted and its end"
          " checked, the least of a grammar step in Python; channel: the served step, the driver's call until it"
          " read the answer; arrival: the same steps from the send to the reply's arrival (what the llm model"
          " waits on after its forward)")
    print(f"  {'rows':>4} {'threads':>7} {'backend':10} {'mode':8} {'p50':>8} {'p99':>8} {'max':>8}"
          "  over raw fill: step by step p50, total; p50/p50")
    for (rows, n, backend, mode), f in figures.items():
        over = (f"  {f['over raw fill p50']:.2f}, {f['over raw fill total']:.2f}; "
                f"{f['p50_ms'] / figures[(rows, n, backend, 'raw fill')]['p50_ms']:.2f}") if mode != "raw fill" else ""
        print(f"  {rows:>4} {n:>7} {backend:10} {mode:8} {f['p50_ms']:8.3f} {f['p99_ms']:8.3f} {f['max_ms']:8.3f}"
              f"{over}")
    for backend in ("xgrammar", "llguidance"):
        one, many = (figures[(64, n, backend, "raw fill")]["p50_ms"] for n in (1, threads))
        print(f"  fill at 64 rows, {backend}: {threads} threads / 1 thread {many / one:.2f}")
    print(f"  host: the same GIL-free work on {threads} threads / 1 thread {host_parallelism(threads):.2f} "
          f"({1 / threads:.2f} on {threads} real idle cores)")
    print(f"  auto after each case's first output (replays by outcome, per served model): {switches}; its raw "
          "rows are llguidance's, the backend it serves first")
    for n in sorted({1, threads}):
        auto = figures[(64, n, "auto", "channel")]["p50_ms"] / figures[(64, n, "xgrammar", "raw fill")]["p50_ms"]
        print(f"  auto channel p50 / xgrammar raw fill p50 at 64 rows, {n} fill threads: {auto:.2f}")

    def over_fill(backend: str, mode: str = "channel") -> float:
        return figures[(64, 1, backend, mode)]["over raw fill p50"]

    print(f"step at 64 rows: channel/raw fill {over_fill('xgrammar'):.2f} (xgrammar), "
          f"{over_fill('llguidance'):.2f} (llguidance), step by step (to the reply's arrival "
          f"{over_fill('xgrammar', 'arrival'):.2f}, {over_fill('llguidance', 'arrival'):.2f}; the backend's own "
          f"accept and fill {over_fill('xgrammar', 'raw'):.2f}, {over_fill('llguidance', 'raw'):.2f}; the Python "
          f"floor {over_fill('xgrammar', 'floor'):.2f}, {over_fill('llguidance', 'floor'):.2f}); p99 "
          f"{figures[(64, 1, 'auto', 'channel')]['p99_ms']:.2f} ms (auto)")
    return figures


def plot_sweep(figures: dict[Config, dict[str, float]], path: Path) -> None:
    """Each plotted mode's step-by-step p50 over the raw fill, per fill threads and backend, a plot per row count."""
    row_counts = sorted({rows for rows, *_ in figures})
    with harness.figure(path, "grammar step over the raw fill, step by step p50 (Qwen3, the four paths)",
                        columns=len(row_counts), size=(6 * len(row_counts), 4.5)) as axes:
        for ax, rows in zip(axes, row_counts, strict=True):
            cases = sorted({(n, backend) for r, n, backend, _ in figures if r == rows})
            x = np.arange(len(cases))
            width = 0.8 / len(PLOTTED)
            for i, mode in enumerate(PLOTTED):
                ax.bar(x + width * i, [figures[(rows, n, b, mode)]["over raw fill p50"] for n, b in cases], width,
                       label=mode)
            ax.axhline(STEP_GOAL, color="black", linestyle="--", linewidth=1, label=f"goal {STEP_GOAL}")
            ax.set_xticks(x + width * (len(PLOTTED) - 1) / 2, [f"{b}\n{n} thr" for n, b in cases], fontsize=8)
            ax.set_title(f"{rows} rows")
            ax.set_ylabel("over the raw fill")
            ax.legend(fontsize=7)


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__)
    harness.add_rows(parser, 64, "sequences per step")
    harness.add_rounds(parser, 3, "interleaved rounds")
    parser.add_argument("--jump-forward", action="store_true", help="also return jump-forward tokens")
    harness.add_backend(parser, "xgrammar", "grammar option backend of every row, in every mode")
    parser.add_argument("--threads", type=int, default=1,
                        help="fill threads: the served model's GRAMMAR_FILL_THREADS, the engine's and the raw "
                             "backend's; with --sweep, the second thread count beside 1 (default %(default)s)")
    parser.add_argument("--sweep", action="store_true",
                        help="64 and 256 rows, every backend and auto, 1 and --threads fill threads: raw fill "
                             "and the channel step only")
    parser.add_argument("--drafts", type=int, default=0,
                        help="also time in-process steps that carry each row's next DRAFTS path tokens as draft "
                             "tokens (speculative decoding: a mask per draft position; mode 'local drafted')")
    parser.add_argument("--fill-states", action="store_true",
                        help="the raw batched fill alone at --rows rows held at steps 2, 10 and 14 of their "
                             "paths, 1 and --threads fill threads, beside a Python loop; the engine's step, also "
                             "pipelined (no server)")
    harness.add_json(parser, "the figures")
    harness.add_plot(parser, "a PNG of --sweep's steps over the raw fill")
    args = parser.parse_args(argv)
    if args.threads <= 0:
        parser.error("--threads must be positive")
    if not 0 <= args.drafts <= GrammarEngineConfig().max_draft_tokens:
        parser.error(f"--drafts must be within 0..{GrammarEngineConfig().max_draft_tokens}")
    bundle = load_tokenizer(QWEN_DIR, vocab_size=QWEN_VOCAB)
    toks = paths(bundle.encode)
    llg = LlgBackend(bundle.hf, bundle.vocab_size, bundle.stop_token_ids)
    if args.fill_states:
        fills = fill_states(bundle.info, llg, toks, args.rows, args.threads)
        if args.json is not None:
            harness.write_json(args.json, {"/".join(map(str, k)): v for k, v in fills.items()})
        return 0
    if args.sweep:
        swept = sweep(bundle, llg, toks, args.threads if args.threads > 1 else min(2, os.cpu_count() or 1),
                      args.rounds, args.jump_forward)
        if args.json is not None:
            harness.write_json(args.json, {"figures": {"/".join(map(str, k)): f for k, f in swept.items()}})
        if args.plot is not None:
            plot_sweep(swept, args.plot)
        return 0
    cons = constraints(args.backend)
    for kind, payload, options in cons:
        parse_constraint(kind, payload, options)  # the schemas pass the server's own checks
    engine = GrammarEngine(bundle.info, bundle.fingerprint,
                           GrammarEngineConfig(max_batch=args.rows, fill_threads=args.threads),
                           encode=bundle.encode, llg=llg)
    times: dict[str, list[float]] = {"raw fill": [], "raw": [], "floor": [], "local": [], "local checked": [],
                                     "bls tensor": [], "channel": [], "arrival": []}
    if args.drafts:
        times["local drafted"] = []
    # The grammar model alone (MODEL_DIR: the Qwen3 tokenizer, MAX_BATCH: the rows), plus the bench driver.
    values = served_values(args.rows, args.threads)
    try:
        with harness.serve(values, prefix="grammar-step-", models=("grammar", "grammar_driver"), prune=True,
                           extra_models=(BENCH / "triton" / "grammar_driver",)) as served:
            server = served.triton
            if server is None:
                raise RuntimeError("the grammar driver is called on tritonserver's own endpoint: serve it in-process")
            time_bls(server, cons, toks, args.rows, args.jump_forward, True)  # warm-up: compiles
            time_local(engine, cons, toks, args.rows, args.jump_forward)
            for r in range(args.rounds):
                order = ["channel", "bls tensor", "local", "local checked", "raw",
                         *(["local drafted"] if args.drafts else [])]
                for mode in order if r % 2 == 0 else order[::-1]:
                    if mode in ("bls tensor", "channel"):
                        called = time_bls(server, cons, toks, args.rows, args.jump_forward, mode == "channel")
                        times[mode] += called["step_s"][1:]
                        if mode == "channel":
                            times["arrival"] += called["arrival_s"][1:]
                    elif mode.startswith("local"):
                        times[mode] += time_local(engine, cons, toks, args.rows, args.jump_forward,
                                                  mode == "local checked",
                                                  args.drafts if mode == "local drafted" else 0)[1:]
                    else:
                        raw_llg = llg if raw_backend(cons) == "llguidance" else None
                        for k, v in time_raw(bundle.info, raw_llg, cons, toks, args.rows, args.threads,
                                             True).items():
                            times[k] += v[1:]
    finally:
        engine.close()
    figures = {k: summary(v) for k, v in times.items()}
    print(f"== grammar step, {args.backend}, {args.rows} rows, {args.threads} fill threads, Qwen3 vocabulary, "
          f"{len(toks[0])} steps x {args.rounds} rounds, jump-forward {'on' if args.jump_forward else 'off'} ==")
    for k, f in figures.items():
        print(f"  {k:13s} p50 {f['p50_ms']:7.3f} ms   p99 {f['p99_ms']:7.3f} ms   max {f['max_ms']:7.3f} ms   "
              f"mean {f['mean_ms']:7.3f} ms")
    steps = len(toks[0])

    def over(mode: str, base: str) -> str:
        ratio = paired(times[mode], times[base], steps)
        return f"{mode}/{base} {ratio['p50']:.2f} ({ratio['total']:.2f})"

    pairs = [("raw", "raw fill"), ("floor", "raw fill"), ("local", "raw fill"), ("local", "floor"),
             ("local checked", "local"), ("bls tensor", "raw fill"), ("channel", "raw fill"), ("arrival", "raw fill"),
             ("arrival", "local"), ("channel", "local"), ("channel", "local checked")]
    if args.drafts:
        pairs.append(("local drafted", "local"))
    print("  step-by-step p50 ratios (total): " + "; ".join(over(mode, base) for mode, base in pairs))
    if args.json is not None:
        harness.write_json(args.json, {"figures": figures, "times": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
