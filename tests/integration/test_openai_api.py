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
from collections.abc import Iterator
from typing import Any, Final

import jsonschema
import openai
import pydantic
import pytest

from deploy.gateway import GatewaySecurity
from deploy.server import TritonServer
from openai_api.server import try_lines
from tests.integration.served import NEVER_ENDS, grammar_active, start_ensemble, wait_freed

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

KEY, ONE_STREAM_KEY = "key-openai-team", "key-openai-one"


class Person(pydantic.BaseModel):
    name: str
    age: int


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
    """Valid when it ended on its own or was closed at the budget, both finishing with "stop"; the report
    tells them apart."""
    assert finish == "stop"
    assert ext["complete"] is not ext["closed_early"]
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
    if max_tokens == 12:  # too few for a name and an age written freely: closed at the budget, and valid
        assert (choice.finish_reason, ext["closed_early"], ext["close_reason"]) == ("stop", True, "budget")
        # what the openai SDK's .parse() keeps (a "length" finish raises LengthFinishReasonError there)
        parsed = client.chat.completions.parse(model="constrained_llm", messages=[
            {"role": "user", "content": "Give one person as JSON."}], response_format=Person,
            max_tokens=max_tokens, temperature=0)
        ext = parsed.model_extra["constrained_llm"] if parsed.model_extra else {}
        assert isinstance(parsed.choices[0].message.parsed, Person)
        assert (parsed.choices[0].finish_reason, ext["closed_early"]) == ("stop", True)


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


@pytest.mark.parametrize("max_tokens", [100, 160, 256])
@pytest.mark.parametrize("ask", ["Get the weather for Paris, London, Berlin, Madrid and Rome.",
                                 "Weather in Tokyo, Osaka, Kyoto please, in celsius."])
def test_several_required_calls_cut_by_the_budget_are_each_complete(client: openai.OpenAI, ask: str,
                                                                    max_tokens: int) -> None:
    """Parallel calls under ``tool_choice: required`` (the default model writes 2 to 8 calls for these): wherever
    ``max_tokens`` falls, every call returned has arguments that parse and validate (the one open at the budget
    is closed; none is opened that cannot fit), and so do the streamed arguments of each call, joined.
    Before, the Tokyo request at 256 tokens opened an eighth call it could not close (``finish_reason: length``)."""
    kwargs: Any = {"model": "constrained_llm", "messages": [{"role": "user", "content": ask}], "tools": [WEATHER],
                   "tool_choice": "required", "parallel_tool_calls": True, "max_tokens": max_tokens, "temperature": 0}
    response = client.chat.completions.create(**kwargs)
    calls = response.choices[0].message.tool_calls
    assert calls, response
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert (response.model_extra or {})["constrained_llm"]["tool_calls"] == [{"valid": True, "violations": []}] * len(
        calls)
    assert response.usage is not None and response.usage.completion_tokens <= max_tokens
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed[delta.index] = streamed.get(delta.index, "") + ((delta.function.arguments or "")
                                                                     if delta.function else "")
    assert sorted(streamed) == list(range(len(streamed))) and streamed
    for arguments in streamed.values():
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


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
    ({"n": 17}, "n", r"^n: must be an integer in \[1, 16\], got 17$"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", r"^top_logprobs: must be an integer in \[0, 20\]"),
    ({"presence_penalty": 2.5}, "presence_penalty", r"^presence_penalty: must be a number in -2\.\.2 \(0 = off\)"),
    ({"extra_body": {"best_effort": 1}}, "best_effort", r"^best_effort: unrecognized request argument$"),
    ({"max_tokens": 100_000}, "max_tokens", r"^max_tokens: must be in 1\.\.\d+, got 100000$"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", r"^max_completion_tokens: must be"),
    ({"temperature": 3}, "temperature", r"^temperature: must be a number in 0\.\.2"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "response_format.json_schema.schema.properties.a.uniqueItems", r"is not enforced by either grammar backend"),
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


def test_compile_deadline_is_504_and_a_key_over_its_streams_is_429(client: openai.OpenAI, server: TritonServer) -> None:
    """A compile past GRAMMAR_COMPILE_TIMEOUT_S (2 s) answers 504; while a request of the key that allows one
    stream is open, a second one gets 429."""
    # A compile of minutes: past the deadline whatever the machine's speed.
    with pytest.raises(openai.InternalServerError, match="did not finish within 2 s") as timed_out:
        client.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4, response_format=SLOW,
                                       extra_body={"constrained_llm": {"options": {"backend": "xgrammar"}}})
    assert timed_out.value.status_code == 504

    # The key's one stream: a request that cannot end before 1,000 tokens (NEVER_ENDS), held open until
    # closed below; it has streamed a token, so it is in the server (counted against the key).
    with openai.OpenAI(base_url=_url(server), api_key=ONE_STREAM_KEY, max_retries=0, timeout=120) as one:
        holder = one.chat.completions.create(
            model="constrained_llm", messages=[{"role": "user", "content": "Write one letter per line."}],
            max_tokens=1000, stream=True,
            extra_body={"constrained_llm": {"regex": NEVER_ENDS, "options": {"on_repeat": "continue"}}})
        try:
            assert any(chunk.choices and chunk.choices[0].delta.content for chunk in holder)
            with pytest.raises(openai.RateLimitError, match="already has 1 streams open") as caught:
                one.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4)
            assert caught.value.status_code == 429
        finally:
            holder.close()  # cancels the request inside the server
    assert wait_freed(server) == (0, 0)


def test_not_ready_is_503(server: TritonServer, client: openai.OpenAI) -> None:
    gateway = server.gateway
    assert gateway is not None
    conn = _connection(server)
    gateway.set_health(False, "tritonserver is restarting")
    try:
        with pytest.raises(openai.InternalServerError, match="not ready") as caught:
            client.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=4)
        assert caught.value.status_code == 503
        # every route, /v1/models included (a load balancer probing it must not send traffic yet) ...
        with pytest.raises(openai.InternalServerError, match="not ready"):
            client.models.list()
        # ... but the health route, which needs no key
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert (health.status, json.loads(health.read())) == (
            503, {"status": "not ready", "reason": "tritonserver is restarting"})
    finally:
        gateway.set_health(True)
    assert client.chat.completions.create(model="constrained_llm", messages=ASK, max_tokens=2).choices
    conn.request("GET", "/health")
    health = conn.getresponse()
    assert (health.status, json.loads(health.read())) == (200, {"status": "ready", "reason": None})
    conn.close()


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
    assert wait_freed(server) == (0, 0)


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
    curl, python = try_lines(_url(server), "constrained_llm", keys=True, python=sys.executable)  # as launch.py
    line = curl if which == "curl" else python
    if which == "curl" and shutil.which("curl") is None:
        pytest.skip("no curl binary")
    done = subprocess.run(["bash", "-c", line], env={**os.environ, "CONSTRAINED_LLM_API_KEY": KEY},
                          capture_output=True, text=True, timeout=120, check=True)
    content = json.loads(done.stdout)["choices"][0]["message"]["content"] if which == "curl" else done.stdout
    person = json.loads(content)
    assert sorted(person) == ["age", "name"]


# --------------------------------------------------------------------------- n, seeds, logprobs
def _ext(response: Any) -> dict[str, Any]:
    return response.model_extra["constrained_llm"] if response.model_extra else {}


def test_unseeded_requests_vary_and_a_reported_seed_replays(client: openai.OpenAI) -> None:
    """Without a seed the server draws one per request and reports it; sending it back gives the same output."""
    # open-ended and 24 tokens at temperature 1: three equal outputs would take a near-deterministic model
    kwargs: dict[str, Any] = {"model": "constrained_llm", "max_tokens": 24, "temperature": 1.0,
                              "messages": [{"role": "user", "content": "Write one short sentence about the sea."}]}
    answers = [client.chat.completions.create(**kwargs) for _ in range(3)]
    seeds = [_ext(a)["seed"] for a in answers]
    assert all(isinstance(s, int) and 0 <= s < 2**64 for s in seeds) and len(set(seeds)) == 3
    texts = [a.choices[0].message.content for a in answers]
    assert len(set(texts)) >= 2, texts
    replay = client.chat.completions.create(**kwargs, seed=seeds[1])
    assert (replay.choices[0].message.content, _ext(replay)["seed"]) == (texts[1], seeds[1])


def test_n_choices_are_independent_sequences(client: openai.OpenAI) -> None:
    """``n`` choices, each valid under the schema, indexed, with its own report; a seeded request's choice i
    replays alone with seed + i; usage counts the prompt once and every completion."""
    # Without jump-forward: its widths follow measured step costs, the one thing a seed does not replay
    # (llm_runtime/sampler.py).
    kwargs: dict[str, Any] = {"model": "constrained_llm", "messages": [{"role": "user", "content": "A person?"}],
                              "response_format": _person_format(), "max_tokens": 24, "temperature": 1.0,
                              "extra_body": {"constrained_llm": {"options": {"jump_forward": False}}}}
    response = client.chat.completions.create(**kwargs, n=3, seed=7)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
        assert choice.model_extra is not None and choice.model_extra["constrained_llm"]["json"]["valid"] is True
    assert [c.model_extra["constrained_llm"]["seed"] for c in response.choices if c.model_extra] == [7, 8, 9]
    alone = client.chat.completions.create(**kwargs, seed=8)
    assert alone.choices[0].message.content == response.choices[1].message.content
    assert response.usage is not None and alone.usage is not None
    assert response.usage.prompt_tokens == alone.usage.prompt_tokens
    stream = client.chat.completions.create(**kwargs, n=2, seed=7, stream=True,
                                            stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == {0: response.choices[0].message.content, 1: response.choices[1].message.content}
    assert finishes == {0: "stop", 1: "stop"}
    pair = client.chat.completions.create(**kwargs, n=2, seed=7)
    assert [c.message.content for c in pair.choices] == [c.message.content for c in response.choices[:2]]
    assert usage == pair.usage


def test_logprobs_after_the_grammar_mask(client: openai.OpenAI) -> None:
    """Chat ``logprobs``/``top_logprobs``: one entry per output token whose text joins into the content,
    alternatives only among tokens the grammar allows (a choice constraint: the two answers' tokens)."""
    response = client.chat.completions.create(
        model="constrained_llm", messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=8,
        logprobs=True, top_logprobs=3, extra_body={"constrained_llm": {"choice": ["yes", "no"]}})
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert bytes(b for e in entries for b in e.bytes or []).decode() == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) <= 3
    first = {t.token for t in entries[0].top_logprobs}
    assert first <= {"yes", "no", "y", "n", "ye"}, first  # never a token the grammar forbids
    completion = client.completions.create(model="constrained_llm", prompt="Yes or no?", max_tokens=8, logprobs=2,
                                           extra_body={"constrained_llm": {"choice": ["yes", "no"]}})
    legacy = completion.choices[0].logprobs
    assert legacy is not None and "".join(legacy.tokens or []) == completion.choices[0].text
    assert legacy.text_offset == [sum(len(t) for t in (legacy.tokens or [])[:i]) for i in range(len(legacy.tokens or []))]


def test_completions_response_format_and_vllm_sampling_fields(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="constrained_llm", prompt="A person:", max_tokens=24,
                                           extra_body={"response_format": _person_format(), "top_k": 20,
                                                       "min_p": 0.05, "repetition_penalty": 1.1})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_message_fields_clients_send_back(client: openai.OpenAI) -> None:
    """A history as AutoGen, LangGraph and the openai SDK leave it: names, null audio and function_call, and
    the message a ``.parse()`` returned appended as it is."""
    first = client.chat.completions.parse(model="constrained_llm", messages=[
        {"role": "user", "content": "A person?", "name": "alice"}], response_format=Person, max_tokens=24)
    history: Any = [{"role": "system", "content": "Be brief.", "name": "planner"},
               {"role": "user", "content": "A person?", "name": "alice"},
               first.choices[0].message.model_dump(), {"role": "user", "content": "Another.", "name": "alice"}]
    assert "parsed" in history[2] and history[2]["audio"] is None and history[2]["function_call"] is None
    again = client.chat.completions.parse(model="constrained_llm", messages=history, response_format=Person,
                                          max_tokens=24)
    assert isinstance(again.choices[0].message.parsed, Person)


# --------------------------------------------------------------------------- the Responses API
def test_responses_create_parse_and_store(client: openai.OpenAI) -> None:
    response = client.responses.parse(model="constrained_llm", input="Invent a person.", text_format=Person,
                                      max_output_tokens=24, instructions="Answer in JSON.")
    assert response.status == "completed" and isinstance(response.output_parsed, Person)
    assert response.usage is not None and 0 < response.usage.output_tokens <= 24
    assert response.instructions == "Answer in JSON."
    stored = client.responses.retrieve(response.id)
    assert stored.output_text == response.output_text
    follow = client.responses.create(model="constrained_llm", input="And another.", previous_response_id=response.id,
                                     max_output_tokens=8)
    assert follow.previous_response_id == response.id and follow.usage is not None
    assert follow.usage.input_tokens > response.usage.input_tokens  # the stored conversation came first
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="constrained_llm", input="x", previous_response_id=response.id)


def test_responses_stream_events(client: openai.OpenAI) -> None:
    with client.responses.stream(model="constrained_llm", input="Invent a person.", text_format=Person,
                                 max_output_tokens=24) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and isinstance(final.output_parsed, Person)


def test_responses_tool_round_trip(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
                 "parameters": WEATHER["function"]["parameters"], "strict": True}
    first = client.responses.create(model="constrained_llm", input="Weather in Paris?", tools=[tool],
                                    tool_choice="required", max_output_tokens=40)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    conversation: Any = [{"role": "user", "content": "Weather in Paris?"}, *[c.model_dump() for c in calls],
                         {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    second = client.responses.create(model="constrained_llm", tools=[tool], max_output_tokens=8,
                                     input=conversation)
    assert second.status in ("completed", "incomplete") and second.output


def test_responses_incomplete_at_the_budget_and_logprobs(client: openai.OpenAI) -> None:
    cut = client.responses.create(model="constrained_llm", input="Tell a story.", max_output_tokens=3,
                                  include=["message.output_text.logprobs"], top_logprobs=2)
    assert (cut.status, cut.incomplete_details and cut.incomplete_details.reason) == ("incomplete",
                                                                                      "max_output_tokens")
    message = next(item for item in cut.output if item.type == "message")
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs is not None
    assert "".join(lp.token for lp in part.logprobs) == part.text


def test_responses_refuse_built_in_tools(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="constrained_llm", input="x", tools=[{"type": "web_search"}])
    assert caught.value.body is not None and caught.value.body["param"] == "tools[0].type"  # type: ignore[index]
