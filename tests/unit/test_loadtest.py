"""The load test's logic without locust: jobs, the judge of every output, load shapes, the summary.

(``loadtest/locustfile.py`` itself imports locust, which monkey-patches the
whole process with gevent, so it runs only as a locust process: see
``tests/integration/test_loadtest_smoke.py``.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from client import Result, Usage
from grammar_backend.fidelity import unenforced_keywords
from loadtest.run import exit_deadline
from loadtest.summary import percentile, render, summarize
from loadtest.workload import (
    OWN_SCHEMAS,
    Job,
    Workload,
    judge,
    judge_refusal,
    shape_tick,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}


def _result(text: str, finish: str = "stop", *, complete: bool = True, closed: str | None = None,
            stop_string: bool = False, status: str | None = None, error: str | None = None) -> Result:
    return Result(text=text, finish_reason=finish, complete=complete, usage=Usage(5, 7), parsed=None, json=None,
                  error=error, status=status, closed_early=closed is not None, close_reason=closed,
                  stop_string=stop_string)


@pytest.fixture()
def workload() -> Workload:
    return Workload.build(None, 0, 32, None, seed=3)


def test_own_schemas_are_enforced_in_full_and_have_prompts(workload: Workload) -> None:
    names = sorted(path.stem for path in OWN_SCHEMAS.glob("*.json"))
    assert names == ["contact_extraction", "invoice_extraction", "tool_call_search"]
    for name, schema, prompt in workload.schemas:
        assert unenforced_keywords(schema, strict_mode=False) == (), name
        assert prompt


def test_jobs_of_every_kind(workload: Workload) -> None:
    job = workload.constrained()
    assert (job.tag, job.max_tokens) == ("constrained", 32)
    assert job.constraint is not None and job.schema is not None
    assert json.loads(job.constraint.payload) == job.schema
    assert (workload.unconstrained().constraint, workload.regex().constraint.kind) == (None, "regex")  # type: ignore[union-attr]
    cold = {workload.cold().constraint.payload for _ in range(20)}  # type: ignore[union-attr]
    assert len(cold) == 20  # a new schema every time: a compile per request
    bad = {workload.bad().name for _ in range(200)}
    assert bad == {"bad:max_tokens", "bad:schema_json", "bad:schema_type", "bad:regex", "bad:option", "bad:utf8"}


@pytest.mark.parametrize(
    ("tag", "result", "reason"),
    [
        ("constrained", _result('{"n":3}'), None),
        ("constrained", _result('{"n":3}', "length", complete=False, closed="budget"), None),  # closed early: valid
        ("constrained", _result('{"n":-1}'), "invalid at $.n: minimum"),
        ("constrained", _result('{"n":'), "not JSON"),
        ("constrained", _result('{"n":', "length", complete=False), "truncated"),
        ("constrained", _result('{"n"', complete=False, stop_string=True), "stop string"),
        ("constrained", _result("", "error", complete=False, status="INTERNAL", error="boom"), "error INTERNAL: boom"),
        ("regex", _result("Anna 12 apples"), None),
        ("regex", _result("anna 12 apples"), "regex mismatch"),
        ("choice", _result("neutral"), None),
        ("choice", _result("meh"), "not a choice"),
        ("unconstrained", _result("anything", "length", complete=False), None),
    ],
)
def test_judge(workload: Workload, tag: str, result: Result, reason: str | None) -> None:
    job = {"constrained": Job("constrained", "constrained", "p", workload.constrained().constraint, 8, SCHEMA),
           "regex": workload.regex(), "choice": workload.choice(), "unconstrained": workload.unconstrained()}[tag]
    assert judge(job, result) == reason


@pytest.mark.parametrize(
    ("result", "error", "reason"),
    [
        ({"finish_reason": "error", "status": "INVALID_ARGUMENT", "error": "max_tokens: must be in 1..1024, got 0"},
         None, None),
        ({"finish_reason": "error", "status": "INTERNAL", "error": "max_tokens: x"}, None,
         "expected error INVALID_ARGUMENT, got ('error', 'INTERNAL')"),
        ({"finish_reason": "error", "status": "INVALID_ARGUMENT", "error": "temperature: x"}, None,
         "unexpected message: temperature: x"),
        ({"finish_reason": "stop", "status": None}, None, "expected error INVALID_ARGUMENT, got ('stop', None)"),
        (None, "UNAVAILABLE: gone", "in-band error instead of RESULT: UNAVAILABLE: gone"),
        (None, None, "no RESULT"),
    ],
)
def test_judge_refusal(result: dict[str, Any] | None, error: str | None, reason: str | None) -> None:
    job = Job("bad", "bad:max_tokens", expect=("INVALID_ARGUMENT", "max_tokens: must be in 1.."))
    assert judge_refusal(job, result, error) == reason


@pytest.mark.parametrize(
    ("shape", "now", "expected"),
    [
        ("steady", 0, (8, 2.0)), ("steady", 59.9, (8, 2.0)), ("steady", 60, None),
        ("ramp", 0, (1, 2.0)), ("ramp", 24, (4, 2.0)), ("ramp", 48, (8, 2.0)), ("ramp", 59, (8, 2.0)),
        ("spike", 10, (2, 8.0)), ("spike", 24, (8, 8.0)), ("spike", 35.9, (8, 8.0)), ("spike", 36, (2, 8.0)),
    ],
)
def test_shapes(shape: str, now: float, expected: tuple[int, float] | None) -> None:
    assert shape_tick(shape, now, 60.0, 8, 2.0) == expected


@pytest.mark.parametrize(("run_time", "seconds"), [("45s", 285.0), ("2m", 360.0), ("1h", 3840.0), ("90", 330.0)])
def test_exit_deadline(run_time: str, seconds: float) -> None:
    assert exit_deadline(run_time) == seconds


def test_an_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^shape must be one of \('steady', 'ramp', 'spike'\), got 'wave'$"):
        shape_tick("wave", 0, 60, 8, 1)


@pytest.mark.parametrize(
    ("histogram", "q", "value"),
    [({"10": 50, "20": 49, "900": 1}, 50, 10.0), ({"10": 50, "20": 49, "900": 1}, 99, 20.0),
     ({"10": 50, "20": 49, "900": 1}, 100, 900.0), ({}, 50, float("nan"))],
)
def test_percentile(histogram: dict[str, int], q: float, value: float) -> None:
    got = percentile(histogram, q)
    assert got == value or (math.isnan(got) and math.isnan(value))


def test_summary_per_kind(tmp_path: Path) -> None:
    def entry(method: str, name: str, times: dict[str, int], failures: int = 0, tokens: int = 0) -> dict[str, Any]:
        return {"method": method, "name": name, "num_requests": sum(times.values()), "num_failures": failures,
                "total_content_length": tokens, "response_times": times, "start_time": 100.0,
                "last_request_timestamp": 110.0}

    (tmp_path / "run.json").write_text(json.dumps([
        entry("grpc", "constrained", {"5000": 4}, failures=1, tokens=200),
        entry("grpc", "bad:regex", {"30": 2}), entry("grpc", "bad:utf8", {"20": 1}),
        entry("ttft", "constrained", {"400": 3, "900": 1}), entry("itl", "constrained", {"70": 90, "300": 10}),
    ]))
    outputs = {"outcomes": {"constrained": {"valid": 2, "closed:budget": 1, "failed": 1}},
               "failures": {"constrained": {"truncated": 1}}}
    summary = summarize(tmp_path / "run", outputs)
    assert summary["duration_s"] == 10.0
    constrained = summary["kinds"]["constrained"]
    assert (constrained["requests"], constrained["failures"], constrained["output_tokens_s"]) == (4, 1, 20.0)
    assert constrained["ttft_ms"] == {"50%": 400.0, "95%": 900.0, "99%": 900.0}
    assert constrained["itl_ms"] == {"50%": 70.0, "95%": 300.0, "99%": 300.0}
    assert summary["kinds"]["bad"]["requests"] == 3
    text = render(summary)
    assert "failure constrained: 1 x truncated" in text
    assert "constrained         4     1    0.40    20.0  400/900/900          70/300/300" in text


@pytest.mark.parametrize(
    ("script", "timeout_s", "status"),
    [
        # Exits on its own: its status.
        ("import sys; sys.exit(3)", 30.0, 3),
        # Writes its report, then hangs at exit: killed, judged from the report.
        ("import json, sys, time; open(sys.argv[1], 'w').write(json.dumps([{'num_failures': 0}])); time.sleep(60)",
         30.0, 0),
        ("import json, sys, time; open(sys.argv[1], 'w').write(json.dumps([{'num_failures': 2}])); time.sleep(60)",
         30.0, 1),
        # Never writes a report and outlives the deadline: killed, failed.
        ("import time; time.sleep(60)", 2.0, 1),
    ],
)
def test_a_locust_that_hangs_at_exit_costs_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str,
                                                   timeout_s: float, status: int) -> None:
    import sys
    import time

    from loadtest import run as run_mod

    monkeypatch.setattr(run_mod, "EXIT_AFTER_REPORT_S", 1.0)
    report = tmp_path / "run.json"
    t0 = time.monotonic()
    assert run_mod._run_locust([sys.executable, "-c", script, str(report)], report, timeout_s) == status
    assert time.monotonic() - t0 < 20
