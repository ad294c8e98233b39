"""The OpenAI-compatible endpoint through the real ``openai`` client, against a real tritonserver (``-k openai``).

One server for the module: the endpoint on a free port, API keys on (a key
without a limit and one limited to one stream), and a 2 s compile deadline so
that a slow compile answers 504 quickly.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final

import jsonschema
import openai
import pytest

from deploy.gateway import GatewaySecurity
from deploy.server import TritonServer
from openai_api.server import try_lines
from tests.integration.served import grammar_active, grammar_stats, start_ensemble, wait_freed
from tests.support.poll import wait_for

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

KEY, ONE_STREAM_KEY = "key-openai-team", "key-openai-one"
PERSON: Any = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
#: A compile that takes minutes on xgrammar (tests/integration/test_compile_isolation.py).
SLOW: Any = {"type": "json_schema", "json_schema": {"name": "slow", "schema": {
    "description": "slow-openai", "enum": [f"value-{i}" for i in range(100_000)]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    tmp = tmp_path_factory.mktemp("openai")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"id": "team", "sha256": hashlib.sha256(KEY.encode()).hexdigest()},
        {"id": "one", "sha256": hashlib.sha256(ONE_STREAM_KEY.encode()).hexdigest(), "max_streams": 1}]}))
    srv = start_ensemble(tmp, values={"GRAMMAR_COMPILE_TIMEOUT_S": "2"}, openai_port=0,
                         gateway_security=GatewaySecurity(api_keys_file=keys))
    try:
        yield srv
    finally:
        srv.stop()


def _url(server: TritonServer) -> str:
    front = server.openai
    assert front is not None
    return front.url


@pytest.fixture(scope="module")
def client(server: TritonServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=_url(server), api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


_HEADERS: Final = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _connection(server: TritonServer) -> http.client.HTTPConnection:
    front = server.openai
    assert front is not None
    return http.client.HTTPConnection(front.config.host, front.config.port, timeout=60)


def _person_format() -> Any:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def _check_person(content: str, finish: str, ext: dict[str, Any]) -> None:
    """Valid when it ended on its own or was closed at the budget; reported as such."""
    assert finish in ("stop", "length")
    assert ext["complete"] is (finish == "stop" and not ext["closed_early"])
    jsonschema.validate(json.loads(content), PERSON)
    assert ext["json"]["valid"] is True
    assert ext["json"]["parsed"] is True


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["constrained_llm"]
    assert client.models.retrieve("constrained_llm").owned_by == "constrained-llm"
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist"):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("max_tokens", [64, 12])
def test_json_schema_strict(client: openai.OpenAI, max_tokens: int) -> None:
    response = client.chat.completions.create(model="constrained_llm", messages=[
        {"role": "user", "content": "Give one person as JSON."}], response_format=_person_format(),
        max_tokens=max_tokens, temperature=0)
    choice = response.choices[0]
    ext = response.model_extra["constrained_llm"] if response.model_extra else {}
    assert choice.message.content is not None
    _check_person(choice.message.content, choice.finish_reason, ext)
    assert response.usage is not None and 0 < response.usage.completion_tokens <= max_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    if max_tokens == 12:  # too few for a name and an age written freely: closed at the budget
        assert (choice.finish_reason, ext["closed_early"], ext["close_reason"]) == ("length", True, "budget")


def test_json_schema_strict_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="constrained_llm", messages=[
        {"role": "user", "content": "Give one person as JSON."}], response_format=_person_format(),
        max_tokens=64, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1
    last = finals[0]
    _check_person(content, str(last.choices[0].finish_reason), (last.model_extra or {})["constrained_llm"])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client: openai.OpenAI, choice: Any) -> None:
    response = client.chat.completions.create(
        model="constrained_llm", messages=ASK, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
        max_tokens=48, temperature=0)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert (response.model_extra or {})["constrained_llm"]["tool_calls"] == [{"valid": True, "violations": []}]


def test_forced_tool_call_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="constrained_llm", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_tokens=48, temperature=0, stream=True)
    starts, arguments, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.id is not None:
                starts.append((call.id, call.function.name if call.function else None))
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert len(starts) == 1 and starts[0][1] == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_auto_tool_choice_leaves_text_free(client: openai.OpenAI) -> None:
    """Under ``auto`` the model may answer in text (the default 135M model always does: it never starts a
    call on its own; calls under auto are tested on the grammar in tests/unit/test_openai_api.py): the text
    is returned as content, no call markup leaks, and the finish reason is the text's."""
    response = client.chat.completions.create(model="constrained_llm", messages=ASK, tools=[WEATHER],
                                              max_tokens=24, temperature=0)
    message = response.choices[0].message
    assert message.tool_calls is None
    assert message.content and "<tool_call>" not in message.content
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"n": 2}, "n", r"^n: only 1 choice per request is supported; got 2$"),
    ({"logprobs": True}, "logprobs", r"^logprobs: log probabilities are not returned"),
    ({"presence_penalty": 2.5}, "presence_penalty", r"^presence_penalty: must be a number in -2\.\.2 \(0 = off\)"),
    ({"extra_body": {"best_effort": 1}}, "best_effort", r"^best_effort: unrecognized request argument$"),
    ({"max_tokens": 100_000}, "max_tokens", r"^max_tokens: must be in 1\.\.\d+, got 100000$"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", r"^max_completion_tokens: must be"),
    ({"temperature": 3}, "temperature", r"^temperature: must be a number in 0\.\.2"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}}}},
     "response_format.json_schema.schema", r"required"),
    ({"extra_body": {"constrained_llm": {"ebnf": 'rule ::= "a"'}}}, "constrained_llm.ebnf", r"root"),
    ({"extra_body": {"constrained_llm": {"regex": "[a-"}}}, "constrained_llm.regex", r"."),
])
def test_bad_requests(client: openai.OpenAI, extra: dict[str, Any], param: str, message: str) -> None:
    budget = {} if "max_completion_tokens" in extra else {"max_tokens": 8}
    kwargs: dict[str, Any] = {"model": "constrained_llm", "messages": ASK, **budget, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"].startswith(param), body
    assert body["type"] == "invalid_request_error"
    assert re.search(message, body["message"]), body


def test_bad_key_and_unknown_model(server: TritonServer) -> None:
    with (openai.OpenAI(base_url=_url(server), api_key="not-a-key", max_retries=0) as bad,
          pytest.raises(openai.AuthenticationError, match="unknown API key") as caught):
        bad.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4)
    assert caught.value.status_code == 401
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "invalid_api_key"
    with (openai.OpenAI(base_url=_url(server), api_key=KEY, max_retries=0) as good,
          pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist")):
        good.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=4)


def test_compile_deadline_is_504_and_a_key_over_its_streams_is_429(server: TritonServer) -> None:
    """A compile past GRAMMAR_COMPILE_TIMEOUT_S (2 s) answers 504; while it runs, the key that allows one
    stream gets 429 for a second request."""
    outcome: list[BaseException] = []

    def slow() -> None:
        with openai.OpenAI(base_url=_url(server), api_key=ONE_STREAM_KEY, max_retries=0) as c:
            try:
                c.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4,
                                          response_format=SLOW,
                                          extra_body={"constrained_llm": {"options": {"backend": "xgrammar"}}})
            except openai.APIError as err:
                outcome.append(err)

    thread = threading.Thread(target=slow)
    thread.start()
    wait_for(lambda: grammar_stats(server)["in_flight"] >= 1, 30, "the slow compile started", interval_s=0.1)
    with (openai.OpenAI(base_url=_url(server), api_key=ONE_STREAM_KEY, max_retries=0) as c,
          pytest.raises(openai.RateLimitError, match="already has 1 streams open") as caught):
        c.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4)
    assert caught.value.status_code == 429
    thread.join(60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], openai.InternalServerError)
    assert outcome[0].status_code == 504
    assert "did not finish within 2 s" in outcome[0].message


def test_not_ready_is_503(server: TritonServer, client: openai.OpenAI) -> None:
    gateway = server.gateway
    assert gateway is not None
    gateway.set_health(False, "tritonserver is restarting")
    try:
        with pytest.raises(openai.InternalServerError, match="not ready") as caught:
            client.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4)
        assert caught.value.status_code == 503
    finally:
        gateway.set_health(True)
    assert client.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=2).choices


def test_disconnect_mid_stream_frees_the_sequence(server: TritonServer) -> None:
    """A client that leaves a stream gets its request cancelled inside the server, not decoded to max_tokens.

    The constraint cannot end before ~1,000 sampled tokens (3,000 characters of a/b, no jump-forward), a
    minute of decoding here, so a sequence freed within 10 s was cancelled.
    """
    body = {"model": "constrained_llm", "messages": ASK, "max_tokens": 1000, "stream": True,
            "constrained_llm": {"regex": "[ab]{3000}", "options": {"jump_forward": False, "on_budget": "truncate"}}}
    conn = _connection(server)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=_HEADERS)
        response = conn.getresponse()
        assert response.status == 200
        seen = 0
        while seen < 4:
            if response.readline().startswith(b"data: "):
                seen += 1
        assert grammar_active(server) == 1
    finally:
        conn.close()
    # close() dropped the connection mid-stream.
    assert wait_freed(server, timeout_s=10) == (0, 0)


def test_http_errors_are_openai_json(server: TritonServer) -> None:
    for method, path, body, status, param in (("POST", "/v1/chat/completions", b"{", 400, "body"),
                                              ("GET", "/v1/engines", None, 404, None)):
        conn = _connection(server)
        try:
            conn.request(method, path, body=body, headers=_HEADERS)
            response = conn.getresponse()
            error = json.loads(response.read())["error"]
        finally:
            conn.close()
        assert (response.status, error["type"], error["param"]) == (status, "invalid_request_error", param)
    # Counted by route, a path off the routes as "other" (no series per scanned path).
    front = server.openai
    assert front is not None
    metrics = front.metrics_text()
    assert 'openai_requests_total{endpoint="/v1/chat/completions",code="400"}' in metrics
    assert re.search(r'^openai_requests_total\{endpoint="other",code="404"\} [1-9]', metrics, re.MULTILINE), metrics
    assert "/v1/engines" not in metrics
    assert "\nopenai_requests_open 0\n" in metrics


@pytest.mark.parametrize("which", ["curl", "python"])
def test_printed_try_lines_work(server: TritonServer, which: str) -> None:
    """The lines the launcher prints once ready (`make serve`) run as printed and answer valid JSON."""
    curl, python = try_lines(_url(server), "constrained_llm", keys=True)
    line = curl if which == "curl" else python.replace("python -c", f"{sys.executable} -c", 1)
    if which == "curl" and shutil.which("curl") is None:
        pytest.skip("no curl binary")
    done = subprocess.run(["bash", "-c", line], env={**os.environ, "CONSTRAINED_LLM_API_KEY": KEY},
                          capture_output=True, text=True, timeout=120, check=True)
    content = json.loads(done.stdout)["choices"][0]["message"]["content"] if which == "curl" else done.stdout
    person = json.loads(content)
    assert sorted(person) == ["age", "name"]
