"""Prompt-lookup speculation, served: tokens per forward and tokens per second with drafts on and off.

Usage (from the repository root, after ``make model``)::

    .venv/bin/python bench/speculation_bench.py            # ~10 min on 2 shared cores
    .venv/bin/python bench/speculation_bench.py --quick    # ~4 min (also BENCH_QUICK=1; make bench-spec)

One ``tritonserver`` per model (rendered like ``make render``, the server's
``DRAFT_TOKENS`` default off) serves every request, greedy; each request
sets ``DRAFT_TOKENS`` itself: 0 (off) or ``--drafts`` (on).  The default
model first, then the tiny stand-in (a random model that never copies: the
cost of drafts that are not kept, on a fast forward).  Workloads:

* ``extract``: the prompt holds records the output copies (the extraction
  that speculation is for), free text and under the records' JSON schema;
* ``free``: open generation (a story; a city as JSON), where little repeats.

Each cell runs ``--concurrency`` streams at once, off and on one after the
other (the order flips every round, so machine noise hits both alike).
Forward passes come from the ``llm_steps_total`` counter, drafts fed and
kept from ``llm_draft_tokens_total`` and ``llm_draft_tokens_kept_total``
(read before and after each batch; batches never overlap).  Greedy outputs
must be the same on and off: every difference is counted and printed.
Nothing here asserts a time.  The last line is ``speculation on/off
tokens/s at 1 stream: extract A (json B), free C (json D) (MODEL); ...``
for each model.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
from harness import MODEL_DIR

from client import Client, Constraint
from deploy.drain import scrape, value
from telemetry import PUBLISH_MIN_GAP_S

RECORD_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "born": {"type": "integer"},
                   "field": {"type": "string"}},
    "required": ["name", "city", "born", "field"], "additionalProperties": False,
}
CITY_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"},
                   "description": {"type": "string"}},
    "required": ["name", "country", "population", "description"], "additionalProperties": False,
}
PEOPLE: Final = (
    ("Ada Lovelace", "London", 1815, "mathematics"),
    ("Alan Turing", "Maida Vale", 1912, "computer science"),
    ("Marie Curie", "Warsaw", 1867, "physics and chemistry"),
    ("Grace Hopper", "New York City", 1906, "programming languages"),
)
STORIES: Final = ("a lighthouse keeper", "a lost cat", "a baker at dawn", "two rival chess players")
CITIES: Final = ("Lisbon", "Kyoto", "Nairobi", "Quito")
WORKLOADS: Final = ("extract", "free")
MODES: Final = ("off", "on")


def request_of(workload: str, constrained: bool, i: int) -> tuple[str, Constraint | None]:
    """The ``i``-th prompt of a workload, and its constraint."""
    if workload == "extract":
        name, city, born, field = PEOPLE[i % len(PEOPLE)]
        record = json.dumps({"name": name, "city": city, "born": born, "field": field})
        return (f"Here is a record: {record}. Copy the record exactly, as JSON, and nothing else.",
                Constraint.json_schema(RECORD_SCHEMA) if constrained else None)
    if constrained:
        return f"Describe the city of {CITIES[i % len(CITIES)]} as JSON.", Constraint.json_schema(CITY_SCHEMA)
    return f"Write a short story about {STORIES[i % len(STORIES)]}.", None


@dataclass(frozen=True)
class Record:
    model: str
    workload: str
    constrained: bool
    concurrency: int
    mode: str
    round: int
    wall_s: float
    tokens: int
    forwards: int
    drafts: int
    kept: int
    texts: tuple[str, ...]


def counters(metrics_url: str) -> tuple[int, int, int]:
    """Steps, drafts fed and drafts kept, once the llm model has published its last step: no request
    live, and the same values twice, one publication gap apart (a fast model's last steps otherwise
    land in the next batch's count)."""
    last: tuple[int, int, int] | None = None
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        m = scrape(metrics_url)
        now = (int(value(m, "llm_steps_total")), int(value(m, "llm_draft_tokens_total")),
               int(value(m, "llm_draft_tokens_kept_total")))
        if now == last and value(m, "llm_live_requests") == 0:
            return now
        last = now
        time.sleep(2 * PUBLISH_MIN_GAP_S)
    raise RuntimeError("the llm model's counters did not settle within 60 s")


def batch(client: Client, metrics_url: str, model: str, workload: str, constrained: bool, concurrency: int,
          mode: str, round_no: int, drafts: int, max_tokens: int) -> Record:
    """``concurrency`` requests at once, timed from the first send to the last answer.

    Raises
    ------
    client.errors.ClientError
        A failed request fails the benchmark (never silently left out).
    """
    results: list[Any] = [None] * concurrency
    errors: list[BaseException] = []

    def one(i: int) -> None:
        prompt, constraint = request_of(workload, constrained, i)
        try:
            results[i] = client.generate(prompt, constraint=constraint, max_tokens=max_tokens, temperature=0.0,
                                         draft_tokens=drafts if mode == "on" else 0, require_complete=False)
        except BaseException as err:  # noqa: BLE001 -- re-raised below, on the bench's thread
            errors.append(err)

    before = counters(metrics_url)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    after = counters(metrics_url)
    return Record(model, workload, constrained, concurrency, mode, round_no, wall,
                  sum(r.usage.completion_tokens for r in results), after[0] - before[0], after[1] - before[1],
                  after[2] - before[2], tuple(r.text for r in results))


def run(model: str, model_dir: Path, rounds: int, concurrencies: Sequence[int], drafts: int,
        max_tokens: int) -> list[Record]:
    records: list[Record] = []
    with harness.serve(harness.render_values(model_dir), prefix="spec-bench-") as server, \
            Client(server.url, timeout_s=600.0) as client:
        # Warm-up, not counted: every cell once in both modes.  A JSON constraint's first completed output
        # also sets off backend auto's replay and xgrammar compile (grammar_service.auto_switch), which
        # would otherwise land in one measured batch.
        for workload in WORKLOADS:
            for constrained in (False, True):
                for mode in MODES:
                    batch(client, server.metrics_url, model, workload, constrained, max(concurrencies), mode, -1,
                          drafts, max_tokens)
        time.sleep(5.0)
        for r in range(rounds):
            for k, (workload, constrained, conc) in enumerate(
                    (w, c, n) for w in WORKLOADS for c in (False, True) for n in concurrencies):
                order = MODES if (r + k) % 2 == 0 else MODES[::-1]
                pair = {m: batch(client, server.metrics_url, model, workload, constrained, conc, m, r, drafts,
                                 max_tokens) for m in order}
                records += pair.values()
                off, on = pair["off"], pair["on"]
                print(f"  {model} round {r} {workload:7s} {'json' if constrained else 'text':4s} x{conc}: "
                      f"off {off.tokens / off.wall_s:6.1f} tok/s {off.tokens / max(1, off.forwards):.2f} tok/fwd, "
                      f"on {on.tokens / on.wall_s:6.1f} tok/s {on.tokens / max(1, on.forwards):.2f} tok/fwd "
                      f"(kept {on.kept}/{on.drafts} drafts)", flush=True)
    return records


def report(records: Sequence[Record], model: str, concurrencies: Sequence[int]) -> str:
    """Print the model's table; returns its part of the last line."""
    print(f"\n== {model}: greedy, sums over rounds ==")
    print(f"  {'workload':8s} {'kind':4s} {'streams':>7s} {'tok/fwd off':>11s} {'tok/fwd on':>10s} "
          f"{'tok/s off':>9s} {'tok/s on':>8s} {'on/off':>6s} {'kept/fed':>9s} {'differ':>6s}")
    ratio: dict[tuple[str, bool], float] = {}
    for workload in WORKLOADS:
        for constrained in (False, True):
            for conc in concurrencies:
                cell = [x for x in records if x.model == model and x.workload == workload and x.round >= 0
                        and x.constrained == constrained and x.concurrency == conc]
                by = {m: [x for x in cell if x.mode == m] for m in MODES}
                tok = {m: sum(x.tokens for x in by[m]) for m in MODES}
                fwd = {m: sum(x.forwards for x in by[m]) for m in MODES}
                rate = {m: tok[m] / sum(x.wall_s for x in by[m]) for m in MODES}
                fed, kept = sum(x.drafts for x in by["on"]), sum(x.kept for x in by["on"])
                differ = sum(a != b for x, y in zip(by["off"], by["on"], strict=True)
                             for a, b in zip(x.texts, y.texts, strict=True))
                if conc == concurrencies[0]:
                    ratio[(workload, constrained)] = rate["on"] / rate["off"]
                print(f"  {workload:8s} {'json' if constrained else 'text':4s} {conc:7d} "
                      f"{tok['off'] / max(1, fwd['off']):11.2f} {tok['on'] / max(1, fwd['on']):10.2f} "
                      f"{rate['off']:9.1f} {rate['on']:8.1f} {rate['on'] / rate['off']:6.3f} "
                      f"{kept:4d}/{fed:<4d} {differ:6d}")
    return (f"extract {ratio[('extract', False)]:.2f} (json {ratio[('extract', True)]:.2f}), "
            f"free {ratio[('free', False)]:.2f} (json {ratio[('free', True)]:.2f}) ({model})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = harness.bench_parser(__doc__)
    harness.add_rounds(parser, 3)
    harness.add_max_tokens(parser, 96)
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_quick(parser, "one round, 48 tokens, one stream", env=True)
    parser.add_argument("--drafts", type=int, default=6, help="DRAFT_TOKENS of the 'on' requests (default %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4],
                        help="streams at once per cell (default %(default)s); the last line reads the first")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny stand-in")
    harness.add_json(parser, "every record")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rounds, max_tokens, concurrencies = args.rounds, args.max_tokens, args.concurrency
    if args.quick:
        rounds, max_tokens, concurrencies = 1, 48, [1]
    models = [("default", args.model_dir)] + ([] if args.no_tiny else [("tiny", harness.tiny_checkpoint())])
    records: list[Record] = []
    for name, path in models:
        records += run(name, path, rounds, concurrencies, args.drafts, max_tokens)
    parts = [report(records, name, concurrencies) for name, _ in models]
    if args.json is not None:
        harness.write_json(args.json, [asdict(x) for x in records])
    print(f"speculation on/off tokens/s at {concurrencies[0]} stream(s): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
