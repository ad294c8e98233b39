"""The Responses API (``openai_api.responses``): requests as the real clients send them, the response object
and the stream's events as the ``openai`` SDK's own types read them, and the response store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from client.sdk import Chunk, Result, TokenLogprob, TopLogprob, Usage
from openai_api.errors import BadRequest, OpenAIError
from openai_api.request import EXTENSION, parse_chat
from openai_api.responses import ResponsesOutput, ResponseStore, parse_responses
from openai_api.tools import call_prefix
from tests.unit.test_openai_api import values

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "openai_clients"
DEFAULT = 64
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                               "additionalProperties": False}}
ORDER: Any = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                               "color": {"enum": ["red", "green"]},
                                               "items": {"type": "array", "items": {"type": "string"}}},
              "required": ["title", "color", "items"], "additionalProperties": False}
EVENTS: Any = TypeAdapter(ResponseStreamEvent)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def _captured(pattern: str) -> list[Any]:
    out = []
    for path in sorted(FIXTURES.glob(pattern)):
        doc = json.loads(path.read_text())
        out.append(pytest.param({k: v for k, v in doc.items() if not k.startswith("_")}, id=path.stem))
    return out


# =========================================================================== requests
@pytest.mark.parametrize("request_body", _captured("*responses*.json") + _captured("pydantic_ai-agent-*.json"))
def test_every_captured_client_request_is_taken(request_body: dict[str, Any]) -> None:
    """What openai, instructor, langchain, pydantic-ai, openai-agents and litellm send by default (recorded
    in tests/fixtures/openai_clients by its capture.py) is a request this endpoint serves."""
    parsed = parse_responses(request_body, DEFAULT)
    assert parsed.plan.endpoint == "responses"
    assert values(parsed.plan)["MESSAGES"][0]


@pytest.mark.parametrize("request_body", _captured("*-chat-*.json"))
def test_every_captured_chat_request_is_taken(request_body: dict[str, Any]) -> None:
    assert parse_chat(request_body, DEFAULT).endpoint == "chat"


CALL = f'{call_prefix("get_weather")}{{"city": "Paris"}}}}</tool_call>'


@pytest.mark.parametrize(("input_", "instructions", "expected"), [
    pytest.param("hi", None, [{"role": "user", "content": "hi"}], id="string"),
    pytest.param("hi", "Be brief.", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                 id="instructions"),
    pytest.param([{"role": "developer", "content": "D"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                  {"type": "input_text", "text": "b"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                   "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}]},
                  {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city": "Paris"}', "status": "completed"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
                 None,
                 [{"role": "system", "content": "D"}, {"role": "user", "content": "ab"},
                  {"role": "assistant", "content": f"Let me see.{CALL}"},
                  {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}], id="items"),
])
def test_input_translation(input_: Any, instructions: str | None, expected: list[dict[str, str]]) -> None:
    fields = {} if instructions is None else {"instructions": instructions}
    assert values(parse_responses(body(input=input_, **fields), DEFAULT).plan)["MESSAGES"] == [expected]


def test_plan_fields_and_echo() -> None:
    parsed = parse_responses(body(max_output_tokens=9, temperature=0.5, top_p=0.9, metadata={"a": "b"},
                                  include=["message.output_text.logprobs"], top_logprobs=2, store=False,
                                  text={"format": {"type": "json_schema", "name": "order", "schema": ORDER,
                                                   "strict": True}}), DEFAULT)
    plan = parsed.plan
    assert (plan.kind, plan.constraint_param, plan.max_tokens_param, plan.logprobs, plan.max_tokens) == (
        "json_schema", "text.format.schema", "max_output_tokens", 2, 9)
    tensors = values(plan)
    assert (tensors["MAX_TOKENS"], tensors["TEMPERATURE"], tensors["TOP_P"]) == ([9], [0.5], [pytest.approx(0.9)])
    assert (parsed.store, parsed.echo["metadata"], parsed.echo["text"]["format"]["name"]) == (False, {"a": "b"},
                                                                                              "order")


@pytest.mark.parametrize(("tools", "choice", "mode", "names"), [
    ([WEATHER], None, "auto", ["get_weather"]),
    ([WEATHER], "required", "required", ["get_weather"]),
    ([WEATHER], "none", None, []),
    ([WEATHER, {**WEATHER, "name": "get_time"}], {"type": "function", "name": "get_time"}, "named", ["get_time"]),
    ([WEATHER, {**WEATHER, "name": "get_time"}],
     {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]},
     "required", ["get_time"]),
])
def test_tool_choice(tools: list[Any], choice: Any, mode: str | None, names: list[str]) -> None:
    fields = {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
    plan = parse_responses(body(**fields), DEFAULT).plan
    assert (plan.tool_mode, [t.name for t in plan.tools]) == (mode, names)
    assert all(t.strict for t in plan.tools)  # the Responses API's default


def test_tools_with_a_text_format_are_an_agents_turn() -> None:
    """openai-agents' default: function tools and a structured final output in one request."""
    plan = parse_responses(body(tools=[WEATHER], text={"format": {"type": "json_schema", "name": "o",
                                                                  "schema": ORDER}}), DEFAULT).plan
    tag = json.loads(values(plan)["GRAMMAR"][0])
    assert (plan.kind, tag["format"]["type"]) == ("structural_tag", "or")
    assert tag["format"]["elements"][1] == {"type": "json_schema", "json_schema": ORDER}


BAD = [
    (body(input=None), "input", "is required"),
    (body(input=[]), "input", "must be a string or a non-empty array of items, got array"),
    (body(foo=1), "foo", "unrecognized request argument"),
    (body(tools=[{"type": "web_search"}]), "tools[0].type",
     "the built-in tool 'web_search' is not supported (it runs on OpenAI's side): only function tools"),
    (body(tool_choice={"type": "file_search"}, tools=[WEATHER]), "tool_choice.type",
     "the built-in tool 'file_search' is not supported"),
    (body(conversation="conv_1"), "conversation",
     "conversations are not stored by this server: use previous_response_id, or send the conversation as input"),
    (body(truncation="auto"), "truncation",
     "only disabled is supported: a conversation longer than the context is refused, not cut"),
    (body(reasoning={"effort": "high"}), "reasoning.effort",
     "reasoning controls are not supported by this model (its thinking section is constrained_llm.reasoning)"),
    (body(include=["reasoning.encrypted_content"]), "include[0]",
     "only 'message.output_text.logprobs' is supported, got 'reasoning.encrypted_content'"),
    (body(top_logprobs=21), "top_logprobs", "must be an integer in [0, 20], got 21"),
    (body(input=[{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].type",
     "must be one of input_text, output_text, text, refusal (this model reads text only), got 'input_image'"),
    (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]), "input[0].arguments",
     ("is not JSON (Expecting property name enclosed in double quotes at column 2): a call's arguments are one "
     "JSON object")),
    (body(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type",
     ("item references are not supported: send the item itself, or continue a stored response with "
     "previous_response_id")),
    (body(input=[{"type": "web_search_call", "id": "ws"}]), "input[0].type",
     ("must be message, function_call, function_call_output or reasoning (built-in tools are not supported), got "
     "'web_search_call'")),
    (body(text={"format": {"type": "json_schema", "name": "o", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}),
     "text.format.schema.properties.a.uniqueItems", "strict mode: keyword 'uniqueItems' is not enforced"),
    (body(tools=[{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}]),
     "tools[0].parameters.properties.a.not", "strict mode: keyword 'not' is not enforced by xgrammar"),
    (body(metadata={"k": 1}), "metadata.k", "must be a string of at most 512 characters"),
    (body(max_output_tokens=0), "max_output_tokens", "must be in [1, 2147483647], got 0"),
    (body(tool_choice="required"), "tool_choice", "needs function tools"),
    (body(background=True), "background", "background responses are not supported"),
]


@pytest.mark.parametrize(("request_body", "param", "reason"), BAD)
def test_bad_requests(request_body: dict[str, Any], param: str, reason: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_responses(request_body, DEFAULT)
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: {reason}")


# =========================================================================== output
def result(text: str, finish: str = "stop", **fields: Any) -> Result:
    fields.setdefault("complete", finish == "stop")
    return Result(text=text, finish_reason=finish, usage=Usage(11, 4), parsed=None, json=None, error=None, **fields)


def _lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, list(token.encode()), -0.5, (TopLogprob(token, list(token.encode()), -0.5),))


def _stream(parsed: Any, pieces: list[str], res: Result) -> tuple[ResponsesOutput, list[dict[str, Any]]]:
    out = ResponsesOutput(parsed)
    events = out.start()
    for piece in pieces[:-1]:
        events += out.piece(0, Chunk(piece))
    events += out.finish(0, res, Chunk(pieces[-1], result=res))
    frames = [out.frame(e) for e in events]
    decoded = []
    for frame in frames:
        head, data = frame.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        decoded.append(event)
    return out, decoded


def _summary(response: Response) -> list[tuple[str, str]]:
    """Each output item's type and its text (a message) or arguments (a call), read through the SDK's type."""
    items = [item.model_dump() for item in response.output]
    return [(i["type"], i["content"][0]["text"] if i["type"] == "message" else i["arguments"]) for i in items]


@pytest.mark.parametrize(("fields", "pieces", "res", "status", "items"), [
    pytest.param({}, ["He", "llo"], result("Hello"), "completed", [("message", "Hello")], id="text"),
    pytest.param({}, ["He", "llo"], result("Hello", "length"), "incomplete", [("message", "Hello")], id="length"),
    pytest.param({"text": {"format": {"type": "json_object"}}}, ['{"a"', ": 1}"],
                 result('{"a": 1}', "length", closed_early=True, close_reason="budget", complete=False),
                 "completed", [("message", '{"a": 1}')], id="closed-at-the-budget"),
    pytest.param({"tools": [WEATHER], "tool_choice": "required"}, [CALL[:20], CALL[20:] + "\n", CALL],
                 result(f"{CALL}\n{CALL}"), "completed",
                 [("function_call", '{"city": "Paris"}'), ("function_call", '{"city": "Paris"}')], id="two-calls"),
    pytest.param({"tools": [WEATHER]}, ["Sure. ", CALL], result(f"Sure. {CALL}"), "completed",
                 [("message", "Sure. "), ("function_call", '{"city": "Paris"}')], id="text-then-call"),
])
def test_body_and_stream_agree(fields: dict[str, Any], pieces: list[str], res: Result, status: str,
                               items: list[tuple[str, str]]) -> None:
    parsed = parse_responses(body(**fields), DEFAULT)
    whole = ResponsesOutput(parsed).body([res])
    response = Response.model_validate(whole)  # the openai SDK's own type reads it
    assert response.status == status
    assert _summary(response) == items
    assert (response.incomplete_details is None) is (status == "completed")
    assert whole[EXTENSION]["closed_early"] is res.closed_early
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (11, 4)
    _out, events = _stream(parsed, pieces, res)
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == f"response.{status}"
    streamed = Response.model_validate(events[-1]["response"])
    assert _summary(streamed) == items
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [kind for kind, _ in items]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(t for kind, t in items if kind == "message")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == "".join(t for kind, t in items if kind == "function_call")


def test_reasoning_item_and_logprobs() -> None:
    parsed = parse_responses(body(include=["message.output_text.logprobs"], top_logprobs=1), DEFAULT)
    res = result("ab", reasoning="think", reasoning_tokens=3, logprobs=[_lp("a"), _lp("b")])
    whole = Response.model_validate(ResponsesOutput(parsed).body([res]))
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 3
    message = whole.output[1]
    assert message.type == "message"
    part = message.content[0]
    assert part.type == "output_text" and [lp.token for lp in part.logprobs or []] == ["a", "b"]
    out = ResponsesOutput(parsed)
    events = out.start() + out.piece(0, Chunk("a", reasoning="think", logprobs=[_lp("a")]))
    events += out.finish(0, res, Chunk("b", result=res, logprobs=[_lp("b")]))
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in d["logprobs"]] for d in deltas] == [["a"], ["b"]]


def test_failed_stream_ends_with_response_failed() -> None:
    out = ResponsesOutput(parse_responses(body(), DEFAULT))
    events = out.start() + out.piece(0, Chunk("x"))
    error = OpenAIError("DEADLINE_EXCEEDED", "too slow").body()
    events += out.failed(error)
    for event in events:
        EVENTS.validate_python({**event, "sequence_number": 0})
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "too slow"}
    assert (events[-2]["code"], events[-2]["message"]) == ("deadline_exceeded", "too slow")


# =========================================================================== the store
def _stored(kept: ResponseStore, key: str | None, text: str, **fields: Any) -> dict[str, Any]:
    parsed = parse_responses(body(input=text, **fields), DEFAULT)
    response = ResponsesOutput(parsed).body([result(f"re: {text}")])
    kept.put(key, parsed, response)
    return response


def test_store_continues_a_conversation_per_key() -> None:
    store = ResponseStore(max_per_key=2)
    first = _stored(store, "team", "one")
    items = store.get("team", first["id"]).items
    assert items == ({"type": "message", "role": "user", "content": "one"},
                     {"type": "message", "role": "assistant", "content": "re: one"})
    follow = parse_responses(body(input="two", previous_response_id=first["id"]), DEFAULT, items)
    assert values(follow.plan)["MESSAGES"] == [[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "re: one"},
        {"role": "user", "content": "two"}]]
    with pytest.raises(OpenAIError, match="not found") as caught:
        store.get("other", first["id"])  # another key's
    assert (caught.value.http_status, caught.value.param) == (404, "previous_response_id")
    not_stored = _stored(store, "team", "x", store=False)
    with pytest.raises(OpenAIError):
        store.get("team", not_stored["id"])
    second, third = _stored(store, "team", "two"), _stored(store, "team", "three")
    with pytest.raises(OpenAIError):
        store.get("team", first["id"])  # the least recently used, past max_per_key
    assert store.get("team", second["id"]) and store.get("team", third["id"])
    store.delete("team", third["id"])
    with pytest.raises(OpenAIError):
        store.get("team", third["id"])
    assert len(store) == 1


def test_store_bounded_in_bytes() -> None:
    store = ResponseStore(max_per_key=100, max_bytes=6000)
    kept = [_stored(store, None, "x" * 500) for _ in range(8)]
    assert 0 < len(store) < 8
    store.get(None, kept[-1]["id"])
