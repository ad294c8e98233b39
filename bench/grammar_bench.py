"""Grammar-engine figures, each side by side with the same raw xgrammar call in the same run.

Usage (from the repository root)::

    .venv/bin/python bench/grammar_bench.py ../shared/data/maskbench-dev            # ~10 min, both tokenizers
    .venv/bin/python bench/grammar_bench.py ../shared/data/maskbench-dev --quick    # smoke run, < 60 s

For each tokenizer (default: Qwen3 and SmolLM2), over a seeded random sample
of MaskBench schemas (``--limit``, cut short by ``--budget`` seconds of
per-schema work), measured in one child process per tokenizer (a schema that
hangs or crashes the compiler costs a respawned worker, never the run):

* **compile**: ``GrammarEngine.compile`` on a cold key (spec -> cache miss ->
  compile thread) vs ``GrammarCompiler.compile_json_schema`` with the same
  arguments (compact separators, ``strict_mode=False``), one compile thread
  each, the order alternating per schema.  A compile past ``--timeout`` kills
  the worker and counts as "> timeout" in both columns.
* **cache hit**: ``GrammarEngine.compile`` on a cached key vs a cache-enabled
  ``GrammarCompiler`` asked again for the same schema (median of 20 calls per
  schema).  ``parse_constraint`` (JSON parse, meta-schema check the first
  time a schema is seen, canonical text), which a request pays before any
  cache lookup, is shown on its own rows: a new schema, and the same schema
  again (median of 5).
* **mask, one sequence**: each valid test instance is forced token by token;
  ours is one ``engine.step`` per token (accept the previous token + fill the
  next mask, the per-step work of the grammar model), raw is
  ``GrammarMatcher.accept_token`` + ``fill_next_token_bitmask`` timed together,
  and raw fill alone is the figure comparable to MaskBench's mask time.

Then, in this process, on up to ``--batch-schemas`` of the schemas that compiled
quickly: **batch fill** for B = 1/16/64/256 sequences, each advanced to a
random point inside a valid instance, at 1 and 2 fill threads: ``engine.step``
with no new tokens (table lookups + ``BitmaskBuffer.fill``) vs
``BatchGrammarMatcher.batch_fill_next_token_bitmask`` over the same matchers.

Nothing here asserts a time: the script prints figures (and ``--json`` writes
them).  All timings are wall-clock ``perf_counter_ns`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import numpy as np
from harness import MODEL_DIR, QWEN_DIR, QWEN_VOCAB
from maskbench import (
    Outcome,
    WorkerContext,
    WorkerPool,
    compact_json,
    first_line,
    fmt,
    percentile,
    select_files,
    subset_of,
)

#: (path, logits width or None for the model config's) of the default tokenizers.
DEFAULT_TOKENIZERS: Final = (
    (QWEN_DIR, QWEN_VOCAB),
    (MODEL_DIR, None),
)

#: MaskBench's published mask times (Llama-3.1 vocabulary, one thread).
MASK_ANCHORS: Final = (("XGrammar", 9.0, 5700.0), ("LLGuidance", 46.0, 533.0))

#: The raw xgrammar arguments equal to the engine's default options
#: (compact whitespace, strict=False, schema key order, no indent).
RAW_KWARGS: Final[dict[str, Any]] = {
    "any_whitespace": False,
    "separators": (",", ":"),
    "strict_mode": False,
    "any_order": False,
    "indent": None,
}

HIT_REPS: Final = 20


@dataclass(frozen=True)
class Settings:
    """Knobs of one run (picklable: the worker gets a copy)."""

    limit: int
    timeout_s: float
    budget_s: float
    max_tokens: int
    batch_sizes: tuple[int, ...]
    threads: tuple[int, ...]
    batch_schemas: int
    batch_seconds: float
    seed: int
    max_file_bytes: int | None = None


FULL: Final = Settings(limit=200, timeout_s=10.0, budget_s=180.0, max_tokens=1500,
                       batch_sizes=(1, 16, 64, 256), threads=(1, 2), batch_schemas=8, batch_seconds=1.0, seed=0)
#: A smoke run: small files only (schemas under 4 KB compile in well under a
#: second), so it exercises every code path, not the compile-time tail.
QUICK: Final = Settings(limit=4, timeout_s=3.0, budget_s=6.0, max_tokens=200,
                        batch_sizes=(1, 16, 64, 256), threads=(1, 2), batch_schemas=2, batch_seconds=0.1, seed=0,
                        max_file_bytes=4000)


# ---------------------------------------------------------------------------
# Per-schema work (inside the worker process)
# ---------------------------------------------------------------------------


@dataclass
class _State:
    bundle: Any
    engine: Any
    raw: Any
    width: int
    max_tokens: int
    next_seq: int = 1


def _init_worker(tokenizer: str, vocab_size: int | None, settings: Settings) -> _State:
    import xgrammar as xgr

    from grammar_backend.tokenizer import load_tokenizer
    from grammar_service.cache import CacheConfig
    from grammar_service.engine import GrammarEngine, GrammarEngineConfig
    from grammar_service.workers import WorkerConfig

    bundle = load_tokenizer(tokenizer, vocab_size=vocab_size)
    engine = GrammarEngine(
        bundle.info,
        bundle.fingerprint,
        GrammarEngineConfig(
            max_batch=1,
            # The parent's kill is the limit; these backstops never fire first.
            cache=CacheConfig(max_bytes=256 * 1024 * 1024, workers=1, timeout_s=4 * settings.timeout_s + 60),
            workers=WorkerConfig(cpu_s=4 * settings.timeout_s + 60),
        ),
    )
    raw = xgr.GrammarCompiler(bundle.info, max_threads=1, cache_enabled=True, cache_limit_bytes=256 * 1024 * 1024)
    engine.warm_up()  # the compile worker process starts here, outside every timed phase (1-4 s)
    return _State(bundle, engine, raw, (bundle.vocab_size + 31) // 32, settings.max_tokens)


def _instance_tokens(bundle: Any, tests: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """Token ids of the valid instances, at most ``max_tokens`` in all (the last one cut)."""
    out: list[list[int]] = []
    left = max_tokens
    for test in tests:
        if left <= 0:
            break
        if test.get("valid") is True:
            ids = bundle.hf.encode(compact_json(test["data"]), add_special_tokens=False)[:left]
            out.append(ids)
            left -= len(ids)
    return out


def _time_ours(state: _State, spec: Any, tokens: list[int], samples: list[int]) -> bool:
    """One ``engine.step`` per token (the first fills the initial mask); False if a token is rejected."""
    engine = state.engine
    seq_id = state.next_seq
    state.next_seq += 1
    engine.start(seq_id, spec)
    ids = np.array([seq_id], dtype=np.uint64)
    tok = np.zeros((1, 1), dtype=np.int32)
    counts = np.zeros(1, dtype=np.int32)
    clock = time.perf_counter_ns
    try:
        for i in range(len(tokens) + 1):
            if i:
                tok[0, 0] = tokens[i - 1]
                counts[0] = 1
            t0 = clock()
            res = engine.step(ids, tok, counts)
            samples.append(clock() - t0)
            if res.errors[0] is not None:
                samples.pop()  # a rejected token fills no mask
                return False
        return True
    finally:
        engine.end([seq_id])


def _time_raw(state: _State, compiled: Any, tokens: list[int], fills: list[int], steps: list[int]) -> bool:
    """``accept_token`` + ``fill_next_token_bitmask`` per token, timed as a pair and the fill alone."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = np.empty((1, state.width), dtype=np.int32)
    clock = time.perf_counter_ns
    t0 = clock()
    matcher.fill_next_token_bitmask(bitmask)
    t1 = clock()
    fills.append(t1 - t0)
    steps.append(t1 - t0)
    for token in tokens:
        t0 = clock()
        ok = matcher.accept_token(token)
        t1 = clock()
        if not ok:
            return False
        matcher.fill_next_token_bitmask(bitmask)
        t2 = clock()
        fills.append(t2 - t1)
        steps.append(t2 - t0)
    return True


def _median_call_ns(fn: Any, reps: int) -> float:
    clock = time.perf_counter_ns
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(np.median(times))


def bench_schema(state: _State, task: tuple[str, int], ctx: WorkerContext) -> dict[str, Any]:
    """Measure one schema: compile (ours/raw), cache hit (ours/raw), spec parse, per-token mask (ours/raw)."""
    from grammar_backend.errors import CompileError, ConstraintError
    from grammar_backend.spec import parse_constraint

    path, index = task
    name = Path(path).name
    rec: dict[str, Any] = {"file": name, "subset": subset_of(name)}
    ctx.phase("load")
    try:
        case = json.loads(Path(path).read_text(encoding="utf-8"))
        schema, tests = case["schema"], list(case.get("tests") or [])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        rec.update(status="bad_file", reason=first_line(err))
        return rec
    text = json.dumps(schema, ensure_ascii=False)

    ctx.phase("spec")
    t0 = time.perf_counter_ns()
    try:
        spec = parse_constraint("json_schema", text)
    except ConstraintError as err:
        rec.update(status="spec_rejected", reason=str(err))
        return rec
    rec["parse_us"] = (time.perf_counter_ns() - t0) / 1e3
    # A schema sent again: spec.py remembers which schemas passed the meta-schema check.
    rec["parse_again_us"] = _median_call_ns(lambda: parse_constraint("json_schema", text), 5) / 1e3

    compiled_raw = None
    # Alternate which compile goes first, so neither always meets a cold CPU cache.
    for which in ("ours", "raw") if index % 2 == 0 else ("raw", "ours"):
        ctx.phase(f"compile_{which}", **{k: rec[k] for k in ("ours_compile_s", "raw_compile_s") if k in rec})
        t0 = time.perf_counter_ns()
        try:
            if which == "ours":
                state.engine.compile(spec)
            else:
                compiled_raw = state.raw.compile_json_schema(spec.payload, **RAW_KWARGS)
        except CompileError as err:
            rec.update(status="compile_error", reason=err.reason)
            return rec
        except (RuntimeError, ValueError, TypeError) as err:  # what xgrammar raises for a schema it cannot compile
            rec.update(status="compile_error", reason=f"raw: {first_line(err)}")
            return rec
        rec[f"{which}_compile_s"] = (time.perf_counter_ns() - t0) / 1e9

    ctx.phase("cache_hit")
    rec["ours_hit_us"] = _median_call_ns(lambda: state.engine.compile(spec), HIT_REPS) / 1e3
    rec["raw_hit_us"] = _median_call_ns(lambda: state.raw.compile_json_schema(spec.payload, **RAW_KWARGS),
                                        HIT_REPS) / 1e3

    ctx.phase("mask")
    ours: list[int] = []
    raw_fill: list[int] = []
    raw_step: list[int] = []
    rejected = 0
    for i, tokens in enumerate(_instance_tokens(state.bundle, tests, state.max_tokens)):
        if i % 2 == 0:
            ok = _time_ours(state, spec, tokens, ours)
            _time_raw(state, compiled_raw, tokens, raw_fill, raw_step)
        else:
            _time_raw(state, compiled_raw, tokens, raw_fill, raw_step)
            ok = _time_ours(state, spec, tokens, ours)
        rejected += int(not ok)
    rec.update(status="ok", valid_rejected=rejected,
               ours_step_ns=np.asarray(ours, dtype=np.int64),
               raw_fill_ns=np.asarray(raw_fill, dtype=np.int64),
               raw_step_ns=np.asarray(raw_step, dtype=np.int64))
    return rec


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


def _record(outcome: Outcome) -> dict[str, Any]:
    if outcome.kind == "done":
        return dict(outcome.record)
    path, _ = outcome.task
    name = Path(path).name
    rec = {"file": name, "subset": subset_of(name), "status": outcome.kind, "phase": outcome.phase,
           "reason": outcome.detail}
    rec.update({k: v for k, v in outcome.record.items() if k.endswith("_compile_s")})
    return rec


def _value(x: float, censor: float | None) -> float | str | None:
    """A figure for the table and JSON: None when missing, ``">T"`` when censored by a timeout."""
    if math.isnan(x):
        return None
    if math.isinf(x):
        return f">{censor:g}" if censor is not None else None
    return x


def _row(label: str, unit: str, ours: Sequence[float] | np.ndarray, raw: Sequence[float] | np.ndarray | None,
         scale: float = 1.0, censor: float | None = None) -> dict[str, Any]:
    """One figure: p50/p99 of ours and raw (in ``unit``) and the ratios ours/raw.

    Infinite samples are timeouts; a percentile that lands on one reads ``">T"``.
    """
    o50, o99 = percentile(ours, 50) * scale, percentile(ours, 99) * scale
    row: dict[str, Any] = {"figure": label, "unit": unit, "n": len(ours),
                           "ours_p50": _value(o50, censor), "ours_p99": _value(o99, censor)}
    if raw is not None:
        r50, r99 = percentile(raw, 50) * scale, percentile(raw, 99) * scale
        row.update(raw_p50=_value(r50, censor), raw_p99=_value(r99, censor))
        for key, a, b in (("ratio_p50", o50, r50), ("ratio_p99", o99, r99)):
            ratio = a / b if b > 0 and np.isfinite(a) and np.isfinite(b) else float("nan")
            row[key] = _value(ratio, None)
    return row


def _cell(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return fmt(value, ".3g") if abs(value) < 1000 else fmt(value, ".0f")


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The figures as a fixed-width table."""
    head = ("figure", "unit", "n", "ours p50", "ours p99", "raw p50", "raw p99", "ours/raw p50", "ours/raw p99")
    lines = [head]
    for r in rows:
        lines.append((r["figure"], r["unit"], str(r["n"]), _cell(r["ours_p50"]), _cell(r["ours_p99"]),
                      _cell(r.get("raw_p50")), _cell(r.get("raw_p99")),
                      _cell(r.get("ratio_p50")), _cell(r.get("ratio_p99"))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def schema_figures(records: list[dict[str, Any]], timeout_s: float) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Rows of the per-schema figures; also the per-token samples (ns) by name."""
    ok = [r for r in records if r["status"] == "ok"]
    timeouts = [r for r in records if r["status"] == "timeout" and r["phase"].startswith("compile")]
    inf = [float("inf")] * len(timeouts)
    # A compile that timed out is "> timeout" in both columns (only one of the two was attempted).
    ours_c = [r["ours_compile_s"] for r in ok] + inf
    raw_c = [r["raw_compile_s"] for r in ok] + inf
    tokens = {k: np.concatenate([r[k] for r in ok]) if ok else np.zeros(0, dtype=np.int64)
              for k in ("ours_step_ns", "raw_fill_ns", "raw_step_ns")}
    rows = [
        _row("compile (cold key)", "s", ours_c, raw_c, censor=timeout_s),
        _row("cache hit", "us", [r["ours_hit_us"] for r in ok], [r["raw_hit_us"] for r in ok]),
        _row("parse_constraint, new schema", "us", [r["parse_us"] for r in records if "parse_us" in r], None),
        _row("parse_constraint, same schema again", "us",
             [r["parse_again_us"] for r in records if "parse_again_us" in r], None),
        _row("mask 1 seq: step vs accept+fill", "us", tokens["ours_step_ns"], tokens["raw_step_ns"], 1e-3),
        _row("mask 1 seq: step vs fill only", "us", tokens["ours_step_ns"], tokens["raw_fill_ns"], 1e-3),
    ]
    return rows, tokens


def batch_figures(bundle: Any, records: list[dict[str, Any]], files: dict[str, Path],
                  settings: Settings) -> tuple[list[dict[str, Any]], list[str]]:
    """Batch fill of B real matchers mid-document: ``engine.step`` vs ``batch_fill_next_token_bitmask``."""
    import xgrammar as xgr

    from grammar_backend.spec import parse_constraint
    from grammar_service.cache import CacheConfig
    from grammar_service.engine import GrammarEngine, GrammarEngineConfig

    chosen: list[tuple[Any, list[int]]] = []
    names: list[str] = []
    # Schemas that compiled fast (each is compiled again here) and have a valid instance of >= 8 tokens.
    for rec in records:
        if len(chosen) >= settings.batch_schemas:
            break
        if rec["status"] != "ok" or rec["ours_compile_s"] > 2.0:
            continue
        case = json.loads(files[rec["file"]].read_text(encoding="utf-8"))
        docs = _instance_tokens(bundle, list(case.get("tests") or []), 10**9)
        docs = [d for d in docs if len(d) >= 8]
        if not docs or rec["valid_rejected"]:
            continue
        spec = parse_constraint("json_schema", json.dumps(case["schema"], ensure_ascii=False))
        chosen.append((spec, max(docs, key=len)))
        names.append(rec["file"])
    if not chosen:
        return [], names

    rows: list[dict[str, Any]] = []
    rng = random.Random(settings.seed)
    max_b = max(settings.batch_sizes)
    positions = [rng.randint(1, len(chosen[i % len(chosen)][1]) - 1) for i in range(max_b)]
    clock = time.perf_counter_ns
    with tempfile.TemporaryDirectory(prefix="grammar-bench-store-") as store:
        for threads in settings.threads:
            # The on-disk store lets the second engine load what the first compiled.
            engine = GrammarEngine(bundle.info, bundle.fingerprint, GrammarEngineConfig(
                max_batch=max_b, fill_threads=threads, cache=CacheConfig(workers=1, store_dir=store)))
            try:
                for i in range(max_b):
                    spec, doc = chosen[i % len(chosen)]
                    engine.start(i, spec)
                    prefix = np.asarray([doc[:positions[i]]], dtype=np.int32)
                    res = engine.step(np.array([i], dtype=np.uint64), prefix, np.array([positions[i]]))
                    if res.errors[0] is not None:
                        raise RuntimeError(f"batch setup: {res.errors[0]}")
                for b in settings.batch_sizes:
                    ids = np.arange(b, dtype=np.uint64)
                    tok = np.zeros((b, 1), dtype=np.int32)
                    counts = np.zeros(b, dtype=np.int32)
                    # xgrammar's own matchers (this engine has no llguidance backend: auto is xgrammar).
                    matchers = [m for m in (engine.table.get(i).matcher for i in range(b))
                                if isinstance(m, xgr.GrammarMatcher)]
                    raw_batch = xgr.BatchGrammarMatcher(threads)
                    raw_mask = np.empty((b, (bundle.vocab_size + 31) // 32), dtype=np.int32)
                    ours: list[int] = []
                    raw: list[int] = []
                    deadline = time.monotonic() + settings.batch_seconds
                    while len(ours) < 5 or (time.monotonic() < deadline and len(ours) < 2000):
                        t0 = clock()
                        engine.step(ids, tok, counts)
                        t1 = clock()
                        raw_batch.batch_fill_next_token_bitmask(matchers, raw_mask)
                        t2 = clock()
                        ours.append(t1 - t0)
                        raw.append(t2 - t1)
                    if not np.array_equal(engine.bitmask.buffer[:b], raw_mask):
                        raise RuntimeError(f"batch B={b} threads={threads}: engine mask differs from raw xgrammar")
                    rows.append(_row(f"batch fill B={b} threads={threads}", "us", ours, raw, 1e-3))
                    per_row = _row(f"  per row, B={b} threads={threads}", "us",
                                   np.asarray(ours) / b, np.asarray(raw) / b, 1e-3)
                    if b > 1:
                        rows.append(per_row)
            finally:
                engine.close()
    return rows, names


def load_bundle(path: Path, vocab_size: int | None) -> Any:
    from grammar_backend.tokenizer import load_tokenizer

    return load_tokenizer(path, vocab_size=vocab_size)


def run_tokenizer(data_dir: Path, tokenizer: Path, vocab_size: int | None, settings: Settings,
                  quiet: bool) -> dict[str, Any]:
    """All figures for one tokenizer."""
    files = select_files(data_dir, None, settings.seed)
    if settings.max_file_bytes is not None:
        files = [f for f in files if f.stat().st_size <= settings.max_file_bytes]
    if settings.limit < len(files):
        files = sorted(random.Random(settings.seed).sample(files, settings.limit))
    by_name = {f.name: f for f in files}
    # The order is already random (a seeded sample, re-shuffled), so a run cut
    # short by the budget still measures a random subset.
    order = list(files)
    random.Random(settings.seed).shuffle(order)
    records: list[dict[str, Any]] = []
    start = time.monotonic()
    with WorkerPool(1, _init_worker, (str(tokenizer), vocab_size, settings), bench_schema,
                    settings.timeout_s) as pool:
        bundle = load_bundle(tokenizer, vocab_size)  # overlaps the worker's own load
        load_done = time.monotonic()
        budget_start: list[float] = []

        def keep_going() -> bool:
            if not budget_start:
                budget_start.append(time.monotonic())
            return time.monotonic() - budget_start[0] < settings.budget_s

        for outcome in pool.run([(str(f), i) for i, f in enumerate(order)], keep_going):
            records.append(_record(outcome))
            if not quiet and (len(records) % 20 == 0 or outcome.kind != "done"):
                note = f" [{records[-1]['file']}: {outcome.kind} in {outcome.phase}]" if outcome.kind != "done" else ""
                print(f"    {len(records)} schemas in {time.monotonic() - start:.0f} s{note}",
                      file=sys.stderr, flush=True)
        respawns = pool.respawns
    phase_a = time.monotonic() - start
    rows, _ = schema_figures(records, settings.timeout_s)
    t0 = time.monotonic()
    batch_rows, batch_names = batch_figures(bundle, records, by_name, settings)
    counts = {s: sum(1 for r in records if r["status"] == s)
              for s in ("ok", "spec_rejected", "compile_error", "timeout", "crash", "error", "bad_file")}
    for rec in records:
        for key in ("ours_step_ns", "raw_fill_ns", "raw_step_ns"):
            if key in rec:
                rec[f"{key[:-3]}_tokens"] = int(rec.pop(key).size)
    return {
        "tokenizer": str(tokenizer),
        "vocab_size": bundle.vocab_size,
        "tokenizer_size": len(bundle.hf),
        "stop_token_ids": list(bundle.stop_token_ids),
        "sampled": len(files),
        "measured": len(records),
        "counts": counts,
        "worker_respawns": respawns,
        "valid_instances_rejected": sum(r.get("valid_rejected", 0) for r in records),
        "seconds": {"parent_tokenizer_load": round(load_done - start, 2), "per_schema": round(phase_a, 1),
                    "batch": round(time.monotonic() - t0, 1)},
        "rows": rows + batch_rows,
        "batch_schemas": batch_names,
        "schemas": records,
    }


def print_result(res: dict[str, Any], settings: Settings) -> None:
    c = res["counts"]
    print(f"\n== {res['tokenizer']}: vocab {res['vocab_size']} ({res['tokenizer_size']} tokens), "
          f"stop {res['stop_token_ids']}")
    print(f"schemas: {res['measured']} measured of {res['sampled']} sampled (budget {settings.budget_s:g} s): "
          f"{c['ok']} ok, {c['spec_rejected']} spec rejected, {c['compile_error']} compile errors, "
          f"{c['timeout']} timeouts (>{settings.timeout_s:g} s), {c['crash']} crashes, {c['error']} harness errors; "
          f"{res['valid_instances_rejected']} valid instances rejected; worker respawns {res['worker_respawns']}")
    print(f"time: per-schema phase {res['seconds']['per_schema']} s, batch phase {res['seconds']['batch']} s "
          f"(batch schemas: {', '.join(res['batch_schemas']) or 'none'})")
    print(format_rows(res["rows"]))


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser)
    parser.add_argument("--tokenizer", type=Path, action="append", default=None,
                        help="tokenizer folder or .gguf; repeatable (default: Qwen3 and SmolLM2 under build/)")
    parser.add_argument("--vocab-size", type=int, action="append", default=None,
                        help="logits width of each --tokenizer, in the same order (default: from the model config)")
    parser.add_argument("--limit", type=int, default=None, help=f"schemas sampled per tokenizer (default {FULL.limit})")
    harness.add_phase_timeout(parser, None, f"(default {FULL.timeout_s:g})")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds of per-schema work per tokenizer before the sample is cut "
                             f"(default {FULL.budget_s:g})")
    harness.add_quick(parser, "smoke run: few schemas, short budget (< 60 s)")
    harness.add_seed(parser, 0)
    harness.add_json(parser, "all figures")
    harness.add_quiet(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = Settings(
        limit=args.limit if args.limit is not None else base.limit,
        timeout_s=args.timeout if args.timeout is not None else base.timeout_s,
        budget_s=args.budget if args.budget is not None else base.budget_s,
        max_tokens=base.max_tokens, batch_sizes=base.batch_sizes, threads=base.threads,
        batch_schemas=base.batch_schemas, batch_seconds=base.batch_seconds, seed=args.seed,
        max_file_bytes=base.max_file_bytes,
    )
    if settings.limit <= 0 or settings.timeout_s <= 0 or settings.budget_s <= 0:
        raise SystemExit("--limit, --timeout and --budget must be positive")
    if args.tokenizer is None:
        if args.vocab_size is not None:
            raise SystemExit("--vocab-size needs --tokenizer (one per tokenizer)")
        pairs: list[tuple[Path, int | None]] = list(DEFAULT_TOKENIZERS)
    else:
        sizes: list[int | None] = list(args.vocab_size) if args.vocab_size else [None] * len(args.tokenizer)
        if len(sizes) != len(args.tokenizer):
            raise SystemExit(f"--vocab-size given {len(sizes)} times for {len(args.tokenizer)} --tokenizer")
        pairs = list(zip(args.tokenizer, sizes))
    for path, _ in pairs:
        if not path.exists():
            raise SystemExit(f"tokenizer {path}: not found (Qwen3: build/tokenizers/qwen3; "
                             "SmolLM2: `python -m deploy.prepare_model`)")

    print(f"grammar_bench: {args.data}, {settings}", flush=True)
    start = time.monotonic()
    results = []
    for path, vocab in pairs:
        res = run_tokenizer(args.data, path, vocab, settings, args.quiet)
        print_result(res, settings)
        results.append(res)
    print("\nanchors (MaskBench, Llama-3.1 vocabulary, one thread), mask time p50 / p99: "
          + "; ".join(f"{n} {p50:g} us / {p99:g} us" for n, p50, p99 in MASK_ANCHORS))
    print("ours/raw: above 1 is the engine's overhead over the bare xgrammar call; 'mask 1 seq: step' includes "
          "the previous token's accept, the table lookup and the per-row bookkeeping of engine.step.")
    print(f"total {time.monotonic() - start:.0f} s")
    if args.json is not None:
        doc = {"settings": settings.__dict__, "anchors": {n: {"p50_us": a, "p99_us": b} for n, a, b in MASK_ANCHORS},
               "tokenizers": results}
        harness.write_json(args.json, doc, allow_nan=False)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
