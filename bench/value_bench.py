"""Value checks: how many more completed outputs are valid, and what the retries cost.

Usage (from the repository root, after ``make model``)::

    .venv/bin/python bench/value_bench.py ../shared/data/maskbench-dev             # ~10 min on 2 cores
    .venv/bin/python bench/value_bench.py ../shared/data/maskbench-dev --count 12  # ~3 min

The sample: seeded dev-set schemas (at most ``MAX_SCHEMA_CHARS`` of compact
JSON, accepted by the server) that use a keyword no grammar enforces
(``uniqueItems``, ``contains``, ``not``, ``if``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, ``multipleOf``, ``format``, a lookahead
``pattern``) and that :func:`grammar_backend.values.rules_for` checks under
llguidance, ``auto``'s JSON backend.  Each schema is served twice by a real
tritonserver on loopback (greedy, ``--concurrency`` streams, the order of the
two flipping from schema to schema so machine noise hits both alike):
``value_retries: 0`` (before) and the default (after).

Per run: completed outputs (``complete`` or closed early) and how many of
them validate against the full schema; outputs that used retries and the
retries; output tokens, tokens generated (with those the retries dropped:
``RESULT.value_dropped_tokens``) and the sum of request latencies.  The last line
reads ``completed outputs valid: before X% (A/B), after Y% (C/D)``.
Nothing here asserts: figures vary with the machine; read ratios from one run.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
from budget_bench import MAX_SCHEMA_CHARS, PROMPT, _accepted
from harness import MODEL_DIR

from client import Client, ClientError, Constraint
from grammar_backend.spec import keyword_sites, parse_constraint
from grammar_backend.values import rules_for

#: Keywords that no grammar of either backend expresses (fully), and a lookahead pattern.
KEYWORDS: Final = frozenset({"uniqueItems", "contains", "not", "if", "dependentRequired", "dependentSchemas",
                             "dependencies", "multipleOf", "format"})


def _uses_checked_keyword(schema: Any) -> bool:
    for _, key, value in keyword_sites(schema):
        if key in KEYWORDS or (key == "pattern" and isinstance(value, str) and "(?" in value):
            return True
    return False


def sample(data: Path, count: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` (name, schema) whose values llguidance-served decoding checks, seeded, small schemas only."""
    files = sorted(data.glob("*.json"))
    random.Random(seed).shuffle(files)
    out = []
    for path in files:
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        if not isinstance(schema, dict) or len(json.dumps(schema, separators=(",", ":"))) > MAX_SCHEMA_CHARS:
            continue
        if not _accepted(schema) or not _uses_checked_keyword(schema):
            continue
        if rules_for(parse_constraint("json_schema", json.dumps(schema)), "llguidance") is None:
            continue
        out.append((path.name, schema))
        if len(out) == count:
            break
    return out


def one(url: str, schema: dict[str, Any], retries: int | None, max_tokens: int) -> dict[str, Any]:
    """One served request (greedy); ``retries`` None: the server default."""
    constraint = Constraint.json_schema(schema).with_policies(value_retries=retries)
    prompt = PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))
    t0 = time.perf_counter()
    try:
        with Client(url, timeout_s=900) as client:
            result = client.generate(prompt, constraint=constraint, max_tokens=max_tokens, require_complete=False)
    except ClientError as err:
        return {"outcome": f"error: {err}"[:120], "tokens": 0, "dropped": 0, "seconds": time.perf_counter() - t0,
                "retries": 0, "completed": False, "valid": False, "violations": []}
    completed = result.complete or result.closed_early
    valid = bool(result.json is not None and result.json.valid)
    return {
        "outcome": "valid" if valid else "invalid" if completed else "truncated",
        "tokens": result.usage.completion_tokens,
        "dropped": result.value_dropped_tokens,
        "seconds": time.perf_counter() - t0,
        "retries": result.value_retries,
        "completed": completed,
        "valid": valid,
        "backend": result.backend,
        "violations": [] if result.json is None else [v.message[:120] for v in result.json.violations[:3]],
    }


def served(model_dir: Path, schemas: Sequence[tuple[str, dict[str, Any]]], max_tokens: int,
           concurrency: int) -> dict[str, list[dict[str, Any]]]:
    """Both runs of every schema through one real server; returns the outcomes by run."""
    jobs = []
    for i in range(len(schemas)):
        pair = [("before", i, 0), ("after", i, None)]
        jobs += pair if i % 2 else pair[::-1]
    with harness.serve(harness.render_values(model_dir), prefix="value-bench-") as server, \
            ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda job: one(server.url, schemas[job[1]][1], job[2], max_tokens), jobs))
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for (run, i, _), outcome in zip(jobs, done, strict=True):
        runs[run].append({"schema": schemas[i][0], **outcome})
    for outcomes in runs.values():
        outcomes.sort(key=lambda o: o["schema"])
    return runs


def figures(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The totals of one run."""
    completed = [o for o in outcomes if o["completed"]]
    return {
        "outputs": len(outcomes),
        "completed": len(completed),
        "completed_valid": sum(o["valid"] for o in completed),
        "valid": sum(o["valid"] for o in outcomes),
        "retried_outputs": sum(1 for o in outcomes if o["retries"]),
        "retries": sum(o["retries"] for o in outcomes),
        "tokens": sum(o["tokens"] for o in outcomes),
        "generated": sum(o["tokens"] + o["dropped"] for o in outcomes),
        "seconds": sum(o["seconds"] for o in outcomes),
        "errors": sum(1 for o in outcomes if o["outcome"].startswith("error")),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run both modes and print their figures; returns the exit status."""
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser)
    harness.add_count(parser, 40)
    harness.add_seed(parser, 0)
    harness.add_max_tokens(parser, 384)
    harness.add_concurrency(parser, 4)
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_json(parser, "every outcome")
    args = parser.parse_args(argv)
    schemas = sample(args.data, args.count, args.seed)
    print(f"value_bench: {len(schemas)} schemas from {args.data} (seed {args.seed}), max_tokens {args.max_tokens}, "
          f"concurrency {args.concurrency}, greedy", flush=True)
    runs = served(args.model_dir, schemas, args.max_tokens, args.concurrency)
    before, after = figures(runs["before"]), figures(runs["after"])
    for name, f in (("before (value_retries 0)", before), ("after (default)", after)):
        print(f"{name}: {f['completed']}/{f['outputs']} completed, {f['completed_valid']} of them valid; "
              f"{f['retried_outputs']} outputs retried ({f['retries']} retries); {f['tokens']} output tokens, "
              f"{f['generated']} generated (with the dropped ones); {f['seconds']:.1f} s of request time; "
              f"{f['errors']} errors")
    print(f"cost: tokens generated after/before {after['generated'] / max(1, before['generated']):.3f}, request time "
          f"after/before {after['seconds'] / max(1e-9, before['seconds']):.3f}")

    def share(f: dict[str, Any]) -> str:
        return f"{100 * f['completed_valid'] / max(1, f['completed']):.1f}% ({f['completed_valid']}/{f['completed']})"

    print(f"completed outputs valid: before {share(before)}, after {share(after)}")
    if args.json is not None:
        harness.write_json(args.json, {"schemas": [n for n, _ in schemas], "before": before, "after": after,
                                       "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
