"""Repetition controls: do penalties make more constrained outputs end on their own?

Usage (from the repository root, after ``make model``)::

    .venv/bin/python bench/penalty_bench.py ../shared/data/maskbench-dev            # ~25 min on 2 cores
    .venv/bin/python bench/penalty_bench.py ../shared/data/maskbench-dev --quick    # ~8 min

A real tritonserver on loopback (the default model, SmolLM2-135M) serves the
project's own schemas (``tests/fixtures/schemas``) and a seeded sample of
small MaskBench schemas, each with the prompt "Produce one realistic JSON
instance of this schema: ...", at ``--max-tokens`` (384; 256 with
``--quick``), with the default policies (budget and runaway closing on).
Every schema runs under each penalty setting (:data:`SETTINGS`) at
temperature 0 and 0.7 (seeded by the schema's index, so the settings draw
alike), 8 streams at a time, the settings interleaved per schema so machine
noise hits them alike.  Per (setting, temperature):

* ``own``: the model ended the output itself (no closing), and it validates;
* ``repeat``/``budget``: the server closed it on a runaway or at the budget;
* ``trunc``: it ended unparseable; ``invalid``: it parsed and broke the schema;
* ``valid``: it validates, however it ended; ``tokens``: mean completion tokens;
* ``loop``: valid outputs whose text holds a 12-character run three times in a
  row (what a repetition close leaves behind: ``"type","type","type"``).

The last line reads ``ended on their own: off G%/S%, best <setting> G%/S%``
(greedy / temperature 0.7).  Nothing here asserts.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
from budget_bench import PROMPT, sample
from harness import MODEL_DIR, OWN_SCHEMAS

from client import Client, ClientError, Constraint

#: The penalty settings compared, by name (SDK keyword arguments); "off" is the server's default.
SETTINGS: Final[dict[str, dict[str, float]]] = {
    "off": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "frequency 0.3": {"frequency_penalty": 0.3},
    "presence 0.5": {"presence_penalty": 0.5},
}
TEMPERATURES: Final = (0.0, 0.7)
_LOOP: Final = re.compile(r"(.{12,}?)\1\1", re.DOTALL)


def one(url: str, schema: dict[str, Any], penalties: dict[str, float], temperature: float, seed: int,
        max_tokens: int) -> dict[str, Any]:
    """One served request; returns its outcome."""
    prompt = PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))
    try:
        with Client(url, timeout_s=900) as client:
            result = client.generate(prompt, constraint=Constraint.json_schema(schema), max_tokens=max_tokens,
                                     temperature=temperature, seed=seed, require_complete=False,
                                     repetition_penalty=penalties.get("repetition_penalty"),
                                     frequency_penalty=penalties.get("frequency_penalty"),
                                     presence_penalty=penalties.get("presence_penalty"))
    except ClientError as err:
        return {"outcome": f"error: {err}"[:160], "tokens": 0, "loop": False}
    valid = bool(result.json is not None and result.json.valid)  # valid is None when the text did not parse
    if valid and not result.closed_early:
        outcome = "own"
    elif result.closed_early and result.close_reason == "repetition":
        outcome = "repeat" if valid else "invalid"
    elif result.closed_early:
        outcome = "budget" if valid else "invalid"
    elif result.complete:
        outcome = "invalid"
    else:
        outcome = "trunc"
    return {"outcome": outcome, "valid": valid, "tokens": result.usage.completion_tokens,
            "loop": bool(valid and _LOOP.search(result.text))}


def figures(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    n = len(outcomes)
    count = {k: sum(o["outcome"] == k for o in outcomes) for k in ("own", "repeat", "budget", "invalid", "trunc")}
    errors = [o["outcome"] for o in outcomes if o["outcome"].startswith("error")]
    return {"n": n, **count, "errors": errors, "valid": sum(o.get("valid", False) for o in outcomes),
            "loop": sum(o["loop"] for o in outcomes),
            "tokens": sum(o["tokens"] for o in outcomes) / max(n, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser)
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_count(parser, 35, "MaskBench schemas in the sample")
    harness.add_max_tokens(parser, 384)
    harness.add_seed(parser, 26)
    harness.add_quick(parser, "15 MaskBench schemas, 256 tokens")
    harness.add_json(parser, "the figures")
    args = parser.parse_args(argv)
    count, max_tokens = (15, 256) if args.quick else (args.count, args.max_tokens)
    schemas = [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(OWN_SCHEMAS.glob("*.json"))]
    schemas += [(name, schema) for name, schema, _ in sample(args.data, count, args.seed)]
    jobs = [(i, name, schema, setting, temp) for i, (name, schema) in enumerate(schemas)
            for temp in TEMPERATURES for setting in SETTINGS]
    print(f"{len(schemas)} schemas x {len(SETTINGS)} settings x {len(TEMPERATURES)} temperatures, "
          f"max_tokens {max_tokens}", flush=True)
    results: dict[tuple[str, float], list[dict[str, Any]]] = {(s, t): [] for s in SETTINGS for t in TEMPERATURES}
    t0 = time.perf_counter()
    with harness.serve(harness.render_values(args.model_dir), prefix="penalty-bench-") as server, \
            ThreadPoolExecutor(8) as pool:
        futures = [(setting, temp, pool.submit(one, server.url, schema, SETTINGS[setting], temp, i, max_tokens))
                   for i, _, schema, setting, temp in jobs]
        for setting, temp, fut in futures:
            results[(setting, temp)].append(fut.result())
    print(f"served in {time.perf_counter() - t0:.0f} s\n")
    if args.json:  # the raw outcomes first: a long run is never lost to a bug in the summary
        harness.write_json(args.json, {f"{s}@{t}": r for (s, t), r in results.items()})
    table = {f"{s}@{t}": figures(results[(s, t)]) for s in SETTINGS for t in TEMPERATURES}
    print(f"{'setting':<16}{'temp':>5}{'own':>6}{'repeat':>8}{'budget':>8}{'invalid':>9}{'trunc':>7}{'valid':>7}"
          f"{'loop':>6}{'tokens':>8}")
    for s in SETTINGS:
        for t in TEMPERATURES:
            f = table[f"{s}@{t}"]
            print(f"{s:<16}{t:>5}{f['own']:>6}{f['repeat']:>8}{f['budget']:>8}{f['invalid']:>9}{f['trunc']:>7}"
                  f"{f['valid']:>7}{f['loop']:>6}{f['tokens']:>8.0f}")
            for err in f["errors"]:
                print(f"    {err}")
    if args.json:
        harness.write_json(args.json, {"max_tokens": max_tokens, "schemas": [n for n, _ in schemas],
                                       "figures": table,
                                       "outcomes": {f"{s}@{t}": r for (s, t), r in results.items()}})

    def share(s: str, t: float) -> str:
        f = table[f"{s}@{t}"]
        return f"{100 * f['own'] / max(f['n'], 1):.0f}%"

    best = max(SETTINGS, key=lambda s: sum(table[f"{s}@{t}"]["own"] for t in TEMPERATURES))
    print(f"\nended on their own: off {share('off', 0.0)}/{share('off', 0.7)}, "
          f"best {best} {share(best, 0.0)}/{share(best, 0.7)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
