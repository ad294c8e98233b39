"""Unit tests of the OpenAI-compatible endpoint's parts (:mod:`openai_api`), without a server.

Requests are parsed into real ``InferInput`` tensors (read back from their wire
content); tool-call grammars are compiled by the server's own path
(:func:`grammar_backend.spec.parse_constraint`, :func:`grammar_backend.compile.compile_spec`)
on the Qwen3 tokenizer of ``make tokenizers`` and driven token by token with
``xgrammar.GrammarMatcher``; responses are rendered from real :class:`client.sdk.Result`
objects.  Strict mode has its own file (``test_openai_strict.py``).
"""

from __future__ import annotations

import ast
import asyncio
import json
import random
import re
import shlex
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest
import xgrammar as xgr
from tritonclient.utils import deserialize_bytes_tensor

from client.errors import InvalidRequest, ServerUnavailable
from client.sdk import JsonReport, Result, Usage
from contract import errors as status
from deploy.gateway import _REFUSAL_CODES, GatewaySecurity
from grammar_backend.compile import compile_spec
from grammar_backend.spec import parse_constraint
from openai_api.errors import HTTP_STATUS, BadRequest, OpenAIError, from_status
from openai_api.request import EXTENSION, Plan, client_error_param, parse_chat, parse_completion
from openai_api.response import Renderer, finish_reason, usage
from openai_api.server import OpenAIConfig, OpenAIServerError, try_lines
from openai_api.tools import (
    ArgsDelta,
    CallStart,
    Event,
    TextDelta,
    Tool,
    ToolCallParser,
    call_prefix,
    tool_constraint,
    tools_prompt,
)
from tests.support.poll import wait_for
from tests.tls_certs import SecretVolume, der, make_pki, openssl_missing, served_cert

DEFAULT = 123  # the chat budget handed to parse_chat (distinct from every other number here)
MSG = [{"role": "user", "content": "hi"}]
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME_ARGS = {"type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}
WEATHER_TOOL = Tool("get_weather", "Weather of a city", WEATHER_ARGS, False)
TIME_TOOL = Tool("get_time", "", TIME_ARGS, False)
CALL_W = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALL_T = '<tool_call>{"name": "get_time", "arguments": {"tz": 1}}</tool_call>'
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}
_DTYPES = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}


def fn(name: str, parameters: dict[str, Any], description: str | None = None) -> dict[str, Any]:
    """An OpenAI function tool entry."""
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


WEATHER = fn("get_weather", WEATHER_ARGS, "Weather of a city")
TIME = fn("get_time", TIME_ARGS)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "p", **fields}


def parse(endpoint: str, body: Any) -> Plan:
    return parse_chat(body, DEFAULT) if endpoint == "chat" else parse_completion(body)


def values(plan: Plan) -> dict[str, list[Any]]:
    """Each input tensor's values, read back from its wire content (MESSAGES decoded from JSON)."""
    out: dict[str, list[Any]] = {}
    for tensor in plan.inputs:
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            items = [item.decode("utf-8") for item in deserialize_bytes_tensor(raw)]
            out[tensor.name()] = [json.loads(items[0])] if tensor.name() == "MESSAGES" else items
        else:
            out[tensor.name()] = np.frombuffer(raw, dtype=_DTYPES[tensor.datatype()]).tolist()
    return out


# =========================================================================== 1. requests
CHAT_BASE = {"MESSAGES": [MSG], "MAX_TOKENS": [DEFAULT], "TEMPERATURE": [1.0]}
PROMPT_BASE = {"PROMPT": ["p"], "MAX_TOKENS": [16], "TEMPERATURE": [1.0]}
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "content": {"type": "const_string",
                                                                                   "value": "x"}, "end": "</a>"}}
NEUTRAL_CHAT: dict[str, Any] = {
    "n": 1, "logprobs": False, "top_logprobs": 0, "logit_bias": {},
    "modalities": ["text"], "store": False, "metadata": {}, "service_tier": "default", "user": "u",
    "safety_identifier": "", "prompt_cache_key": "k", "audio": None, "functions": None}


def _grammar(kind: str, payload: str, options: str | None = None) -> dict[str, list[str]]:
    out = {"GRAMMAR_TYPE": [kind], "GRAMMAR": [payload]}
    return out if options is None else {**out, "GRAMMAR_OPTIONS": [options]}


# (endpoint, body, (kind, constraint_param, max_tokens_param, stream, include_usage), tensors)
GOOD = [
    pytest.param("chat", chat(), (None, None, "max_tokens", False, False), CHAT_BASE, id="minimal"),
    pytest.param("chat", chat(temperature=0.5, top_p=0.5, seed=7, stop=["END", "##"], max_completion_tokens=9),
                 (None, None, "max_completion_tokens", False, False),
                 {**CHAT_BASE, "MAX_TOKENS": [9], "TEMPERATURE": [0.5], "TOP_P": [0.5], "SEED": [7],
                  "STOP": ["END", "##"]}, id="sampling"),
    pytest.param("chat", chat(frequency_penalty=0.5, presence_penalty=-1,
                              constrained_llm={"repetition_penalty": 1.25, "min_p": 0.5, "top_k": 5}),
                 (None, None, "max_tokens", False, False),
                 {**CHAT_BASE, "TOP_K": [5], "REPETITION_PENALTY": [1.25], "FREQUENCY_PENALTY": [0.5],
                  "PRESENCE_PENALTY": [-1.0], "MIN_P": [0.5]}, id="penalties"),
    pytest.param("completions", completion(frequency_penalty=0), (None, None, "max_tokens", False, False),
                 {**PROMPT_BASE, "FREQUENCY_PENALTY": [0.0]}, id="completion-penalty-off"),
    pytest.param("chat", chat(temperature=0, stop="END", max_tokens=5), (None, None, "max_tokens", False, False),
                 {**CHAT_BASE, "MAX_TOKENS": [5], "TEMPERATURE": [0.0], "STOP": ["END"]}, id="stop-string"),
    pytest.param("chat", chat(max_tokens=5, max_completion_tokens=5),
                 (None, None, "max_completion_tokens", False, False), {**CHAT_BASE, "MAX_TOKENS": [5]},
                 id="both-budgets-equal"),
    pytest.param("chat", chat(stream=True, stream_options={"include_usage": True}),
                 (None, None, "max_tokens", True, True), CHAT_BASE, id="stream-usage"),
    pytest.param("chat", chat(stream=True, stream_options={"include_obfuscation": False}),
                 (None, None, "max_tokens", True, False), CHAT_BASE, id="stream-no-usage"),
    pytest.param("chat", chat(response_format={"type": "text"}), (None, None, "max_tokens", False, False),
                 CHAT_BASE, id="format-text"),
    pytest.param("chat", chat(response_format={"type": "json_object"}),
                 ("json_object", "response_format", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("json_object", "")}, id="format-json-object"),
    pytest.param("chat", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "description": "", "strict": True, "schema": PERSON}}),
                 ("json_schema", "response_format.json_schema.schema", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("json_schema", json.dumps(PERSON, separators=(",", ":")))},
                 id="format-json-schema"),
    pytest.param("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "any"}}),
                 ("json_object", "response_format.json_schema.schema", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("json_object", "")}, id="format-json-schema-without-schema"),
    pytest.param("chat", chat(response_format={"type": "json_object"}, **{EXTENSION: {"options": {
        "whitespace": "any", "indent": 2}}}), ("json_object", "response_format", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("json_object", "", '{"indent":2,"whitespace":"any"}')},
                 id="format-with-extension-options"),
    pytest.param("chat", chat(**{EXTENSION: {"regex": "[0-9]+", "options": {"on_budget": "truncate"}, "top_k": 5}}),
                 ("regex", "constrained_llm.regex", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("regex", "[0-9]+", '{"on_budget":"truncate"}'), "TOP_K": [5]},
                 id="ext-regex-options-top-k"),
    pytest.param("chat", chat(**{EXTENSION: {"choice": ["yes", "no"]}}),
                 ("choice", "constrained_llm.choice", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("choice", '["yes","no"]')}, id="ext-choice"),
    pytest.param("chat", chat(**{EXTENSION: {"grammar": 'root ::= "a"'}}),
                 ("ebnf", "constrained_llm.grammar", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("ebnf", 'root ::= "a"')}, id="ext-grammar-alias"),
    pytest.param("chat", chat(**{EXTENSION: {"ebnf": 'root ::= "b"', "regex": None}}),
                 ("ebnf", "constrained_llm.ebnf", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("ebnf", 'root ::= "b"')}, id="ext-ebnf"),
    pytest.param("chat", chat(**{EXTENSION: {"lark": 'start: "c"'}}),
                 ("lark", "constrained_llm.lark", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("lark", 'start: "c"')}, id="ext-lark"),
    pytest.param("chat", chat(**{EXTENSION: {"structural_tag": TAG}}),
                 ("structural_tag", "constrained_llm.structural_tag", "max_tokens", False, False),
                 {**CHAT_BASE, **_grammar("structural_tag", json.dumps(TAG, separators=(",", ":")))},
                 id="ext-structural-tag"),
    pytest.param("chat", chat(**NEUTRAL_CHAT),
                 (None, None, "max_tokens", False, False), CHAT_BASE, id="neutral-values"),
    pytest.param("chat", chat(tool_choice="none", parallel_tool_calls=False), (None, None, "max_tokens", False, False),
                 CHAT_BASE, id="tool-choice-none-without-tools"),
    pytest.param("completions", completion(), (None, None, "max_tokens", False, False), PROMPT_BASE,
                 id="completion-minimal"),
    pytest.param("completions", completion(prompt=["q"], stream=True, max_tokens=3, echo=False, best_of=1, suffix="",
                                           **{EXTENSION: {"regex": "a"}}),
                 ("regex", "constrained_llm.regex", "max_tokens", True, False),
                 {**PROMPT_BASE, "PROMPT": ["q"], "MAX_TOKENS": [3], **_grammar("regex", "a")},
                 id="completion-list-prompt-regex"),
]


@pytest.mark.parametrize(("endpoint", "body", "fields", "tensors"), GOOD)
def test_good_bodies_plan_and_tensors(endpoint: str, body: dict[str, Any], fields: tuple[Any, ...],
                                      tensors: dict[str, list[Any]]) -> None:
    plan = parse(endpoint, body)
    assert (plan.endpoint, plan.model, plan.tools, plan.tool_mode) == (endpoint, "m", (), None)
    assert (plan.kind, plan.constraint_param, plan.max_tokens_param, plan.stream, plan.include_usage) == fields
    assert values(plan) == tensors
    request = plan.infer_request("ensemble")
    assert (request.model_name, [t.name for t in request.inputs]) == ("ensemble", [t.name() for t in plan.inputs])


def _calls(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(pairs)]


@pytest.mark.parametrize(("messages", "expected"), [
    pytest.param([{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": None, "tool_calls": _calls(("get_weather", '{"city": "Paris"}'))},
                  {"role": "tool", "tool_call_id": "c0", "content": "sunny"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
                  {"role": "assistant", "content": CALL_W},
                  {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}], id="roles"),
    pytest.param([{"role": "system", "content": "S"},
                  {"role": "assistant", "content": "Let me see.", "refusal": None,
                   "tool_calls": _calls(("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": 1}'))}],
                 [{"role": "system", "content": "S"}, {"role": "assistant", "content": f"Let me see.{CALL_W}{CALL_T}"}],
                 id="assistant-text-and-two-calls"),
    pytest.param([{"role": "assistant", "content": [{"type": "text", "text": ""}], "refusal": "no"}],
                 [{"role": "assistant", "content": "no"}], id="assistant-refusal"),
    pytest.param([{"role": "user", "content": "hi", "name": "alice"}, {"role": "developer", "content": "D", "name": "ops"},
                  {"role": "assistant", "content": "x", "name": "bot", "audio": None, "function_call": None,
                   "tool_calls": None, "parsed": {"a": 1}, "annotations": [], "reasoning_content": "hmm"}],
                 [{"role": "user", "content": "hi", "name": "alice"}, {"role": "system", "content": "D", "name": "ops"},
                  {"role": "assistant", "content": "x", "name": "bot"}], id="names-and-read-back-fields"),
    pytest.param([{"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                           "arguments": '{"city": "Paris"}'}},
                  {"role": "function", "name": "get_weather", "content": "sunny"}],
                 [{"role": "assistant", "content": CALL_W},
                  {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}], id="deprecated-function-call"),
])
def test_messages_translation(messages: list[dict[str, Any]], expected: list[dict[str, str]]) -> None:
    assert values(parse_chat(chat(messages=messages), DEFAULT))["MESSAGES"] == [expected]


@pytest.mark.parametrize(("first", "expected_first"), [
    ({"role": "developer", "content": "D"}, [{"role": "system", "content": "D\n\nPROMPT"}]),
    ({"role": "user", "content": "U"}, [{"role": "system", "content": "PROMPT"}, {"role": "user", "content": "U"}]),
])
@pytest.mark.parametrize(("tool_choice", "parallel", "mode", "tools"), [
    (None, None, "auto", (WEATHER_TOOL, TIME_TOOL)),
    ("auto", False, "auto", (WEATHER_TOOL, TIME_TOOL)),
    ("required", True, "required", (WEATHER_TOOL, TIME_TOOL)),
    ({"type": "function", "function": {"name": "get_time"}}, None, "named", (TIME_TOOL,)),
])
def test_tools_plan(first: dict[str, str], expected_first: list[dict[str, str]], tool_choice: Any,
                    parallel: bool | None, mode: str, tools: tuple[Tool, ...]) -> None:
    plan = parse_chat(chat(messages=[first], tools=[WEATHER, TIME], tool_choice=tool_choice,
                           parallel_tool_calls=parallel), DEFAULT)
    assert (plan.tools, plan.tool_mode, plan.kind, plan.constraint_param) == (tools, mode, "structural_tag", "tools")
    got = values(plan)
    expected_constraint = tool_constraint(tools, mode, parallel=parallel is not False)  # type: ignore[arg-type]
    assert got["GRAMMAR"] == [expected_constraint.payload]
    prompt = tools_prompt(tools, mode)  # type: ignore[arg-type]
    assert got["MESSAGES"] == [[{**m, "content": m["content"].replace("PROMPT", prompt)} for m in expected_first]]


def test_tool_choice_none_drops_the_tools() -> None:
    plan = parse_chat(chat(tools=[WEATHER], tool_choice="none"), DEFAULT)
    assert (plan.tools, plan.tool_mode, plan.kind, values(plan)) == ((), None, None, CHAT_BASE)


OPTIONS = "strict, whitespace, indent, any_order, on_budget, on_repeat, backend, jump_forward, value_retries"
# (endpoint, body, param, exact message without the "param: " head, code)
BAD = [
    ("chat", [], "body", "must be an object, got array", "invalid_argument"),
    ("chat", chat(foo=1), "foo", "unrecognized request argument", "unknown_parameter"),
    ("completions", completion(tools=[WEATHER]), "tools", "unrecognized request argument", "unknown_parameter"),
    ("completions", completion(top_logprobs=0), "top_logprobs", "unrecognized request argument", "unknown_parameter"),
    ("chat", {"messages": MSG}, "model", "is required", "invalid_argument"),
    ("chat", chat(model=5), "model", "must be a string, got integer", "invalid_argument"),
    ("chat", chat(n=0), "n", "must be an integer in [1, 16], got 0", "invalid_argument"),
    ("chat", chat(n=17), "n", "must be an integer in [1, 16], got 17", "invalid_argument"),
    ("chat", chat(n=True), "n", "must be an integer in [1, 16], got true", "invalid_argument"),
    ("chat", chat(logprobs=1), "logprobs", "must be a boolean, got integer", "invalid_argument"),
    ("chat", chat(top_logprobs=3), "top_logprobs", "needs logprobs set to true", "invalid_argument"),
    ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs", "must be an integer in [0, 20], got 21",
     "invalid_argument"),
    ("completions", completion(logprobs=True), "logprobs", "must be an integer in [0, 20], got true",
     "invalid_argument"),
    ("completions", completion(n=17), "n", "must be an integer in [1, 16], got 17", "invalid_argument"),
    ("chat", chat(top_k=1.5), "top_k", "must be an integer, got number", "invalid_argument"),
    ("chat", chat(top_k=-1), "top_k", "must be in [0, 2147483647], got -1", "invalid_argument"),
    ("chat", chat(min_p=0.5, **{EXTENSION: {"min_p": 0.2}}), "min_p",
     "differs from constrained_llm.min_p; give one of them", "invalid_argument"),
    ("completions", completion(response_format={"type": "json_object"}, **{EXTENSION: {"regex": "a"}}),
     "constrained_llm.regex", "give one constraint: response_format or the extension's, not both",
     "invalid_argument"),
    ("chat", chat(presence_penalty=2.5), "presence_penalty", "must be a number in -2..2 (0 = off), got 2.5",
     "invalid_argument"),
    ("chat", chat(frequency_penalty="1"), "frequency_penalty", "must be a number, got string", "invalid_argument"),
    ("completions", completion(frequency_penalty=-3), "frequency_penalty",
     "must be a number in -2..2 (0 = off), got -3.0", "invalid_argument"),
    ("chat", chat(constrained_llm={"repetition_penalty": 0}), "constrained_llm.repetition_penalty",
     "must be a number in (0, 2] (1 = off), got 0.0", "invalid_argument"),
    ("chat", chat(constrained_llm={"min_p": True}), "constrained_llm.min_p", "must be a number, got boolean",
     "invalid_argument"),
    ("chat", chat(constrained_llm={"min_p": 1.5}), "constrained_llm.min_p", "must be a number in 0..1 (0 = off), got 1.5",
     "invalid_argument"),
    ("chat", chat(logit_bias={"1": 5}), "logit_bias",
     'not supported (the grammar mask decides which tokens are allowed); got {"1": 5}', "unsupported_parameter"),
    ("chat", chat(modalities=["text", "audio"]), "modalities", 'only text output is supported; got ["text", "audio"]',
     "unsupported_parameter"),
    ("chat", chat(store=True), "store", "stored completions are not supported; got true", "unsupported_parameter"),
    ("chat", chat(service_tier="flex"), "service_tier", 'this server has one service tier; got "flex"',
     "unsupported_parameter"),
    ("completions", completion(echo=True), "echo", "the prompt is not echoed; got true", "unsupported_parameter"),
    ("completions", completion(best_of=2), "best_of", "only 1 candidate per request is supported; got 2",
     "unsupported_parameter"),
    ("completions", completion(suffix="x"), "suffix", 'insertion (suffix) is not supported; got "x"',
     "unsupported_parameter"),
    ("chat", chat(audio={}), "audio", "audio output is not supported", "unsupported_parameter"),
    ("chat", chat(functions=[]), "functions", "deprecated by OpenAI and not supported: use tools",
     "unsupported_parameter"),
    ("chat", chat(reasoning_effort="low"), "reasoning_effort", "reasoning controls are not supported by this model",
     "unsupported_parameter"),
    ("chat", chat(user=5), "user", "must be a string, got integer", "invalid_argument"),
    ("chat", chat(messages=[]), "messages", "must be a non-empty array", "invalid_argument"),
    ("chat", {"model": "m"}, "messages", "must be a non-empty array", "invalid_argument"),
    ("chat", chat(messages=["hi"]), "messages[0]", "must be an object, got string", "invalid_argument"),
    ("chat", chat(messages=[{"role": "bot", "content": "x"}]), "messages[0].role",
     "must be one of system, developer, user, assistant, tool, function, got 'bot'", "invalid_argument"),
    ("chat", chat(messages=[{"role": "user", "content": "x", "tool_call_id": "n"}]), "messages[0].tool_call_id",
     "not a field of a user message; expected role, content, name", "invalid_argument"),
    ("chat", chat(messages=[{"role": "user", "content": "x", "name": 5}]), "messages[0].name",
     "must be a string, got integer", "invalid_argument"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].type",
     "must be one of text (this model reads text only), got 'image_url'", "invalid_argument"),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content",
     "must be a string or an array of content parts, got integer", "invalid_argument"),
    ("chat", chat(messages=[{"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}]), "messages[0].audio",
     "audio output is not supported, so no earlier audio can be referenced", "invalid_argument"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]),
     "messages[0].tool_calls[0].function.arguments",
     ("is not JSON (Expecting property name enclosed in double quotes at column 2): a call's arguments are one "
     "JSON object"), "invalid_argument"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[0].tool_calls[0].function.arguments",
     "must be a JSON object (a call's arguments are one JSON object)", "invalid_argument"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}]), "messages[0].tool_calls[0].type",
     "only function calls are supported, got 'custom'", "invalid_argument"),
    ("chat", chat(messages=[{"role": "tool", "content": "r"}]), "messages[0].tool_call_id",
     "must be a string, got null", "invalid_argument"),
    ("chat", chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                         "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments", "must be a string, got object", "invalid_argument"),
    ("chat", chat(max_tokens=0), "max_tokens", "must be in [1, 2147483647], got 0", "invalid_argument"),
    ("chat", chat(max_completion_tokens=0), "max_completion_tokens", "must be in [1, 2147483647], got 0",
     "invalid_argument"),
    ("chat", chat(max_tokens=1.5), "max_tokens", "must be an integer, got number", "invalid_argument"),
    ("chat", chat(max_completion_tokens=True), "max_completion_tokens", "must be an integer, got boolean",
     "invalid_argument"),
    ("chat", chat(max_tokens=5, max_completion_tokens=6), "max_tokens",
     "differs from max_completion_tokens; give one of them", "invalid_argument"),
    ("completions", completion(max_tokens=2**31), "max_tokens", "must be in [1, 2147483647], got 2147483648",
     "invalid_argument"),
    ("chat", chat(temperature="1"), "temperature", "must be a number, got string", "invalid_argument"),
    ("chat", chat(temperature=True), "temperature", "must be a number, got boolean", "invalid_argument"),
    ("chat", chat(temperature=3), "temperature", "must be a number in 0..2, got 3.0", "invalid_argument"),
    ("chat", chat(top_p=0), "top_p", "must be a number in (0, 1], got 0.0", "invalid_argument"),
    ("chat", chat(seed=-1), "seed", "must be in [0, 18446744073709551615], got -1", "invalid_argument"),
    ("chat", chat(seed=1.5), "seed", "must be an integer, got number", "invalid_argument"),
    ("chat", chat(stop=5), "stop", "must be a string or an array of strings, got integer", "invalid_argument"),
    ("chat", chat(stop=[""]), "stop[0]", "must not be empty", "invalid_argument"),
    ("chat", chat(stop=["a", 3]), "stop[1]", "must be a string, got int", "invalid_argument"),
    ("chat", chat(stream="yes"), "stream", "must be a boolean, got string", "invalid_argument"),
    ("chat", chat(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true",
     "invalid_argument"),
    ("chat", chat(stream=True, stream_options={"x": 1}), "stream_options.x", "unrecognized stream option",
     "invalid_argument"),
    ("chat", chat(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation",
     "obfuscation padding is not sent by this server", "invalid_argument"),
    ("chat", chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage",
     "must be a boolean, got string", "invalid_argument"),
    ("chat", chat(response_format="json"), "response_format", "must be an object, got string", "invalid_argument"),
    ("chat", chat(response_format={"type": "xml"}), "response_format.type",
     "must be one of text, json_object, json_schema, got 'xml'", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_object", "json_schema": {}}), "response_format.json_schema",
     "unknown field for type json_object", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema"}), "response_format.json_schema",
     "must be an object, got null", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}),
     "response_format.json_schema.name", "must be a string, got null", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
     "response_format.json_schema.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "x": 1}}),
     "response_format.json_schema.x", "unknown field; expected name, description, schema, strict", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}),
     "response_format.json_schema.strict", "must be a boolean, got string", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": []}}),
     "response_format.json_schema.schema", "must be an object, got array", "invalid_argument"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {  # strict mode: one smoke case
        "name": "a", "strict": True, "schema": {"type": "object", "properties": {"a": {
            "type": "array", "uniqueItems": True}}}}}),
     "response_format.json_schema.schema.properties.a.uniqueItems",
     ("strict mode: keyword 'uniqueItems' is not enforced by either grammar backend (xgrammar: uniqueItems is ignored "
     "by xgrammar; llguidance: not implemented by llguidance (ignored while decoding)); remove it, or set strict to "
     "false to decode without it and have the report name it"), "invalid_argument"),
    ("chat", chat(tool_choice="auto"), "tool_choice", "needs tools", "invalid_argument"),
    ("chat", chat(tools=[]), "tools", "must be a non-empty array of function tools", "invalid_argument"),
    ("chat", chat(tools=[{"type": "retrieval"}]), "tools[0].type",
     "only function tools are supported, got 'retrieval'", "invalid_argument"),
    ("chat", chat(tools=[{**WEATHER, "x": 1}]), "tools[0].x", "unknown field; expected type, function",
     "invalid_argument"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "examples": []}}]),
     "tools[0].function.examples", "unknown field; expected name, description, parameters, strict",
     "invalid_argument"),
    ("chat", chat(tools=[fn("a.b", WEATHER_ARGS)]), "tools[0].function.name",
     "must be 1-64 characters of a-z, A-Z, 0-9, _ and -", "invalid_argument"),
    ("chat", chat(tools=[WEATHER, WEATHER]), "tools[1].function.name", "'get_weather' is defined twice",
     "invalid_argument"),
    ("chat", chat(tools=[fn("f", {"type": "array"})]), "tools[0].function.parameters.type",
     'must be "object" (function arguments are a JSON object)', "invalid_argument"),
    ("chat", chat(tools=[fn("f", "{}")]), "tools[0].function.parameters",  # type: ignore[arg-type]
     "must be an object, got string", "invalid_argument"),
    ("chat", chat(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls", "must be a boolean, got string",
     "invalid_argument"),
    ("chat", chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", "'nope' is not one of the tools", "invalid_argument"),
    ("chat", chat(tools=[WEATHER], tool_choice={"type": "custom"}), "tool_choice",
     'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', "invalid_argument"),
    ("chat", chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice",
     'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', "invalid_argument"),
    ("chat", chat(tools=[WEATHER], **{EXTENSION: {"regex": "a"}}), "constrained_llm.regex",
     'the extension\'s constraints cannot be combined with tool calls; set tool_choice to "none" to use one',
     "invalid_argument"),
    ("chat", chat(response_format={"type": "json_object"}, **{EXTENSION: {"regex": "a"}}), "constrained_llm.regex",
     "give one constraint: response_format or the extension's, not both", "invalid_argument"),
    ("chat", chat(**{EXTENSION: []}), "constrained_llm", "must be an object, got array", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"schema": {}}}), "constrained_llm.schema",
     "unknown field; expected one of regex, choice, ebnf, grammar, lark, structural_tag, options, top_k, repetition_penalty, min_p, reasoning, draft_tokens",
     "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"regex": "a", "choice": ["a"]}}), "constrained_llm.choice",
     "give one constraint, not regex and choice", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"regex": 5}}), "constrained_llm.regex", "must be a string, got integer",
     "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"ebnf": ""}}), "constrained_llm.ebnf", "must not be empty", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"choice": []}}), "constrained_llm.choice", "must not be empty", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"choice": "yes"}}), "constrained_llm.choice", "must be a list of strings, got str",
     "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"structural_tag": "x"}}), "constrained_llm.structural_tag",
     "must be an object, got string", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"options": {"indent": 2}}}), "constrained_llm.options",
     "needs a constraint (response_format, tools or a kind of constrained_llm)", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"regex": "a", "options": []}}), "constrained_llm.options",
     "must be an object, got array", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"regex": "a", "options": {"bogus": 1}}}), "constrained_llm.options.bogus",
     f"unknown option; expected one of {OPTIONS}", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"regex": "a", "options": {"indent": 2}}}), "constrained_llm.options.indent",
     "only applies to json_schema and json_object, not regex", "invalid_argument"),
    ("chat", chat(tools=[WEATHER], **{EXTENSION: {"options": {"on_budget": "never"}}}),
     "constrained_llm.options.on_budget", "must be one of 'close', 'truncate', got 'never'", "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"top_k": 1.5}}), "constrained_llm.top_k", "must be an integer, got number",
     "invalid_argument"),
    ("chat", chat(**{EXTENSION: {"top_k": -1}}), "constrained_llm.top_k", "must be in [0, 2147483647], got -1",
     "invalid_argument"),
    ("completions", completion(prompt=["a", "b"]), "prompt",
     "must be a string or an array of one string (batches and token ids are not supported)", "invalid_argument"),
    ("completions", completion(prompt=[1, 2]), "prompt",
     "must be a string or an array of one string (batches and token ids are not supported)", "invalid_argument"),
    ("completions", {"model": "m"}, "prompt", "must be a string, got null", "invalid_argument"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "reason", "code"), BAD,
                         ids=[f"{i}-{row[2]}" for i, row in enumerate(BAD)])
def test_bad_bodies(endpoint: str, body: Any, param: str, reason: str, code: str) -> None:
    with pytest.raises(BadRequest, match=f"^{re.escape(f'{param}: {reason}')}$") as caught:
        parse(endpoint, body)
    err = caught.value
    assert (err.param, err.reason, err.code, err.http_status) == (param, reason, code, 400)


SCHEMA_BAD_TYPE = {"type": "object", "properties": {"a": {"type": 5}}}


@pytest.mark.parametrize(("body", "param"), [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA_BAD_TYPE}}),
     "response_format.json_schema.schema.properties.a.type"),
    (chat(tools=[fn("f", SCHEMA_BAD_TYPE)]), "tools[0].function.parameters.properties.a.type"),
    (chat(**{EXTENSION: {"choice": ["a", "a"]}}), "constrained_llm.choice[1]"),
    (chat(**{EXTENSION: {"structural_tag": {"type": "nope"}}}), "constrained_llm.structural_tag.type"),
])
def test_payload_error_paths(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_chat(body, DEFAULT)
    assert caught.value.param == param


_SCHEMA_FORMAT = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                      max_completion_tokens=4)


@pytest.mark.parametrize(("body", "field", "param"), [
    (_SCHEMA_FORMAT, None, None),
    (_SCHEMA_FORMAT, "grammar", "response_format.json_schema.schema"),
    (_SCHEMA_FORMAT, "grammar_type", "response_format.json_schema.schema"),
    (_SCHEMA_FORMAT, "grammar#/properties/name/type", "response_format.json_schema.schema.properties.name.type"),
    (_SCHEMA_FORMAT, "grammar_options.indent", "constrained_llm.options.indent"),
    (_SCHEMA_FORMAT, "max_tokens", "max_completion_tokens"),
    (_SCHEMA_FORMAT, "messages[0].content", "messages[0].content"),
    (_SCHEMA_FORMAT, "stop[1]", "stop[1]"),
    (chat(tools=[WEATHER]), "grammar", "tools"),
    (chat(**{EXTENSION: {"regex": "("}}), "grammar", "constrained_llm.regex"),
    (chat(max_tokens=4), "max_tokens", "max_tokens"),
    (chat(), "grammar", "constrained_llm"),
    (_SCHEMA_FORMAT, "grammar_options", "constrained_llm.options"),
    # JSON pointers: escapes undone, an array keyword's number an index.
    (_SCHEMA_FORMAT, "grammar#/properties/a~1b~0c/anyOf/1/enum/0",
     "response_format.json_schema.schema.properties.a/b~c.anyOf[1].enum[0]"),
    (_SCHEMA_FORMAT, "grammar#/properties/0", "response_format.json_schema.schema.properties.0"),
    (chat(tools=[WEATHER]), "grammar#/format/tags/0/content", "tools"),  # a pointer into the tag, not the body
])
def test_param_of(body: dict[str, Any], field: str | None, param: str | None) -> None:
    plan = parse_chat(body, DEFAULT)
    assert plan.param_of(field) == param
    if field is not None:
        assert client_error_param(plan, InvalidRequest(field, "bad")) == param
        assert client_error_param(plan, ServerUnavailable("down", status=status.UNAVAILABLE)) is None


# =========================================================================== 2. tools
def test_tools_prompt_text() -> None:
    head = ("You can call functions. The functions, with a JSON Schema of their arguments:\n"
            '{"name":"get_weather","description":"Weather of a city","parameters":{"type":"object","properties":'
            '{"city":{"type":"string"}},"required":["city"]}}\n'
            '{"name":"get_time","parameters":{"type":"object","properties":{"tz":{"type":"integer"}},'
            '"required":["tz"]}}\n'
            'To call a function, write <tool_call>{"name": "<function name>", "arguments": '
            "<the arguments as a JSON object>}</tool_call>\n")
    tools = (WEATHER_TOOL, TIME_TOOL)
    assert tools_prompt(tools, "auto") == head + "Call a function only when it helps; otherwise answer in text."
    assert tools_prompt(tools, "required") == head + "Answer with function calls only."
    assert tools_prompt(tools, "named") == head + "Call get_weather now."
    assert call_prefix("f\u00e9") == '<tool_call>{"name": "f\u00e9", "arguments": '


def _tag(tool: Tool) -> dict[str, Any]:
    return {"type": "tag", "begin": call_prefix(tool.name), "end": "}</tool_call>",
            "content": {"type": "json_schema", "json_schema": tool.parameters}}


@pytest.mark.parametrize(("mode", "parallel", "fmt"), [
    ("auto", True, {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [_tag(WEATHER_TOOL), _tag(TIME_TOOL)],
                    "at_least_one": False, "stop_after_first": False}),
    ("required", False, {"type": "tags_with_separator", "tags": [_tag(WEATHER_TOOL), _tag(TIME_TOOL)],
                         "separator": "\n", "at_least_one": True, "stop_after_first": True}),
    ("named", True, _tag(WEATHER_TOOL)),
])
def test_tool_constraint_document(mode: Any, parallel: bool, fmt: dict[str, Any]) -> None:
    tools = (WEATHER_TOOL,) if mode == "named" else (WEATHER_TOOL, TIME_TOOL)
    constraint = tool_constraint(tools, mode, parallel=parallel)
    assert (constraint.kind, json.loads(constraint.payload)) == ("structural_tag", {"type": "structural_tag",
                                                                                      "format": fmt})


@pytest.fixture(scope="module")
def compiler(qwen_info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(qwen_info, max_threads=1)


BAD_ARG = '<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>'
EXTRA_ARG = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}</tool_call>'
OTHER = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
COMPACT = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
# (mode, parallel, output, verdict): "ended" = every token and then the stop token accepted; "open" = every
# token accepted but the output may not end there; "rejected" = a token of the output refused.
MATCHES = [
    ("auto", True, "", "ended"),
    ("auto", True, "The weather is fine.", "ended"),
    ("auto", True, f"Let me check. {CALL_W}", "ended"),
    ("auto", True, f"{CALL_W} and {CALL_T} done", "ended"),
    ("auto", True, BAD_ARG, "rejected"),
    ("auto", True, EXTRA_ARG, "rejected"),
    ("auto", True, OTHER, "rejected"),
    ("auto", True, COMPACT, "rejected"),
    ("auto", True, '<tool_call>{"name": "get_time", "arguments": {"tz": "1"}}</tool_call>', "rejected"),
    ("auto", False, f"Sure. {CALL_W}", "ended"),
    ("auto", False, f"{CALL_W} then text", "rejected"),
    ("required", True, CALL_W, "ended"),
    ("required", True, f"{CALL_W}\n{CALL_T}", "ended"),
    ("required", True, f"{CALL_W}\n", "open"),
    ("required", True, "", "open"),
    ("required", True, f"Sure. {CALL_W}", "rejected"),
    ("required", True, f"\n{CALL_W}", "rejected"),
    ("required", True, CALL_W + CALL_T, "rejected"),
    ("required", True, BAD_ARG, "rejected"),
    ("required", False, CALL_T, "ended"),
    ("required", False, f"{CALL_W}\n{CALL_T}", "rejected"),
    ("named", True, CALL_W, "ended"),
    ("named", True, CALL_T, "rejected"),
    ("named", True, f"{CALL_W}\n{CALL_W}", "rejected"),
    ("named", True, f"x{CALL_W}", "rejected"),
    ("named", True, BAD_ARG, "rejected"),
]


@pytest.mark.parametrize(("mode", "parallel", "output", "verdict"), MATCHES)
def test_tool_grammar_on_tokens(compiler: xgr.GrammarCompiler, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo,
                                mode: Any, parallel: bool, output: str, verdict: str) -> None:
    tools = (WEATHER_TOOL,) if mode == "named" else (WEATHER_TOOL, TIME_TOOL)
    constraint = tool_constraint(tools, mode, parallel=parallel)
    grammar = compile_spec(compiler, parse_constraint(constraint.kind, constraint.payload, constraint.options_json))
    ids = qwen_tokenizer.encode(output)
    if "<tool_call>" in output:  # the model's single special token is what the grammar must take
        assert 151657 in ids
    matcher = xgr.GrammarMatcher(grammar)
    accepted = all(matcher.accept_token(token) for token in ids)
    got = "rejected" if not accepted else "ended" if matcher.accept_token(qwen_info.stop_token_ids[0]) else "open"
    assert got == verdict
    assert matcher.is_terminated() == (got == "ended")
    assert xgr.GrammarMatcher(grammar).accept_string(output) == accepted


# =========================================================================== 3. the call parser
NAMES = ("get_weather", "get_time")
HARD_ARGS = r'{"q": "a}b\"}</tool_call>c\\", "n": {"m": [1, {"k": "]"}]}}'
# (output, merged events, calls, complete calls)
PARSES = [
    ("Hello, <world> <tool", [TextDelta("Hello, <world> <tool")], [], 0),
    (CALL_W, [CallStart(0, "get_weather"), ArgsDelta(0, '{"city": "Paris"}')], [("get_weather", '{"city": "Paris"}')],
     1),
    (f"{CALL_W}\n{CALL_T}", [CallStart(0, "get_weather"), ArgsDelta(0, '{"city": "Paris"}'), TextDelta("\n"),
                             CallStart(1, "get_time"), ArgsDelta(1, '{"tz": 1}')],
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": 1}')], 2),
    (f"Let me check <<{CALL_T} ok.", [TextDelta("Let me check <<"), CallStart(0, "get_time"), ArgsDelta(0, '{"tz": 1}'),
                                      TextDelta(" ok.")], [("get_time", '{"tz": 1}')], 1),
    (f"{call_prefix('get_time')}{HARD_ARGS}}}</tool_call>", [CallStart(0, "get_time"), ArgsDelta(0, HARD_ARGS)],
     [("get_time", HARD_ARGS)], 1),
    (f'{call_prefix("get_weather")}{{"city": "Par', [CallStart(0, "get_weather"), ArgsDelta(0, '{"city": "Par')],
     [("get_weather", '{"city": "Par')], 0),
    (f'{call_prefix("get_weather")}{{"city": "P"}}}} trailing', [CallStart(0, "get_weather"),
                                                              ArgsDelta(0, '{"city": "P"}'), TextDelta("} trailing")],
     [("get_weather", '{"city": "P"}')], 0),
    (f'{call_prefix("get_weather")}{{}}}}</tool_ca', [CallStart(0, "get_weather"), ArgsDelta(0, "{}"),
                                                   TextDelta("}</tool_ca")], [("get_weather", "{}")], 0),
    (OTHER, [TextDelta(OTHER)], [], 0),
    ('<tool_call>{"name": "get_w', [TextDelta('<tool_call>{"name": "get_w')], [], 0),
    ("<tool_call>", [TextDelta("<tool_call>")], [], 0),
]


def _merge(events: Sequence[Event]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + event.text)
        elif isinstance(event, ArgsDelta) and isinstance(last, ArgsDelta) and last.index == event.index:
            out[-1] = ArgsDelta(last.index, last.text + event.text)
        else:
            out.append(event)
    return out


def _pieces(text: str, how: str | int) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(how)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("how", ["whole", "chars", 1, 2, 3, 4, 5])
@pytest.mark.parametrize(("output", "events", "calls", "complete"), PARSES, ids=[
    "text", "one-call", "two-calls", "text-call-text", "braces-in-strings", "truncated-args", "malformed-end",
    "unfinished-end-tag", "unknown-function", "unfinished-head", "bare-open-tag"])
def test_tool_call_parser(output: str, events: list[Event], calls: list[tuple[str, str]], complete: int,
                          how: str | int) -> None:
    parser = ToolCallParser(NAMES)
    got: list[Event] = []
    for piece in _pieces(output, how):
        got += parser.feed(piece)
    got += parser.finish()
    assert _merge(got) == events
    assert (parser.calls, parser.complete_calls) == (calls, complete)
    assert all(e.text for e in got if not isinstance(e, CallStart))  # no empty deltas


# =========================================================================== 4. responses
def result(text: str, finish: str = "stop", **fields: Any) -> Result:
    """A final result as the SDK builds it (usage 11 + 4)."""
    fields.setdefault("complete", finish == "stop")
    return Result(text=text, finish_reason=finish, usage=Usage(11, 4), parsed=None, json=None, error=None, **fields)


REPORT = {"complete": True, "closed_early": False, "close_reason": None, "stop_string": False, "backend": None, "seed": None,
          "value_retries": 0, "json": None, "tool_calls": None}
USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}


def _strip(obj: dict[str, Any], prefix: str) -> dict[str, Any]:
    assert re.fullmatch(prefix + r"[0-9a-f]{24}", obj.pop("id"))
    assert abs(obj.pop("created") - time.time()) < 60
    return obj


def test_body_chat_and_completion() -> None:
    chat_body = Renderer(parse_chat(chat(), DEFAULT)).body(result("Hello"))
    assert _strip(chat_body, "chatcmpl-") == {
        "object": "chat.completion", "model": "m", "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello", "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}], "usage": USAGE, EXTENSION: REPORT}
    text_body = Renderer(parse_completion(completion())).body(result("abc", "length"))
    assert _strip(text_body, "cmpl-") == {
        "object": "text_completion", "model": "m", "system_fingerprint": None,
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}], "usage": USAGE,
        EXTENSION: {**REPORT, "complete": False}}


def test_stream_chunks_shape() -> None:
    plan = parse_chat(chat(stream=True, stream_options={"include_usage": True}), DEFAULT)
    renderer = Renderer(plan)
    first = renderer.chunks("He")
    rest = renderer.chunks("") + renderer.final_chunks("llo", result("Hello"))
    chunks = first + rest
    assert {c["id"] for c in chunks} == {renderer.id} and {c["created"] for c in chunks} == {renderer.created}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [(c["choices"], c["usage"]) for c in chunks] == [
        ([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], None),
        ([{"index": 0, "delta": {"content": "He"}, "logprobs": None, "finish_reason": None}], None),
        ([{"index": 0, "delta": {"content": "llo"}, "logprobs": None, "finish_reason": None}], None),
        ([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}], None),
        ([], USAGE)]
    assert [EXTENSION in c for c in chunks] == [False, False, False, True, False]
    assert chunks[3][EXTENSION] == REPORT
    # Completions: no role chunk, no usage member nor chunk without include_usage.
    renderer = Renderer(parse_completion(completion(stream=True)))
    chunks = renderer.chunks("a") + renderer.final_chunks("", result("a"))
    assert [(c["object"], c["choices"], "usage" in c) for c in chunks] == [
        ("text_completion", [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}], False),
        ("text_completion", [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}], False)]
    # No delta before the end: the role chunk still comes first.
    chunks = Renderer(parse_chat(chat(stream=True), DEFAULT)).final_chunks("", result(""))
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {}]


def _plan(mode: str | None, stream: bool = False) -> Plan:
    choice = {"auto": "auto", "required": "required", None: "none",
              "named": {"type": "function", "function": {"name": "get_weather"}}}[mode]
    return parse_chat(chat(tools=[WEATHER, TIME], tool_choice=choice, stream=stream), DEFAULT)


# (tool mode, output, RESULT finish_reason, extra Result fields, OpenAI finish_reason, content, calls)
FINISHES = [
    (None, "Hi", "stop", {}, "stop", "Hi", []),
    (None, "Hi", "length", {}, "length", "Hi", []),
    (None, CALL_W, "stop", {}, "stop", CALL_W, []),
    ("auto", "Hi", "stop", {}, "stop", "Hi", []),
    ("auto", f"Sure. {CALL_W}", "stop", {}, "tool_calls", "Sure. ", [("get_weather", '{"city": "Paris"}')]),
    ("auto", CALL_W, "stop", {"stop_string": True}, "tool_calls", None, [("get_weather", '{"city": "Paris"}')]),
    ("auto", f'x {call_prefix("get_time")}{{"tz": 1', "length", {}, "length", "x ", [("get_time", '{"tz": 1')]),
    ("auto", f'x {call_prefix("get_time")}{{"tz": 1', "stop", {}, "stop", "x ", [("get_time", '{"tz": 1')]),
    ("auto", CALL_T, "length", {"closed_early": True, "close_reason": "budget", "complete": False}, "tool_calls",
     None, [("get_time", '{"tz": 1}')]),
    (None, '{"a": 1}', "length", {"closed_early": True, "close_reason": "budget", "complete": False}, "stop",
     '{"a": 1}', []),
    ("required", f"{CALL_W}\n{CALL_T}", "stop", {}, "tool_calls", None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": 1}')]),
    ("named", CALL_W, "stop", {}, "tool_calls", None, [("get_weather", '{"city": "Paris"}')]),
    # auto with a text format (an agent's turn): the separators between calls are no content
    ("auto", f"{CALL_W}\n{CALL_T}\n", "stop", {}, "tool_calls", None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": 1}')]),
]


@pytest.mark.parametrize(("mode", "output", "finish", "fields", "reason", "content", "calls"), FINISHES)
def test_body_and_stream_agree(mode: str | None, output: str, finish: str, fields: dict[str, Any], reason: str,
                               content: str | None, calls: list[tuple[str, str]]) -> None:
    res = result(output, finish, **fields)
    body = Renderer(_plan(mode)).body(res)
    message = body["choices"][0]["message"]
    assert (body["choices"][0]["finish_reason"], message["content"]) == (reason, content)
    got_calls = message.get("tool_calls", [])
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == [
        ("function", n, a) for n, a in calls]
    ids = [c["id"] for c in got_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)
    assert body[EXTENSION] == {**REPORT, **{k: v for k, v in fields.items()}, "complete": res.complete,
                               "tool_calls": None if mode is None else [{"valid": True if a.endswith("}") else None, "violations": []}
                                                                        for _, a in calls]}
    for seed in range(3):  # the same content, calls and finish reason in a stream cut anywhere
        renderer = Renderer(_plan(mode, stream=True))
        pieces = _pieces(output, seed) if len(output) > 1 else [output]
        chunks = [c for p in pieces[:-1] for c in renderer.chunks(p)] + renderer.final_chunks(pieces[-1], res)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        text = "".join(d.get("content", "") for d in deltas[1:])
        streamed: dict[int, list[str]] = {}
        for d in deltas:
            for call in d.get("tool_calls", []):
                if "id" in call:
                    assert (call["type"], call["function"]["arguments"], call["index"]) == ("function", "",
                                                                                           len(streamed))
                    streamed[call["index"]] = [call["function"]["name"], ""]
                streamed[call["index"]][1] += call["function"]["arguments"]
        assert (text or None if calls else text) == content
        assert [tuple(v) for v in streamed.values()] == calls
        assert chunks[-1]["choices"][0]["finish_reason"] == reason
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1][EXTENSION] == body[EXTENSION]


def test_report_fields_and_call_validation() -> None:
    json_report: dict[str, Any] = {"parsed": True, "parse_error": None, "valid": True, "violations": [], "unenforced": []}
    res = result('{"a": 1}', "length", complete=False, closed_early=True, close_reason="budget", stop_string=True,
                 backend="llguidance", value_retries=2, raw={"json": json_report})
    assert Renderer(parse_chat(chat(), DEFAULT)).report(res) == {
        "complete": False, "closed_early": True, "close_reason": "budget", "stop_string": True,
        "backend": "llguidance", "value_retries": 2, "json": json_report, "tool_calls": None, "seed": None}
    renderer = Renderer(_plan("auto"))
    body = renderer.body(result(f"{CALL_W}{BAD_ARG}{call_prefix('get_time')}{{}}}}</tool_call>"))
    assert body[EXTENSION]["tool_calls"] == [
        {"valid": True, "violations": []},
        {"valid": False, "violations": [{"pointer": "/city", "message": "5 is not of type 'string'"}]},
        {"valid": False, "violations": [{"pointer": "", "message": "'tz' is a required property"}]}]
    assert renderer.tool_calls() == body["choices"][0]["message"]["tool_calls"]


_CLOSED: Final = {"closed_early": True, "close_reason": "budget", "complete": False}


@pytest.mark.parametrize(("finish", "calls", "fields", "expected"), [
    ("stop", 0, {}, "stop"), ("stop", 2, {}, "tool_calls"), ("length", 0, {}, "length"), ("length", 1, {}, "length"),
    ("length", 0, _CLOSED, "stop"), ("length", 1, _CLOSED, "tool_calls"),
    ("length", 0, {**_CLOSED, "json": JsonReport(parsed=True, parse_error=None, valid=True, violations=(),
                                                 unenforced=())}, "stop"),
    ("length", 0, {**_CLOSED, "json": JsonReport(parsed=True, parse_error=None, valid=False, violations=(),
                                                 unenforced=())}, "length"),
    ("length", 0, {**_CLOSED, "reasoning": "", "reasoning_ended": False}, "length"),
])
def test_finish_reason_and_usage(finish: str, calls: int, fields: dict[str, Any], expected: str) -> None:
    res = Result(text="", finish_reason=finish, usage=Usage(11, 4), parsed=None, error=None,
                 **{"json": None, "complete": finish == "stop", **fields})
    assert finish_reason(res, calls) == expected
    assert usage(result("", finish)) == USAGE


# =========================================================================== 5. errors
HTTP_TABLE = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"), "UNAUTHENTICATED": (401, "invalid_request_error"),
    "PERMISSION_DENIED": (403, "invalid_request_error"), "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"), "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "INTERNAL": (500, "server_error"), "UNAVAILABLE": (503, "server_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}


def test_http_status_table_covers_every_server_status() -> None:
    assert dict(HTTP_STATUS) == HTTP_TABLE
    server_statuses = {*status.TRITON_CODE_NAMES, *_REFUSAL_CODES}
    assert server_statuses <= set(HTTP_STATUS)


@pytest.mark.parametrize("name", [*HTTP_TABLE, "CANCELLED", "UNKNOWN", "", None])
def test_from_status(name: str | None) -> None:
    err = from_status(name, "went wrong", param="stop")
    known = name in HTTP_TABLE
    assert (err.grpc_status, err.http_status, err.type) == (
        (name, *HTTP_TABLE[name]) if known and name is not None else ("INTERNAL", 500, "server_error"))
    assert err.body() == {"error": {"message": "went wrong", "type": err.type, "param": "stop",
                                    "code": err.grpc_status.lower()}}
    assert str(err) == "went wrong"


def test_error_bodies() -> None:
    err = OpenAIError("NOT_FOUND", "model 'x' does not exist", param="model", code="model_not_found")
    assert (err.http_status, err.body()) == (404, {"error": {"message": "model 'x' does not exist",
                                                             "type": "invalid_request_error", "param": "model",
                                                             "code": "model_not_found"}})
    bad = BadRequest("messages[0].role", "must be a string")
    assert (str(bad), bad.message, bad.reason, bad.param, bad.code, bad.grpc_status) == (
        "messages[0].role: must be a string", "messages[0].role: must be a string", "must be a string",
        "messages[0].role", "invalid_argument", "INVALID_ARGUMENT")
    assert OpenAIError("INTERNAL", "boom").body() == {"error": {"message": "boom", "type": "server_error",
                                                                "param": None, "code": "internal"}}
    assert BadRequest("n", "no", code="unsupported_parameter").body()["error"]["code"] == "unsupported_parameter"
    with pytest.raises(ValueError, match=r"^grpc_status: unknown status 'CANCELLED'$"):
        OpenAIError("CANCELLED", "x")


# =========================================================================== 6. server settings
@pytest.mark.parametrize(("fields", "message"), [
    ({"port": 0}, "port: must be in [1, 65535], got 0"),
    ({"port": -1}, "port: must be in [1, 65535], got -1"),
    ({"port": 65536}, "port: must be in [1, 65535], got 65536"),
    ({"models": ()}, "models: must not be empty"),
    ({"default_max_tokens": 0}, "default_max_tokens: must be in [1, 2147483647], got 0"),
    ({"default_max_tokens": 2**31}, "default_max_tokens: must be in [1, 2147483647], got 2147483648"),
])
def test_config_refuses(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(OpenAIServerError, match=f"^{re.escape(message)}$"):
        OpenAIConfig(**fields)


@pytest.mark.parametrize("port", [1, 8080, 65535])
def test_config_accepts(port: int) -> None:
    config = OpenAIConfig(port=port)
    assert (config.port, config.models, config.ssl_context()) == (port, ("constrained_llm",), None)


def test_config_tls(tmp_path: Path) -> None:
    missing = OpenAIConfig(security=GatewaySecurity(tls_cert=tmp_path / "no.crt", tls_key=tmp_path / "no.key"))
    with pytest.raises(OpenAIServerError, match=f"^tls: cannot read {re.escape(str(tmp_path))}/no.crt: "):
        missing.ssl_context()
    if openssl_missing():
        pytest.skip("openssl is not installed: no certificate to load")
    pki = make_pki(tmp_path)
    context = OpenAIConfig(security=GatewaySecurity(tls_cert=pki.cert, tls_key=pki.key)).ssl_context()
    assert context is not None and context.verify_mode == ssl.CERT_NONE
    mutual = OpenAIConfig(security=GatewaySecurity(tls_cert=pki.cert, tls_key=pki.key, tls_client_ca=pki.ca))
    context = mutual.ssl_context()
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.skipif(openssl_missing(), reason="openssl is not installed: no certificate to load")
def test_tls_port_serves_a_renewed_certificate_without_restart(tmp_path: Path) -> None:
    """The port's context (what aiohttp serves with) hands new connections the renewed certificate."""
    first, second = make_pki(tmp_path, "first"), make_pki(tmp_path, "second")
    volume = SecretVolume(tmp_path / "tls", first)
    cert, key, _ = volume.files()
    context = OpenAIConfig(security=GatewaySecurity(tls_cert=cert, tls_key=key)).ssl_context()
    seen: list[bytes] = []

    async def serve() -> None:
        async def close(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(close, "127.0.0.1", 0, ssl=context)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        seen.append(await loop.run_in_executor(None, served_cert, port))
        volume.put(second)

        def renewed() -> bool:
            seen.append(served_cert(port))
            return seen[-1] == der(second.cert)

        await loop.run_in_executor(None, wait_for, renewed, 30, "the renewed certificate")
        server.close()
        await server.wait_closed()

    asyncio.run(serve())
    assert (seen[0], seen[-1]) == (der(first.cert), der(second.cert))


_TRY_BODY = ('{"model": "constrained_llm", "messages": [{"role": "user", "content": "Invent a person."}], '
             '"response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": '
             '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
             '"required": ["name", "age"], "additionalProperties": false}}}}')
_TRY_FORMAT = ("{'type': 'json_schema', 'json_schema': {'name': 'person', 'strict': True, 'schema': {'type': "
               "'object', 'properties': {'name': {'type': 'string'}, 'age': {'type': 'integer'}}, 'required': "
               "['name', 'age'], 'additionalProperties': False}}}")


@pytest.mark.parametrize(("keys", "auth", "key"), [
    (False, "", "'none'"),
    (True, ' -H "Authorization: Bearer $CONSTRAINED_LLM_API_KEY"', "os.environ['CONSTRAINED_LLM_API_KEY']"),
])
def test_try_lines(keys: bool, auth: str, key: str) -> None:
    url = "http://127.0.0.1:8080/v1"
    curl, python = try_lines(url, "constrained_llm", keys=keys)
    assert curl == f"curl -s {url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{_TRY_BODY}'"
    assert python == (f'python -c "import os, openai; c = openai.OpenAI(base_url=\'{url}\', api_key={key}); '
                      "print(c.chat.completions.create(model='constrained_llm', messages=[{'role': 'user', "
                      f"'content': 'Invent a person.'}}], response_format={_TRY_FORMAT}).choices[0].message.content)\"")
    # What a shell hands curl is a body this endpoint takes (strict mode included) ...
    argv = shlex.split(curl)
    body = json.loads(argv[argv.index("-d") + 1])
    plan = parse_chat(body, DEFAULT)
    assert (plan.kind, plan.model) == ("json_schema", "constrained_llm")
    # ... and the Python line is Python asking for the same response_format.
    code = shlex.split(python.replace("$", "\\$"))[2]
    call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.keyword) and n.arg == "response_format")
    assert ast.literal_eval(call.value) == body["response_format"]
