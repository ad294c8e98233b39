"""Budget and runaway closing: does ``on_budget: close`` keep outputs valid, and what does it cost?

Usage (from the repository root, after ``make model``)::

    .venv/bin/python bench/budget_bench.py ../shared/data/maskbench-dev             # ~15 min on 2 cores
    .venv/bin/python bench/budget_bench.py ../shared/data/maskbench-dev --quick     # ~5 min
    .venv/bin/python bench/budget_bench.py ../shared/data/maskbench-dev --kinds-only  # part 2c, ~10 s

Five parts, in one run:

1. **Search** (in process, no server).  For a seeded sample of MaskBench
   schemas with a valid test instance: the instance is tokenized with the
   SmolLM2 tokenizer, cut at a random token, and :meth:`Closer.complete`
   searches the completion of that prefix.  Reports how often one is found,
   how often prefix + completion validates against the full schema (xgrammar
   leaves some keywords unenforced: see the fidelity report), the search time
   p50/p99/max and the completion length in tokens.
2. **Step overhead** (in process).  ``GrammarEngine.step`` over 8 rows that
   replay a runaway string (``"bin/bin/..."``) with a 4,096-token budget,
   ``on_budget: close`` vs ``truncate``, interleaved: what the budget checks
   cost on rows far from their budget.
2b. **Replay** (in process, the real engine and masks, no model).  The
   issue's misses: large MaskBench schemas (3-20k characters), a scripted
   "model" that writes the start of the valid instance up to its first string
   value, then runs away (an aperiodic digit run, ``1234567890...``,
   ``1000...``, prose without a short unit, invented keys), at
   ``--replay-tokens`` (384); where the mask refuses its token it takes the
   closing one.  The engine has llguidance, which ``backend: auto`` serves JSON with.
2c. **Kinds** (in process, the real engine, both backends).  One output of
   each constraint kind (regex, a regex with escapes, EBNF, Lark, choice,
   three parallel tool calls in a structural tag), written by a scripted model
   (``standins/scripted.py``) at 50 %, 80 % and 100 % of its length in
   tokens: complete by the model, closed early, or truncated, and whether the
   constraint's shortest output fits (where it does, nothing may be truncated).
3. **Served** (a real tritonserver on loopback, 4 streams at a time, greedy).
   The project's own schemas (``tests/fixtures/schemas``) and a seeded
   sample of small MaskBench schemas, each with the prompt "Produce one
   realistic JSON instance of this schema: ...".  Phase 1, at
   ``--max-tokens`` (384): ``truncate``/``continue`` (before) vs the defaults
   (after).  Phase 2, for the schemas whose "before" output finished on its
   own in ``n`` tokens: ``max_tokens`` at 50 % and 80 % of ``n``, ``close``
   vs ``truncate``; and the ample budget again with budget closing on (and
   runaway closing off), whose output must be unchanged.  Per run: outputs
   that parse and validate (by the model alone or closed early), parsed but
   invalid (keywords xgrammar leaves unenforced), truncated; tokens used.
   Modes alternate per schema, so machine noise hits both alike.

Every miss (an output that is not valid although the shortest valid
instance fits its budget) is printed with the tail of its text and why: the
violation of an output that parsed, else where its completion stopped fitting
(its text replayed with a completion search at every token).  ``--misses
OUT.json`` prints them for an earlier run's ``--json`` file.

The last line reads ``valid at 50% budget: close X% (C/T) truncate Y% (D/T)``.
Nothing here asserts: figures vary with the machine; read ratios from one run.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import numpy as np
import xgrammar as xgr
from e2e_bench import pct
from harness import MODEL_DIR, OWN_SCHEMAS

from client import Client, ClientError, Constraint
from grammar_backend.closing import Closer
from grammar_backend.compile import compile_spec
from grammar_backend.errors import GrammarError
from grammar_backend.fidelity import validate_output
from grammar_backend.protocol import CLOSE_STATE_REASONS
from grammar_backend.spec import parse_constraint
from grammar_backend.tokenizer import load_tokenizer
from grammar_service.engine import GrammarEngine, GrammarEngineConfig

PROMPT: Final = "Produce one realistic JSON instance of this schema: {schema}"
#: Schemas larger than this (compact JSON characters) are left out: they make
#: prompts of thousands of tokens, and the served part measures closing, not prefill.
MAX_SCHEMA_CHARS: Final = 2500
#: Served runs without budget closing (their misses are the point of comparison, not closing's).
WITHOUT_CLOSING: Final = frozenset({"before", "truncate50", "truncate80"})
#: Part 2b's schemas: the issue's misses were in schemas of 3-19k characters.
LARGE: Final = (3000, 20000)
#: Part 2b's runaways (each repeated for as long as the output runs): a counter's digits (no short
#: period), the period-10 digit run and ``1000...`` of the issue, and prose without a short unit.
RUNAWAYS: Final[dict[str, str]] = {
    "digits": str(7**400),
    "period10": "1234567890" * 40,
    "zeros": "1" + "0" * 400,
    "prose": "",  # filled below: 400 words in a seeded random order
    # Invented keys after the string value ends (issue 47: "xzx":1,"yzx":1,... in an open object): no short
    # period, and no key twice within the budget (256 keys; repeated keys are the value checks', which this
    # part leaves off); where the object is closed the mask refuses the key and the model takes the closer's.
    "keys": 'a",' + "".join(f'"{a}{b}{c}{d}":1,' for a in "xyzw" for b in "xyzw" for c in "xyzw" for d in "xyzw"),
}
_WORDS: Final = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "while", "seven", "wizards",
                 "judge", "boxing", "matches", "near", "ancient", "harbors", "filled", "with", "curious",
                 "travelers", "carrying", "maps", "and", "lanterns")
_rng = random.Random(5)
RUNAWAYS["prose"] = " ".join(_rng.choice(_WORDS) for _ in range(400))
MODES: Final[dict[str, dict[str, str]]] = {
    "close": {},  # the defaults
    "truncate": {"on_budget": "truncate", "on_repeat": "continue"},
}


def _accepted(schema: dict[str, Any]) -> bool:
    """Whether the server would take the schema (a refused one is not part of the sample)."""
    try:
        parse_constraint("json_schema", json.dumps(schema))
    except GrammarError:
        return False
    return True


def sample(data: Path, count: int, seed: int, sizes: tuple[int, int] = (0, MAX_SCHEMA_CHARS), *,
           object_instance: bool = False) -> list[tuple[str, dict[str, Any], Any]]:
    """``count`` (name, schema, first valid instance) from ``data``, seeded, of ``sizes`` compact characters
    (small by default; ``object_instance``: the instance is a JSON object)."""
    files = sorted(data.glob("*.json"))
    random.Random(seed).shuffle(files)
    out = []
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        schema = doc["schema"]
        size = len(json.dumps(schema, separators=(",", ":"))) if isinstance(schema, dict) else -1
        if (valid and sizes[0] <= size <= sizes[1] and (isinstance(valid[0], dict) or not object_instance)
                and _accepted(schema)):
            out.append((path.name, schema, valid[0]))
        if len(out) == count:
            break
    return out


def search_part(model_dir: Path, schemas: Sequence[tuple[str, dict[str, Any], Any]], seed: int) -> dict[str, Any]:
    """Part 1: completions of random prefixes of valid instances."""
    from transformers import AutoTokenizer

    bundle = load_tokenizer(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    compiler = xgr.GrammarCompiler(bundle.info, max_threads=1)
    closer = Closer(bundle.info)
    rng = random.Random(seed)
    times: list[float] = []
    lengths: list[int] = []
    found = valid = tried = 0
    missed: list[str] = []
    for name, schema, instance in schemas:
        spec = parse_constraint("json_schema", json.dumps(schema))
        try:
            matcher = xgr.GrammarMatcher(compile_spec(compiler, spec))
        except RuntimeError:
            continue
        ids = tokenizer.encode(json.dumps(instance, separators=(",", ":"), ensure_ascii=False),
                               add_special_tokens=False)
        if len(ids) < 2:
            continue
        cut = rng.randint(1, len(ids) - 1)
        if not all(matcher.accept_token(t) for t in ids[:cut]):
            continue  # an instance the grammar over-constrains (see maskbench.py)
        tried += 1
        t0 = time.perf_counter()
        tokens = closer.complete(matcher)
        times.append(time.perf_counter() - t0)
        if tokens is None:
            missed.append(name)
            continue
        found += 1
        lengths.append(len(tokens))
        if validate_output(schema, tokenizer.decode(ids[:cut] + list(tokens))).valid:
            valid += 1
    return {"tried": tried, "found": found, "valid": valid, "missed": missed,
            "search_ms": {"p50": pct(times, 50) * 1e3, "p99": pct(times, 99) * 1e3, "max": max(times) * 1e3},
            "completion_tokens": {"p50": pct(lengths, 50), "p99": pct(lengths, 99)}}


def step_part(model_dir: Path, steps: int) -> dict[str, float]:
    """Part 2: per-step cost of budget checks on rows far from their budget, close vs truncate."""
    from transformers import AutoTokenizer

    bundle = load_tokenizer(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    engine = GrammarEngine(bundle.info, bundle.fingerprint, GrammarEngineConfig(max_batch=16), encode=bundle.encode)
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    prefix = tokenizer.encode('{"s":"', add_special_tokens=False)
    unit = tokenizer.encode("bin/", add_special_tokens=False)
    rows = 8
    timings: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        ids = {}
        for k, (mode, options) in enumerate(MODES.items()):
            spec = parse_constraint("json_schema", schema, {**options, "on_repeat": "continue"})
            ids[mode] = np.arange(rows, dtype=np.uint64) + 100 * (k + 1)
            for seq_id in ids[mode]:
                engine.start(int(seq_id), spec, budget=4096)
            first = np.array([prefix] * rows, np.int32)
            engine.step(ids[mode], first, np.full(rows, len(prefix), np.int32))
        counts = np.ones(rows, np.int32)
        for i in range(steps):
            tokens = np.full((rows, 1), unit[i % len(unit)], np.int32)
            order = list(MODES) if i % 2 else list(MODES)[::-1]
            for mode in order:
                t0 = time.perf_counter()
                engine.step(ids[mode], tokens, counts)
                timings[mode].append(time.perf_counter() - t0)
    finally:
        engine.close()
    return {f"{mode}_us_p50": pct(t, 50) * 1e6 for mode, t in timings.items()} | {
        f"{mode}_us_p99": pct(t, 99) * 1e6 for mode, t in timings.items()}


class _Diagnosis:
    """Why an output missed although a completion fitted: replays its text with a fresh matcher and a
    completion search at every token (a few seconds per miss, only for misses)."""

    def __init__(self, model_dir: Path) -> None:
        self.bundle = load_tokenizer(str(model_dir))
        self.compiler = xgr.GrammarCompiler(self.bundle.info, max_threads=1)
        self.closer = Closer(self.bundle.info)

    def reason(self, schema: dict[str, Any], text: str, budget: int, outcome: str) -> str:
        """One line: the violation of a parsed output, else where the completion stopped fitting."""
        if outcome == "parsed_invalid":
            report = validate_output(schema, text)
            first = report.violations[0] if report.violations else None
            return (f"ends invalid: {first.pointer or '/'} {first.message} ({first.keyword})" if first
                    else f"ends invalid: {report.parse_error}")
        if outcome.startswith("error"):
            return outcome
        matcher = xgr.GrammarMatcher(compile_spec(self.compiler, parse_constraint("json_schema",
                                                                                   json.dumps(schema))))
        ids = self.bundle.hf.encode(text, add_special_tokens=False)  # re-tokenized: positions are approximate
        last_fit: tuple[int, int] | None = None
        lengths: list[int | None] = []
        for position in range(len(ids) + 1):
            found = self.closer.complete(matcher)
            lengths.append(None if found is None else len(found))
            if found is not None and position + len(found) + 1 <= budget:
                last_fit = (position, len(found))
            if position == len(ids) or not matcher.accept_token(ids[position]):
                break
        if last_fit is None:
            known = [n for n in lengths if n is not None]
            return ("no completion found within the search bound at any token" if not known
                    else f"no completion ever fitted (shortest at the start: {lengths[0]} tokens, budget {budget})")
        at, size = last_fit
        after = lengths[at + 1] if at + 1 < len(lengths) else None
        grown = ("no completion found" if after is None else f"a completion of {after} tokens")
        cut = self.bundle.hf.decode(ids[max(0, at - 12):at + 1])
        return (f"fitted until token {at} (completion {size} tokens, {budget - at - 1} left), then "
                f"{cut!r} led to {grown}: not closed in time")


def print_misses(records: Sequence[dict[str, Any]], schemas: dict[str, dict[str, Any]], model_dir: Path) -> int:
    """Print each output that is not valid although the shortest valid instance fits its budget (runs with
    budget closing on only); returns their count."""
    misses = [r for r in records if 0 < r.get("shortest", 0) <= r["budget"] and r["run"] not in WITHOUT_CLOSING
              and r["outcome"] not in ("valid", "valid_closed")]
    diagnosis = _Diagnosis(model_dir) if misses else None
    for r in misses:
        schema = schemas[r["schema"]]
        reason = diagnosis.reason(schema, r["text"], r["budget"], r["outcome"]) if diagnosis else ""
        print(f"  miss {r['run']:10s} {r['schema']} budget {r['budget']} tokens {r['tokens']} "
              f"{r['outcome']} closed {r.get('close_reason')}: ...{r['text'][-70:]!r}\n      why: {reason}",
              flush=True)
    return len(misses)


def replay_part(model_dir: Path, schemas: Sequence[tuple[str, dict[str, Any], Any]],
                budget: int) -> dict[str, Any]:
    """Part 2b: the issue's runaways on large schemas, through the real engine (no server, no model).

    A scripted "model" writes the start of each schema's valid instance up to its first string value,
    then a runaway of each kind in :data:`RUNAWAYS` (``standins.scripted``: where the mask refuses its
    token it takes the closer's).
    """
    from grammar_backend.llg import LlgBackend
    from grammar_service.workers import WorkerConfig
    from standins.scripted import replay

    bundle = load_tokenizer(str(model_dir))

    def encode(text: str) -> list[int]:
        return list(bundle.hf.encode(text, add_special_tokens=False))

    def decode(tokens: list[int]) -> str:
        return str(bundle.hf.decode(tokens))

    # These schemas' compiles may pass the serving default (1 GiB) on a loaded host: the closing is measured.
    # With llguidance, as served: backend auto picks it for JSON.
    engine = GrammarEngine(bundle.info, bundle.fingerprint,
                           GrammarEngineConfig(max_batch=1, workers=WorkerConfig(memory_bytes=4096 << 20)),
                           encode=bundle.encode,
                           llg=LlgBackend(bundle.hf, bundle.info.vocab_size, bundle.info.stop_token_ids))
    records: list[dict[str, Any]] = []
    step_s: list[float] = []
    seq_id = 0
    try:
        for name, schema, instance in schemas:
            text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
            cut = text.find('":"')
            if cut < 0:
                continue
            spec = parse_constraint("json_schema", json.dumps(schema))
            minimal = shortest(model_dir, [(name, schema, None)])[0]
            for kind, runaway in RUNAWAYS.items():
                seq_id += 1
                try:
                    out = replay(engine, decode, encode, seq_id, spec, text[:cut + 3], runaway, budget, step_s)
                except GrammarError as err:
                    records.append({"run": kind, "schema": name, "shortest": 0, "budget": budget,
                                    "outcome": f"error: {err}"[:120], "tokens": 0, "text": "", "close_reason": None})
                    break
                body, state = out.text, out.closed
                report = validate_output(schema, body)
                outcome = (("valid_closed" if state is not None else "valid") if report.valid
                           else "parsed_invalid" if report.parsed else "truncated")
                records.append({"run": kind, "schema": name, "shortest": minimal, "budget": budget,
                                "outcome": outcome, "tokens": out.tokens, "text": body,
                                "close_reason": None if state is None else CLOSE_STATE_REASONS[state]})
    finally:
        engine.close()
    by_kind = {kind: dict(Counter(r["outcome"] for r in records if r["run"] == kind)) for kind in RUNAWAYS}
    return {"records": records, "outcomes": by_kind, "step_us_p50": pct(step_s, 50) * 1e6,
            "step_us_p99": pct(step_s, 99) * 1e6}


#: Part 2c's outputs, one per constraint kind: (name, kind, payload, what the scripted model writes).  The
#: model writes the text and then stops, so at 100 % of its length (plus the stop token) it fits.
_METRIC = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}},
                                            "window": {"type": "integer"}},
           "required": ["names", "window"], "additionalProperties": False}
KINDS: Final[list[tuple[str, str, str, str]]] = [
    ("regex", "regex", r"([0-9]{3}-[0-9]{4}\n)+", "".join(f"555-{1000 + 37 * i}\n" for i in range(12))),
    ("regex-escapes", "regex", r'\{\n   "name": "[\w]+",\n   "population": [\d]+\n\}',
     '{\n   "name": "Paris",\n   "population": 2148271\n}'),
    ("ebnf", "ebnf", 'root ::= expr "\\n"\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
     "(12+34)-(56+(7-8))+(91-(23+45))-(67+89)+(10-(11+12))\n"),
    ("lark", "lark", 'start: row+\nrow: /[a-z]+/ "," /[0-9]+/ "\\n"',
     "".join(f"{w},{n}\n" for w, n in zip(("apple", "pear", "plum", "fig", "lime", "kiwi", "date", "peach"),
                                         range(3, 80, 9)))),
    ("choice", "choice", json.dumps(["no", "the second and much longer answer of the two"]),
     "the second and much longer answer of the two"),
    ("tool-calls", "structural_tag", "", ""),  # filled below: three parallel calls under tool_choice required
]
#: Part 2c's budgets, in shares of the output's length in tokens.
SHARES: Final = (0.5, 0.8, 1.0)


def _tool_calls() -> tuple[str, str]:
    from openai_api.tools import CALL_CLOSE, Tool, call_prefix, tool_constraint

    tool = Tool("get_metrics", "", _METRIC, True)
    calls = "\n".join(call_prefix(tool.name) + json.dumps({"names": [f"metric_{i}_{j}" for j in range(4)],
                                                           "window": 30}) + "}" + CALL_CLOSE for i in range(3))
    return tool_constraint([tool], "required", parallel=True).payload, calls


def kinds_part(model_dir: Path) -> dict[str, Any]:
    """Part 2c: every constraint kind at 50/80/100 % of its output's length (issue 47), through the real
    engine with a scripted model (``standins.scripted``): it writes the output, where the mask refuses
    its token it takes the closer's.  Per kind and share: complete by the model (``valid``), closed early
    (``closed``), ended without the grammar's stop (``truncated``); ``fits``: the shortest output of the
    constraint fits the budget, where every output must end complete."""
    from grammar_backend.llg import LlgBackend
    from standins.scripted import replay

    bundle = load_tokenizer(str(model_dir))
    engine = GrammarEngine(bundle.info, bundle.fingerprint, GrammarEngineConfig(max_batch=1), encode=bundle.encode,
                           llg=LlgBackend(bundle.hf, bundle.info.vocab_size, bundle.info.stop_token_ids))
    compiler = xgr.GrammarCompiler(bundle.info, max_threads=1)

    def encode(text: str) -> list[int]:
        return list(bundle.hf.encode(text, add_special_tokens=False))

    def decode(tokens: list[int]) -> str:
        return str(bundle.hf.decode(tokens))

    table: dict[str, dict[str, Any]] = {}
    seq_id = 0
    try:
        for name, kind, payload, text in KINDS:
            if kind == "structural_tag":
                payload, text = _tool_calls()
            length = len(encode(text)) + 1  # the stop token
            for backend in ("xgrammar", "llguidance") if kind != "structural_tag" else ("xgrammar",):
                spec = parse_constraint(kind, payload, {"backend": backend})
                shortest = engine.closer.complete(xgr.GrammarMatcher(compile_spec(compiler, spec)), shortest=True) or ()
                for share in SHARES:
                    seq_id += 1
                    budget = max(1, round(length * share))
                    out = replay(engine, decode, encode, seq_id, spec, text, "", budget)
                    outcome = ("truncated" if not out.stopped else "closed" if out.closed is not None
                               else "valid")
                    row = table.setdefault(f"{name}/{backend}", {})
                    row[f"{share:.0%}"] = {"outcome": outcome, "budget": budget,
                                            "fits": len(shortest) + 1 <= budget, "tokens": out.tokens,
                                            "tail": out.text[-60:]}
    finally:
        engine.close()
    return table


def one(url: str, schema: dict[str, Any], options: dict[str, str], max_tokens: int) -> dict[str, Any]:
    """One served request (greedy); returns its outcome."""
    constraint = Constraint.json_schema(schema).with_policies(on_budget=options.get("on_budget"),
                                                             on_repeat=options.get("on_repeat"))
    prompt = PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))
    try:
        with Client(url, timeout_s=900) as client:
            result = client.generate(prompt, constraint=constraint, max_tokens=max_tokens, require_complete=False)
    except ClientError as err:
        return {"outcome": f"error: {err}"[:120], "tokens": 0, "text": "", "complete": False, "close_reason": None}
    if result.json is not None and result.json.valid:
        outcome = "valid_closed" if result.closed_early else "valid"
    elif result.complete or result.closed_early:
        outcome = "parsed_invalid"  # keywords xgrammar leaves unenforced (the fidelity report)
    else:
        outcome = "truncated"
    return {"outcome": outcome, "tokens": result.usage.completion_tokens, "text": result.text,
            "complete": result.complete, "close_reason": result.close_reason}


def shortest(model_dir: Path, schemas: Sequence[tuple[str, dict[str, Any], Any]]) -> list[int]:
    """Per schema, the tokens of its shortest valid instance plus the stop token (0: none found).

    A budget below it cannot hold any valid output: closing cannot help there.
    """
    bundle = load_tokenizer(str(model_dir))
    compiler = xgr.GrammarCompiler(bundle.info, max_threads=1)
    closer = Closer(bundle.info)
    out = []
    for _, schema, _ in schemas:
        matcher = xgr.GrammarMatcher(compile_spec(compiler, parse_constraint("json_schema", json.dumps(schema))))
        tokens = closer.complete(matcher)
        out.append(0 if tokens is None else len(tokens) + 1)
    return out


def _valid_share(outcomes: Sequence[dict[str, Any]]) -> tuple[int, int]:
    ok = sum(o["outcome"] in ("valid", "valid_closed") for o in outcomes)
    return ok, len(outcomes)


def served_part(model_dir: Path, schemas: Sequence[tuple[str, dict[str, Any], Any]], max_tokens: int,
                concurrency: int) -> dict[str, Any]:
    """Part 3: the same schemas through the real server; modes interleaved in every phase.

    Phase 1: every schema at ``max_tokens``, ``truncate`` (before) and the
    defaults (after).  Phase 2, for the schemas whose ``truncate`` output
    finished on its own in ``n`` tokens: ``max_tokens`` at 50 % and 80 % of
    ``n``, ``close`` vs ``truncate``; and at ``max_tokens`` with budget
    closing on and runaway closing off, whose text must equal the ``truncate``
    one (an ample budget changes nothing).
    """
    close_budget_only = {"on_budget": "close", "on_repeat": "continue"}
    minimal = shortest(model_dir, schemas)
    with harness.serve(harness.render_values(model_dir), prefix="budget-bench-") as server:
        def run(jobs: list[tuple[str, int, dict[str, str], int]]) -> dict[tuple[str, int], dict[str, Any]]:
            with ThreadPoolExecutor(concurrency) as pool:
                done = pool.map(lambda job: one(server.url, schemas[job[1]][1], job[2], job[3]), jobs)
                return {(job[0], job[1]): {**outcome, "budget": job[3]} for job, outcome in zip(jobs, done,
                                                                                               strict=True)}

        t0 = time.perf_counter()
        first = run([job for i in range(len(schemas)) for job in _pair(
            ("before", i, MODES["truncate"], max_tokens), ("after", i, MODES["close"], max_tokens), i)])
        natural = {i: first["before", i]["tokens"] for i in range(len(schemas)) if first["before", i]["complete"]}
        jobs = []
        for i, n in natural.items():
            for share in (50, 80):
                budget = max(1, n * share // 100)
                jobs += _pair((f"close{share}", i, MODES["close"], budget),
                              (f"truncate{share}", i, MODES["truncate"], budget), i)
            jobs.append(("ample", i, close_budget_only, max_tokens))
        second = run(jobs)
        elapsed = time.perf_counter() - t0
    outcomes = {**first, **second}
    figures: dict[str, Any] = {"elapsed_s": elapsed, "schemas": len(schemas), "natural": len(natural)}
    for key in ("before", "after", "close50", "truncate50", "close80", "truncate80"):
        mine = [o for (k, _), o in outcomes.items() if k == key]
        # Where the shortest valid instance fits in the budget (always, at max_tokens).
        fits = [o for (k, i), o in outcomes.items() if k == key and 0 < minimal[i] <= o["budget"]]
        figures[key] = {
            "outcomes": dict(Counter(o["outcome"] for o in mine)),
            "closed": dict(Counter(o["close_reason"] for o in mine if o["close_reason"])),
            "valid": _valid_share(mine),
            "valid_where_it_fits": _valid_share(fits),
            "tokens_mean": float(np.mean([o["tokens"] for o in mine])) if mine else float("nan"),
        }
    figures["records"] = [{"run": k, "schema": schemas[i][0], "shortest": minimal[i], **o}
                          for (k, i), o in sorted(outcomes.items())]
    figures["ample_unchanged"] = (sum(outcomes["ample", i]["text"] == outcomes["before", i]["text"]
                                      for i in natural), len(natural))
    return figures


def _pair(a: tuple[str, int, dict[str, str], int], b: tuple[str, int, dict[str, str], int],
          i: int) -> list[tuple[str, int, dict[str, str], int]]:
    """The two modes of one schema, in an order that flips from schema to schema (noise hits both alike)."""
    return [a, b] if i % 2 else [b, a]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three parts and print their figures; returns the exit status."""
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser)
    parser.add_argument("--search-schemas", type=int, default=300)
    parser.add_argument("--served-schemas", type=int, default=60, help="MaskBench schemas, plus the project's own")
    harness.add_max_tokens(parser, 384)
    harness.add_concurrency(parser, 4)
    parser.add_argument("--steps", type=int, default=400)
    harness.add_seed(parser, 7)
    parser.add_argument("--replay-schemas", type=int, default=12, help="large schemas replayed with runaways")
    parser.add_argument("--replay-tokens", type=int, default=384, help="their budget (the issue's max_tokens)")
    harness.add_quick(parser, "100 search, 6 replayed and 16 served schemas, 256 tokens")
    parser.add_argument("--misses", type=Path, default=None,
                        help="only print the misses of an earlier run's --json file (and why), then exit")
    parser.add_argument("--kinds-only", action="store_true", help="only part 2c (every kind; about a minute)")
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_json(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.search_schemas, args.served_schemas, args.max_tokens, args.steps = 100, 16, 256, 200
        args.replay_schemas = 6
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json (run `make model`)")
    if args.misses is not None:
        saved = json.loads(args.misses.read_text())
        by_name = {**{p.name: json.loads(p.read_text(encoding="utf-8")) for p in OWN_SCHEMAS.glob("*.json")}}
        for part in ("replay", "served"):
            records = saved.get(part, {}).get("records", [])
            for r in records:
                if r["schema"] not in by_name:
                    by_name[r["schema"]] = json.loads((args.data / r["schema"]).read_text(encoding="utf-8"))["schema"]
            print(f"{part}: {print_misses(records, by_name, args.model_dir)} misses where a completion fitted")
        return 0
    t_all = time.perf_counter()
    kinds = kinds_part(args.model_dir)
    print("kinds: outcome at 50 % / 80 % / 100 % of the output's length (* : the shortest output fits)")
    for key, row in kinds.items():
        print(f"  {key:24s} " + "  ".join(f"{share} {r['outcome']}{'*' if r['fits'] else ''} ({r['tokens']}/{r['budget']})"
                                          for share, r in row.items()), flush=True)
    misses = [(key, share, r) for key, row in kinds.items() for share, r in row.items()
              if r["fits"] and r["outcome"] == "truncated"]
    print(f"kinds: {len(misses)} truncated where the shortest output fits"
          + "".join(f"\n  {k} {sh}: ...{r['tail']!r}" for k, sh, r in misses), flush=True)
    if args.kinds_only:
        return 0
    search = search_part(args.model_dir, sample(args.data, args.search_schemas, args.seed), args.seed)
    print(f"search: {search['found']}/{search['tried']} prefixes completed "
          f"({100 * search['found'] / max(search['tried'], 1):.1f} %), {search['valid']} validate; "
          f"search ms p50 {search['search_ms']['p50']:.2f} p99 {search['search_ms']['p99']:.2f} "
          f"max {search['search_ms']['max']:.2f}; completion tokens p50 {search['completion_tokens']['p50']:.0f} "
          f"p99 {search['completion_tokens']['p99']:.0f}; missed {search['missed']}", flush=True)
    steps = step_part(args.model_dir, args.steps)
    print("step, 8 rows far from their budget, us: "
          + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()), flush=True)
    large = sample(args.data, args.replay_schemas, args.seed, LARGE, object_instance=True)  # the misses
    replay = replay_part(args.model_dir, large, args.replay_tokens)
    print(f"replay: {len(large)} schemas of {LARGE[0]}-{LARGE[1]} characters, budget {args.replay_tokens}, "
          f"step us p50 {replay['step_us_p50']:.0f} p99 {replay['step_us_p99']:.0f}", flush=True)
    for kind, outcomes in replay["outcomes"].items():
        print(f"  {kind:10s} {outcomes}", flush=True)
    large_schemas = {name: schema for name, schema, _ in large}
    print(f"replay: {print_misses(replay['records'], large_schemas, args.model_dir)} misses where a completion "
          "fitted", flush=True)
    own = [(path.name, json.loads(path.read_text(encoding="utf-8")), None)
           for path in sorted(OWN_SCHEMAS.glob("*.json"))]
    served = served_part(args.model_dir, own + sample(args.data, args.served_schemas, args.seed + 1),
                         args.max_tokens, args.concurrency)
    print(f"served: {served['schemas']} schemas, {served['natural']} finish on their own within "
          f"{args.max_tokens} tokens; {served['elapsed_s']:.0f} s", flush=True)
    for key in ("before", "after", "close50", "truncate50", "close80", "truncate80"):
        figures = served[key]
        ok, total = figures["valid"]
        fit_ok, fit_total = figures["valid_where_it_fits"]
        print(f"  {key:10s} valid {ok}/{total} ({fit_ok}/{fit_total} where the shortest valid instance fits): "
              f"{figures['outcomes']} closed {figures['closed']} mean tokens {figures['tokens_mean']:.1f}",
              flush=True)
    same, natural = served["ample_unchanged"]
    print(f"  ample budget, budget closing on: {same}/{natural} outputs unchanged")
    served_schemas = {name: schema for name, schema, _ in own + sample(args.data, args.served_schemas, args.seed + 1)}
    print(f"served: {print_misses(served['records'], served_schemas, args.model_dir)} misses where the shortest "
          "valid instance fitted", flush=True)
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if args.json is not None:
        harness.write_json(args.json, {"kinds": kinds, "search": search, "steps": steps, "replay": replay,
                                       "served": served})

    def share(key: str) -> str:
        ok, total = served[key]["valid"]
        fit_ok, fit_total = served[key]["valid_where_it_fits"]
        return f"{100 * ok / max(total, 1):.0f}% ({ok}/{total}; {fit_ok}/{fit_total} where one fits)"

    print(f"valid at {args.max_tokens} tokens: before (truncate) {share('before')}, after (close) {share('after')}")
    print(f"valid at 50% budget: close {share('close50')} truncate {share('truncate50')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
