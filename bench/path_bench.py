"""The serving path at GPU token rates: what does serving cost around a fast forward?

Usage (from the repository root, after ``make venv``)::

    make bench-path                      # ~1 min on 2 shared cores (BENCH_QUICK=1: ~40 s)
    .venv/bin/python bench/path_bench.py --quick --json /tmp/path.json --plot /tmp/path.png
    .venv/bin/python bench/path_bench.py --quick --hold 60   # a steadier equal-work figure at 16 rows
    .venv/bin/python bench/path_bench.py --quick --hold 60 --backend xgrammar   # the other grammar backend
    .venv/bin/python bench/path_bench.py --model-dir build/models/smollm2-135m-instruct --quick

The default model is a tiny random Llama (``standins.tiny_model``: hidden
64, 2 layers, a ChatML template; built once under ``build/models/tiny-llama``)
whose forward takes a few milliseconds on this CPU: a stand-in for a GPU
step, behind which no serving cost hides.  It runs on one torch thread
(``TORCH_THREADS=1``, as a GPU engine keeps one host thread busy; a second
thread only spins on the cores the serving path needs: served 2,550 against
4,330 tokens/s at 16 streams).  ``--model-dir`` measures any other
checkpoint with ``deploy/values.json``'s threads (the embedded default,
SmolLM2-135M, takes 40-80 ms a step).

What it does, in one run:

1. Renders ``model_repository/`` (``deploy/values.json``, the model folder,
   ``--set KEY=VALUE`` overrides) and starts ``python -m deploy`` as a
   child process on free loopback ports, as ``make serve`` does: the gateway
   runs in that launcher process, apart from this client.
2. At each concurrency (1, 8, 16, and 32 when ``MAX_BATCH`` allows), sends
   the same prompts constrained (``e2e_bench.PERSON_SCHEMA``) and
   unconstrained, greedy, ``--max-tokens``; the two modes alternate batch
   by batch, repeated for at least ``--min-seconds`` per concurrency and
   round.  Concurrency N is N threads, one stream each, released together.
   Per request: time to first token (first non-empty text delta), the gaps
   between text deltas (what a reader sees as inter-token latency; with
   coalescing one delta carries several tokens) and the tokens.
   Each unconstrained batch runs beside the same batch of the same engine
   in this process (``e2e_bench.InProcess``: same prompts, threads and
   batch limit, no Triton; right before or after it, turn by turn, while
   the server idles): served / in-process tokens/s, unconstrained.
3. Around every batch, reads the CPU times (psutil) of every server process
   (the launcher with the gateway, tritonserver, each Python-backend stub
   and the grammar model's compile workers): CPU seconds per 1,000 streamed
   tokens, per process, mode and concurrency; and this process's own (the
   client's streams), apart: on this machine it shares the server's cores.
   With ``--hold SECONDS``, batches of both modes then alternate at the
   top concurrency (16) that long, for the step stats only: the equal-work
   figure at that batch then rests on thousands of steps of each mode,
   taken turn by turn (this host's speed moves by up to 2x between batches).
4. Stops the server and reads the ``llm`` model's step stats from its log:
   the decode-step time at each full batch for steps whose rows were all
   free or all constrained (equal work; see ``e2e_bench.equal_work_ratios``),
   and its parts: the forward per mode and the decode loop's own time on a
   constrained step's grammar work (``e2e_bench.step_parts``).

Prints a table, writes ``--json`` and ``--plot``; the last line reads
``path at concurrency 16: served/in-process S, constrained/unconstrained R``.
Nothing here asserts a time: read ratios from one run on this noisy host.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import numpy as np
import psutil
from e2e_bench import (
    MODES,
    PERSON_SCHEMA,
    PROMPTS,
    InProcess,
    cpu_seconds,
    equal_work_ratios,
    parse_step_stats,
    passes,
    pct,
    step_parts,
    tree_cpu_s,
)
from harness import ENSEMBLE, TINY_DIR, Served, tiny_checkpoint

from client import Client, Constraint

CONCURRENCIES: Final = (1, 8, 16, 32)
#: This benchmark's own CPU (the client's streams) in the CPU table: not the server's, but on this
#: machine it takes the same cores.
CLIENT_LABEL: Final = "(client: this benchmark)"
#: A Python-backend stub's argv names its model instance, e.g. ``llm_0_0``.
_INSTANCE_RE: Final = re.compile(r"^([A-Za-z0-9_.-]+?)_\d+_\d+$")


# --------------------------------------------------------------------------- processes
@dataclass(frozen=True)
class Proc:
    """One server process: a stable label and its pid."""

    label: str
    pid: int


def _children(pid: int) -> list[int]:
    try:
        return [int(kid.pid) for kid in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _label(pid: int, parent: str) -> str:
    argv: list[str] = [a for a in psutil.Process(pid).cmdline() if a]
    exe = Path(argv[0]).name if argv else "?"
    if "triton_python_backend_stub" in exe:
        for arg in argv:
            m = _INSTANCE_RE.match(arg)
            if m:
                return f"stub {arg}"
        return "stub ?"
    if exe == "tritonserver":
        return "tritonserver"
    if parent.startswith("stub grammar"):
        return "grammar compile worker"
    return f"{exe} (child of {parent})"


def server_processes(launcher: int) -> list[Proc]:
    """The launcher (gateway, supervisor) and every process below it, labelled."""
    out = [Proc("launcher + gateway", launcher)]
    todo = [(k, out[0].label) for k in _children(launcher)]
    while todo:
        pid, parent = todo.pop()
        try:
            label = _label(pid, parent)
        except psutil.NoSuchProcess:
            continue  # exited meanwhile
        out.append(Proc(label, pid))
        todo.extend((k, label) for k in _children(pid))
    return out


class CpuMeter:
    """CPU seconds per process label, accumulated over measured intervals."""

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher
        self.spent: dict[str, float] = {}

    def snapshot(self) -> dict[int, tuple[str, float]]:
        """CPU seconds per server process now, and this process's own (the client) under pid 0."""
        snap = {p.pid: (p.label, cpu_seconds(p.pid)) for p in server_processes(self.launcher)}
        times = os.times()
        snap[0] = (CLIENT_LABEL, times.user + times.system)
        return snap

    def add(self, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
            into: dict[str, float]) -> None:
        """Add each process's CPU between two snapshots to ``into`` (by label; new processes from 0)."""
        for pid, (label, cpu) in after.items():
            into[label] = into.get(label, 0.0) + cpu - before.get(pid, (label, 0.0))[1]


# --------------------------------------------------------------------------- requests
@dataclass
class Record:
    """One measured request."""

    mode: str
    concurrency: int
    round: int
    ttft_s: float
    latency_s: float
    completion_tokens: int
    deltas: int
    gaps_s: list[float] = field(default_factory=list)


def one_request(client: Client, mode: str, concurrency: int, round_no: int, prompt: int, max_tokens: int,
                gate: threading.Barrier | None = None, backend: str = "auto") -> tuple[Record, float, float]:
    """Stream one request; returns its record and its start and end times.

    Raises
    ------
    client.errors.ClientError
        Any failure, an error result included: a failed request fails the run.
    """
    constraint = Constraint.json_schema(PERSON_SCHEMA).with_policies(backend=backend) if mode == "constrained" \
        else None
    if gate is not None:
        gate.wait()
    t0 = time.perf_counter()
    last = math.nan
    ttft = math.nan
    gaps: list[float] = []
    tokens = deltas = 0
    for chunk in client.stream(PROMPTS[prompt % len(PROMPTS)], constraint=constraint, max_tokens=max_tokens,
                               temperature=0.0, require_complete=False):
        now = time.perf_counter()
        if chunk.text:
            deltas += 1
            if math.isnan(ttft):
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
        if chunk.result is not None:
            tokens = chunk.result.usage.completion_tokens
    end = time.perf_counter()
    return Record(mode, concurrency, round_no, ttft, end - t0, tokens, deltas, gaps), t0, end


def streams_at_once(client: Client, mode: str, concurrency: int, round_no: int, max_tokens: int, backend: str = "auto"
                    ) -> list[tuple[Record, float, float]]:
    """``concurrency`` streams released together (one thread each, prompts 0..N-1): :func:`one_request`'s results."""
    gate = threading.Barrier(concurrency, timeout=120.0)
    with ThreadPoolExecutor(concurrency, thread_name_prefix=f"path-{mode}") as pool:
        futs = [pool.submit(one_request, client, mode, concurrency, round_no, i, max_tokens, gate, backend)
                for i in range(concurrency)]
        return [f.result() for f in futs]


def run_load(served: Served, concurrencies: Sequence[int], rounds: int, max_tokens: int, reference: InProcess,
             min_s: float, backend: str = "auto") -> tuple[list[Record], dict[str, float], dict[str, dict[str, float]]]:
    """Warm up, then the measured batches; returns records, walls and CPU seconds per (mode@conc, process).

    Each round measures each concurrency for at least ``min_s`` seconds
    (:func:`e2e_bench.passes`), both modes alternating; each unconstrained
    batch runs beside an in-process batch of the same prompts
    (``reference``, :meth:`e2e_bench.InProcess.beside`).
    """
    meter = CpuMeter(served.pid)
    records: list[Record] = []
    walls: dict[str, float] = {}
    cpu: dict[str, dict[str, float]] = {}

    def batch(client: Client, mode: str, conc: int, r: int, prompt: int) -> None:
        key = f"{mode}@{conc}"
        before = meter.snapshot()
        if conc == 1:
            rec, t0, t1 = one_request(client, mode, 1, r, prompt, max_tokens, backend=backend)
            done, wall = [rec], t1 - t0
        else:
            out = streams_at_once(client, mode, conc, r, max_tokens, backend)
            done = [o[0] for o in out]
            wall = max(o[2] for o in out) - min(o[1] for o in out)
        meter.add(before, meter.snapshot(), cpu.setdefault(key, {}))
        records.extend(done)
        walls[key] = walls.get(key, 0.0) + wall

    server_cpu = partial(tree_cpu_s, served.pid)
    with Client(served.url, timeout_s=600.0) as client:
        for mode in MODES:  # the constrained warm-up pays the one compile
            one_request(client, mode, 1, -1, 0, max_tokens, backend=backend)
        for r in range(rounds):
            for conc in concurrencies:
                for k in passes(min_s):
                    for mode in MODES if (r + k) % 2 == 0 else MODES[::-1]:
                        for prompt in range(len(PROMPTS) if conc == 1 else 1):
                            run = partial(batch, client, mode, conc, r, prompt)
                            if mode == "constrained":
                                run()
                            else:
                                reference.beside(run, conc, prompt, server_cpu)
            print(f"  round {r + 1}/{rounds} done", flush=True)
    return records, walls, cpu


def hold_load(served: Served, concurrency: int, seconds: float, max_tokens: int, backend: str = "auto") -> int:
    """Batches of ``concurrency`` streams, the two modes alternating, for ``seconds``; returns the pairs run.

    Only the ``llm`` model's step stats read them: the equal-work medians
    at that batch then come from thousands of steps of each mode, taken
    turn by turn.  This host's speed moves by up to 2x from one batch to the
    next (the free step's p50 at 16 rows: 0.93-1.67 ms in four runs of the
    same code), and two medians of 150-250 steps, from batches seconds
    apart, moved with it (equal work 0.52-0.76).
    """
    pairs = 0
    with Client(served.url, timeout_s=600.0) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for mode in MODES:
                streams_at_once(client, mode, concurrency, -1, max_tokens, backend)
            pairs += 1
    return pairs


# --------------------------------------------------------------------------- report
def summarize(records: list[Record], walls: Mapping[str, float], cpu: Mapping[str, Mapping[str, float]],
              in_proc: Mapping[int, float], ratios: Mapping[int, tuple[float, float, float]],
              parts: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """Per (mode, concurrency): tokens/s, TTFT and inter-delta percentiles, CPU per 1,000 tokens per process."""
    out: dict[str, Any] = {}
    for key, wall in walls.items():
        mode, conc_s = key.split("@")
        conc = int(conc_s)
        rs = [r for r in records if r.mode == mode and r.concurrency == conc]
        tokens = sum(r.completion_tokens for r in rs)
        gaps = [g for r in rs for g in r.gaps_s]
        ttfts = [r.ttft_s for r in rs if not math.isnan(r.ttft_s)]
        out[key] = {
            "requests": len(rs),
            "completion_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else math.nan,
            "ttft_s_p50": pct(ttfts, 50),
            "ttft_s_p99": pct(ttfts, 99),
            "inter_delta_s_p50": pct(gaps, 50),
            "inter_delta_s_p99": pct(gaps, 99),
            "tokens_per_delta": tokens / max(1, sum(r.deltas for r in rs)),
            "cpu_s_per_1k_tokens": {k: 1000.0 * v / tokens for k, v in sorted(cpu.get(key, {}).items())
                                    if tokens and k != CLIENT_LABEL},
            "client_cpu_s_per_1k_tokens": 1000.0 * cpu.get(key, {}).get(CLIENT_LABEL, 0.0) / tokens if tokens else 0.0,
        }
        if mode == "unconstrained" and conc in in_proc:
            out[key]["in_process_tokens_per_s"] = in_proc[conc]
            out[key]["served_over_in_process"] = out[key]["tokens_per_s"] / in_proc[conc]
        if mode == "constrained" and conc in ratios:
            free, cons, r = ratios[conc]
            out[key]["equal_work"] = {"free_step_s_p50": free, "constrained_step_s_p50": cons, "ratio": r,
                                      **parts.get(conc, {})}
    return out


def print_report(summary: Mapping[str, Any], concurrencies: Sequence[int], model: Path, max_tokens: int) -> None:
    """The tables."""
    print(f"\n== serving path, {model.name}, greedy, max_tokens={max_tokens} ==")
    head = (f"{'mode':14s} {'conc':>4s} {'tok/s':>8s} {'in-proc':>8s} {'srv/in':>6s} {'ttft p50':>9s} "
            f"{'ttft p99':>9s} {'gap p50':>8s} {'gap p99':>8s} {'tok/delta':>9s} {'cpu ms/tok':>10s}")
    print(head)
    print("-" * len(head))
    for conc in concurrencies:
        for mode in MODES:
            s = summary[f"{mode}@{conc}"]
            inp = s.get("in_process_tokens_per_s", math.nan)
            sio = s.get("served_over_in_process", math.nan)
            cpu = sum(s["cpu_s_per_1k_tokens"].values())
            print(f"{mode:14s} {conc:4d} {s['tokens_per_s']:8.1f} {inp:8.1f} {sio:6.3f} "
                  f"{s['ttft_s_p50'] * 1e3:7.1f}ms {s['ttft_s_p99'] * 1e3:7.1f}ms {s['inter_delta_s_p50'] * 1e3:6.1f}ms "
                  f"{s['inter_delta_s_p99'] * 1e3:6.1f}ms {s['tokens_per_delta']:9.2f} {cpu:10.3f}")
    print("\n== CPU seconds per 1,000 streamed tokens, per server process ==")
    labels = sorted({k for s in summary.values() for k in s["cpu_s_per_1k_tokens"]})
    print(f"{'process':28s} " + " ".join(f"{m[0]}@{c:<5d}" for c in concurrencies for m in MODES))
    for label in labels:
        row = [summary[f"{m}@{c}"]["cpu_s_per_1k_tokens"].get(label, 0.0) for c in concurrencies for m in MODES]
        print(f"{label:28s} " + " ".join(f"{v:7.3f}" for v in row))
    row = [summary[f"{m}@{c}"]["client_cpu_s_per_1k_tokens"] for c in concurrencies for m in MODES]
    print(f"{CLIENT_LABEL:28s} " + " ".join(f"{v:7.3f}" for v in row))
    print("\n== equal work: decode step at a full batch (steps where no prompt joined) ==")
    for conc in concurrencies:
        ew = summary[f"constrained@{conc}"].get("equal_work")
        if ew is not None:
            print(f"  batch {conc:2d}: free p50 {ew['free_step_s_p50'] * 1e3:.3f} ms, constrained p50 "
                  f"{ew['constrained_step_s_p50'] * 1e3:.3f} ms, constrained/unconstrained {ew['ratio']:.3f}; "
                  f"forward p50 {ew.get('forward_free_s_p50', math.nan) * 1e3:.3f} / "
                  f"{ew.get('forward_constrained_s_p50', math.nan) * 1e3:.3f} ms, grammar on the loop p50 "
                  f"{ew.get('grammar_loop_s_p50', math.nan) * 1e3:.3f} ms")


def plot(summary: Mapping[str, Any], concurrencies: Sequence[int], path: Path) -> None:
    """Tokens/s (served, in-process) and CPU per token by process, as a PNG."""
    with harness.figure(path, f"{ENSEMBLE}: the serving path", columns=2, size=(12, 4.5)) as (a, b):
        x = np.arange(len(concurrencies))
        for i, mode in enumerate(MODES):
            a.bar(x + 0.27 * i, [summary[f"{mode}@{c}"]["tokens_per_s"] for c in concurrencies], 0.27,
                  label=f"served {mode}")
        a.bar(x + 0.54, [summary[f"unconstrained@{c}"].get("in_process_tokens_per_s", 0.0) for c in concurrencies],
              0.27, label="in-process unconstrained")
        a.set_xticks(x + 0.27, [str(c) for c in concurrencies])
        a.set_xlabel("concurrency")
        a.set_ylabel("output tokens/s")
        a.legend(fontsize=8)
        keys = [f"{m}@{c}" for c in concurrencies for m in MODES]
        labels = sorted({k for s in summary.values() for k in s["cpu_s_per_1k_tokens"]})
        bottom = np.zeros(len(keys))
        for label in labels:
            vals = np.array([summary[k]["cpu_s_per_1k_tokens"].get(label, 0.0) for k in keys])
            b.bar(range(len(keys)), vals, bottom=bottom, label=label)
            bottom += vals
        b.set_xticks(range(len(keys)), [f"{k.split('@')[0][:5]}@{k.split('@')[1]}" for k in keys], rotation=45,
                     fontsize=7)
        b.set_ylabel("CPU s per 1,000 streamed tokens")
        b.legend(fontsize=7)


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = harness.bench_parser(__doc__)
    harness.add_model_dir(parser, None, help_text=f"checkpoint to serve (default: the tiny stand-in, built at "
                                                   f"{TINY_DIR})")
    harness.add_max_tokens(parser, 128)
    harness.add_rounds(parser, 2, "measured rounds")
    harness.add_min_seconds(parser, 3.0)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="render value over deploy/values.json (repeat), e.g. MAX_BATCH=32")
    harness.add_json(parser)
    harness.add_plot(parser)
    harness.add_quick(parser, "1 round, 64 max tokens", env=True)
    harness.add_backend(parser, "auto", "grammar backend of the constrained requests (auto: llguidance for this "
                                        "schema)")
    parser.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                        help="after the rounds, alternate batches of both modes at the top concurrency this long: "
                             "its equal-work figure then rests on thousands of steps (default: off)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens = 1, 64
    if args.max_tokens < 1 or args.rounds < 1:
        parser.error("--max-tokens and --rounds must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    t_all = time.perf_counter()
    model = args.model_dir.resolve() if args.model_dir is not None else tiny_checkpoint()
    if not (model / "config.json").is_file():
        print(f"error: --model-dir {model}: no config.json", file=sys.stderr)
        return 2
    # The stand-in plays a GPU step, which keeps one host thread busy: a
    # second torch thread would only spin on the cores the serving path needs.
    values = harness.render_values(model, {"TORCH_THREADS": "1"} if args.model_dir is None else None)
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or key not in values:
            print(f"error: --set {item!r}: expected KEY=VALUE with a key of deploy/values.json", file=sys.stderr)
            return 2
        values[key] = value
    max_batch = int(values["MAX_BATCH"])
    concurrencies = [c for c in CONCURRENCIES if c <= max_batch]
    top = 16 if 16 in concurrencies else concurrencies[-1]
    # python -m deploy, as make serve runs it: the gateway in the launcher process, apart from this client.
    with harness.serve(values, prefix="path-bench-", launcher=True) as served, \
            InProcess(model, args.max_tokens, values) as reference:
        print(f"server ready at {served.url} in {served.ready_s:.1f} s", flush=True)
        records, walls, cpu = run_load(served, concurrencies, args.rounds, args.max_tokens, reference,
                                       args.min_seconds, args.backend)
        if args.hold > 0:
            pairs = hold_load(served, top, args.hold, args.max_tokens, args.backend)
            print(f"  held {pairs} pairs of {top}-stream batches for {args.hold:.0f} s", flush=True)
    stats = parse_step_stats(served.log_text)
    ratios = equal_work_ratios(stats, concurrencies)
    in_proc = reference.tokens_per_s()
    summary = summarize(records, walls, cpu, in_proc, ratios, {c: step_parts(stats, c) for c in ratios})
    print_report(summary, concurrencies, model, args.max_tokens)
    print(f"  (in-process batches ran beside the served ones; the idle server's CPU meanwhile: "
          f"{reference.idle_server_share():.1%} of a core)")
    if args.plot is not None:
        plot(summary, concurrencies, args.plot)
    if args.json is not None:
        payload = {"model_dir": str(model), "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "backend": args.backend,
                   "values": values, "summary": summary, "llm_step_stats": stats,
                   "idle_server_cpu_share": reference.idle_server_share(),
                   "records": [asdict(r) for r in records]}
        harness.write_json(args.json, payload)
    print(f"total {time.perf_counter() - t_all:.1f} s", file=sys.stderr)
    sio = summary[f"unconstrained@{top}"].get("served_over_in_process", math.nan)
    ew = summary[f"constrained@{top}"].get("equal_work", {}).get("ratio", math.nan)
    print(f"path at concurrency {top}: served/in-process {sio:.3f}, constrained/unconstrained {ew:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
