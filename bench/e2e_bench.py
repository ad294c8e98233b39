"""End-to-end cost of grammar constraints on the real ``constrained_llm`` ensemble.

Usage (from the repository root, after ``make model``)::

    make bench-e2e                                            # ~10 min on 2 shared cores (BENCH_QUICK=1: ~2 min)
    .venv/bin/python bench/e2e_bench.py --quick --json /tmp/e2e.json --plot /tmp/e2e.png

What it does, in one process and one server:

1. Renders ``model_repository/`` into a temporary folder (``deploy.render``
   with ``deploy/values.json`` and ``MODEL_DIR`` = the local SmolLM2 folder)
   and starts its own ``tritonserver`` on free loopback ports
   (:func:`harness.serve`, the gateway in this process).
2. Sends the SAME prompts constrained (a JSON schema of a person: name, age,
   city, hobbies with ``maxItems``) and unconstrained, greedy, the same
   ``max_tokens``, through :class:`client.Client` streams.  Constrained and
   unconstrained requests alternate (per prompt at concurrency 1, per batch at
   concurrency 8 and 16, the order flipping every pass; each round repeats
   its passes for at least ``--min-seconds`` per concurrency), so machine
   noise from the other workers on this shared host hits both sides alike.
   Concurrency N is N threads, each with its own stream, released together by
   a barrier (16 = the default ``MAX_BATCH``).
3. Reports output tokens/s (``usage.completion_tokens`` / wall time: summed
   request time at concurrency 1, first start to last end of each batch at
   concurrency 8), time to first token (first non-empty text delta) p50/p99,
   and the constrained/unconstrained ratios.  One warm-up request per side
   runs first (the constrained one pays the one-time grammar compile, shown
   on its own line) and is not counted.  Each unconstrained request or
   batch runs beside the same one on the same engine in this process
   (:class:`InProcess`: no Triton, right before or after it, turn by turn):
   served / in-process tokens/s.
4. Stops the server and parses the ``llm step stats: {json}`` line the llm
   model logs at shutdown: forward time, the per-step round trip to the
   grammar model (``grammar_s``) and the part of it NOT hidden behind the
   forward (``mask_wait_s``).  These figures cover every step of the run,
   warm-up and unconstrained steps included (unconstrained steps carry no
   grammar time; the llm model drops their NaN entries).
5. In this process, with the server gone: the grammar fill time per step,
   ``GrammarEngine.step`` (accept the previous token + fill the next mask),
   for 1 and 8 sequences on the same schema, each sequence replaying the
   token path of a real constrained output of step 2 (re-tokenized; the
   server does not return token ids).

6. Equal work: the two modes end at different lengths (a JSON object stops,
   free text runs on), so tokens/s mixes batch shrinkage with grammar cost.
   The server's step stats give the decode-step time at each full live batch
   for steps whose rows were all free or all constrained (no prompt joining):
   tokens per step / step time is the throughput at equal output lengths
   (a constrained step adds more than one token per row where it jumps
   forward over forced text).  The last line is ``ratio
   constrained/unconstrained at concurrency 8: R`` with that R.

Nothing here asserts a time; the script prints a table (``--json`` writes
every figure and raw per-request record, ``--plot`` a PNG).  Wall-clock ``perf_counter`` on a
shared machine: read ratios from one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:
    # Imported as bench.e2e_bench (the integration tests read its step stats), bench/ is not on sys.path,
    # and harness lives there (run as a script, sys.path[0] is bench/ already).
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from harness import ENSEMBLE, MODEL_DIR, VALUES

from client import Client, Constraint

if TYPE_CHECKING:
    from llm_runtime.scheduler import Scheduler

STATS_MARKER: Final = "llm step stats: "

#: Several fields, a nested array with maxItems and bounded strings: a realistic
#: extraction schema whose grammar has a few dozen states.
PERSON_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "hobbies", "employed"],
    "additionalProperties": False,
}

#: Asking for JSON in both modes keeps the unconstrained output close to the
#: constrained one in kind, so both sides do similar work per request.
PROMPTS: Final[tuple[str, ...]] = (
    "Invent a fictional person. Reply with JSON: name, age, city, email, hobbies, employed.",
    "Describe a retired teacher from Lisbon as a JSON object with name, age, city, email, hobbies and employed.",
    "Give me a JSON record of a young software engineer: name, age, city, email, hobbies, employed.",
    "Create a JSON profile for a musician living in Osaka (name, age, city, email, hobbies, employed).",
)

MODES: Final = ("constrained", "unconstrained")
CONCURRENCIES: Final = (1, 8, 16)
QUICK_CONCURRENCIES: Final = (1, 8)

T = TypeVar("T")


@dataclass(frozen=True)
class Record:
    """One measured request."""

    mode: str
    concurrency: int
    round: int
    prompt: int
    start_s: float
    ttft_s: float
    latency_s: float
    completion_tokens: int
    finish_reason: str
    complete: bool
    valid: bool | None
    text: str


# --------------------------------------------------------------------------- helpers
def passes(min_s: float) -> Iterator[int]:
    """Pass numbers 0, 1, ... until ``min_s`` seconds have passed since the first (at least one pass).

    A batch of 16 tiny-model streams lasts about 0.1 s, so one batch per
    figure rests on one moment of this shared host: a quick run with one
    read served/in-process 0.69, where runs of 3 s per figure read 0.46-0.51.
    """
    end = time.monotonic() + min_s
    n = 0
    while n == 0 or time.monotonic() < end:
        yield n
        n += 1


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (its threads included); 0 once it is gone."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(times.user + times.system)


def tree_cpu_s(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` and of every process below it."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    return cpu_seconds(pid) + sum(cpu_seconds(kid.pid) for kid in kids)


def pct(values: Sequence[float], q: float) -> float:
    """Percentile ``q`` of ``values`` (linear interpolation); NaN when empty."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else math.nan


def ms(seconds: float) -> str:
    """Seconds as a right-aligned millisecond figure."""
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:9.3f}"


def ratio(num: float, den: float) -> str:
    """``num / den`` formatted, or ``-`` when undefined."""
    if math.isnan(num) or math.isnan(den) or den == 0:
        return "-"
    return f"{num / den:.3f}"


# --------------------------------------------------------------------------- requests
def one_request(
    client: Client,
    mode: str,
    concurrency: int,
    round_no: int,
    prompt_idx: int,
    max_tokens: int,
    start_gate: Callable[[], object] | None = None,
) -> Record:
    """Stream one request and time it (TTFT = first non-empty text delta).

    Raises
    ------
    client.errors.ClientError
        On any request failure, including a server ``error`` result: a failed
        request must fail the benchmark, never be silently left out.
    """
    constraint = Constraint.json_schema(PERSON_SCHEMA) if mode == "constrained" else None
    if start_gate is not None:
        start_gate()
    t0 = time.perf_counter()
    ttft = math.nan
    result = None
    # require_complete=False: a length-capped output is a normal outcome here
    # (both sides get the same max_tokens); errors still raise.
    for chunk in client.stream(
        PROMPTS[prompt_idx], constraint=constraint, max_tokens=max_tokens, temperature=0.0, require_complete=False
    ):
        if chunk.text and math.isnan(ttft):
            ttft = time.perf_counter() - t0
        if chunk.result is not None:
            result = chunk.result
    latency = time.perf_counter() - t0
    if result is None:
        raise RuntimeError(f"{mode} prompt {prompt_idx}: stream ended without a final result")
    return Record(
        mode=mode,
        concurrency=concurrency,
        round=round_no,
        prompt=prompt_idx,
        start_s=t0,
        ttft_s=ttft,
        latency_s=latency,
        completion_tokens=result.usage.completion_tokens,
        finish_reason=result.finish_reason,
        complete=result.complete,
        valid=None if result.json is None else result.json.valid,
        text=result.text,
    )


def concurrent_batch(
    client: Client, mode: str, round_no: int, max_tokens: int, n: int
) -> tuple[list[Record], float]:
    """Run ``n`` requests at once, one thread and one stream each.

    Returns
    -------
    records, wall_s
        The records and the time from the first start to the last end.
    """
    # The timeout frees the other threads if one fails before reaching the barrier.
    barrier = threading.Barrier(n, timeout=120.0)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"bench-{mode}") as pool:
        futures = [
            pool.submit(one_request, client, mode, n, round_no, i % len(PROMPTS), max_tokens, barrier.wait)
            for i in range(n)
        ]
        # result() re-raises a request's exception here: a failed request fails the run.
        done = [f.result() for f in futures]
    wall = max(r.start_s + r.latency_s for r in done) - min(r.start_s for r in done)
    return done, wall


def run_e2e(url: str, rounds: int, max_tokens: int, concurrencies: Sequence[int] = CONCURRENCIES,
            reference: InProcess | None = None, server_cpu: Callable[[], float] | None = None,
            min_s: float = 0.0) -> dict[str, Any]:
    """Warm up, then the interleaved measured rounds; returns raw records and walls.

    Each round measures each concurrency for at least ``min_s`` seconds
    (:func:`passes`), both modes alternating.

    ``reference``: each unconstrained request (concurrency 1) or batch runs
    beside an in-process batch of the same prompts (:meth:`InProcess.beside`;
    ``server_cpu`` reads the server's CPU seconds around it).
    """
    def paired(call: Callable[[], T], mode: str, n: int, prompt: int) -> T:
        if reference is None or mode == "constrained":
            return call()
        return reference.beside(call, n, prompt, server_cpu)

    records: list[Record] = []
    # (mode, concurrency) -> wall seconds over which its tokens were produced.
    walls: dict[tuple[str, int], float] = {(m, c): 0.0 for m in MODES for c in concurrencies}
    with Client(url, timeout_s=600.0) as client:
        warm = {mode: one_request(client, mode, 1, -1, 0, max_tokens) for mode in MODES}
        for mode, rec in warm.items():
            print(f"  warm-up {mode:13s}: ttft {rec.ttft_s * 1e3:8.1f} ms, {rec.completion_tokens} tokens "
                  f"in {rec.latency_s:.2f} s", flush=True)  # fmt: skip
        for r in range(rounds):
            t_round = time.perf_counter()
            for k in passes(min_s):
                order = MODES if (r + k) % 2 == 0 else MODES[::-1]
                for p in range(len(PROMPTS)):
                    # Flip the order per prompt too, so neither side always runs
                    # right after the other's (cache-warming) request.
                    for mode in order if p % 2 == 0 else order[::-1]:
                        rec = paired(partial(one_request, client, mode, 1, r, p, max_tokens), mode, 1, p)
                        records.append(rec)
                        walls[(mode, 1)] += rec.latency_s
            for conc in (c for c in concurrencies if c > 1):
                for k in passes(min_s):
                    for mode in MODES if (r + k) % 2 == 0 else MODES[::-1]:
                        batch, wall = paired(partial(concurrent_batch, client, mode, r, max_tokens, conc),
                                             mode, conc, 0)
                        records.extend(batch)
                        walls[(mode, conc)] += wall
            print(f"  round {r + 1}/{rounds} done in {time.perf_counter() - t_round:.1f} s", flush=True)
    return {"records": records, "walls": walls, "warmup": warm}


def summarize(records: list[Record], walls: dict[tuple[str, int], float]) -> dict[str, dict[str, Any]]:
    """Per (mode, concurrency): tokens/s, TTFT and latency percentiles, outcome counts."""
    out: dict[str, dict[str, Any]] = {}
    concurrencies = sorted({c for _, c in walls})
    for mode in MODES:
        for conc in concurrencies:
            rs = [r for r in records if r.mode == mode and r.concurrency == conc]
            tokens = sum(r.completion_tokens for r in rs)
            wall = walls[(mode, conc)]
            out[f"{mode}@{conc}"] = {
                "requests": len(rs),
                "completion_tokens": tokens,
                "tokens_per_request_mean": tokens / len(rs) if rs else math.nan,
                "wall_s": wall,
                "tokens_per_s": tokens / wall if wall > 0 else math.nan,
                "ttft_s_p50": pct([r.ttft_s for r in rs if not math.isnan(r.ttft_s)], 50),
                "ttft_s_p99": pct([r.ttft_s for r in rs if not math.isnan(r.ttft_s)], 99),
                "latency_s_p50": pct([r.latency_s for r in rs], 50),
                "finish_stop": sum(r.finish_reason == "stop" for r in rs),
                "finish_length": sum(r.finish_reason == "length" for r in rs),
                "json_valid": sum(r.valid is True for r in rs),
            }
    return out


# --------------------------------------------------------------------------- server log
def parse_step_stats(log_text: str) -> list[dict[str, Any]]:
    """Every ``llm step stats: {json}`` object in a server log (one per llm instance).

    Raises
    ------
    RuntimeError
        If there is none, or one is not valid JSON.
    """
    found: list[dict[str, Any]] = []
    for line in log_text.splitlines():
        at = line.find(STATS_MARKER)
        if at < 0:
            continue
        try:
            # Triton 2.51 logs a Python-backend message as a quoted JSON string
            # (`model.py:115] "llm step stats: {\\"steps\\": ...}"`): unquote it first.
            if at > 0 and line[at - 1] == '"':
                message, _ = json.JSONDecoder().raw_decode(line, at - 1)
                body = str(message)[len(STATS_MARKER) :]
            else:
                body = line[at + len(STATS_MARKER) :]
            found.append(json.loads(body))
        except ValueError as err:
            raise RuntimeError(f"server log: unparsable step stats line: {line!r}") from err
    if not found:
        raise RuntimeError(f"server log: no {STATS_MARKER.strip()!r} line (did the llm model finalize?)")
    return found


# --------------------------------------------------------------------------- in-process grammar fill
def grammar_fill(model_dir: Path, texts: Sequence[str], reps: int) -> dict[str, dict[str, float]]:
    """Time ``GrammarEngine.step`` for 1 and 8 sequences along real constrained outputs.

    Each sequence replays the token path of one output text (re-tokenized with
    the model's tokenizer): the first step accepts nothing and fills the first
    mask, every further step accepts one token and fills the next mask -- the
    per-step work the grammar model does for the llm model.

    Raises
    ------
    RuntimeError
        If the engine rejects a replayed token (a re-tokenization the grammar
        does not accept would make the timings meaningless).
    """
    from tokenizers import Tokenizer

    from grammar_backend.spec import parse_constraint
    from triton_support.service import GrammarModelConfig

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    paths = [np.asarray(tok.encode(t, add_special_tokens=False).ids, dtype=np.int32) for t in texts]
    engine = GrammarModelConfig(tokenizer=str(model_dir), fill_threads=1).build_engine()
    try:
        spec = parse_constraint("json_schema", json.dumps(PERSON_SCHEMA))
        engine.compile(spec)  # compile once, outside the timed steps
        out: dict[str, dict[str, float]] = {}
        next_id = 1
        for batch in (1, 8):
            times: list[float] = []
            for rep in range(reps):
                rows = [paths[(rep * batch + i) % len(paths)] for i in range(batch)]
                length = min(len(p) for p in rows)
                ids = np.arange(next_id, next_id + batch, dtype=np.uint64)
                next_id += batch
                for seq_id in ids:
                    engine.start(int(seq_id), spec)
                tokens = np.zeros((batch, 1), dtype=np.int32)
                counts = np.zeros(batch, dtype=np.int32)
                for step in range(length + 1):
                    if step:
                        for i, path in enumerate(rows):
                            tokens[i, 0] = path[step - 1]
                        counts.fill(1)
                    t0 = time.perf_counter()
                    res = engine.step(ids, tokens, counts)
                    times.append(time.perf_counter() - t0)
                    bad = [e for e in res.errors if e is not None]
                    if bad:
                        raise RuntimeError(f"grammar replay, batch {batch}, step {step}: {bad[0]}")
                engine.end([int(s) for s in ids])
            out[f"B={batch}"] = {
                "steps": len(times),
                "step_s_p50": pct(times, 50),
                "step_s_p99": pct(times, 99),
                "per_row_s_p50": pct(times, 50) / batch,
            }
        return out
    finally:
        engine.close()


# --------------------------------------------------------------------------- report
def print_report(
    summary: dict[str, dict[str, Any]],
    warm: dict[str, Record],
    stats: list[dict[str, Any]],
    fill: dict[str, dict[str, float]],
    max_tokens: int,
    rounds: int,
) -> None:
    """Print the tables."""
    print()
    print(f"== end-to-end, {ENSEMBLE}, SmolLM2-135M CPU, greedy, max_tokens={max_tokens}, "
          f"{len(PROMPTS)} prompts, {rounds} round(s) ==")  # fmt: skip
    head = (f"{'mode':14s} {'conc':>4s} {'reqs':>5s} {'tokens':>7s} {'tok/req':>7s} {'tok/s':>8s} "
            f"{'ttft p50 ms':>11s} {'ttft p99 ms':>11s} {'lat p50 s':>9s} {'stop/len':>8s} {'valid':>5s}")  # fmt: skip
    concurrencies = sorted({int(k.split("@")[1]) for k in summary})
    print(head)
    print("-" * len(head))
    for conc in concurrencies:
        for mode in MODES:
            s = summary[f"{mode}@{conc}"]
            print(
                f"{mode:14s} {conc:4d} {s['requests']:5d} {s['completion_tokens']:7d} "
                f"{s['tokens_per_request_mean']:7.1f} {s['tokens_per_s']:8.2f} "
                f"{ms(s['ttft_s_p50']):>11s} {ms(s['ttft_s_p99']):>11s} {s['latency_s_p50']:9.2f} "
                f"{s['finish_stop']:>3d}/{s['finish_length']:<4d} "
                f"{s['json_valid'] if mode == 'constrained' else '-':>5}"
            )
    print()
    print("ratio constrained / unconstrained (tokens/s mixes in different output lengths; see equal work below):")
    for conc in concurrencies:
        c, u = summary[f"constrained@{conc}"], summary[f"unconstrained@{conc}"]
        print(f"  conc {conc}: tok/s {ratio(c['tokens_per_s'], u['tokens_per_s'])}   "
              f"ttft p50 {ratio(c['ttft_s_p50'], u['ttft_s_p50'])}   "
              f"ttft p99 {ratio(c['ttft_s_p99'], u['ttft_s_p99'])}")  # fmt: skip
    print(f"  warm-up (not counted): constrained ttft {warm['constrained'].ttft_s * 1e3:.1f} ms "
          f"(includes the one-time grammar compile), unconstrained {warm['unconstrained'].ttft_s * 1e3:.1f} ms")  # fmt: skip
    print()
    print("== llm model step stats (server log, whole run incl. warm-up; grammar figures from constrained steps) ==")
    for i, st in enumerate(stats):
        print(f"  instance {i}: steps {st.get('steps')}, max batch seen {st.get('max_batch_size_seen')}")
        for name, label in (
            ("forward_s", "forward"),
            ("grammar_s", "grammar round trip"),
            ("mask_wait_s", "mask wait (not hidden)"),
            ("grammar_loop_s", "grammar on the loop"),
        ):
            p50, p99 = float(st.get(f"{name}_p50", math.nan)), float(st.get(f"{name}_p99", math.nan))
            print(f"    {label:24s} p50 {ms(p50)} ms   p99 {ms(p99)} ms")
        print(f"    raw: {json.dumps(st)}")
    print()
    print("== grammar fill in-process (GrammarEngine.step = accept 1 token + fill next mask, 1 fill thread) ==")
    for key, f in fill.items():
        print(f"  {key}: {int(f['steps'])} steps, p50 {ms(f['step_s_p50'])} ms, p99 {ms(f['step_s_p99'])} ms, "
              f"per row p50 {ms(f['per_row_s_p50'])} ms")  # fmt: skip
    print()
    print("== equal work: decode step at a full batch (the whole step, steps where no prompt joined) ==")
    ratios = equal_work_ratios(stats, concurrencies)
    for conc, (free, cons, r) in ratios.items():
        parts = step_parts(stats, conc)
        print(f"  batch {conc:2d}: free p50 {ms(free)} ms, constrained p50 {ms(cons)} ms, "
              f"throughput constrained/unconstrained {r:.3f}; forward p50 {ms(parts['forward_free_s_p50'])} / "
              f"{ms(parts['forward_constrained_s_p50'])} ms, grammar on the loop p50 "
              f"{ms(parts['grammar_loop_s_p50'])} ms")
    for i, st in enumerate(stats):
        if st.get("output_tokens"):
            print(f"  llm instance {i}: {st['steps']} steps, {st['output_tokens']} output tokens, "
                  f"{st['jump_tokens']} of them jumped forward (forwards per output token "
                  f"{st['steps'] / st['output_tokens']:.3f}, all modes)")
    # main() prints the headline figure (equal work, concurrency 8) as the last line.


class _NoGrammar:
    """The in-process run sends no constraint: a grammar call would be a bug of this script."""

    def start(self, *args: object) -> None:
        raise AssertionError("the in-process run is unconstrained")

    step = end = start


class InProcess:
    """The same engine in this process, no Triton: the reference of served / in-process.

    Same prompts (through the preprocessing model's own chat template), same
    greedy decoding and ``max_tokens``, same ``TORCH_THREADS``, batch limit
    and ``MAX_PREFILL_TOKENS`` as the served ``llm`` model (``values``: what
    the server was rendered with; default ``deploy/values.json``); a
    batch's wall time runs from the first submit to the last finish, as the
    served side's runs from the first request start to the last response.

    The benchmarks run it *beside* the served side, while the server is up
    and idle: each unconstrained served batch is paired with an in-process
    batch of the same prompts and size, run right before or right after it
    (the order flips from one pair to the next).  Measured minutes apart,
    after the served rounds, served/in-process at 8 SmolLM2 streams read 0.67
    to 0.88 for the same code (seven quick runs); side by side, 0.87-0.98
    (five runs).  The server's own CPU while the in-process batches ran is
    kept too (:attr:`server_cpu_s`; 0.0-3.2 % of a core measured), so a busy
    idle server would show.

    Use as a context manager: the engine loads on entry (then one warm-up
    request), the torch thread count is restored on exit.
    """

    def __init__(self, model_dir: Path, max_tokens: int, values: dict[str, str] | None = None) -> None:
        if values is None:
            values = json.loads(VALUES.read_text())
        self.model_dir = model_dir
        self.max_tokens = max_tokens
        self.max_batch = int(values["MAX_BATCH"])
        self.torch_threads = int(values["TORCH_THREADS"]) or None
        self.max_prefill_tokens = int(values["MAX_PREFILL_TOKENS"]) if values["MAX_PREFILL_TOKENS"] else None
        self.tokens: dict[int, int] = {}
        self.wall_s: dict[int, float] = {}
        self.server_cpu_s = 0.0
        self._stack = contextlib.ExitStack()
        self._sched: Scheduler | None = None
        self._ids: list[list[int]] = []
        self._turn = 0

    def __enter__(self) -> Self:
        import torch

        from llm_runtime.engine import TorchEngine, TorchEngineConfig
        from llm_runtime.scheduler import Scheduler, SchedulerConfig
        from pipeline.preprocess import PreprocessConfig, Preprocessor, RawRequest

        pre = Preprocessor.from_config(PreprocessConfig(tokenizer=str(self.model_dir)))
        self._ids = [pre(RawRequest(prompt=p.encode()))[0] for p in PROMPTS]
        self._stack.callback(torch.set_num_threads, torch.get_num_threads())
        try:
            engine = TorchEngine(self.model_dir, TorchEngineConfig(max_batch_size=self.max_batch, max_seq_len=2048,
                                                                   num_threads=self.torch_threads))
            self._sched = self._stack.enter_context(Scheduler(engine, _NoGrammar(), SchedulerConfig(max_prefill_tokens=self.max_prefill_tokens)))  # type: ignore[arg-type]
            self._batch(1, 0)  # warm-up, not counted
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _batch(self, n: int, first_prompt: int) -> tuple[int, float]:
        from llm_runtime.scheduler import FinishEvent, GenerationRequest, TokenEvent

        if self._sched is None:
            raise RuntimeError("InProcess is used outside its with block")

        done = threading.Semaphore(0)
        tokens = [0]
        errors: list[str] = []

        def on_event(event: TokenEvent | FinishEvent) -> None:
            if isinstance(event, FinishEvent):
                if event.finish_reason == "error":
                    errors.append(str(event.error))
                tokens[0] += event.completion_tokens
                done.release()

        t0 = time.perf_counter()
        for i in range(n):
            self._sched.submit(GenerationRequest(self._ids[(first_prompt + i) % len(self._ids)],
                                                 max_tokens=self.max_tokens, temperature=0.0), on_event)
        for _ in range(n):
            if not done.acquire(timeout=600):
                raise TimeoutError("an in-process request did not finish")
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"in-process request failed: {errors[0]}")
        return tokens[0], wall

    def beside(self, served: Callable[[], T], n: int, first_prompt: int = 0,
               server_cpu: Callable[[], float] | None = None) -> T:
        """Run ``served()`` and an in-process batch of ``n`` requests (prompts from ``first_prompt``), one
        after the other, the in-process one first on every other call; returns what ``served()`` returned.

        ``server_cpu``: the server's CPU seconds so far (read around the in-process batch).
        """
        self._turn += 1
        first = self._turn % 2 == 0
        if first:
            self._measure(n, first_prompt, server_cpu)
        out = served()
        if not first:
            self._measure(n, first_prompt, server_cpu)
        return out

    def _measure(self, n: int, first_prompt: int, server_cpu: Callable[[], float] | None) -> None:
        cpu0 = server_cpu() if server_cpu is not None else 0.0
        tokens, wall = self._batch(n, first_prompt)
        if server_cpu is not None:
            self.server_cpu_s += server_cpu() - cpu0
        self.tokens[n] = self.tokens.get(n, 0) + tokens
        self.wall_s[n] = self.wall_s.get(n, 0.0) + wall

    def idle_server_share(self) -> float:
        """The server's CPU seconds per second of in-process batches (0 where not read)."""
        wall = sum(self.wall_s.values())
        return self.server_cpu_s / wall if wall > 0 else 0.0

    def tokens_per_s(self) -> dict[int, float]:
        """In-process tokens/s per batch size, over every batch run so far."""
        return {n: self.tokens[n] / w for n, w in self.wall_s.items() if w > 0}


def equal_work_ratios(stats: list[dict[str, Any]], concurrencies: Sequence[int]) -> dict[int, tuple[float, float, float]]:
    """Per batch size: free and constrained step-time medians (worst instance) and the throughput ratio.

    At a fixed live batch both modes decode the same rows; throughput is
    tokens per step / step time, where a free step adds one token per row and
    a constrained one adds more when rows jump forward (forced text appended
    without sampling).  Without jumps the ratio is free / constrained step time.
    """
    out: dict[int, tuple[float, float, float]] = {}
    for conc in concurrencies:
        free = [float(st[f"step_s_p50_b{conc}_free"]) for st in stats if f"step_s_p50_b{conc}_free" in st]
        cons = [float(st[f"step_s_p50_b{conc}_constrained"]) for st in stats
                if f"step_s_p50_b{conc}_constrained" in st]
        if free and cons:
            tok_free = min(float(st.get(f"tokens_per_step_b{conc}_free", conc)) for st in stats
                           if f"step_s_p50_b{conc}_free" in st)
            tok_cons = min(float(st.get(f"tokens_per_step_b{conc}_constrained", conc)) for st in stats
                           if f"step_s_p50_b{conc}_constrained" in st)
            out[conc] = (max(free), max(cons), (tok_cons / max(cons)) / (tok_free / max(free)))
    return out


def step_parts(stats: list[dict[str, Any]], batch: int) -> dict[str, float]:
    """The parts of the equal-work steps at ``batch`` rows (worst instance, as :func:`equal_work_ratios`).

    ``forward_{free,constrained}_s_p50``: the forward's median per mode (a
    constrained one feeds jumped tokens too); ``grammar_loop_s_p50``: the
    decode loop's own time on a constrained step's grammar work beside it
    (the request, the wait for and reading of the answer, masking).  NaN
    where no instance reports it.
    """
    keys = {"forward_free_s_p50": f"forward_s_p50_b{batch}_free",
            "forward_constrained_s_p50": f"forward_s_p50_b{batch}_constrained",
            "grammar_loop_s_p50": f"grammar_loop_s_p50_b{batch}_constrained"}
    return {name: max((float(st[key]) for st in stats if key in st), default=math.nan) for name, key in keys.items()}


def plot(summary: dict[str, dict[str, Any]], ratios: dict[int, tuple[float, float, float]], path: Path) -> None:
    """tokens/s and step time per concurrency, both modes, as a PNG."""
    concs = sorted({int(k.split("@")[1]) for k in summary})
    with harness.figure(path, f"{ENSEMBLE}: constrained vs unconstrained", columns=2, size=(10, 4)) as (a, b):
        for i, mode in enumerate(MODES):
            a.bar([x + 0.4 * i for x in range(len(concs))], [summary[f"{mode}@{c}"]["tokens_per_s"] for c in concs],
                  width=0.4, label=mode)
        a.set_xticks([x + 0.2 for x in range(len(concs))], [str(c) for c in concs])
        a.set_xlabel("concurrency")
        a.set_ylabel("output tokens/s")
        a.legend()
        rc = sorted(ratios)
        b.plot(rc, [1e3 * ratios[c][0] for c in rc], "o-", label="free")
        b.plot(rc, [1e3 * ratios[c][1] for c in rc], "o-", label="constrained")
        b.set_xlabel("live batch")
        b.set_ylabel("ms per decode step (p50)")
        b.legend()


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    # Annotated: mypy also checks this module as bench.e2e_bench (the integration tests import it), where
    # harness does not resolve and would be Any.
    parser: argparse.ArgumentParser = harness.bench_parser(__doc__)
    harness.add_max_tokens(parser, 64)
    harness.add_rounds(parser, 2)
    harness.add_min_seconds(parser, 10.0)
    parser.add_argument("--fill-reps", type=int, default=6, help="replays per batch size of the fill timing")
    harness.add_model_dir(parser, MODEL_DIR)
    harness.add_json(parser, "every figure and record")
    parser.add_argument("--grammar-mode", choices=("overlap", "processor"), default="overlap",
                        help="the llm model's grammar_mode (processor: TensorRT-LLM's serial call order)")
    parser.add_argument("--stream-interval-ms", type=float, default=None,
                        help="the llm model's STREAM_INTERVAL_MS: least ms between a stream's responses "
                             "(default: deploy/values.json's)")
    harness.add_plot(parser, "a PNG of tokens/s and step times")
    harness.add_quick(parser, "a few minutes: 1 round, 32 max tokens, concurrency 1 and 8", env=True)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens, args.concurrencies = 1, 32, QUICK_CONCURRENCIES
    else:
        args.concurrencies = CONCURRENCIES
    for name in ("max_tokens", "rounds", "fill_reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json (run `make model`)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    t_all = time.perf_counter()
    overrides = {"GRAMMAR_MODE": args.grammar_mode}
    if args.stream_interval_ms is not None:
        overrides["STREAM_INTERVAL_MS"] = f"{args.stream_interval_ms:g}"
    values = harness.render_values(args.model_dir, overrides)
    # tritonserver driven from this process: the gateway runs here, beside the clients.
    with harness.serve(values, prefix="e2e-bench-") as server:
        print(f"server ready at {server.url} in {server.ready_s:.1f} s (log {server.log})", flush=True)
        with InProcess(args.model_dir, args.max_tokens, values) as reference:
            run = run_e2e(server.url, args.rounds, args.max_tokens, args.concurrencies, reference,
                          partial(tree_cpu_s, server.pid), args.min_seconds)
    print(f"server stopped (exit status {server.exit_status})", flush=True)
    stats = parse_step_stats(server.log_text)
    summary = summarize(run["records"], run["walls"])
    # One greedy output per prompt (the last one at concurrency 1).
    texts = list({r.prompt: r.text for r in run["records"] if r.mode == "constrained" and r.concurrency == 1}.values())
    fill = grammar_fill(args.model_dir, texts, args.fill_reps)
    print_report(summary, run["warmup"], stats, fill, args.max_tokens, args.rounds)
    ratios = equal_work_ratios(stats, args.concurrencies)
    raw = reference.tokens_per_s()
    print("\n== served vs the same engine in-process (unconstrained, same prompts, threads and batch limit; "
          "each served batch beside an in-process one) ==")
    print(f"  the idle server's CPU while the in-process batches ran: {reference.idle_server_share():.1%} of a core")
    for conc, tps in raw.items():
        served = summary[f"unconstrained@{conc}"]["tokens_per_s"]
        print(f"  conc {conc:2d}: served {served:7.2f} tok/s, in-process {tps:7.2f} tok/s, "
              f"served/in-process {served / tps:.3f}")
    print(f"ratio constrained/unconstrained at concurrency 8: {ratios[8][2]:.3f}" if 8 in ratios
          else "ratio constrained/unconstrained at concurrency 8: n/a")
    if args.plot is not None:
        plot(summary, ratios, args.plot)
    if args.json is not None:
        payload = {
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "schema": PERSON_SCHEMA,
            "prompts": list(PROMPTS),
            "summary": summary,
            "equal_work": {str(c): {"free_step_s_p50": f, "constrained_step_s_p50": k, "ratio": r}
                           for c, (f, k, r) in ratios.items()},
            "in_process_tokens_per_s": {str(c): v for c, v in raw.items()},
            "idle_server_cpu_share": reference.idle_server_share(),
            "llm_step_stats": stats,
            "grammar_fill": fill,
            "warmup": {k: asdict(v) for k, v in run["warmup"].items()},
            "records": [asdict(r) for r in run["records"]],
        }
        harness.write_json(args.json, payload)
    print(f"total {time.perf_counter() - t_all:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
