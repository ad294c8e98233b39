"""Smoke tests of the benchmark scripts ``bench/maskbench.py``, ``bench/grammar_bench.py`` and ``bench/processor_bench.py``.

Both scripts run as subprocesses on a tiny MaskBench-format folder written
here, and the exact per-schema outcomes of their JSON output are checked: a
schema that passes, an over-constraint (keys out of schema order), an
under-constraint caught by the post-validator (``uniqueItems``), a compile
error (a lookbehind), a spec rejection (an unknown type), and for maskbench a
compile that runs past the time limit (eight 20,000-fold bounded repetitions:
about 40 s each with the Qwen3 vocabulary on the 2-core machine, so minutes on
any machine, killed at 20 s).  The limits only bound a hang: the other
schemas' phases take well under a second on the loaded 2-core machine, and
nothing asserts how long a run takes.  The worker pool's crash / timeout /
error handling is checked directly with tasks that segfault, hang and raise.

Data: the Qwen3 tokenizer (:mod:`tests.support.assets`); the script tests skip
with the reason when it is absent, or fail under ``REQUIRE_ASSETS=1``.
Measured on 2 shared cores: pool test ~5 s, maskbench ~35 s, grammar_bench ~20 s, grammar_step_bench's
fill states ~15 s.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.support import assets
from tests.support.poll import HANG_S, poll

REPO = Path(__file__).resolve().parents[2]
QWEN_PADDED = 151_936
#: A bench script's whole run (tokenizer loads included): reached only when it hangs.
RUN_HANG_S = 600
#: maskbench's per-phase limit: many times what a phase of the normal schemas takes, far below the slow one.
PHASE_LIMIT_S = 20

#: file name -> (schema, [(valid, instance), ...])
CASES: dict[str, tuple[Any, list[tuple[bool, Any]]]] = {
    "Handwritten---closed.json": (
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        [
            (True, {"name": "Ann", "age": 3}),
            (True, {"name": "Bob", "age": 0}),
            (False, {"name": "Ann", "age": -1}),
            (False, {"name": "Annabelle", "age": 3}),
            (False, {"name": "Ann"}),
            (False, {"name": "Ann", "age": 3, "x": 1}),
        ],
    ),
    "Handwritten---order.json": (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        [(True, {"a": 1, "b": 2}), (True, {"b": 2, "a": 1}), (False, {"a": "1", "b": 2})],
    ),
    "Synthesized_1.json": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [(True, [1, 2, 3]), (False, [1, 1]), (False, ["a"])],
    ),
    "Handwritten---lookbehind.json": ({"type": "string", "pattern": "(?<=a)b"}, [(True, "b")]),
    "Handwritten---badtype.json": ({"type": "wat"}, [(True, 1)]),
}
#: Sorted last, so no task is left after its timeout and no worker is respawned (saves a tokenizer load).
#: Eight distinct bounded repetitions (xgrammar's compile time adds up over them): minutes of compile.
SLOW = ("WashingtonPost---slow.json", (
    {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{20_000 + i}}}$"}
                                      for i in range(8)},
     "required": [f"p{i}" for i in range(8)], "additionalProperties": False},
    [(True, {f"p{i}": "abc" for i in range(8)})]))


def _write_cases(folder: Path, cases: dict[str, tuple[Any, list[tuple[bool, Any]]]]) -> Path:
    folder.mkdir()
    for name, (schema, tests) in cases.items():
        doc = {"description": name, "schema": schema,
               "tests": [{"description": f"case {i}", "valid": v, "data": d} for i, (v, d) in enumerate(tests)]}
        (folder / name).write_text(json.dumps(doc), encoding="utf-8")
    return folder


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_HANG_S, check=False,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# --------------------------------------------------------------------- pool
# Task functions of the pool test: module-level, so spawned workers import
# them from this module by name.


def _pool_init(tag: str) -> str:
    return tag


def _pool_task(state: str, task: str, ctx: Any) -> dict[str, Any]:
    ctx.phase("work", seen=task)
    if task == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif task == "hang":
        time.sleep(120)
    elif task == "raise":
        raise ValueError("bad task")
    return {"state": state, "task": task, "pid": os.getpid()}


def test_pool_survives_segfault_hang_and_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench/ is not a package; the scripts import each other as top-level modules.
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import maskbench

    tasks = ["a", "segfault", "hang", "raise", "b"]
    with maskbench.WorkerPool(1, _pool_init, ("S",), _pool_task, timeout_s=2.0) as pool:
        outcomes = {o.task: o for o in pool.run(tasks)}
        respawns = pool.respawns
    assert sorted(outcomes) == sorted(tasks)
    assert [(t, outcomes[t].kind, outcomes[t].phase) for t in tasks] == [
        ("a", "done", "work"), ("segfault", "crash", "work"), ("hang", "timeout", "work"),
        ("raise", "error", "work"), ("b", "done", "work"),
    ]
    assert outcomes["a"].record["state"] == "S" and outcomes["b"].record["task"] == "b"
    assert outcomes["segfault"].detail.startswith("killed by SIGSEGV")
    assert outcomes["segfault"].record == {"seen": "segfault"}  # the phase info survives the crash
    assert outcomes["hang"].detail == "work did not finish within 2 s"
    # Not before its timeout (a slower machine only adds to it).  That it was killed rather than waited out
    # is the kind: a task that ends by itself (120 s) reports "done".
    assert outcomes["hang"].elapsed_s >= 2.0, outcomes["hang"].elapsed_s
    assert outcomes["raise"].detail.startswith("ValueError: bad task\n")
    assert outcomes["a"].record["pid"] != outcomes["b"].record["pid"]  # a fresh worker after the kills
    assert respawns == 2


@pytest.mark.parametrize(
    ("name", "subset"),
    [("Github_easy---o123.json", "Github_easy"), ("BFCL_java_10.json", "BFCL_java"),
     ("Handwritten---oneofpr2.json", "Handwritten"), ("JME_3.json", "JME"), ("odd.json", "odd")],
)
def test_subset_of(monkeypatch: pytest.MonkeyPatch, name: str, subset: str) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import maskbench

    assert maskbench.subset_of(name) == subset


# ---------------------------------------------------------------- maskbench


def test_maskbench_outcomes(tmp_path: Path) -> None:
    qwen = assets.qwen3_dir()
    data = _write_cases(tmp_path / "data", {**CASES, SLOW[0]: SLOW[1]})
    out = tmp_path / "maskbench.json"
    proc = _run("maskbench.py", [str(data), "--tokenizer", str(qwen), "--vocab-size", str(QWEN_PADDED),
                                 "--workers", "1", "--timeout", str(PHASE_LIMIT_S), "--backend", "xgrammar",
                                 "--json", str(out), "--no-value-checks", "--quiet"])
    doc = json.loads(out.read_text())
    by_file = {r["file"]: r for r in doc["schemas"]}
    got = {name: (r["status"], r["passed"], [v["test"] for v in r.get("valid_rejected", [])],
                  [(u["test"], u["caught"]) for u in r.get("invalid_accepted", [])])
           for name, r in by_file.items()}
    assert got == {
        "Handwritten---closed.json": ("compiled", True, [], []),
        "Handwritten---order.json": ("compiled", False, [1], []),
        "Synthesized_1.json": ("compiled", False, [], [(1, True)]),
        "Handwritten---lookbehind.json": ("compile_error", False, [], []),
        "Handwritten---badtype.json": ("spec_rejected", False, [], []),
        "WashingtonPost---slow.json": ("timeout", False, [], []),
    }
    assert by_file["Handwritten---lookbehind.json"]["reason"] == (
        "grammar: xgrammar cannot compile this json_schema: Regex parsing error at position 3: "
        "Lookbehind is not supported yet."
    )
    assert by_file["Handwritten---badtype.json"]["reason"].startswith("grammar#/type: not a valid JSON Schema: ")
    assert by_file["WashingtonPost---slow.json"]["phase"] == "compile"
    assert by_file["WashingtonPost---slow.json"]["reason"] == f"compile did not finish within {PHASE_LIMIT_S} s"
    assert by_file["Handwritten---order.json"]["valid_rejected"][0]["at"] == "...{\" | 'b'"
    assert by_file["Synthesized_1.json"]["invalid_accepted"][0]["violation"] == "[1, 1] has non-unique elements"
    for name in ("Handwritten---closed.json", "Handwritten---order.json", "Synthesized_1.json"):
        assert by_file[name]["mask_mismatches"] == 0 and by_file[name]["untokenizable"] == []
    assert doc["respawns"] == 0
    assert doc["subsets"]["Handwritten"] == {
        "schemas": 4, "spec_rejected": 1, "compile_error": 1, "timeout": 0, "crash": 0, "error": 0, "bad_file": 0,
        "compiled": 2, "passed": 1, "over_schemas": 1, "valid_rejected": 1, "valid_total": 6, "under_schemas": 0,
        "invalid_accepted": 0, "caught": 0, "validator_errors": 0, "invalid_total": 5, "untokenizable": 0, "mask_mismatches": 0,
        "valid_rejected_tokenization": 0, "valid_rejected_value_check": 0, "value_checked": 0,
        "value_checked_schemas": 0, "passed_or_caught": 1,
    }
    totals = doc["totals"]
    assert (totals["schemas"], totals["passed"], totals["timeout"], totals["invalid_accepted"], totals["caught"]) == (
        6, 1, 1, 1, 1)
    assert "TOTAL" in proc.stdout and "LLGuidance 8909" in proc.stdout
    assert "passed when post-validation counts (every valid instance accepted, every invalid one rejected while " \
           "decoding or flagged by post-validation): 2/6 (33.3%)" in proc.stdout
    assert {r["backend"] for r in doc["schemas"] if r["status"] == "compiled"} == {"xgrammar"}
    assert (doc["timings"]["by_backend"]["xgrammar"]["schemas"], doc["timings"]["by_backend"]["xgrammar"]["passed"]) == (
        3, 1)


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_maskbench_backends(tmp_path: Path, backend: str) -> None:
    """auto serves JSON with llguidance first and tries xgrammar where llguidance refuses; the reason is the first
    backend's, naming the second's."""
    qwen = assets.qwen3_dir()
    names = ("Handwritten---closed.json", "Handwritten---lookbehind.json")
    data = _write_cases(tmp_path / "data", {name: CASES[name] for name in names})
    out = tmp_path / "maskbench.json"
    _run("maskbench.py", [str(data), "--tokenizer", str(qwen), "--vocab-size", str(QWEN_PADDED), "--workers", "1",
                          "--backend", backend, "--json", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    by_file = {r["file"]: r for r in doc["schemas"]}
    closed, lookbehind = by_file[names[0]], by_file[names[1]]
    assert (closed["status"], closed["passed"], closed["backend"]) == ("compiled", True, "llguidance")
    assert lookbehind["status"] == "compile_error"
    assert lookbehind["reason"].startswith("grammar: llguidance cannot compile this json_schema: ")
    assert ("(xgrammar too: xgrammar cannot compile this json_schema: Regex parsing error at position 3: Lookbehind "
            "is not supported yet.)" in lookbehind["reason"]) is (backend == "auto")
    assert doc["config"]["options"]["backend"] == backend



@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_maskbench_value_checks(tmp_path: Path, backend: str) -> None:
    """With value checks (the default) the repeated item is rejected at its end, as decoding would drop it."""
    name = "Synthesized_1.json"
    data = _write_cases(tmp_path / "data", {name: CASES[name]})
    out = tmp_path / "maskbench.json"
    proc = _run("maskbench.py", [str(data), "--tokenizer", str(assets.qwen3_dir()), "--vocab-size", str(QWEN_PADDED),
                                 "--workers", "1", "--backend", backend, "--json", str(out), "--quiet"])
    (rec,) = json.loads(out.read_text())["schemas"]
    assert (rec["passed"], rec["value_checked"], rec["invalid_accepted"], rec["valid_rejected"]) == (True, [1], [], [])
    assert "value checks on: 1 invalid instances rejected at a value's end in 1 schemas" in proc.stdout


# ------------------------------------------------------------ grammar_bench


def test_grammar_bench_outcomes(tmp_path: Path) -> None:
    qwen = assets.qwen3_dir()
    data = _write_cases(tmp_path / "data", CASES)
    out = tmp_path / "bench.json"
    # Budget and phase limit only bound a hang: every schema is measured, none times out, however loaded.
    proc = _run("grammar_bench.py", [str(data), "--quick", "--tokenizer", str(qwen), "--vocab-size",
                                     str(QWEN_PADDED), "--limit", "10", "--budget", str(RUN_HANG_S),
                                     "--timeout", str(HANG_S), "--json", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    (res,) = doc["tokenizers"]
    assert (res["vocab_size"], res["tokenizer_size"], res["stop_token_ids"]) == (QWEN_PADDED, 151_669, [151_645])
    by_file = {r["file"]: r for r in res["schemas"]}
    assert {name: (r["status"], r.get("valid_rejected")) for name, r in by_file.items()} == {
        "Handwritten---closed.json": ("ok", 0),
        "Handwritten---order.json": ("ok", 1),
        "Synthesized_1.json": ("ok", 0),
        "Handwritten---lookbehind.json": ("compile_error", None),
        "Handwritten---badtype.json": ("spec_rejected", None),
    }
    assert res["counts"] == {"ok": 3, "spec_rejected": 1, "compile_error": 1, "timeout": 0, "crash": 0,
                             "error": 0, "bad_file": 0}
    # Raw fill and raw accept+fill are timed at the same tokens; ours at the same tokens too.
    for r in (by_file[n] for n in ("Handwritten---closed.json", "Synthesized_1.json")):
        assert r["ours_step_tokens"] == r["raw_fill_tokens"] == r["raw_step_tokens"] > 0
    rows = {row["figure"]: row for row in res["rows"]}
    assert rows["compile (cold key)"]["n"] == 3 and rows["cache hit"]["n"] == 3
    # Every schema the spec accepted, parsed once new and then again.
    assert rows["parse_constraint, new schema"]["n"] == rows["parse_constraint, same schema again"]["n"] == 4
    for name in ("compile (cold key)", "cache hit", "mask 1 seq: step vs accept+fill", "batch fill B=256 threads=2"):
        row = rows[name]
        assert row["ours_p50"] > 0 and row["raw_p50"] > 0 and row["ratio_p50"] > 0
    # The batch phase uses the schemas whose valid instances were all accepted (not "order").
    assert res["batch_schemas"] == ["Handwritten---closed.json"]
    assert [f for f in rows if f.startswith("batch fill")] == [
        f"batch fill B={b} threads={t}" for t in (1, 2) for b in (1, 16, 64, 256)
    ]
    assert "XGrammar 9 us / 5700 us" in proc.stdout


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_processor_bench_compares_the_three_modes(tmp_path: Path, backend: str) -> None:
    """bench/processor_bench.py on the real default model: every mode measured at the full batch,
    and every constrained output, closed within its 32-token budget, valid."""
    model = assets.smollm2_dir()
    out = tmp_path / "processor.json"
    proc = _run("processor_bench.py", [str(model), "--batch", "2", "--tokens", "32", "--rounds", "1",
                                       "--backend", backend, "--json", str(out)])
    report = json.loads(out.read_text())
    summary = report["summary"]["2"]
    assert set(summary["p50_ms"]) == {"free", "overlap", "processor"}
    assert all(summary["steps"][m] >= 1 and summary["p50_ms"][m] > 0 for m in summary["steps"])
    assert summary["processor_grammar_p50_ms"] > 0
    assert summary["valid"] == {"overlap": "2/2", "processor": "2/2"}
    assert all(len(report["raw"]["2"][m]["forward_s"]) == summary["steps"][m] for m in summary["steps"])
    assert f"{backend}, 32 tokens per request" in proc.stdout
    assert "processor/overlap" in proc.stdout


def test_e2e_equal_work_ratio_reads_the_step_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import e2e_bench

    stats = [{"step_s_p50_b8_free": 0.100, "step_s_p50_b8_constrained": 0.125, "step_s_p50_b1_free": 0.05},
             {"step_s_p50_b8_free": 0.080, "step_s_p50_b8_constrained": 0.120}]
    # Worst instance per mode; batch 1 lacks a constrained figure, so it has no ratio.
    assert e2e_bench.equal_work_ratios(stats, (1, 8)) == {8: (0.100, 0.125, 0.8)}
    # Jump-forward: constrained steps that add 10 tokens for 8 rows make up for their longer forward.
    stats[0].update({"tokens_per_step_b8_free": 8.0, "tokens_per_step_b8_constrained": 10.0})
    stats[1].update({"tokens_per_step_b8_free": 8.0, "tokens_per_step_b8_constrained": 10.0})
    assert e2e_bench.equal_work_ratios(stats, (8,)) == {8: (0.100, 0.125, 1.0)}


def test_step_bench_compares_each_step_with_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import grammar_step_bench

    # Two rounds of a 4-step path: cheap, costly, costly, cheap; the served step costs 0.5 ms more at each.
    floor = [1.0, 6.0, 6.0, 1.0, 1.0, 6.0, 6.0, 1.0]
    served = [1.5, 6.5, 6.5, 1.5, 1.5, 6.5, 6.5, 1.5]
    assert grammar_step_bench.paired(served, floor, 4) == {"p50": pytest.approx(0.5 * (1.5 + 6.5 / 6)),
                                                           "total": pytest.approx(16 / 14)}
    # One round's costly third step (a host hiccup) moves its step's median only halfway.
    served[6] = 16.5
    assert grammar_step_bench.paired(served, floor, 4)["total"] == pytest.approx(21 / 14)


class _PathMatcher:
    """A matcher that takes any token and ends on token 0, for the step bench's paths."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept(self, token: int) -> bool:
        self.seen.append(token)
        return True

    def ended(self) -> bool:
        return bool(self.seen) and self.seen[-1] == 0


@pytest.mark.parametrize("floor", [False, True])
def test_step_bench_steps_every_row_along_its_path(monkeypatch: pytest.MonkeyPatch, floor: bool) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import grammar_step_bench

    rows = [_PathMatcher() for _ in range(3)]
    fills: list[int] = []
    times = grammar_step_bench._time_path(rows, _PathMatcher.accept, _PathMatcher.ended, lambda: fills.append(1),
                                          [[5, 6, 0], [7, 8, 0]], floor=floor)
    # Row r follows path r % 2; one fill per step, the first step before any token.
    assert [m.seen for m in rows] == [[5, 6, 0], [7, 8, 0], [5, 6, 0]]
    assert len(fills) == 4
    assert sorted(times) == ["raw", "raw fill"]
    assert all(len(v) == 4 for v in times.values())


def test_step_bench_floor_refuses_a_row_that_ends_before_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import grammar_step_bench

    with pytest.raises(RuntimeError, match=r"^floor: row 1 ended before its path did, at step 1$"):
        grammar_step_bench._time_path([_PathMatcher(), _PathMatcher()], _PathMatcher.accept, _PathMatcher.ended,
                                      lambda: None, [[5, 6], [0, 6]], floor=True)


def test_step_bench_plots_each_mode_over_the_raw_fill(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import grammar_step_bench

    figures = {(rows, n, backend, mode): {"over raw fill p50": 1.0 + 0.1 * i}
               for rows in (64, 256) for n in (1, 2) for backend in ("xgrammar", "llguidance", "auto")
               for i, mode in enumerate(grammar_step_bench.PLOTTED)}
    grammar_step_bench.plot_sweep(figures, tmp_path / "plots" / "step.png")
    assert (tmp_path / "plots" / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match=r"^\(64, 1, 'xgrammar', 'floor'\)$"):  # a mode not timed is not drawn as 0
        grammar_step_bench.plot_sweep({(64, 1, "xgrammar", "raw"): {"over raw fill p50": 1.0}}, tmp_path / "x.png")


def test_step_bench_fill_states_compares_thread_counts(tmp_path: Path) -> None:
    assets.qwen3_dir()  # the script loads the Qwen3 tokenizer: skipped (or failed) with the reason when absent
    out = tmp_path / "fill.json"
    proc = _run("grammar_step_bench.py", ["--fill-states", "--threads", "2", "--rows", "4", "--json", str(out)])
    fills = json.loads(out.read_text())
    # Held states and the engine's whole step along the paths (-1), each backend on 1 and 2 threads; the fill
    # beside a Python loop (-2: both at once over the sum of the two apart) and the pipelined step (-3), 1 thread.
    assert sorted(fills) == sorted([*(f"{b}/{s}/{n}" for b in ("xgrammar", "llguidance") for s in (2, 10, 14, -1)
                                      for n in (1, 2)), *(f"{b}/{s}/1" for b in ("xgrammar", "llguidance")
                                                          for s in (-2, -3))])
    assert all(v > 0 for v in fills.values())
    assert "in-process engine step along the paths, 4 rows" in proc.stdout
    assert "the fill beside the step thread's Python" in proc.stdout


def test_e2e_step_parts_read_the_step_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import e2e_bench

    stats = [{"forward_s_p50_b8_free": 0.090, "forward_s_p50_b8_constrained": 0.095,
              "grammar_loop_s_p50_b8_constrained": 0.004},
             {"forward_s_p50_b8_free": 0.080, "grammar_loop_s_p50_b8_constrained": 0.006}]
    # Worst instance per part, as equal_work_ratios; a part no instance reports is NaN.
    assert e2e_bench.step_parts(stats, 8) == {"forward_free_s_p50": 0.090, "forward_constrained_s_p50": 0.095,
                                              "grammar_loop_s_p50": 0.006}
    assert all(math.isnan(v) for v in e2e_bench.step_parts(stats, 16).values())


def test_in_process_reference_runs_beside_the_served_side(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """served / in-process: each in-process batch runs next to its served batch, which goes first turn by turn."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import e2e_bench
    import torch

    from standins.tiny_model import CHATML, build_tiny_llama

    model = build_tiny_llama(tmp_path / "model", chat_template=CHATML, max_position_embeddings=2048).path
    threads = torch.get_num_threads()
    order: list[object] = []
    cpu = iter([1.0, 1.5, 2.0, 2.25])
    with e2e_bench.InProcess(model, 8, {"MAX_BATCH": "4", "TORCH_THREADS": "1", "MAX_PREFILL_TOKENS": "16"}) as ref:
        assert ref._sched is not None and ref._sched.config.max_prefill_tokens == 16  # as the server's
        real = ref._batch

        def batch(n: int, first_prompt: int) -> tuple[int, float]:
            order.append(("in-process", n, first_prompt))
            return real(n, first_prompt)

        def served(name: str) -> str:
            order.append(name)
            return name

        monkeypatch.setattr(ref, "_batch", batch)
        for name, n, prompt in (("a", 1, 3), ("b", 2, 0)):
            assert ref.beside(partial(served, name), n, prompt, lambda: next(cpu)) == name
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
    assert order == ["a", ("in-process", 1, 3), ("in-process", 2, 0), "b"]
    assert ref.tokens == {1: 8, 2: 16}
    assert ref.server_cpu_s == 0.75
    assert ref.tokens_per_s() == {n: ref.tokens[n] / ref.wall_s[n] for n in (1, 2)}
    assert ref.idle_server_share() == 0.75 / (ref.wall_s[1] + ref.wall_s[2])


def test_path_bench_reads_the_processes_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU per process: the launcher and every process under it, labelled; a stub by its model instance."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import path_bench

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "llm_0_0"])  # killed below
    try:
        # Until the child has exec'd (its cmdline is empty before).
        labels = poll(lambda: {p.pid: p.label for p in path_bench.server_processes(os.getpid())},
                      lambda found: not found.get(child.pid, "?").startswith("?"), HANG_S, interval_s=0.05)
        assert labels[os.getpid()] == "launcher + gateway"
        assert labels[child.pid].startswith(Path(sys.executable).name)  # not a stub: no stub executable
        assert path_bench.cpu_seconds(os.getpid()) > 0 and path_bench.cpu_seconds(2**22 + 7) == 0.0
    finally:
        child.kill()
        child.wait()


def test_path_bench_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import path_bench

    records = [path_bench.Record("unconstrained", 16, 0, 0.05, 1.0, 100, 5, [0.02, 0.04]),
               path_bench.Record("unconstrained", 16, 0, 0.07, 1.0, 100, 5, [0.06]),
               path_bench.Record("constrained", 16, 0, 0.09, 1.0, 50, 10, [])]
    walls = {"unconstrained@16": 0.5, "constrained@16": 0.25}
    cpu = {"unconstrained@16": {"stub llm_0_0": 0.4, "tritonserver": 0.1, path_bench.CLIENT_LABEL: 0.05},
           "constrained@16": {"stub llm_0_0": 0.1}}
    parts = {16: {"forward_free_s_p50": 0.0018, "forward_constrained_s_p50": 0.0019, "grammar_loop_s_p50": 0.0004}}
    out = path_bench.summarize(records, walls, cpu, {16: 800.0}, {16: (0.002, 0.0025, 0.8)}, parts)
    u, c = out["unconstrained@16"], out["constrained@16"]
    assert (u["tokens_per_s"], u["served_over_in_process"], u["tokens_per_delta"]) == (400.0, 0.5, 20.0)
    assert u["cpu_s_per_1k_tokens"] == {"stub llm_0_0": 2.0, "tritonserver": 0.5}
    assert (u["client_cpu_s_per_1k_tokens"], c["client_cpu_s_per_1k_tokens"]) == (0.25, 0.0)
    assert u["ttft_s_p50"] == pytest.approx(0.06) and u["inter_delta_s_p50"] == pytest.approx(0.04)
    assert c["equal_work"] == {"free_step_s_p50": 0.002, "constrained_step_s_p50": 0.0025, "ratio": 0.8,
                               "forward_free_s_p50": 0.0018, "forward_constrained_s_p50": 0.0019,
                               "grammar_loop_s_p50": 0.0004}
    assert c["tokens_per_s"] == 200.0 and "served_over_in_process" not in c


@pytest.mark.parametrize(("argv", "backend"), [([], "auto"), (["--backend", "xgrammar"], "xgrammar"),
                                                (["--backend", "llguidance"], "llguidance")])
def test_path_bench_backend_option(monkeypatch: pytest.MonkeyPatch, argv: list[str], backend: str) -> None:
    """``--backend`` takes the contract's values (one home: ``contract.POLICIES``) and nothing else."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import path_bench

    assert path_bench.parse_args(argv).backend == backend
    with pytest.raises(SystemExit):
        path_bench.parse_args(["--backend", "outlines"])


def test_penalty_bench_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import penalty_bench

    outcomes = [{"outcome": "own", "valid": True, "tokens": 10, "loop": False},
                {"outcome": "repeat", "valid": True, "tokens": 30, "loop": True},
                {"outcome": "trunc", "valid": False, "tokens": 50, "loop": False},
                {"outcome": "error: UNAVAILABLE", "tokens": 0, "loop": False}]
    assert penalty_bench.figures(outcomes) == {
        "n": 4, "own": 1, "repeat": 1, "budget": 0, "invalid": 0, "trunc": 1, "errors": ["error: UNAVAILABLE"],
        "valid": 2, "loop": 1, "tokens": 22.5}
    assert penalty_bench._LOOP.search('{"a":[' + '"type",' * 6 + '"x"]}') is not None
    assert penalty_bench._LOOP.search('{"name":"Ada","age":36}') is None


def test_speculation_bench_report(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The on/off table and last-line part from records: sums over rounds, the first concurrency's ratio,
    greedy outputs that differ counted."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import speculation_bench as sb

    records = []
    for workload in sb.WORKLOADS:
        for constrained in (False, True):
            for mode, wall, forwards, texts in (("off", 2.0, 40, ("a",)), ("on", 1.0, 20, ("a" if constrained else "b",))):
                records.append(sb.Record("m", workload, constrained, 1, mode, 0, wall, 40, forwards,
                                         30 if mode == "on" else 0, 20 if mode == "on" else 0, texts))
    records.append(sb.Record("m", "extract", False, 1, "on", -1, 99.0, 1, 1, 0, 0, ("warm-up",)))  # not counted
    assert sb.report(records, "m", [1]) == "extract 2.00 (json 2.00), free 2.00 (json 2.00) (m)"
    table = capsys.readouterr().out.splitlines()
    assert table[-4].split() == ["extract", "text", "1", "1.00", "2.00", "20.0", "40.0", "2.000", "20/30", "1"]
    assert table[-3].split()[-1] == "0"  # json: the same text on and off
    prompt, constraint = sb.request_of("extract", True, 5)
    assert "Alan Turing" in prompt and constraint is not None and constraint.kind == "json_schema"
