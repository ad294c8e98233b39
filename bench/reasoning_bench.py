"""Think, then answer: how many answers are valid when the thinking may eat the budget, with and without the thinking budget.

Usage (from the repository root, after ``make model`` and ``make tokenizers``)::

    .venv/bin/python bench/reasoning_bench.py            # ~12 min on 2 cores
    .venv/bin/python bench/reasoning_bench.py --quick    # ~3 min (3 schemas, 2 modes)

Two parts:

1. **Validity** (in process: SmolLM2 on the torch engine, the real grammar
   engine through ``LocalMaskProvider``, the scheduler, 4 rows at a time,
   greedy).  The project's schemas (``tests/fixtures/schemas``, and
   ``loadtest/schemas`` without ``--quick``), each with a prompt that invites
   thinking (:data:`PROMPT`), and ``reasoning`` on with the markers
   ``<think>``/``</think>`` (several SmolLM2 tokens; the model is no
   reasoning model, so the markers are in the request).  First the
   *comfortable budget* of each schema: the thinking the model writes when
   nothing stops it (up to ``--think-cap`` tokens: SmolLM2 rarely ends it on
   its own), plus the answer it then writes, plus 8.  Then at 50 %, 80 % and
   100 % of it, three modes, interleaved per schema:

   * ``budget``: the defaults: the server ends the thinking where only the
     answer's reserve is left of ``max_tokens``
     (:mod:`grammar_backend.reasoning`), and budget closing ends the answer;
   * ``no-budget``: the thinking runs until the model ends it or
     ``max_tokens`` runs out (:class:`ReasoningConfig` ``reserve_answer``
     off); budget closing still ends the answer, where one has begun;
   * ``truncate`` (not with ``--quick``): no thinking budget and no closing
     (``on_budget: truncate``): the grammar applies after the end marker
     and nothing else, as vLLM, SGLang and TensorRT-LLM do.

   Valid = the answer (the text after the end marker) parses and validates
   against the full schema; ``fits`` = ``max_tokens`` holds the end marker,
   the shortest valid answer and the stop token (no mode can do better than
   that).
2. **Step cost** (in process, Qwen3's vocabulary, 64 rows): ``GrammarEngine.step``
   with every row inside its thinking section (the byte automaton, a cached
   mask row ANDed in) against the same rows answering (the matcher's fill,
   a JSON string value), interleaved; ms per step p50 / p99.

Nothing here asserts: figures vary with the machine; read ratios from one run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import numpy as np
from harness import MODEL_DIR, OWN_SCHEMAS, QWEN_DIR, QWEN_VOCAB, REPO

from contract.reasoning import Reasoning, split_reasoning
from grammar_backend.fidelity import validator_for
from grammar_backend.reasoning import ReasoningConfig
from grammar_backend.spec import ConstraintSpec, parse_constraint
from grammar_backend.tokenizer import load_tokenizer
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest
from llm_runtime.scheduler import FinishEvent, GenerationRequest, Scheduler, SchedulerConfig, TokenEvent

THINK: Final = Reasoning(end="</think>", start="<think>")
PROMPT: Final = ("First think step by step inside <think> and </think> about realistic values, then answer with one "
                 "JSON instance of this schema and nothing else: {schema}")
SHARES: Final = (50, 80, 100)
MODES: Final = ("budget", "no-budget", "truncate")


def schemas(quick: bool) -> list[tuple[str, dict[str, Any]]]:
    """The project's schemas: the hand-written fixtures (and the load test's without ``quick``)."""
    folders = [OWN_SCHEMAS] + ([] if quick else [REPO / "loadtest" / "schemas"])
    out = [(path.stem, json.loads(path.read_text())) for folder in folders for path in sorted(folder.glob("*.json"))]
    return out[:3] if quick else out


def spec_for(schema: dict[str, Any], reasoning: Reasoning | None, on_budget: str = "close") -> ConstraintSpec:
    spec = parse_constraint("json_schema", json.dumps(schema), {"on_budget": on_budget})
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, reasoning=reasoning))


class Runner:
    """The in-process stack: one torch engine, one grammar engine per thinking-budget setting."""

    def __init__(self, model_dir: Path, rows: int) -> None:
        self.engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=rows, max_seq_len=2048))
        bundle = load_tokenizer(model_dir, vocab_size=self.engine.vocab_size,
                                stop_token_ids=sorted(self.engine.eos_token_ids))
        self.bundle = bundle
        self.rows = rows

        def grammar(reserve: bool) -> GrammarEngine:
            config = GrammarEngineConfig(max_batch=rows, reasoning=ReasoningConfig(reserve_answer=reserve))
            return GrammarEngine(bundle.info, bundle.fingerprint, config, encode=bundle.encode,
                                 special_ids=bundle.special_ids())

        self.grammars = {True: grammar(True), False: grammar(False)}

    def close(self) -> None:
        for g in self.grammars.values():
            g.close()

    def prompt(self, schema: dict[str, Any]) -> list[int]:
        text = PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))
        ids: Any = self.bundle.hf.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def run(self, jobs: Sequence[tuple[dict[str, Any], ConstraintSpec, int, bool]]) -> list[FinishEvent]:
        """Greedy requests ``(schema, spec, max_tokens, reserve)``, ``rows`` at a time per grammar engine."""
        out: list[FinishEvent | None] = [None] * len(jobs)
        for reserve, grammar in self.grammars.items():
            mine = [i for i, job in enumerate(jobs) if job[3] is reserve]
            if not mine:
                continue
            done = threading.Semaphore(0)
            with Scheduler(self.engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=self.rows)) as s:
                for i in mine:
                    schema, spec, max_tokens, _ = jobs[i]
                    wire = spec.wire()

                    def on_event(event: TokenEvent | FinishEvent, i: int = i,
                                 done: threading.Semaphore = done) -> None:
                        if isinstance(event, FinishEvent):
                            out[i] = event
                            done.release()

                    s.submit(GenerationRequest(self.prompt(schema), max_tokens=max_tokens, temperature=0.0,
                                               constraint=ConstraintRequest(wire["kind"], wire["payload"],
                                                                            wire["options"], validated=True)),
                             on_event)
                for _ in mine:
                    if not done.acquire(timeout=1800):
                        raise TimeoutError("a request did not finish")
        finals = [f for f in out if f is not None]
        assert len(finals) == len(jobs)
        for f in finals:
            if f.finish_reason == "error":
                raise RuntimeError(f"request failed: {f.error}")
        return finals

    def fits(self, schema: dict[str, Any]) -> int:
        """The least ``max_tokens`` that holds the end marker, the shortest valid answer and the stop token."""
        import xgrammar as xgr

        grammar = self.grammars[True]
        matcher = xgr.GrammarMatcher(grammar.compile(spec_for(schema, None)))
        found = grammar.closer.complete(matcher)
        rest = grammar.marker_table(THINK.end).rest(0)
        return 0 if found is None or rest is None else len(rest) + len(found) + 1


def outcome(schema: dict[str, Any], final: FinishEvent) -> dict[str, Any]:
    _, answer, ended = split_reasoning(final.text, THINK)
    report = validator_for(schema).validate_text(answer) if ended else None
    return {"valid": bool(report is not None and report.valid), "ended": ended, "cut": final.reasoning_cut,
            "reasoning_tokens": final.reasoning_tokens, "tokens": final.completion_tokens,
            "finish": final.finish_reason, "close": final.close_reason, "answer": answer[:80]}


def validity_part(model_dir: Path, quick: bool, think_cap: int, rows: int) -> dict[str, Any]:
    modes_run = MODES[:2] if quick else MODES
    runner = Runner(model_dir, rows)
    try:
        chosen = schemas(quick)
        t0 = time.perf_counter()
        # The comfortable budget: the model's free thinking (capped) plus its answer plus 8.
        free = runner.run([(s, spec_for(s, Reasoning(THINK.end, THINK.start, think_cap)), think_cap + 512, True)
                           for _, s in chosen])
        comfortable = {}
        for (name, schema), final in zip(chosen, free, strict=True):
            comfortable[name] = final.completion_tokens + 8
        jobs: list[tuple[dict[str, Any], ConstraintSpec, int, bool]] = []
        keys: list[tuple[str, int, str]] = []
        for n, (name, schema) in enumerate(chosen):
            for share in SHARES:
                budget = max(1, comfortable[name] * share // 100)
                modes = modes_run if n % 2 else modes_run[::-1]  # the order flips per schema: noise hits all alike
                for mode in modes:
                    spec = spec_for(schema, THINK, "truncate" if mode == "truncate" else "close")
                    jobs.append((schema, spec, budget, mode == "budget"))
                    keys.append((name, share, mode))
        finals = runner.run(jobs)
        least = {name: runner.fits(schema) for name, schema in chosen}
        elapsed = time.perf_counter() - t0
    finally:
        runner.close()
    records = []
    for (name, share, mode), (schema, _, budget, _), final in zip(keys, jobs, finals, strict=True):
        records.append({"schema": name, "share": share, "mode": mode, "budget": budget,
                        "fits": 0 < least[name] <= budget, **outcome(schema, final)})
    table: dict[str, dict[str, Any]] = {}
    for mode in modes_run:
        for share in SHARES:
            mine = [r for r in records if r["mode"] == mode and r["share"] == share]
            fit = [r for r in mine if r["fits"]]
            table[f"{mode}@{share}"] = {"valid": sum(r["valid"] for r in mine), "n": len(mine),
                                        "valid_where_it_fits": sum(r["valid"] for r in fit), "fits": len(fit)}
    return {"elapsed_s": elapsed, "comfortable": comfortable, "least": least, "table": table, "records": records}


def step_part(steps: int) -> dict[str, Any]:
    """ms per ``GrammarEngine.step`` at 64 rows: thinking rows against answering rows (Qwen3's vocabulary)."""
    if (QWEN_DIR / "tokenizer.json").is_file():
        bundle = load_tokenizer(QWEN_DIR, vocab_size=QWEN_VOCAB, stop_token_ids=[151645])
    else:  # the model's own tokenizer, where `make tokenizers` has not run
        bundle = load_tokenizer(MODEL_DIR)
    rows = 64
    engine = GrammarEngine(bundle.info, bundle.fingerprint, GrammarEngineConfig(max_batch=rows), encode=bundle.encode,
                           special_ids=bundle.special_ids())
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
              "additionalProperties": False}
    word = bundle.encode(" hmm")
    opening = bundle.encode('{"note":"')
    times: dict[str, list[float]] = {"thinking": [], "answering": []}
    try:
        for mode in ("thinking", "answering"):
            engine.start(0, spec_for(schema, THINK if mode == "thinking" else None, "truncate"))  # compile, warm
            engine.end([0])
        ids = {m: np.arange(1 + k * rows, 1 + (k + 1) * rows, dtype=np.uint64) for k, m in enumerate(times)}
        for mode, seq in ids.items():
            for s in seq:
                # truncate: no budget check in either mode, so only the thinking and the fill are timed.
                engine.start(int(s), spec_for(schema, THINK if mode == "thinking" else None, "truncate"),
                             budget=1 << 20)
            engine.step(seq, np.zeros((rows, 0), np.int32), np.zeros(rows, np.int32))
        for s in ids["answering"]:  # into a string value, where the answering rows stay
            engine.step(np.array([s], np.uint64), np.array([opening], np.int32), np.array([len(opening)], np.int32))
        tokens = np.full((rows, 1), word[0], np.int32)
        counts = np.ones(rows, np.int32)
        for _ in range(steps):
            for mode, seq in ids.items():  # interleaved
                t0 = time.perf_counter()
                engine.step(seq, tokens, counts)
                times[mode].append(time.perf_counter() - t0)
        engine.end([int(s) for seq in ids.values() for s in seq])
    finally:
        engine.close()
    return {mode: {"p50_ms": float(np.percentile(t, 50) * 1e3), "p99_ms": float(np.percentile(t, 99) * 1e3)}
            for mode, t in times.items()} | {"vocab": int(bundle.info.vocab_size), "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__)
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_quick(parser, "3 schemas, a shorter free thinking, fewer steps")
    parser.add_argument("--think-cap", type=int, default=None, help="most tokens of the free thinking (192; 64 quick)")
    harness.add_rows(parser, 9, "requests decoded at once")
    parser.add_argument("--steps", type=int, default=None, help="grammar steps timed per mode (300; 100 quick)")
    harness.add_json(parser)
    args = parser.parse_args(argv)
    cap = args.think_cap or (64 if args.quick else 192)
    figures = {"validity": validity_part(args.model_dir, args.quick, cap, args.rows),
               "step": step_part(args.steps or (100 if args.quick else 300))}
    if args.json is not None:
        harness.write_json(args.json, figures)
    v = figures["validity"]
    print(f"validity: {len(v['comfortable'])} schemas, comfortable budgets {v['comfortable']}, "
          f"least that fits {v['least']}, {v['elapsed_s']:.0f} s")
    print(f"{'mode':<10} " + " ".join(f"{s:>3}% budget (fits)" for s in SHARES))
    for mode in (m for m in MODES if f"{m}@{SHARES[0]}" in v["table"]):
        cells = []
        for share in SHARES:
            c = v["table"][f"{mode}@{share}"]
            share_valid = 100 * c["valid"] / c["n"] if c["n"] else math.nan
            cells.append(f"{share_valid:5.0f}% {c['valid']}/{c['n']} ({c['valid_where_it_fits']}/{c['fits']})")
        print(f"{mode:<10} " + "  ".join(f"{cell:>18}" for cell in cells))
    for r in v["records"]:
        if r["fits"] and not r["valid"] and r["mode"] == "budget":
            print(f"  miss: {r['schema']} {r['share']}% budget {r['budget']}: {r['finish']} {r['close']} "
                  f"ended={r['ended']} {r['answer']!r}")
    s = figures["step"]
    print(f"grammar step, {s['rows']} rows, vocabulary {s['vocab']}: thinking {s['thinking']['p50_ms']:.2f} / "
          f"{s['thinking']['p99_ms']:.2f} ms, answering {s['answering']['p50_ms']:.2f} / "
          f"{s['answering']['p99_ms']:.2f} ms (p50 / p99)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
