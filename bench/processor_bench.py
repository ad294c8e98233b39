"""What the grammar step after the forward (a logits processor's call order) costs against the overlapped one.

One torch engine, one real grammar engine (xgrammar over the model's own
vocabulary), one JSON schema; three modes interleaved in every round, same
greedy requests:

* ``free``: no constraint (the forward alone);
* ``overlap``: the torch scheduler's default, the grammar step of step ``t``
  on a worker thread while the forward of step ``t`` runs;
* ``processor``: the same grammar step after the forward, serially -- the
  call order of an engine's logits processor (the ``llm`` model's
  ``grammar_mode: processor``; the same request and reading of its answer,
  :mod:`llm_runtime.grammar_phase`).

Figures are per decode step at a fixed live batch (only steps where every row
was live count), so different output lengths between modes do not mix in.
The grammar side is in-process here (no BLS): the served processor adds the
BLS round trip on top (docs/benchmarks.md).  Run::

    python bench/processor_bench.py [MODEL_DIR] [--batch 1 8] [--tokens 48] [--rounds 3] [--json out.json]
        [--device cuda --dtype bfloat16] [--backend llguidance]

Constrained requests close at their budget, and every output is checked
against the schema (``valid``).  On a GPU host, ``deploy/gpu/torch_gpu_check.sh``
runs it for published model shapes (``bench/random_checkpoint.py``).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

import harness  # before the project's packages: it puts the repository root on sys.path
import jsonschema
import numpy as np
from harness import MODEL_DIR

from grammar_backend.llg import LlgBackend
from grammar_backend.tokenizer import load_tokenizer
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest
from llm_runtime.scheduler import (
    FinishEvent,
    GenerationRequest,
    Scheduler,
    SchedulerConfig,
    TokenEvent,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["Invent a person.", "Describe a customer.", "Name a pilot.", "A chef, as JSON.",
           "Someone from Lyon.", "A retired teacher.", "A child.", "A painter."]
MODES = ("free", "overlap", "processor")


def run_batch(engine: TorchEngine, grammar: GrammarEngine, mode: str, batch: int, tokens: int,
              backend: str = "xgrammar") -> dict[str, Any]:
    """One batch of ``batch`` greedy requests in ``mode``; per-step figures at the full batch.

    Constrained requests close at the budget (``on_budget: close``), so every
    output must parse and match :data:`SCHEMA`: ``valid`` counts those that do.
    """
    constraint = None if mode == "free" else ConstraintRequest(
        "json_schema", json.dumps(SCHEMA),
        json.dumps({"on_budget": "close", "on_repeat": "continue", "backend": backend}))
    grammar_mode = "processor" if mode == "processor" else "overlap"
    done = threading.Semaphore(0)
    texts: list[list[str]] = [[] for _ in range(batch)]
    produced = [0]
    errors: list[str] = []

    def on_event(row: int, event: TokenEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            if event.finish_reason == "error":
                errors.append(str(event.error))
            produced[0] += event.completion_tokens
            done.release()
        else:
            texts[row].append(event.text_delta)

    with Scheduler(engine, LocalMaskProvider(grammar),
                   SchedulerConfig(max_batch_size=batch, grammar_mode=grammar_mode)) as sched:
        t0 = time.perf_counter()
        for i in range(batch):
            ids = engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids
            sched.submit(GenerationRequest(ids, constraint=constraint, max_tokens=tokens, temperature=0.0),
                         functools.partial(on_event, i))
        for _ in range(batch):
            if not done.acquire(timeout=600):
                raise TimeoutError("a request did not finish")
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"{len(errors)} of {batch} requests failed, the first: {errors[0]}")
        s = sched.stats()
        summary = sched.summary()
    full = (s.batch_size == batch) & (s.prefill_rows == 0)
    wait = np.nan_to_num(s.mask_wait_s)
    step = s.forward_s + wait
    gram = s.grammar_s[full]
    return {
        "steps": int(full.sum()),
        "step_s": step[full].tolist(),
        # Apart from the step: on the H200 (2026-12-04) every step had a ~60 ms floor, flat from a
        # 135M model at batch 1 to a 1.7B one at batch 64; the next run must show whether it is the forward.
        "forward_s": s.forward_s[full].tolist(),
        "grammar_s": gram[np.isfinite(gram)].tolist(),
        "grammar_requests": int(summary["grammar_requests"]),
        "constrained_steps": int((s.constrained_rows > 0).sum()),
        "valid": sum(_valid("".join(t)) for t in texts),
        "tokens": produced[0],
        "wall_s": wall,
    }


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__)
    harness.add_model_dir(parser, MODEL_DIR, positional=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=48)
    harness.add_rounds(parser, 3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, see TorchEngineConfig)")
    parser.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", help="engine dtype (float32, bfloat16, float16)")
    harness.add_backend(parser, "xgrammar", "grammar backend", auto=False)
    harness.add_json(parser)
    args = parser.parse_args(argv)

    engine = TorchEngine(args.model_dir, TorchEngineConfig(max_batch_size=max(args.batch), max_seq_len=512,
                                                      num_threads=args.threads, device=args.device,
                                                      dtype=args.dtype))
    bundle = load_tokenizer(args.model_dir, vocab_size=engine.vocab_size, stop_token_ids=sorted(engine.eos_token_ids))
    llg = LlgBackend(bundle.hf, bundle.vocab_size, bundle.stop_token_ids) if args.backend == "llguidance" else None
    grammar = GrammarEngine(bundle.info, bundle.fingerprint, GrammarEngineConfig(max_batch=max(args.batch)),
                            encode=bundle.encode, llg=llg)
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        run_batch(engine, grammar, "overlap", 1, 4, args.backend)  # warm-up: compile the schema, touch every code path
        for b in args.batch:
            per = results.setdefault(str(b), {m: {"step_s": [], "forward_s": [], "grammar_s": [], "tokens": [], "wall_s": [],
                                                  "valid": []} for m in MODES})
            for _ in range(args.rounds):
                for mode in MODES:  # interleaved: machine noise hits every mode alike
                    out = run_batch(engine, grammar, mode, b, args.tokens, args.backend)
                    for key in ("step_s", "forward_s", "grammar_s"):
                        per[mode][key] += out[key]
                    for key in ("tokens", "wall_s", "valid"):
                        per[mode][key].append(out[key])
                    if mode == "processor" and out["grammar_requests"] != out["constrained_steps"]:
                        raise AssertionError(f"processor: {out['grammar_requests']} grammar requests for "
                                             f"{out['constrained_steps']} constrained steps")
    finally:
        grammar.close()

    print(f"model {args.model_dir.name} on {args.device} ({args.dtype}), {args.backend}, {args.tokens} tokens per "
          f"request, {args.rounds} rounds, {args.threads} torch thread(s); ms per decode step at the full batch "
          "(p50 / p90); tokens/s over each batch's wall time; constrained outputs valid")
    summary: dict[str, Any] = {}
    for b, per in results.items():
        med = {m: float(np.median(per[m]["step_s"])) for m in MODES}
        p90 = {m: float(np.percentile(per[m]["step_s"], 90)) for m in MODES}
        gram = float(np.median(per["processor"]["grammar_s"])) if per["processor"]["grammar_s"] else float("nan")
        summary[b] = {"p50_ms": {m: 1e3 * v for m, v in med.items()}, "p90_ms": {m: 1e3 * v for m, v in p90.items()},
                      "steps": {m: len(per[m]["step_s"]) for m in MODES}, "processor_grammar_p50_ms": 1e3 * gram,
                      "forward_p50_ms": {m: 1e3 * float(np.median(per[m]["forward_s"])) for m in MODES},
                      "tok_s": {m: sum(per[m]["tokens"]) / sum(per[m]["wall_s"]) for m in MODES},
                      "valid": {m: f"{sum(per[m]['valid'])}/{int(b) * len(per[m]['valid'])}" for m in MODES[1:]}}
        cells = "  ".join(f"{m} {1e3 * med[m]:.1f} / {1e3 * p90[m]:.1f}" for m in MODES)
        rates = "  ".join(f"{m} {v:,.0f}" for m, v in summary[b]["tok_s"].items())
        print(f"B={b}: {cells}  | processor grammar step p50 {1e3 * gram:.2f} ms | "
              f"processor/overlap {med['processor'] / med['overlap']:.3f}  overlap/free {med['overlap'] / med['free']:.3f}")
        fwd = "  ".join(f"{m} {v:.1f}" for m, v in summary[b]["forward_p50_ms"].items())
        print(f"      forward p50 ms {fwd}  | tok/s {rates}  | valid {summary[b]['valid']}")
    if args.json is not None:
        harness.write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                       "raw": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
