"""The OpenAI-compatible endpoint against the gRPC path: what does the HTTP front cost, on one server?

Usage (from the repository root, after ``make venv model``)::

    make bench-openai                    # ~4 min on 2 shared cores (BENCH_QUICK=1: ~1.5 min)
    make bench-openai BENCH_TINY=1 BENCH_QUICK=1   # the tiny stand-in: ~40 s
    .venv/bin/python bench/openai_bench.py --quick --tiny --json /tmp/openai.json
    .venv/bin/python bench/openai_bench.py --quick --max-tokens 64 --rounds 2

The default model is the embedded SmolLM2-135M (``build/models/smollm2-135m-instruct``,
``make model``; 40-80 ms a decode step here), as in ``e2e_bench.py``.
``--tiny`` serves the tiny random Llama of ``path_bench.py`` instead
(``standins.tiny_model``, built once under ``build/models/tiny-llama``,
one torch thread): a few-ms forward, a GPU step's stand-in, behind which
no serving cost hides.

What it does, in one run on one server:

1. Renders ``model_repository/`` (``deploy/values.json`` and the model
   folder) and starts ``python -m deploy --openai-port P`` as a child
   process on free loopback ports, as ``make serve`` does: the gateway and
   the OpenAI endpoint (``openai_api/``, on the gateway's event loop) run in
   that launcher process, apart from this client, so the client's own work
   (``openai``'s pydantic chunks, gRPC's callbacks) does not take the
   gateway's GIL.
2. Sends the SAME chat messages (one user message per prompt) over three
   transports, greedy, the same ``max_tokens``: gRPC through
   :class:`client.Client` streams (``messages=``), OpenAI's chat completions
   through ``openai.OpenAI(...).chat.completions.create(stream=True,
   stream_options={"include_usage": True})`` and OpenAI's Responses API
   through ``.responses.create(stream=True)`` (``text.format`` for the
   schema).  Two modes: unconstrained, and
   constrained by a strict JSON schema (a person: name, age, city; every
   property required, ``additionalProperties: false``), given as
   :meth:`client.Constraint.json_schema` over gRPC and as
   ``response_format={"type": "json_schema", "json_schema": {..., "strict": true}}``
   over OpenAI.
3. Interleaves so that machine noise hits both sides alike: at concurrency 1
   each (prompt, mode) runs on every transport back to back, the transport
   order rotating per prompt, mode and round; at concurrency 8 each mode's
   batch runs once per transport, back to back, the order flipping too.
   Concurrency N is N threads released together by a barrier, each with its
   own client (its own gRPC channel, its own HTTP connection pool).  One
   warm-up request per (transport, mode) runs first (the first constrained
   one pays the one-time grammar compile) and one short batch per transport
   opens every client's connection; neither is counted.
4. Per (transport, mode, concurrency): output tokens/s (completion tokens /
   wall: summed request time at concurrency 1, first start to last end of
   each batch at 8), time to first token (first non-empty content delta)
   p50/p99, CPU seconds per 1,000 tokens of the launcher process (gateway +
   OpenAI endpoint), of every server process, and of this client (read from
   psutil CPU times around each batch, ``path_bench.CpuMeter``); and the
   ratios openai/grpc (the HTTP front) and responses/openai (the Responses
   API against chat completions).
5. Checks every output: each constrained one must parse and validate
   (``jsonschema``, Draft 2020-12) on both sides; failures are counted and
   printed, and make the exit status 1.  It also counts pairs (same mode,
   concurrency, round, prompt) whose prompt token counts or texts differ
   between the transports (greedy: at concurrency 1 they must not; at 8 the
   in-flight batch may be joined in another order, which can change a float
   sum and so a greedy pick).

Prints a table; ``--json`` writes every figure and record.  The last line
reads ``openai at concurrency 8: openai/grpc tokens/s U (unconstrained), C
(constrained)``.  Nothing here asserts a time: read ratios from one run on
this noisy shared host, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import jsonschema
import openai
from e2e_bench import ms, pct
from harness import ENSEMBLE, MODEL_DIR, TINY_DIR, Served, tiny_checkpoint
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseTextConfigParam
from openai.types.shared_params import ResponseFormatJSONSchema
from path_bench import CLIENT_LABEL, CpuMeter

from client import Client, Constraint

#: ``openai`` is chat completions; ``responses`` the Responses API, on the same endpoint.
TRANSPORTS: Final = ("grpc", "openai", "responses")
MODES: Final = ("unconstrained", "constrained")
CONCURRENCIES: Final = (1, 8)
#: The launcher process's label in ``path_bench.server_processes``: the gateway and the OpenAI endpoint.
GATEWAY_LABEL: Final = "launcher + gateway"
SCHEMA_NAME: Final = "person"

#: OpenAI's strict subset (every property required, no additional properties), which this endpoint's
#: strict mode takes too (``openai_api.strict``), so the requests could go to OpenAI unchanged.
SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
_VALIDATOR: Final = jsonschema.Draft202012Validator(SCHEMA)

#: Asking for JSON in both modes keeps the unconstrained output close to the
#: constrained one in kind.
PROMPTS: Final[tuple[str, ...]] = (
    "Invent a fictional person. Reply with JSON: name, age, city.",
    "Describe a retired teacher from Lisbon as a JSON object with name, age and city.",
    "Give me a JSON record of a young software engineer: name, age, city.",
    "Create a JSON profile for a musician living in Osaka (name, age, city).",
)

DEFAULT_ROUNDS: Final = 2
DEFAULT_MAX_TOKENS: Final = 128
QUICK_ROUNDS: Final = 1
QUICK_MAX_TOKENS: Final = 64
#: ``max_tokens`` of the connection warm-up batches.
WARM_TOKENS: Final = 4
REQUEST_TIMEOUT_S: Final = 600.0


# --------------------------------------------------------------------------- requests
@dataclass
class Record:
    """One measured request (``slot``: its thread in the batch; ``prompt``: index into :data:`PROMPTS`)."""

    transport: str
    mode: str
    concurrency: int
    round: int
    slot: int
    prompt: int
    start_s: float
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    deltas: int
    finish_reason: str
    closed_early: bool
    text: str
    valid: bool | None = None
    problem: str = ""


def check_output(text: str) -> tuple[bool, str]:
    """Whether ``text`` parses as JSON and validates against :data:`SCHEMA`, and why not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return False, f"not JSON: {err}"
    errors = sorted(_VALIDATOR.iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        return False, "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors[:3])
    return True, ""


def _messages(prompt: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[prompt % len(PROMPTS)]}]


def grpc_send(conn: Client, mode: str, prompt: int, max_tokens: int) -> Record:
    """Stream one request through :class:`client.Client` and time it (TTFT = first non-empty text delta).

    Raises
    ------
    client.errors.ClientError
        On any failure, an error result included: a failed request fails the
        run, it is never silently left out.
    RuntimeError
        The stream ended without a result.
    """
    constraint = Constraint.json_schema(SCHEMA) if mode == "constrained" else None
    t0 = time.perf_counter()
    ttft = math.nan
    deltas = 0
    result = None
    # require_complete=False: a length-capped output is a normal outcome here
    # (both sides get the same max_tokens); errors still raise.
    for chunk in conn.stream(messages=_messages(prompt), constraint=constraint, max_tokens=max_tokens,
                             temperature=0.0, require_complete=False):
        if chunk.text:
            deltas += 1
            if math.isnan(ttft):
                ttft = time.perf_counter() - t0
        if chunk.result is not None:
            result = chunk.result
    latency = time.perf_counter() - t0
    if result is None:
        raise RuntimeError(f"grpc {mode} prompt {prompt}: the stream ended without a result")
    return Record("grpc", mode, 0, 0, 0, prompt, t0, ttft, latency, result.usage.prompt_tokens,
                  result.usage.completion_tokens, deltas, result.finish_reason, result.closed_early, result.text)


def openai_send(conn: openai.OpenAI, mode: str, prompt: int, max_tokens: int) -> Record:
    """Stream one chat completion through the ``openai`` client and time it (TTFT = first non-empty content delta).

    Raises
    ------
    openai.APIError
        On any failure, an error status or an ``error`` event included.
    RuntimeError
        The stream ended without its usage chunk.
    """
    fmt: ResponseFormatJSONSchema | openai.Omit = openai.omit
    if mode == "constrained":
        fmt = {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "strict": True, "schema": SCHEMA}}
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPTS[prompt % len(PROMPTS)]}]
    parts: list[str] = []
    finish = ""
    closed_early = False
    usage = None
    t0 = time.perf_counter()
    ttft = math.nan
    deltas = 0
    stream = conn.chat.completions.create(model=ENSEMBLE, messages=messages, max_tokens=max_tokens,
                                          temperature=0.0, stream=True, stream_options={"include_usage": True},
                                          response_format=fmt)
    with stream:
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.delta.content:
                    deltas += 1
                    parts.append(choice.delta.content)
                    if math.isnan(ttft):
                        ttft = time.perf_counter() - t0
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
                    # The extension report rides on the finish chunk (openai_api.response).
                    report = (chunk.model_extra or {}).get("constrained_llm") or {}
                    closed_early = bool(report.get("closed_early", False))
            if chunk.usage is not None:
                usage = chunk.usage
    latency = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError(f"openai {mode} prompt {prompt}: the stream ended without a usage chunk "
                           "(stream_options.include_usage was set)")
    return Record("openai", mode, 0, 0, 0, prompt, t0, ttft, latency, usage.prompt_tokens, usage.completion_tokens,
                  deltas, finish, closed_early, "".join(parts))


def responses_send(conn: openai.OpenAI, mode: str, prompt: int, max_tokens: int) -> Record:
    """Stream one Responses API request through the ``openai`` client and time it (TTFT = first non-empty
    ``response.output_text.delta``).

    Raises
    ------
    openai.APIError
        On any failure, an error status or an ``error`` event included.
    RuntimeError
        The stream ended without ``response.completed`` or ``response.incomplete``.
    """
    text: ResponseTextConfigParam | openai.Omit = openai.omit
    if mode == "constrained":
        text = {"format": {"type": "json_schema", "name": SCHEMA_NAME, "strict": True, "schema": SCHEMA}}
    parts: list[str] = []
    final = None
    t0 = time.perf_counter()
    ttft = math.nan
    deltas = 0
    stream = conn.responses.create(model=ENSEMBLE, input=PROMPTS[prompt % len(PROMPTS)], max_output_tokens=max_tokens,
                                   temperature=0.0, stream=True, text=text, store=False)
    with stream:
        for event in stream:
            if event.type == "response.output_text.delta" and event.delta:
                deltas += 1
                parts.append(event.delta)
                if math.isnan(ttft):
                    ttft = time.perf_counter() - t0
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    latency = time.perf_counter() - t0
    if final is None or final.usage is None:
        raise RuntimeError(f"responses {mode} prompt {prompt}: the stream ended without its final response")
    report = (final.model_extra or {}).get("constrained_llm") or {}
    finish = "stop" if final.status == "completed" else "length"
    return Record("responses", mode, 0, 0, 0, prompt, t0, ttft, latency, final.usage.input_tokens,
                  final.usage.output_tokens, deltas, finish, bool(report.get("closed_early", False)), "".join(parts))


@dataclass
class Pools:
    """One client per thread and transport, opened once for the run."""

    grpc_clients: list[Client]
    openai_clients: list[openai.OpenAI]

    def send(self, transport: str, i: int, mode: str, prompt: int, max_tokens: int) -> Record:
        """One request over ``transport`` on client ``i`` (:func:`grpc_send`, :func:`openai_send`,
        :func:`responses_send`)."""
        if transport == "grpc":
            return grpc_send(self.grpc_clients[i], mode, prompt, max_tokens)
        if transport == "responses":
            return responses_send(self.openai_clients[i], mode, prompt, max_tokens)
        return openai_send(self.openai_clients[i], mode, prompt, max_tokens)

    def close(self) -> None:
        """Close every client."""
        for c in self.grpc_clients:
            c.close()
        for o in self.openai_clients:
            o.close()


def batch(pools: Pools, transport: str, mode: str, n: int, prompts: Sequence[int], max_tokens: int
          ) -> tuple[list[Record], float]:
    """``n`` requests at once, one thread and one client each, released together by a barrier.

    Returns
    -------
    records, wall_s
        The records (``slot`` set, the other labels left to the caller) and
        the time from the first start to the last end.
    """
    if n == 1:
        rec = pools.send(transport, 0, mode, prompts[0], max_tokens)
        return [rec], rec.latency_s
    # The timeout frees the other threads if one fails before reaching the barrier.
    gate = threading.Barrier(n, timeout=120.0)

    def one(i: int) -> Record:
        gate.wait()
        rec = pools.send(transport, i, mode, prompts[i], max_tokens)
        rec.slot = i
        return rec

    with ThreadPoolExecutor(n, thread_name_prefix=f"{transport}-{mode}") as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        # result() re-raises a request's exception here: a failed request fails the run.
        done = [f.result() for f in futures]
    return done, max(r.start_s + r.latency_s for r in done) - min(r.start_s for r in done)


def _order(k: int) -> tuple[str, ...]:
    """The transports rotated by ``k``: each goes first, last and in between as often."""
    k %= len(TRANSPORTS)
    return TRANSPORTS[k:] + TRANSPORTS[:k]


def run_load(served: Served, rounds: int, max_tokens: int) -> dict[str, Any]:
    """Warm up, then the interleaved measured rounds; returns records, walls, CPU seconds and warm-ups."""
    top = max(CONCURRENCIES)
    pools = Pools([Client(served.url, timeout_s=REQUEST_TIMEOUT_S) for _ in range(top)],
                  [openai.OpenAI(base_url=served.openai_url, api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)
                   for _ in range(top)])
    meter = CpuMeter(served.pid)
    records: list[Record] = []
    walls: dict[str, float] = {}
    cpu: dict[str, dict[str, float]] = {}
    warm: dict[str, Record] = {}

    def measure(transport: str, mode: str, conc: int, r: int, prompts: Sequence[int]) -> None:
        key = f"{transport}/{mode}@{conc}"
        before = meter.snapshot()
        done, wall = batch(pools, transport, mode, conc, prompts, max_tokens)
        meter.add(before, meter.snapshot(), cpu.setdefault(key, {}))
        for rec in done:
            rec.concurrency, rec.round = conc, r
            if mode == "constrained":
                rec.valid, rec.problem = check_output(rec.text)
        records.extend(done)
        walls[key] = walls.get(key, 0.0) + wall

    try:
        for i, mode in enumerate(MODES[::-1]):  # constrained first: it pays the one compile
            for transport in _order(i):
                rec = pools.send(transport, 0, mode, 0, max_tokens)
                warm[f"{transport}/{mode}"] = rec
                print(f"  warm-up {transport:6s} {mode:13s}: ttft {rec.ttft_s * 1e3:8.1f} ms, "
                      f"{rec.completion_tokens} tokens in {rec.latency_s:.2f} s", flush=True)
        for transport in TRANSPORTS:  # every client opens its connection
            batch(pools, transport, "unconstrained", top, [i % len(PROMPTS) for i in range(top)], WARM_TOKENS)
        for r in range(rounds):
            t_round = time.perf_counter()
            modes = MODES if r % 2 == 0 else MODES[::-1]
            for p in range(len(PROMPTS)):
                for m, mode in enumerate(modes if p % 2 == 0 else modes[::-1]):
                    for transport in _order(r + p + m):
                        measure(transport, mode, 1, r, [p])
            for conc in (c for c in CONCURRENCIES if c > 1):
                for m, mode in enumerate(modes):
                    for transport in _order(r + m):
                        measure(transport, mode, conc, r, [i % len(PROMPTS) for i in range(conc)])
            print(f"  round {r + 1}/{rounds} done in {time.perf_counter() - t_round:.1f} s", flush=True)
    finally:
        pools.close()
    return {"records": records, "walls": walls, "cpu": cpu, "warmup": warm}


# --------------------------------------------------------------------------- report
def summarize(records: Sequence[Record], walls: Mapping[str, float], cpu: Mapping[str, Mapping[str, float]]
              ) -> dict[str, dict[str, Any]]:
    """Per (transport, mode, concurrency): tokens/s, TTFT and latency percentiles, CPU per 1,000 tokens, checks."""
    out: dict[str, dict[str, Any]] = {}
    for key, wall in walls.items():
        transport, rest = key.split("/")
        mode, conc_s = rest.split("@")
        rs = [r for r in records if r.transport == transport and r.mode == mode and r.concurrency == int(conc_s)]
        tokens = sum(r.completion_tokens for r in rs)
        ttfts = [r.ttft_s for r in rs if not math.isnan(r.ttft_s)]
        spent = cpu.get(key, {})
        server = sum(v for k, v in spent.items() if k != CLIENT_LABEL)

        def per_1k(seconds: float, tokens: int = tokens) -> float:
            return 1000.0 * seconds / tokens if tokens else math.nan

        out[key] = {
            "requests": len(rs),
            "completion_tokens": tokens,
            "tokens_per_request_mean": tokens / len(rs) if rs else math.nan,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else math.nan,
            "ttft_s_p50": pct(ttfts, 50),
            "ttft_s_p99": pct(ttfts, 99),
            "latency_s_p50": pct([r.latency_s for r in rs], 50),
            "tokens_per_delta": tokens / max(1, sum(r.deltas for r in rs)),
            "finish_stop": sum(r.finish_reason == "stop" for r in rs),
            "finish_length": sum(r.finish_reason == "length" for r in rs),
            "closed_early": sum(r.closed_early for r in rs),
            "valid": sum(r.valid is True for r in rs),
            "invalid": sum(r.valid is False for r in rs),
            "gateway_cpu_s_per_1k_tokens": per_1k(spent.get(GATEWAY_LABEL, 0.0)),
            "server_cpu_s_per_1k_tokens": per_1k(server),
            "client_cpu_s_per_1k_tokens": per_1k(spent.get(CLIENT_LABEL, 0.0)),
            "cpu_s_per_1k_tokens_by_process": {k: per_1k(v) for k, v in sorted(spent.items())},
        }
    return out


def _div(num: float, den: float) -> float:
    return num / den if den and not (math.isnan(num) or math.isnan(den)) else math.nan


def ratios(summary: Mapping[str, Mapping[str, Any]], over: str = "grpc", of: str = "openai",
           ) -> dict[str, dict[str, float]]:
    """Per (mode, concurrency): ``of``/``over`` of tokens/s, TTFT p50/p99 and gateway CPU per token; TTFT p50
    delta (openai/grpc: what the HTTP front costs; responses/openai: the Responses API against chat)."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        for conc in CONCURRENCIES:
            o, g = summary.get(f"{of}/{mode}@{conc}"), summary.get(f"{over}/{mode}@{conc}")
            if o is None or g is None:
                continue
            out[f"{mode}@{conc}"] = {
                "tokens_per_s": _div(o["tokens_per_s"], g["tokens_per_s"]),
                "ttft_s_p50": _div(o["ttft_s_p50"], g["ttft_s_p50"]),
                "ttft_s_p99": _div(o["ttft_s_p99"], g["ttft_s_p99"]),
                "ttft_p50_delta_s": o["ttft_s_p50"] - g["ttft_s_p50"],
                "gateway_cpu_per_token": _div(o["gateway_cpu_s_per_1k_tokens"], g["gateway_cpu_s_per_1k_tokens"]),
                "client_cpu_per_token": _div(o["client_cpu_s_per_1k_tokens"], g["client_cpu_s_per_1k_tokens"]),
            }
    return out


def pair_checks(records: Sequence[Record]) -> dict[str, dict[str, int]]:
    """Per concurrency and HTTP path: request pairs (same mode, round, slot) over gRPC and that path, and how
    many differ."""
    by: dict[tuple[str, int, int, int], dict[str, Record]] = {}
    for r in records:
        by.setdefault((r.mode, r.concurrency, r.round, r.slot if r.concurrency > 1 else r.prompt), {})[r.transport] = r
    out: dict[str, dict[str, int]] = {}
    for (_, conc, _, _), pair in by.items():
        if len(pair) != len(TRANSPORTS):
            continue
        g = pair["grpc"]
        for o in (pair[t] for t in TRANSPORTS[1:]):
            c = out.setdefault(f"{conc}/{o.transport}", {"pairs": 0, "prompt_tokens_differ": 0, "text_differs": 0})
            c["pairs"] += 1
            c["prompt_tokens_differ"] += g.prompt_tokens != o.prompt_tokens
            c["text_differs"] += g.text != o.text
    return out


def _f(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def print_report(summary: Mapping[str, Mapping[str, Any]], rat: Mapping[str, Mapping[str, float]],
                 pairs: Mapping[str, Mapping[str, int]], failures: Sequence[Record], warm: Mapping[str, Record],
                 model: Path, max_tokens: int, rounds: int, rat_responses: Mapping[str, Mapping[str, float]],
                 ) -> None:
    """The tables, the pair checks and every failed output."""
    print(f"\n== openai vs grpc, {ENSEMBLE}, {model.name}, greedy, max_tokens={max_tokens}, "
          f"{len(PROMPTS)} prompts, {rounds} round(s) ==")
    head = (f"{'transport':9s} {'mode':13s} {'conc':>4s} {'reqs':>4s} {'tokens':>6s} {'tok/s':>8s} "
            f"{'ttft p50 ms':>11s} {'ttft p99 ms':>11s} {'lat p50 s':>9s} {'stop/len':>8s} {'valid':>5s} "
            f"{'gw ms/tok':>9s} {'srv ms/tok':>10s} {'cli ms/tok':>10s}")
    print(head)
    print("-" * len(head))
    for conc in CONCURRENCIES:
        for mode in MODES:
            for transport in TRANSPORTS:
                s = summary[f"{transport}/{mode}@{conc}"]
                valid = f"{s['valid']}/{s['requests']}" if mode == "constrained" else "-"
                print(f"{transport:9s} {mode:13s} {conc:4d} {s['requests']:4d} {s['completion_tokens']:6d} "
                      f"{s['tokens_per_s']:8.2f} {ms(s['ttft_s_p50']):>11s} {ms(s['ttft_s_p99']):>11s} "
                      f"{s['latency_s_p50']:9.2f} {s['finish_stop']:>3d}/{s['finish_length']:<4d} {valid:>5s} "
                      f"{_f(s['gateway_cpu_s_per_1k_tokens'], '9.3f'):>9s} "
                      f"{_f(s['server_cpu_s_per_1k_tokens'], '10.3f'):>10s} "
                      f"{_f(s['client_cpu_s_per_1k_tokens'], '10.3f'):>10s}")
    print("  (gw: the launcher process, gateway + OpenAI endpoint; srv: every server process; cli: this client; "
          "CPU ms per streamed token)")
    for title, table in (("openai (chat) / grpc", rat), ("responses / openai (chat)", rat_responses)):
        print(f"\nratio {title}:")
        for conc in CONCURRENCIES:
            for mode in MODES:
                r = table.get(f"{mode}@{conc}")
                if r is None:
                    continue
                print(f"  {mode:13s} conc {conc}: tok/s {_f(r['tokens_per_s'], '.3f')}   "
                      f"ttft p50 {_f(r['ttft_s_p50'], '.3f')} ({_f(r['ttft_p50_delta_s'] * 1e3, '+.1f')} ms)   "
                      f"ttft p99 {_f(r['ttft_s_p99'], '.3f')}   "
                      f"gateway cpu/token {_f(r['gateway_cpu_per_token'], '.3f')}"
                      f"   client cpu/token {_f(r['client_cpu_per_token'], '.3f')}")
    print("  warm-up (not counted): " + ", ".join(f"{k} ttft {v.ttft_s * 1e3:.1f} ms" for k, v in warm.items()))
    print("\nsame request over grpc and each HTTP path (greedy):")
    for level, c in sorted(pairs.items()):
        level_conc, transport = level.split("/")
        print(f"  conc {level_conc} grpc vs {transport}: {c['pairs']} pairs, prompt tokens differ in "
              f"{c['prompt_tokens_differ']}, text differs in {c['text_differs']}")
    print(f"\nconstrained outputs that do not parse or validate: {len(failures)}")
    for f in failures:
        print(f"  {f.transport} conc {f.concurrency} round {f.round} prompt {f.prompt} slot {f.slot} "
              f"finish {f.finish_reason} closed_early {f.closed_early}: {f.problem}; text {f.text[:200]!r}")


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments (``--quick`` sets defaults; an explicit ``--max-tokens`` or ``--rounds`` wins)."""
    parser = harness.bench_parser(__doc__)
    parser.add_argument("--tiny", action="store_true",
                        help=f"serve the tiny stand-in checkpoint (built once at {TINY_DIR}), one torch thread")
    harness.add_model_dir(parser, None, help_text=f"checkpoint to serve (default {MODEL_DIR})")
    harness.add_max_tokens(parser, None, f"per request (default {DEFAULT_MAX_TOKENS}, --quick {QUICK_MAX_TOKENS})")
    harness.add_rounds(parser, None, f"interleaved measured rounds (default {DEFAULT_ROUNDS}, --quick {QUICK_ROUNDS})")
    harness.add_json(parser, "every figure and record")
    harness.add_quick(parser, f"{QUICK_ROUNDS} round of {QUICK_MAX_TOKENS} max tokens", env=True)
    args = parser.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    if args.max_tokens < 1 or args.rounds < 1:
        parser.error("--max-tokens and --rounds must be >= 1")
    if args.tiny and args.model_dir is not None:
        parser.error("--tiny and --model-dir exclude each other")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 when an output failed its check)."""
    args = parse_args(argv)
    t_all = time.perf_counter()
    model = tiny_checkpoint() if args.tiny else (args.model_dir or MODEL_DIR).resolve()
    if not (model / "config.json").is_file():
        print(f"error: {model}: no config.json (run `make model`)", file=sys.stderr)
        return 2
    # As path_bench: the stand-in plays a GPU step, which keeps one host thread busy.
    values = harness.render_values(model, {"TORCH_THREADS": "1"} if args.tiny else None)
    if int(values["MAX_BATCH"]) < max(CONCURRENCIES):
        print(f"error: MAX_BATCH {values['MAX_BATCH']} < concurrency {max(CONCURRENCIES)}", file=sys.stderr)
        return 2
    # python -m deploy --openai-port P: the gateway and the endpoint in the launcher process, apart from this client.
    with harness.serve(values, prefix="openai-bench-", launcher=True, openai=True) as served:
        print(f"server ready in {served.ready_s:.1f} s: grpc {served.url}, openai {served.openai_url}", flush=True)
        run = run_load(served, args.rounds, args.max_tokens)
    records: list[Record] = run["records"]
    summary = summarize(records, run["walls"], run["cpu"])
    rat = ratios(summary)
    rat_responses = ratios(summary, over="openai", of="responses")
    pairs = pair_checks(records)
    failures = [r for r in records if r.valid is False]
    print_report(summary, rat, pairs, failures, run["warmup"], model, args.max_tokens, args.rounds, rat_responses)
    if args.json is not None:
        payload = {"model_dir": str(model), "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "values": values, "schema": SCHEMA, "prompts": list(PROMPTS), "summary": summary,
                   "openai_over_grpc": rat, "responses_over_openai": rat_responses, "pairs": pairs,
                   "failures": len(failures),
                   "warmup": {k: asdict(v) for k, v in run["warmup"].items()},
                   "records": [asdict(r) for r in records]}
        harness.write_json(args.json, payload)
    print(f"total {time.perf_counter() - t_all:.1f} s", file=sys.stderr)
    top = max(CONCURRENCIES)
    free = rat.get(f"unconstrained@{top}", {}).get("tokens_per_s", math.nan)
    cons = rat.get(f"constrained@{top}", {}).get("tokens_per_s", math.nan)
    print(f"openai at concurrency {top}: openai/grpc tokens/s {free:.2f} (unconstrained), {cons:.2f} (constrained)")
    for conc in CONCURRENCIES:
        r = [rat_responses.get(f"{mode}@{conc}", {}) for mode in MODES]
        print(f"responses at concurrency {conc}: responses/chat tokens/s "
              f"{r[0].get('tokens_per_s', math.nan):.3f} (unconstrained), {r[1].get('tokens_per_s', math.nan):.3f} "
              f"(constrained); ttft p50 {r[0].get('ttft_s_p50', math.nan):.3f}, {r[1].get('ttft_s_p50', math.nan):.3f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
