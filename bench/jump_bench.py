"""Jump-forward on schema-heavy prompts: time to a complete JSON object, served, vs unconstrained.

Usage (from the repository root, after ``make model``)::

    .venv/bin/python bench/jump_bench.py                 # ~6 min on 2 shared cores
    .venv/bin/python bench/jump_bench.py --rounds 1 --json /tmp/jump.json

One ``tritonserver`` (rendered like ``make render``, the embedded default)
serves every request, one at a time (concurrency 1: the figure is a
request's latency, not batch throughput).  For each schema and round, in an
order that rotates every round so machine noise hits every mode alike:

* ``jump``: the schema, greedy, option ``jump_forward`` on (the default);
* ``no-jump``: the same request with ``jump_forward`` off;
* ``free``: no constraint, ``max_tokens`` = the ``jump`` output's token
  count, on a prompt that makes the model write prose past it: unconstrained
  generation of the same length.

Forward passes per request come from the ``llm_steps_total`` counter of the
metrics endpoint (read before and after each request; requests never
overlap).  Nothing here asserts a time.  The last line is ``ratio
jump-forward/unconstrained time to a complete object: R`` (sum of ``jump``
latencies over the sum of ``free`` latencies of the same lengths).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
from harness import MODEL_DIR, OWN_SCHEMAS

from client import Client, Constraint
from deploy.drain import scrape, value

#: Schema-heavy requests: long required keys, enums and nested objects, where
#: much of the output is forced by the schema.
CASES: Final[tuple[tuple[str, str], ...]] = (
    ("order", "Create an order record as JSON."),
    ("person", "Describe a person as JSON."),
    ("tool_weather", "Call the weather tool for Lisbon."),
    ("shipment", "Describe a parcel shipment as JSON."),
)
SHIPMENT_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "tracking_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{9}$"},
        "destination_address": {
            "type": "object",
            "properties": {"street_address": {"type": "string", "maxLength": 30},
                           "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                           "country_code": {"enum": ["PT", "ES", "FR", "DE"]}},
            "required": ["street_address", "postal_code", "country_code"], "additionalProperties": False,
        },
        "delivery_status": {"enum": ["label_created", "in_transit", "out_for_delivery", "delivered"]},
        "signature_required": {"type": "boolean"},
    },
    "required": ["tracking_number", "destination_address", "delivery_status", "signature_required"],
    "additionalProperties": False,
}
FREE_PROMPT: Final = "Write a long, detailed essay about the history of the city of Lisbon."
MODES: Final = ("jump", "no-jump", "free")


@dataclass(frozen=True)
class Record:
    """One measured request."""

    case: str
    mode: str
    round: int
    latency_s: float
    completion_tokens: int
    forwards: int
    finish_reason: str
    valid: bool | None


def schema_of(case: str) -> dict[str, Any]:
    if case == "shipment":
        return SHIPMENT_SCHEMA
    return json.loads((OWN_SCHEMAS / f"{case}.json").read_text())  # type: ignore[no-any-return]


def steps(metrics_url: str) -> int:
    return int(value(scrape(metrics_url), "llm_steps_total"))


def measure(client: Client, metrics_url: str, case: str, mode: str, round_no: int, max_tokens: int) -> Record:
    """One request, timed, with the forward passes it took.

    Raises
    ------
    client.errors.ClientError
        A failed request fails the benchmark (never silently left out).
    """
    prompt, constraint = FREE_PROMPT, None
    if mode != "free":
        prompt = dict(CASES)[case]
        constraint = Constraint.json_schema(schema_of(case)).with_policies(jump_forward=mode == "jump")
    before = steps(metrics_url)
    t0 = time.perf_counter()
    result = client.generate(prompt, constraint=constraint, max_tokens=max_tokens, temperature=0.0,
                             require_complete=False)
    latency = time.perf_counter() - t0
    time.sleep(0.3)  # the llm model publishes its counters on the step after the request ends
    return Record(case, mode, round_no, latency, result.usage.completion_tokens, steps(metrics_url) - before,
                  result.finish_reason, None if result.json is None else result.json.valid)


def run(url: str, metrics_url: str, rounds: int, max_tokens: int) -> list[Record]:
    records: list[Record] = []
    with Client(url, timeout_s=600.0) as client:
        for case, _ in CASES:  # warm-up: compiles every grammar once
            measure(client, metrics_url, case, "jump", -1, max_tokens)
        for r in range(rounds):
            for k, (case, _) in enumerate(CASES):
                shift = (r + k) % 2
                jump = measure(client, metrics_url, case, "jump", r, max_tokens) if shift == 0 else None
                nojump = measure(client, metrics_url, case, "no-jump", r, max_tokens)
                if jump is None:
                    jump = measure(client, metrics_url, case, "jump", r, max_tokens)
                free = measure(client, metrics_url, case, "free", r, jump.completion_tokens)
                records += [jump, nojump, free]
                print(f"  round {r} {case:12s}: " + ", ".join(
                    f"{x.mode} {x.latency_s:.2f} s/{x.completion_tokens} tok/{x.forwards} fwd" for x in (jump, nojump, free)),
                    flush=True)
    return records


def report(records: Sequence[Record]) -> float:
    """Print the table; returns the jump/free time ratio."""
    print("\n== time to a complete JSON object, concurrency 1, greedy (sums over rounds) ==")
    print(f"  {'schema':12s} {'tokens':>7s} {'fwd jump':>9s} {'fwd no-jump':>11s} {'jump s':>8s} {'no-jump s':>9s} "
          f"{'free s':>8s} {'jump/free':>9s} {'jump/no-jump':>12s}")
    totals = {m: 0.0 for m in MODES}
    for case, _ in CASES:
        rows = {m: [x for x in records if x.case == case and x.mode == m and x.round >= 0] for m in MODES}
        t = {m: sum(x.latency_s for x in rows[m]) for m in MODES}
        for m in MODES:
            totals[m] += t[m]
        tokens = sum(x.completion_tokens for x in rows["jump"])
        print(f"  {case:12s} {tokens:7d} {sum(x.forwards for x in rows['jump']):9d} "
              f"{sum(x.forwards for x in rows['no-jump']):11d} {t['jump']:8.2f} {t['no-jump']:9.2f} {t['free']:8.2f} "
              f"{t['jump'] / t['free']:9.3f} {t['jump'] / t['no-jump']:12.3f}")
    short = [x for x in records if x.mode == "free" and x.round >= 0 and x.finish_reason != "length"]
    invalid = [x for x in records if x.mode != "free" and x.round >= 0 and x.valid is not True]
    print(f"  free outputs that ended before their length: {len(short)}; constrained outputs not valid: {len(invalid)}")
    print(f"  total: jump {totals['jump']:.2f} s, no-jump {totals['no-jump']:.2f} s, free {totals['free']:.2f} s; "
          f"jump/no-jump {totals['jump'] / totals['no-jump']:.3f}")
    return totals["jump"] / totals["free"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = harness.bench_parser(__doc__)
    harness.add_rounds(parser, 2)
    harness.add_max_tokens(parser, 256, "per constrained request")
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_json(parser, "every record")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with harness.serve(harness.render_values(args.model_dir), prefix="jump-bench-") as server:
        records = run(server.url, server.metrics_url, args.rounds, args.max_tokens)
    r = report(records)
    if args.json is not None:
        harness.write_json(args.json, [asdict(x) for x in records])
    print(f"ratio jump-forward/unconstrained time to a complete object: {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
