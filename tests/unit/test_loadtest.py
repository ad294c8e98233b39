"""The load test's logic without locust: jobs, the judge of every output, load shapes, the summary.

(``loadtest/locustfile.py`` itself imports locust, which monkey-patches the
whole process with gevent, so it runs only as a locust process: see
``tests/integration/test_loadtest_smoke.py``.)

The ``openai`` task's streams are the endpoint's own: its request parser
(:func:`openai_api.request.parse_chat`) takes :func:`loadtest.workload.chat_request`,
its renderer (:class:`openai_api.response.Renderer`) writes the chunks, and
the ``openai`` package's ``ChatCompletionChunk`` reads them back.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk

from client import Result, Usage
from client.constraints import Constraint
from grammar_backend.fidelity import unenforced_keywords
from loadtest.run import DEADLINE, exit_deadline, locust_command, openai_endpoint, openai_ready
from loadtest.summary import percentile, render, summarize
from loadtest.workload import (
    OWN_SCHEMAS,
    ChatStream,
    Job,
    Workload,
    chat_request,
    exclude_tags,
    judge,
    judge_chat,
    judge_refusal,
    kinds_short,
    openai_base_url,
    schema_name,
    shape_tick,
    strict_ok,
)
from openai_api.request import parse_chat
from openai_api.response import Renderer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
#: SCHEMA as OpenAI's strict mode takes it (closed).
STRICT = {**SCHEMA, "additionalProperties": False}


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
    assert names == ["contact_extraction", "invoice_extraction", "order_status", "tool_call_search"]
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


@pytest.mark.parametrize(
    ("shape", "now", "expected"),
    [("steady", 60, (8, 2.0)), ("steady", 600, (8, 2.0)), ("ramp", 600, (8, 2.0)), ("spike", 24, (8, 8.0)),
     ("spike", 60, (2, 8.0)), ("spike", 600, (2, 8.0))],
)
def test_a_shape_that_holds_keeps_its_last_level_past_its_end(shape: str, now: float,
                                                             expected: tuple[int, float]) -> None:
    """A run that ends on counts (--min-per-kind): past -t the shape holds instead of stopping."""
    assert shape_tick(shape, now, 60.0, 8, 2.0, hold=True) == expected


@pytest.mark.parametrize(
    ("ended", "least", "short"),
    [
        ({}, 1, {"bad": 0, "constrained": 0, "openai": 0}),
        ({"constrained": 3, "bad": 1}, 1, {"openai": 0}),
        # Only the kinds in the mix count (regex is not in it here).
        ({"constrained": 2, "bad": 2, "openai": 1, "regex": 9}, 2, {"openai": 1}),
        ({"constrained": 2, "bad": 5, "openai": 2}, 2, {}),
    ],
)
def test_kinds_short(ended: dict[str, int], least: int, short: dict[str, int]) -> None:
    assert kinds_short(ended, ("openai", "constrained", "bad"), least) == short


@pytest.mark.parametrize(("run_time", "seconds"), [("45s", 285.0), ("2m", 360.0), ("1h", 3840.0), ("90", 330.0),
                                                   (DEADLINE, 1140.0)])
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
        entry("http", "openai", {"3000": 2}, tokens=50), entry("ttft", "openai", {"300": 2}),
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
    openai = summary["kinds"]["openai"]
    assert (openai["requests"], openai["output_tokens_s"], openai["ttft_ms"]["50%"]) == (2, 5.0, 300.0)
    text = render(summary)
    assert "failure constrained: 1 x truncated" in text
    assert "constrained         4     1    0.40    20.0  400/900/900          70/300/300" in text


@pytest.mark.parametrize(
    ("script", "timeout_s", "status"),
    [
        # Exits on its own: its status.
        ("import sys; sys.exit(3)", 30.0, 3),
        # Writes its report, then hangs at exit: killed, judged from the report.
        ("import json, sys, time; open(sys.argv[1], 'w').write(json.dumps([{'num_failures': 0}])); time.sleep(600)",
         30.0, 0),
        ("import json, sys, time; open(sys.argv[1], 'w').write(json.dumps([{'num_failures': 2}])); time.sleep(600)",
         30.0, 1),
        # Never writes a report and outlives the deadline: killed, failed.
        ("import time; time.sleep(600)", 2.0, 1),
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
    # The children sleep 600 s: the bound tells a kill (seconds) from waiting them out, it is not a speed check.
    assert time.monotonic() - t0 < 120


# --------------------------------------------------------------------------- the openai task
def _openai_job(label: str = "counter") -> Job:
    return Job("openai", "openai", "Count.", Constraint.json_schema(STRICT), 32, STRICT, label=label)


@pytest.mark.parametrize(
    ("url", "expected"),
    [("", None), ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1"),
     ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080/v1"), ("https://llm.example:443/v1", "https://llm.example:443/v1")],
)
def test_openai_base_url(url: str, expected: str | None) -> None:
    assert openai_base_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [("127.0.0.1:8080/v1", r"^--openai-url '127\.0\.0\.1:8080/v1': must be http\(s\)://HOST:PORT/v1$"),
     ("ftp://h:21/v1", r"^--openai-url 'ftp://h:21/v1': must be http\(s\)://HOST:PORT/v1$"),
     ("http://h:8080", r"^--openai-url 'http://h:8080': the path must be /v1 \(the client appends /chat/completions\)$"),
     ("http://h:8080/v1?x=1", r"^--openai-url 'http://h:8080/v1\?x=1': the path must be /v1 "),
     ("http://h:99999/v1", r"^--openai-url 'http://h:99999/v1': Port out of range 0-65535$")],
)
def test_a_bad_openai_url_is_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        openai_base_url(url)


@pytest.mark.parametrize(
    ("exclude", "tags", "url", "expected"),
    [(None, None, None, ["openai"]),  # no endpoint: the task is off, the gRPC mix unchanged
     (["bad"], None, None, ["bad", "openai"]),
     (None, ["constrained"], None, ["openai"]),
     ([], [], None, ["openai"]),
     (None, None, "http://h:8080/v1", []),
     (["bad"], ["openai", "constrained"], "http://h:8080/v1", ["bad"])],
)
def test_exclude_tags(exclude: list[str] | None, tags: list[str] | None, url: str | None,
                      expected: list[str]) -> None:
    assert exclude_tags(exclude, tags, url) == expected


def test_the_openai_tag_without_an_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^--tags openai: needs --openai-url \(the OpenAI-compatible endpoint"):
        exclude_tags(None, ["constrained", "openai"], None)


@pytest.mark.parametrize(
    ("label", "name"),
    [("invoice_extraction", "invoice_extraction"), ("Glaiveai2K---calc_1", "Glaiveai2K---calc_1"),
     ("a.b c/d", "a_b_c_d"), ("x" * 70, "x" * 64), ("", "schema")],
)
def test_schema_name(label: str, name: str) -> None:
    assert schema_name(label) == name


def test_chat_request() -> None:
    assert chat_request(_openai_job("a.b")) == {
        "model": "constrained_llm",
        "messages": [{"role": "user", "content": "Count."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a_b", "schema": STRICT, "strict": True}},
        "max_tokens": 32,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with pytest.raises(ValueError, match=r"^regex: not a JSON job \(no schema\)$"):
        chat_request(Job("regex", "regex", "p", Constraint.regex("a"), 8))


def test_the_endpoint_takes_the_request() -> None:
    plan = parse_chat(chat_request(_openai_job()), 256)
    assert (plan.endpoint, plan.model, plan.kind, plan.stream, plan.include_usage) == (
        "chat", "constrained_llm", "json_schema", True, True)
    assert plan.constraint_param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("schema", "ok"),
    [(STRICT, True),
     # Strict mode takes what a backend enforces (optional properties), not what no backend does (uniqueItems).
     ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}, True),
     ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, False)],
)
def test_strict_ok(schema: dict[str, Any], ok: bool) -> None:
    assert strict_ok(schema) is ok


def test_openai_jobs_come_from_the_strict_schemas(workload: Workload) -> None:
    assert workload.strict == []  # built without openai: the task is off
    with pytest.raises(ValueError, match=r"^loadtest: no schema for the openai task: none of the own or sampled "):
        workload.openai()
    mixed = Workload(workload.schemas, 32, seed=1, strict=[("counter", STRICT, "Count.")])
    job = mixed.openai()
    assert (job.tag, job.name, job.prompt, job.max_tokens, job.schema, job.label) == (
        "openai", "openai", "Count.", 32, STRICT, "counter")
    assert job.constraint is not None and json.loads(job.constraint.payload) == STRICT
    built = Workload.build(None, 0, 32, None, openai=True)
    # every own schema: each keyword of them is enforced by a backend
    assert [name for name, _, _ in built.strict] == ["contact_extraction", "invoice_extraction", "order_status",
                                                     "tool_call_search"]
    assert built.strict == [entry for entry in built.schemas if strict_ok(entry[1])]
    assert [name for name, _, _ in built.schemas] == [name for name, _, _ in workload.schemas]


def _report(valid: bool | None = True) -> dict[str, Any]:
    return {"parsed": valid is not None, "parse_error": None if valid is not None else "line 1 column 6: x",
            "valid": valid, "violations": [], "unenforced": []}


def _final(text: str, finish: str = "stop", *, complete: bool = True, closed: str | None = None,
           stop_string: bool = False, report: dict[str, Any] | None = None) -> Result:
    return Result(text=text, finish_reason=finish, complete=complete, usage=Usage(5, 7), parsed=None, json=None,
                  error=None, closed_early=closed is not None, close_reason=closed, stop_string=stop_string,
                  raw={"json": report})


def _rendered(deltas: list[str], result: Result) -> tuple[ChatStream, list[str]]:
    """The endpoint's chunks for ``deltas`` and ``result``, read back by the openai package, fed to a ChatStream."""
    renderer = Renderer(parse_chat(chat_request(_openai_job()), 256))
    chunks = [c for d in deltas for c in renderer.chunks(d)] + renderer.final_chunks("", result)
    stream = ChatStream()
    texts = [stream.feed(ChatCompletionChunk.model_validate(json.loads(json.dumps(c)))) for c in chunks]
    return stream, texts


def test_a_chat_stream_is_read_as_sent() -> None:
    stream, texts = _rendered(['{"n":', "3}"], _final('{"n":3}', report=_report()))
    assert texts == ["", '{"n":', "3}", "", ""]  # role chunk, two deltas, finish chunk, usage chunk
    assert (stream.text, stream.finish_reason, stream.completion_tokens, stream.problem) == (
        '{"n":3}', "stop", 7, None)
    assert stream.report["complete"] is True and stream.report["json"] == _report()


@pytest.mark.parametrize(
    ("deltas", "result", "reason", "outcome"),
    [
        (['{"n":', "3}"], _final('{"n":3}', report=_report()), None, "valid"),
        # Closed at the budget: "length", and it parses and validates.
        (['{"n":3}'], _final('{"n":3}', "length", complete=False, closed="budget", report=_report()), None,
         "closed:budget"),
        (['{"n":-1}'], _final('{"n":-1}', report=_report(False)), "invalid at $.n: minimum", "failed"),
        (['{"n":'], _final('{"n":', "length", complete=False, report=_report(None)), "truncated", "failed"),
        (['{"n"'], _final('{"n"', complete=False, stop_string=True, report=_report(None)), "stop string", "failed"),
        # The output is valid but the endpoint's report says otherwise.
        (['{"n":3}'], _final('{"n":3}', report=_report(False)), "report json parsed=True valid=False", "failed"),
        (['{"n":3}'], _final('{"n":3}', report=None), "report json null", "failed"),
        (['{"n":3}'], _final('{"n":3}', "length", report=_report()), "complete but finish_reason length", "failed"),
    ],
)
def test_judge_chat(deltas: list[str], result: Result, reason: str | None, outcome: str) -> None:
    stream, _ = _rendered(deltas, result)
    assert judge_chat(_openai_job(), stream) == reason
    assert stream.outcome(reason) == outcome


def _chunk(*choices: dict[str, Any], usage: dict[str, int] | None = None, **extra: Any) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "constrained_llm",
        "choices": list(choices), "usage": usage, **extra})


def _choice(content: str | None = None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": content, **delta}, "finish_reason": finish}


_REPORT = {"complete": True, "closed_early": False, "close_reason": None, "stop_string": False, "json": _report()}
_USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
_CALL = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]


@pytest.mark.parametrize(
    ("chunks", "reason"),
    [
        ([_chunk(_choice('{"n":3}')), _chunk(_choice(finish="stop"), constrained_llm=_REPORT), _chunk(usage=_USAGE)],
         None),
        ([_chunk(_choice('{"n":3}')), _chunk(_choice(finish="stop"), constrained_llm=_REPORT)], "no usage chunk"),
        ([_chunk(_choice('{"n":3}')), _chunk(usage=_USAGE)], "no finish_reason"),
        ([_chunk(_choice('{"n":3}', "stop")), _chunk(usage=_USAGE)], "no constrained_llm report"),
        ([_chunk(_choice('{"n":3}', "tool_calls"), constrained_llm=_REPORT), _chunk(usage=_USAGE)],
         "finish_reason tool_calls"),
        ([_chunk(_choice('{"n":3}', "stop"), constrained_llm=_REPORT), _chunk(usage=_USAGE), _chunk(_choice(" "))],
         "a chunk after the usage chunk"),
        ([_chunk(_choice('{"n":3}', "stop"), constrained_llm=_REPORT), _chunk(_choice(" ")), _chunk(usage=_USAGE)],
         "a chunk after the finish_reason"),
        ([_chunk(_choice('{"n":3}'), _choice("4")), _chunk(_choice(finish="stop"), constrained_llm=_REPORT)],
         "2 choices in a chunk"),
        ([_chunk(_choice('{"n":3}', "stop"), constrained_llm=_REPORT, usage=_USAGE)], "usage on a chunk with choices"),
        ([_chunk(_choice(tool_calls=_CALL)), _chunk(_choice('{"n":3}', "stop"), constrained_llm=_REPORT),
          _chunk(usage=_USAGE)], "a tool call in a json_schema response"),
    ],
)
def test_the_stream_shape_is_checked(chunks: list[ChatCompletionChunk], reason: str | None) -> None:
    stream = ChatStream()
    for chunk in chunks:
        stream.feed(chunk)
    assert judge_chat(_openai_job(), stream) == reason


@pytest.mark.parametrize(("host", "port", "url"), [("127.0.0.1", 8080, "http://127.0.0.1:8080/v1"), ("h", 0, "")])
def test_openai_endpoint(host: str, port: int, url: str) -> None:
    assert openai_endpoint(host, port) == url


@pytest.mark.parametrize("url", ["", "http://127.0.0.1:8080/v1"])
def test_locust_command_passes_the_openai_url(tmp_path: Path, url: str) -> None:
    cmd = locust_command("127.0.0.1:8001", tmp_path, 4, "30s", "steady", tags=["openai"], openai_url=url)
    tail = cmd[cmd.index("--max-requests") + 2:]
    assert tail == ([] if not url else ["--openai-url", url]) + ["--tags", "openai"]


def test_locust_command_ends_on_counts_only_when_asked(tmp_path: Path) -> None:
    timed = locust_command("127.0.0.1:8001", tmp_path, 4, "20s", "spike", max_requests=60)
    assert "--min-per-kind" not in timed and "--deadline" not in timed
    assert timed[timed.index("--max-requests") + 1] == "60" and timed[timed.index("-t") + 1] == "20s"
    counted = locust_command("127.0.0.1:8001", tmp_path, 4, "20s", "spike", min_per_kind=2)
    assert counted[-4:] == ["--min-per-kind", "2", "--deadline", DEADLINE]
    assert counted[counted.index("-t") + 1] == "20s"  # the least run time (the spike's length)


def test_openai_ready_without_an_endpoint() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert openai_ready(f"http://127.0.0.1:{port}/v1") is False
