"""Unit tests of client.sdk without a server.

Request tensors are real ``tritonclient.grpc.InferInput`` objects, inspected
through their serialised content; responses are real ``InferResult`` objects
wrapping protobuf ``ModelInferResponse`` messages built the way Triton sends
them.  The transport itself (a real stream to a real server) is covered by the
integration tests; here only an unreachable port is used.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from client import (
    Chunk,
    Client,
    ClientError,
    ClosedEarly,
    Constraint,
    DeadlineExceeded,
    GenerateRequest,
    GenerationError,
    InvalidConstraint,
    InvalidRequest,
    JsonReport,
    ServerBusy,
    ServerUnavailable,
    TruncatedOutput,
    Unenforced,
    Usage,
    Violation,
)
from client.sdk import (
    API_KEY_ENV,
    DEFAULT_MAX_TOKENS,
    REQUEST_FIELDS,
    RequestFields,
    StreamAssembler,
    TokenLogprob,
    TopLogprob,
    as_request,
    build_inputs,
    check_result,
    parse_logprobs,
    parse_result,
)

_NUMPY = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}


def tensors(inputs: list[grpcclient.InferInput]) -> list[tuple[str, str, list[int], list[Any]]]:
    """(name, datatype, shape, values) of each input, decoded from its wire content."""
    out = []
    for tensor in inputs:
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            values: list[Any] = [item.decode("utf-8") for item in deserialize_bytes_tensor(raw)]
        else:
            values = np.frombuffer(raw, dtype=_NUMPY[tensor.datatype()]).tolist()
        out.append((tensor.name(), tensor.datatype(), list(tensor.shape()), values))
    return out


DEFAULTS: list[tuple[str, str, list[int], list[Any]]] = [
    ("MAX_TOKENS", "INT32", [1], [DEFAULT_MAX_TOKENS]), ("TEMPERATURE", "FP32", [1], [0.0])]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}
SCHEMA_JSON = '{"type":"object","properties":{"n":{"type":"integer"}}}'


def _prompt(text: str = "hi") -> tuple[str, str, list[int], list[Any]]:
    return ("PROMPT", "BYTES", [1], [text])


def _grammar(kind: str, payload: str) -> list[tuple[str, str, list[int], list[Any]]]:
    return [("GRAMMAR_TYPE", "BYTES", [1], [kind]), ("GRAMMAR", "BYTES", [1], [payload])]


BUILD_CASES: list[tuple[str, dict[str, Any], list[tuple[str, str, list[int], list[Any]]]]] = [
    ("prompt-only", {"prompt": "hi"}, [_prompt(), *DEFAULTS]),
    ("unicode-prompt", {"prompt": "héllo\n"}, [_prompt("héllo\n"), *DEFAULTS]),
    (
        "messages",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "é?"}]},
        [
            ("MESSAGES", "BYTES", [1], ['[{"role":"system","content":"be brief"},{"role":"user","content":"é?"}]']),
            *DEFAULTS,
        ],
    ),
    (
        "json_schema",
        {"prompt": "hi", "constraint": Constraint.json_schema(SCHEMA)},
        [_prompt(), *_grammar("json_schema", SCHEMA_JSON), *DEFAULTS],
    ),
    (
        "json_schema+options",
        {"prompt": "hi", "constraint": Constraint.json_schema(SCHEMA, strict=True, whitespace="any", indent=2)},
        [
            _prompt(),
            *_grammar("json_schema", SCHEMA_JSON),
            ("GRAMMAR_OPTIONS", "BYTES", [1], ['{"indent":2,"strict":true,"whitespace":"any"}']),
            *DEFAULTS,
        ],
    ),
    ("json_object", {"prompt": "hi", "constraint": Constraint.json_object()},
     [_prompt(), *_grammar("json_object", ""), *DEFAULTS]),
    (
        "json_object+any_order",
        {"prompt": "hi", "constraint": Constraint("json_object", "", {"any_order": True})},
        [_prompt(), *_grammar("json_object", ""), ("GRAMMAR_OPTIONS", "BYTES", [1], ['{"any_order":true}']), *DEFAULTS],
    ),
    ("regex", {"prompt": "hi", "constraint": Constraint.regex(r"[0-9]+")},
     [_prompt(), *_grammar("regex", "[0-9]+"), *DEFAULTS]),
    ("ebnf", {"prompt": "hi", "constraint": Constraint.ebnf('root ::= "a"')},
     [_prompt(), *_grammar("ebnf", 'root ::= "a"'), *DEFAULTS]),
    ("lark", {"prompt": "hi", "constraint": Constraint.lark('start: "a"')},
     [_prompt(), *_grammar("lark", 'start: "a"'), *DEFAULTS]),
    ("choice", {"prompt": "hi", "constraint": Constraint.choice(["red", "blue"])},
     [_prompt(), *_grammar("choice", '["red","blue"]'), *DEFAULTS]),
    (
        "structural_tag",
        {"prompt": "hi", "constraint": Constraint.structural_tag(["<f="], [{"begin": "<f=a>", "schema": SCHEMA,
                                                                            "end": "</f>"}]).with_policies(
                                                                                on_repeat="continue")},
        [
            _prompt(),
            *_grammar("structural_tag",
                      '{"triggers":["<f="],"tags":[{"begin":"<f=a>","schema":' + SCHEMA_JSON + ',"end":"</f>"}]}'),
            ("GRAMMAR_OPTIONS", "BYTES", [1], ['{"on_repeat":"continue"}']),
            *DEFAULTS,
        ],
    ),
    (
        "all-sampling",
        {"prompt": "hi", "max_tokens": 17, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2**64 - 1,
         "stop": ["\n\n", "END"]},
        [
            _prompt(),
            ("MAX_TOKENS", "INT32", [1], [17]),
            ("TEMPERATURE", "FP32", [1], [float(np.float32(0.7))]),
            ("TOP_P", "FP32", [1], [float(np.float32(0.9))]),
            ("TOP_K", "INT32", [1], [40]),
            ("SEED", "UINT64", [1], [2**64 - 1]),
            ("STOP", "BYTES", [2], ["\n\n", "END"]),
        ],
    ),
    ("stop-str", {"prompt": "hi", "stop": "###", "seed": 0},
     [_prompt(), *DEFAULTS, ("SEED", "UINT64", [1], [0]), ("STOP", "BYTES", [1], ["###"])]),
    ("stop-empty-list", {"prompt": "hi", "stop": []}, [_prompt(), *DEFAULTS]),
    ("penalties", {"prompt": "hi", "min_p": 0.05, "presence_penalty": -0.5, "repetition_penalty": 1.1,
                   "frequency_penalty": 0},
     [_prompt(), *DEFAULTS, ("REPETITION_PENALTY", "FP32", [1], [float(np.float32(1.1))]),
      ("FREQUENCY_PENALTY", "FP32", [1], [0.0]), ("PRESENCE_PENALTY", "FP32", [1], [-0.5]),
      ("MIN_P", "FP32", [1], [float(np.float32(0.05))])]),
    ("numpy-ints", {"prompt": "hi", "max_tokens": np.int64(5), "top_k": np.int32(3)},
     [_prompt(), ("MAX_TOKENS", "INT32", [1], [5]), ("TEMPERATURE", "FP32", [1], [0.0]),
      ("TOP_K", "INT32", [1], [3])]),
]


@pytest.mark.parametrize(("kwargs", "expected"), [case[1:] for case in BUILD_CASES], ids=[c[0] for c in BUILD_CASES])
def test_build_inputs_tensors(kwargs: dict[str, Any], expected: list[tuple[str, str, list[int], list[Any]]]) -> None:
    assert tensors(build_inputs(**kwargs)) == expected


#: (fields, exact InvalidRequest message): the same for build_inputs and GenerateRequest.
REJECT_CASES: list[tuple[dict[str, Any], str]] = [
        ({}, r"^prompt: exactly one of prompt and messages is required$"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, r"^prompt: exactly one of prompt and"),
        ({"prompt": 5}, r"^prompt: must be a string, got int$"),
        ({"messages": []}, r"^messages: must not be empty$"),
        ({"messages": "hi"}, r"^messages: must be a list of \{role, content\} objects, got str$"),
        ({"messages": [("user", "hi")]}, r"^messages\[0\]: must be a mapping with role and content, got tuple$"),
        ({"messages": [{"role": "user"}]}, r"^messages\[0\]\.content: is required$"),
        ({"messages": [{"role": "user", "content": "a", "tool_calls": "x"}]}, r"^messages\[0\]\.tool_calls: unknown key"),
        ({"messages": [{"role": "user", "content": "a", "name": 1}]}, r"^messages\[0\]\.name: must be a string"),
        ({"messages": [{"role": 1, "content": "a"}]}, r"^messages\[0\]\.role: must be a string, got int$"),
        ({"messages": [{"role": "", "content": "a"}]}, r"^messages\[0\]\.role: must not be empty$"),
        ({"prompt": "a", "constraint": "regex"}, r"^constraint: must be a Constraint, got str$"),
        ({"prompt": "a", "max_tokens": 0}, r"^max_tokens: must be in \[1, 2147483647\], got 0$"),
        ({"prompt": "a", "max_tokens": 2**31}, r"^max_tokens: must be in \[1, 2147483647\], got 2147483648$"),
        ({"prompt": "a", "max_tokens": True}, r"^max_tokens: must be an integer, got bool$"),
        ({"prompt": "a", "max_tokens": 1.5}, r"^max_tokens: must be an integer, got float$"),
        ({"prompt": "a", "temperature": -0.1}, r"^temperature: must be a number in 0..2, got -0\.1$"),
        ({"prompt": "a", "temperature": float("nan")}, r"^temperature: must be finite, got nan$"),
        ({"prompt": "a", "temperature": "1"}, r"^temperature: must be a number, got str$"),
        ({"prompt": "a", "top_p": 0.0}, r"^top_p: must be a number in \(0, 1\], got 0\.0$"),
        ({"prompt": "a", "top_p": 1.01}, r"^top_p: must be a number in \(0, 1\], got 1\.01$"),
        ({"prompt": "a", "top_k": -1}, r"^top_k: must be in \[0, 2147483647\], got -1$"),
        ({"prompt": "a", "temperature": 2.5}, r"^temperature: must be a number in 0..2, got 2\.5$"),
        ({"prompt": "a", "stop": ["a"] * 9}, r"^stop: at most 8 stop strings, got 9$"),
        ({"prompt": "a", "stop": ["x" * 257]}, r"^stop\[0\]: is 257 characters; at most 256$"),
        ({"prompt": "a", "seed": -1}, r"^seed: must be in \[0, 18446744073709551615\], got -1$"),
        ({"prompt": "a", "seed": 2**64}, r"^seed: must be in \[0, 18446744073709551615\], got 18446744073709551616$"),
        ({"prompt": "a", "stop": [""]}, r"^stop\[0\]: must not be empty$"),
        ({"prompt": "a", "stop": ["x", 1]}, r"^stop\[1\]: must be a string, got int$"),
        ({"prompt": "a", "stop": 5}, r"^stop: must be a string or a list of strings, got int$"),
        ({"prompt": "a\ud800"}, r"^prompt: is not valid Unicode: surrogates not allowed at character 1 \('\\ud800'\)$"),
        ({"prompt": "a", "stop": ["x", "\udfff"]},
         r"^stop\[1\]: is not valid Unicode: surrogates not allowed at character 0 \('\\udfff'\)$"),
        ({"prompt": "a", "repetition_penalty": 0.0},
         r"^repetition_penalty: must be a number in \(0, 2\] \(1 = off\), got 0\.0$"),
        ({"prompt": "a", "min_p": "0.1"}, r"^min_p: must be a number, got str$"),
]


@pytest.mark.parametrize(("kwargs", "message"), REJECT_CASES)
def test_build_inputs_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        build_inputs(**kwargs)


# ----------------------------------------------------------------------------- GenerateRequest
@pytest.mark.parametrize(("kwargs", "expected"), [case[1:] for case in BUILD_CASES], ids=[c[0] for c in BUILD_CASES])
def test_generate_request_inputs(kwargs: dict[str, Any], expected: list[tuple[str, str, list[int], list[Any]]]) -> None:
    request = GenerateRequest(**kwargs)
    assert tensors(request.inputs()) == expected
    assert tensors(request.inputs()) == expected  # a request can be sent again


@pytest.mark.parametrize(("kwargs", "message"), REJECT_CASES)
def test_generate_request_rejects_once_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        GenerateRequest(**kwargs)


def test_request_fields_are_the_dataclass_fields() -> None:
    # RequestFields (the **fields typing) and GenerateRequest are one list: same names, order and types.
    fields = [f for f in dataclasses.fields(GenerateRequest) if f.init]
    assert REQUEST_FIELDS == tuple(f.name for f in fields)
    assert REQUEST_FIELDS == tuple(RequestFields.__annotations__)
    hints = get_type_hints(GenerateRequest)
    assert get_type_hints(RequestFields) == {f.name: hints[f.name] for f in fields}
    assert RequestFields.__required_keys__ == frozenset()
    assert REQUEST_FIELDS == ("prompt", "messages", "constraint", "max_tokens", "temperature", "top_p", "top_k",
                              "seed", "stop", "repetition_penalty", "frequency_penalty", "presence_penalty",
                              "min_p", "logprobs", "draft_tokens", "reasoning", "require_complete")


def test_build_inputs_takes_the_request_fields() -> None:
    params = list(inspect.signature(build_inputs).parameters.values())
    assert [(p.name, p.kind) for p in params] == [("prompt", inspect.Parameter.POSITIONAL_ONLY),
                                                  ("fields", inspect.Parameter.VAR_KEYWORD)]
    every: dict[str, Any] = {"constraint": Constraint.regex("[a-z]+"), "max_tokens": 9, "temperature": 0.5,
                             "top_p": 0.9, "top_k": 3, "seed": 1, "stop": ["\n"], "repetition_penalty": 1.1,
                             "frequency_penalty": 0.5, "presence_penalty": -0.5, "min_p": 0.1, "logprobs": 2,
                             "draft_tokens": 0, "reasoning": {"max_reasoning_tokens": 8}, "require_complete": False}
    assert set(every) | {"prompt", "messages"} == set(REQUEST_FIELDS)
    expected = tensors(GenerateRequest("hi", **every).inputs())
    assert tensors(build_inputs("hi", **every)) == expected
    assert tensors(build_inputs(prompt="hi", **every)) == expected
    assert len(expected) == 16  # every optional tensor is there


def test_generate_request_is_frozen_and_replace_checks_again() -> None:
    request = GenerateRequest("hi", constraint=Constraint.choice(["a", "b"]), max_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_tokens = 5  # type: ignore[misc]
    assert (request.kind, GenerateRequest("hi").kind) == ("choice", None)
    assert dataclasses.replace(request, seed=3) == GenerateRequest("hi", constraint=request.constraint, max_tokens=4,
                                                                   seed=3)
    with pytest.raises(InvalidRequest, match=r"^max_tokens: must be in \[1, 2147483647\], got 0$"):
        dataclasses.replace(request, max_tokens=0)
    assert "_wire" not in repr(request)
    assert request.inputs()[0] is not request.inputs()[0]  # fresh tensors per call


@pytest.mark.parametrize(
    ("args", "fields", "expected"),
    [
        (("hi",), {}, GenerateRequest(prompt="hi")),
        ((), {"prompt": "hi", "max_tokens": 3}, GenerateRequest(prompt="hi", max_tokens=3)),
        ((None,), {"messages": [{"role": "user", "content": "x"}]},
         GenerateRequest(messages=[{"role": "user", "content": "x"}])),
        ((GenerateRequest("hi", seed=1),), {}, GenerateRequest("hi", seed=1)),
        ((GenerateRequest("hi", seed=1),), {"seed": 2, "require_complete": False},
         GenerateRequest("hi", seed=2, require_complete=False)),
    ],
)
def test_as_request(args: tuple[Any, ...], fields: dict[str, Any], expected: GenerateRequest) -> None:
    assert as_request(*args, **fields) == expected


def test_as_request_keeps_a_ready_request() -> None:
    request = GenerateRequest("hi")
    assert as_request(request) is request


@pytest.mark.parametrize(
    ("args", "fields", "error", "message"),
    [
        (("hi",), {"prompt": "again"}, TypeError, r"^prompt given twice: positionally and as prompt=$"),
        (("hi",), {"max_token": 3}, TypeError, r"unexpected keyword argument 'max_token'"),
        ((GenerateRequest("hi"),), {"top_k": -1}, InvalidRequest, r"^top_k: must be in \[0, 2147483647\], got -1$"),
        ((5,), {}, InvalidRequest, r"^prompt: must be a string, got int$"),
    ],
)
def test_as_request_rejects(args: tuple[Any, ...], fields: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        as_request(*args, **fields)


# ----------------------------------------------------------------------------- RESULT parsing
def _result_json(**overrides: Any) -> str:
    obj: dict[str, Any] = {
        "finish_reason": "stop",
        "complete": True,
        "text": '{"n": 3}',
        "usage": {"prompt_tokens": 12, "completion_tokens": 6},
        "error": None,
        "json": {
            "parsed": True,
            "parse_error": None,
            "valid": False,
            "violations": [{"pointer": "/n", "message": "3 is not a multiple of 2"}],
            "unenforced": [{"pointer": "/properties/n", "keyword": "multipleOf"}],
        },
    }
    obj.update(overrides)
    return json.dumps(obj)


def test_parse_result_json_schema() -> None:
    text = _result_json()
    result = parse_result(text, "json_schema")
    assert result.text == '{"n": 3}'
    assert result.finish_reason == "stop"
    assert result.complete is True
    assert result.usage == Usage(prompt_tokens=12, completion_tokens=6)
    assert result.parsed == {"n": 3}
    assert result.error is None
    assert result.json == JsonReport(
        parsed=True,
        parse_error=None,
        valid=False,
        violations=(Violation("/n", "3 is not a multiple of 2"),),
        unenforced=(Unenforced("/properties/n", "multipleOf"),),
    )
    assert dict(result.raw) == json.loads(text)


@pytest.mark.parametrize(
    ("overrides", "kind", "expected"),
    [
        # Truncated JSON: not complete, so not parsed, and no error.
        (
            {"finish_reason": "length", "complete": False, "text": '{"n": ',
             "json": {"parsed": False, "parse_error": "Expecting value", "valid": None, "violations": [],
                      "unenforced": []}},
            "json_schema",
            {"complete": False, "parsed": None, "finish_reason": "length"},
        ),
        ({"text": '{"a": [1, 2]}'}, "json_object", {"parsed": {"a": [1, 2]}}),
        ({"text": "[1, 2]"}, "json_schema", {"parsed": [1, 2]}),  # a schema may allow any value
        ({"text": "yes", "json": None}, "choice", {"parsed": None, "json": None}),
        ({"text": '{"n": 3}'}, None, {"parsed": None}),  # unconstrained: never parsed
        ({"text": "1"}, "regex", {"parsed": None}),  # "json" optional members absent is fine too
        ({"finish_reason": "error", "complete": False, "text": "", "error": "engine failed", "json": None},
         "regex", {"error": "engine failed", "finish_reason": "error"}),
        # Closed early: not complete, but parsed (it parses and validates).
        ({"finish_reason": "length", "complete": False, "closed_early": True, "close_reason": "budget",
          "stop_string": False},
         "json_schema", {"complete": False, "parsed": {"n": 3}, "closed_early": True, "close_reason": "budget"}),
        ({"complete": False, "closed_early": True, "close_reason": "repetition"}, "json_schema",
         {"finish_reason": "stop", "parsed": {"n": 3}, "closed_early": True, "close_reason": "repetition"}),
        # A stop string under a constraint: incomplete, not parsed.
        ({"complete": False, "stop_string": True, "text": '{"n": '}, "json_schema",
         {"complete": False, "parsed": None, "stop_string": True, "closed_early": False}),
        # The grammar backend that served it.
        ({"backend": "llguidance"}, "json_schema", {"backend": "llguidance", "parsed": {"n": 3}}),
        ({"backend": None}, None, {"backend": None}),
        ({"value_retries": 2, "value_dropped_tokens": 7}, "json_schema",
         {"value_retries": 2, "value_dropped_tokens": 7}),
    ],
)
def test_parse_result_variants(overrides: dict[str, Any], kind: str | None, expected: dict[str, Any]) -> None:
    result = parse_result(_result_json(**overrides), kind)
    for name, value in expected.items():
        assert getattr(result, name) == value


def test_parse_result_without_optional_members() -> None:
    text = json.dumps({"finish_reason": "stop", "complete": True, "text": "ok",
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    result = parse_result(text, "regex")
    assert (result.error, result.json, result.parsed) == (None, None, None)


def _without(key: str) -> str:
    obj = json.loads(_result_json())
    del obj[key]
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", r"^malformed RESULT from server: RESULT: invalid JSON at line 1 column 1: Expecting value$"),
        ("[]", r"^malformed RESULT from server: RESULT: expected object, got list$"),
        (_without("finish_reason"), r"^malformed RESULT from server: RESULT\.finish_reason: missing$"),
        (_result_json(finish_reason="done"), r"RESULT\.finish_reason: expected one of \['error', 'length', 'stop'\]"),
        (_result_json(complete="yes"), r"RESULT\.complete: expected bool, got str$"),
        (_result_json(finish_reason="length"), r"RESULT\.complete: true with finish_reason 'length'$"),
        (_result_json(closed_early=True, close_reason=None), r"RESULT\.close_reason: None with closed_early True$"),
        (_result_json(closed_early=True, close_reason="budget"), r"RESULT\.complete: true with closed_early$"),
        (_result_json(closed_early=True, close_reason="tired"),
         r"RESULT\.close_reason: 'tired' with closed_early True$"),
        (_result_json(closed_early="yes"), r"RESULT\.closed_early: expected bool, got str$"),
        (_result_json(backend="outlines"),
         r"RESULT\.backend: expected one of \['xgrammar', 'llguidance'\] or null, got 'outlines'$"),
        (_without("usage"), r"RESULT\.usage: missing$"),
        (_result_json(usage={"prompt_tokens": "3", "completion_tokens": 1}),
         r"RESULT\.usage\.prompt_tokens: expected int, got str$"),
        (_result_json(usage={"prompt_tokens": 3, "completion_tokens": True}),
         r"RESULT\.usage\.completion_tokens: expected int, got bool$"),
        (_without("text"), r"RESULT\.text: missing$"),
        (_result_json(error=3), r"RESULT\.error: expected str, got int$"),
        (_result_json(json=[]), r"RESULT\.json: expected object or null, got list$"),
        (_result_json(json={"parsed": True, "parse_error": None, "valid": True,
                            "violations": [{"message": "x"}], "unenforced": []}),
         r"RESULT\.json\.violations\[0\]\.pointer: missing$"),
        (_result_json(json={"parse_error": None, "valid": True, "violations": [], "unenforced": []}),
         r"RESULT\.json\.parsed: missing$"),
        (_result_json(json={"parsed": True, "parse_error": None, "valid": "yes", "violations": [],
                            "unenforced": []}), r"RESULT\.json\.valid: expected bool, got str$"),
        (_result_json(json={"parsed": True, "parse_error": None, "valid": None, "violations": [],
                            "unenforced": ["uniqueItems"]}),
         r"RESULT\.json\.unenforced\[0\]: expected object, got str$"),
    ],
)
def test_parse_result_rejects_malformed(text: str, message: str) -> None:
    with pytest.raises(GenerationError, match=message) as info:
        parse_result(text, "json_schema")
    assert info.value.result is None


def test_parse_result_complete_json_object_that_is_not_an_object_is_an_error() -> None:
    with pytest.raises(GenerationError, match=r"^output is complete under a json_object constraint but is a JSON "
                                              r"list, not an object$"):
        parse_result(_result_json(text="[1, 2]"), "json_object")


def test_parse_result_complete_but_not_json_is_an_error_with_the_result() -> None:
    with pytest.raises(GenerationError, match=r"^output is complete under a json_object constraint but is not JSON "
                                              r"\(line 1 column 2: Expecting property name"):
        parse_result(_result_json(text="{"), "json_object")
    with pytest.raises(GenerationError) as info:
        parse_result(_result_json(text="nope"), "json_schema")
    assert info.value.result is not None
    assert info.value.result.text == "nope"


@pytest.mark.parametrize(
    ("finish_reason", "complete", "closed", "require_complete", "raises"),
    [
        ("stop", True, None, True, None),
        ("length", False, None, False, None),
        ("length", False, None, True, TruncatedOutput),
        ("length", False, "budget", True, ClosedEarly),
        ("length", False, "budget", False, None),
        ("stop", False, "repetition", True, ClosedEarly),
        ("error", False, None, False, GenerationError),
        ("error", False, None, True, GenerationError),
    ],
)
def test_check_result(finish_reason: str, complete: bool, closed: str | None, require_complete: bool,
                      raises: type | None) -> None:
    text = _result_json(finish_reason=finish_reason, complete=complete, text="x", json=None,
                        error="engine failed" if finish_reason == "error" else None,
                        status="INTERNAL" if finish_reason == "error" else None,
                        closed_early=closed is not None, close_reason=closed)
    result = parse_result(text, None)
    if raises is None:
        check_result(result, require_complete=require_complete)
        return
    with pytest.raises(raises) as info:
        check_result(result, require_complete=require_complete)
    assert type(info.value) is raises
    assert info.value.result is result  # type: ignore[attr-defined]
    if raises is GenerationError:
        assert str(info.value) == "INTERNAL: engine failed"


@pytest.mark.parametrize(
    ("status", "error", "raises", "message", "field"),
    [
        ("INVALID_ARGUMENT", "max_tokens: must be in 1..1024, got 0", InvalidConstraint,
         "max_tokens: must be in 1..1024, got 0", "max_tokens"),
        ("INVALID_ARGUMENT", "grammar#/properties/age/minimum: must be a number", InvalidConstraint,
         "grammar#/properties/age/minimum: must be a number", "grammar#/properties/age/minimum"),
        ("UNAVAILABLE", "the scheduler is shutting down", ServerUnavailable,
         "server unavailable: the scheduler is shutting down", None),
        ("DEADLINE_EXCEEDED", "compile took longer than 20 s", DeadlineExceeded,
         "deadline exceeded: compile took longer than 20 s", None),
        ("RESOURCE_EXHAUSTED", "1024 requests are queued", ServerBusy,
         "server busy: 1024 requests are queued", None),
        (None, "no status given", GenerationError, "server error: no status given", None),
    ],
)
def test_error_result_raises_by_its_status(
    status: str | None, error: str, raises: type[ClientError], message: str, field: str | None
) -> None:
    """Errors arrive as data (RESULT.status); the SDK raises the same types as for a gRPC status."""
    result = parse_result(_result_json(finish_reason="error", complete=False, text="", json=None, error=error,
                                       status=status), None)
    assert result.status == status
    with pytest.raises(raises) as info:
        check_result(result, require_complete=False)
    assert type(info.value) is raises
    assert str(info.value) == message
    assert info.value.status == status
    if field is not None:
        assert info.value.field == field  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- response stream
def response(
    text: bytes | None = b"",
    finish: bytes | None = b"",
    result: str | None = "",
    *,
    final: bool = False,
    text_values: list[bytes] | None = None,
) -> grpcclient.InferResult:
    """A real InferResult as Triton streams it (outputs omitted when None)."""
    message = service_pb2.ModelInferResponse(model_name="constrained_llm", id="r1")
    outputs = [("TEXT", text_values if text_values is not None else None if text is None else [text]),
               ("FINISH_REASON", None if finish is None else [finish]),
               ("RESULT", None if result is None else [result.encode()])]
    for name, values in outputs:
        if values is None:
            continue
        tensor = message.outputs.add()
        tensor.name = name
        tensor.datatype = "BYTES"
        tensor.shape.extend([len(values)])
        message.raw_output_contents.append(serialize_byte_tensor(np.array(values, dtype=np.object_)).item())
    message.parameters["triton_final_response"].bool_param = final
    return grpcclient.InferResult(message)


RESULT_STOP = _result_json(text="Hello!", json=None)


def run(assembler: StreamAssembler, responses: list[grpcclient.InferResult]) -> Iterator[Chunk | None]:
    for item in responses:
        yield assembler.feed(item)


def test_assembler_deltas_then_final_with_result() -> None:
    assembler = StreamAssembler("regex")
    chunks = list(run(assembler, [response(b"Hel"), response(b""), response(b"lo"),
                                  response(b"!", b"stop", RESULT_STOP, final=True)]))
    assert chunks == [Chunk("Hel"), None, Chunk("lo"), None]
    assert assembler.done
    final = assembler.finish()
    assert final.text == "!"
    assert final.result is not None
    assert (final.result.text, final.result.finish_reason) == ("Hello!", "stop")


def test_assembler_result_then_empty_final_response() -> None:
    # The model may send RESULT and then a flags-only final response
    # (enable_empty_final_response delivers it without outputs).
    assembler = StreamAssembler(None)
    chunks = list(run(assembler, [response(b"Hi"), response(b"!", b"stop", RESULT_STOP),
                                  response(None, None, None, final=True)]))
    assert chunks == [Chunk("Hi"), None, None]
    assert assembler.finish() == Chunk("!", parse_result(RESULT_STOP, None))


def test_assembler_joins_utf8_split_across_responses() -> None:
    assembler = StreamAssembler(None)
    chunks = list(run(assembler, [response(b"caf\xc3"), response(b"\xa9 \xe2\x82"), response(b"\xac")]))
    assert chunks == [Chunk("caf"), Chunk("é "), Chunk("€")]


@pytest.mark.parametrize(
    ("responses", "message"),
    [
        ([response(b"a", final=True)], r"^malformed response stream: the final response carried no RESULT$"),
        ([response(b"\xff")], r"^malformed response from server: TEXT is not UTF-8"),
        ([response(b"caf\xc3", b"stop", RESULT_STOP, final=True)], r"^malformed response from server: TEXT is not"),
        ([response(b"", b"stop", RESULT_STOP), response(b"", b"stop", RESULT_STOP, final=True)],
         r"^malformed response stream: RESULT sent twice$"),
        ([response(b"", b"length", RESULT_STOP, final=True)],
         r"RESULT\.finish_reason: 'stop' disagrees with FINISH_REASON 'length'$"),
        ([response(text_values=[b"a", b"b"])], r"^malformed response from server: TEXT: expected 1 element, got 2$"),
        ([response(b"", b"stop", "{", final=True)], r"^malformed RESULT from server: RESULT: invalid JSON"),
    ],
    ids=["no-result", "bad-utf8", "cut-utf8-at-end", "result-twice", "finish-mismatch", "two-texts", "bad-result"],
)
def test_assembler_rejects_broken_streams(responses: list[grpcclient.InferResult], message: str) -> None:
    assembler = StreamAssembler(None)
    with pytest.raises(GenerationError, match=message):
        for item in responses:
            assembler.feed(item)
        assembler.finish()


def test_assembler_rejects_response_after_final_and_early_finish() -> None:
    assembler = StreamAssembler(None)
    with pytest.raises(GenerationError, match=r"^response stream is not finished$"):
        assembler.finish()
    assembler.feed(response(b"", b"stop", RESULT_STOP, final=True))
    with pytest.raises(GenerationError, match=r"^malformed response stream: a response arrived after the final one$"):
        assembler.feed(response(b"x"))


# ----------------------------------------------------------------------------- client
def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens once the socket is closed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": ""}, r"^url: must be a non-empty host:port string$"),
        ({"model": ""}, r"^model: must be a non-empty string$"),
        ({"timeout_s": 0}, r"^timeout_s: must be > 0 or None, got 0$"),
        ({"timeout_s": -1.0}, r"^timeout_s: must be > 0 or None, got -1\.0$"),
        ({"timeout_s": "10"}, r"^timeout_s: must be a number, got str$"),
    ],
)
def test_client_rejects_bad_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Client(**kwargs)


def test_stream_validates_before_any_network_call() -> None:
    with Client(f"127.0.0.1:{_closed_port()}") as llm, pytest.raises(InvalidRequest, match=r"^max_tokens: must be"):
        llm.stream("hi", max_tokens=0)  # raised by the call itself, not on iteration
    with Client(f"127.0.0.1:{_closed_port()}") as llm, pytest.raises(InvalidRequest, match=r"^seed: must be"):
        llm.stream(GenerateRequest("hi"), seed=-1)  # fields given beside a request are checked too


def test_unreachable_server() -> None:
    with Client(f"127.0.0.1:{_closed_port()}", timeout_s=5.0) as llm:
        assert llm.is_ready() is False
        with pytest.raises(ServerUnavailable, match=r"^server unavailable: ") as info:
            llm.generate("hi", constraint=Constraint.regex("a+"))
        assert info.value.status == "UNAVAILABLE"
        with pytest.raises(ServerUnavailable):
            list(llm.stream("hi"))
        for request in (GenerateRequest("hi", max_tokens=4), GenerateRequest(messages=[{"role": "user", "content": "hi"}])):
            with pytest.raises(ServerUnavailable):
                llm.generate(request)
            with pytest.raises(ServerUnavailable):
                list(llm.stream(request))


def test_closed_client_refuses_calls() -> None:
    llm = Client(f"127.0.0.1:{_closed_port()}")
    llm.close()
    with pytest.raises(ClientError, match=r"^client is closed$"):
        llm.generate("hi")


# ----------------------------------------------------------------------------- TLS and API keys
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cert_file": "c.pem"}, r"^key_file: mutual TLS needs both cert_file and key_file$"),
        ({"key_file": "k.pem"}, r"^cert_file: mutual TLS needs both cert_file and key_file$"),
        ({"ca_file": "/nonexistent/ca.pem"}, r"^ca_file: cannot read '/nonexistent/ca\.pem'$"),
        ({"api_key": ""}, r"^api_key: must be a non-empty single-line string$"),
        ({"api_key": "a\nb"}, r"^api_key: must be a non-empty single-line string$"),
    ],
)
def test_client_rejects_bad_security_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Client(**kwargs)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl binary to make a test CA")
def test_client_tls_and_api_key_reach_the_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real gateway with TLS and keys; its upstream is a closed port, so a call
    # that passes TLS and the key check ends UNAVAILABLE there (is_ready False)
    # and the gateway's refusal counter tells the key check's verdict.
    import hashlib
    import json

    from deploy.gateway import Gateway, GatewayConfig, GatewaySecurity
    from tests.tls_certs import make_pki

    pki, other = make_pki(tmp_path, "ca"), make_pki(tmp_path, "other")
    keys = tmp_path / "keys"
    keys.write_text(json.dumps({"keys": [{"id": "t", "sha256": hashlib.sha256(b"good-key").hexdigest()}]}))
    gateway = Gateway(GatewayConfig(upstream=f"127.0.0.1:{_closed_port()}", secret="s" * 32,
                                    security=GatewaySecurity(tls_cert=pki.cert, tls_key=pki.key, api_keys_file=keys)))
    gateway.start()
    url = f"127.0.0.1:{gateway.port}"
    try:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        with Client(url, ca_file=pki.ca, timeout_s=10) as llm:
            with pytest.raises(GenerationError, match=r"^UNAUTHENTICATED: no API key") as info:
                llm.is_ready()
            assert info.value.status == "UNAUTHENTICATED"
        assert gateway.refusals["UNAUTHENTICATED"] == 1
        with Client(url, ca_file=pki.ca, api_key="good-key", timeout_s=10) as llm:
            assert llm.is_ready() is False  # past TLS and the key: the closed upstream answers
        monkeypatch.setenv(API_KEY_ENV, "good-key")
        with Client(url, ca_file=pki.ca, timeout_s=10) as llm:
            assert llm.is_ready() is False
            with pytest.raises(ServerUnavailable):
                llm.generate("hi")
        with Client(url, ca_file=other.ca, timeout_s=10) as llm:
            assert llm.is_ready() is False  # the handshake fails: never reaches the key check
        assert gateway.refusals["UNAUTHENTICATED"] == 1
    finally:
        gateway.stop()


# ----------------------------------------------------------------------------- seed and log probabilities
@pytest.mark.parametrize(("overrides", "seed"), [({"seed": 0}, 0), ({"seed": 2**64 - 1}, 2**64 - 1),
                                                 ({"seed": None}, None), ({}, None)])
def test_parse_result_reads_the_seed(overrides: dict[str, Any], seed: int | None) -> None:
    assert parse_result(_result_json(json=None, **overrides), None).seed == seed


def test_parse_result_refuses_a_seed_that_is_not_an_integer() -> None:
    with pytest.raises(GenerationError, match=r"^malformed RESULT from server: RESULT\.seed: expected int, got str$"):
        parse_result(_result_json(json=None, seed="7"), None)


def lp_response(text: bytes, logprobs: list[dict[str, Any]] | bytes | None, result: str = "", *,
                final: bool = False) -> grpcclient.InferResult:
    """A response as the ensemble streams it to a request with log probabilities (TOKEN_LOGPROBS on each)."""
    message = service_pb2.ModelInferResponse(model_name="constrained_llm", id="r1")
    raw = logprobs if isinstance(logprobs, bytes) or logprobs is None else json.dumps(logprobs).encode()
    for name, value in (("TEXT", text), ("FINISH_REASON", b"stop" if result else b""), ("RESULT", result.encode()),
                        ("TOKEN_LOGPROBS", raw)):
        if value is None:
            continue
        tensor = message.outputs.add()
        tensor.name = name
        tensor.datatype = "BYTES"
        tensor.shape.extend([1])
        message.raw_output_contents.append(serialize_byte_tensor(np.array([value], dtype=np.object_)).item())
    message.parameters["triton_final_response"].bool_param = final
    return grpcclient.InferResult(message)


def _entry(token: str, logprob: float, *top: tuple[str, float]) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}


def test_logprobs_chunks_carry_their_entries_and_the_result_all_of_them() -> None:
    assembler = StreamAssembler(None)
    a, b, c = _entry("He", -0.5, ("He", -0.5), ("Hi", -1.25)), _entry("llo", 0.0, ("llo", 0.0)), _entry("!", -2.0)
    chunks = list(run(assembler, [lp_response(b"He", [a]),
                                  lp_response(b"", [b]),  # held text: its entry waits for the next chunk
                                  lp_response(b"llo", []),
                                  lp_response(b"!", [c], RESULT_STOP, final=True)]))
    assert [None if ch is None else (ch.text, ch.logprobs) for ch in chunks] == [
        ("He", [TokenLogprob("He", [72, 101], -0.5, (TopLogprob("He", [72, 101], -0.5),
                                                     TopLogprob("Hi", [72, 105], -1.25)))]),
        None,
        ("llo", [TokenLogprob("llo", [108, 108, 111], 0.0, (TopLogprob("llo", [108, 108, 111], 0.0),))]),
        None,
    ]
    final = assembler.finish()
    assert final.logprobs == [TokenLogprob("!", [33], -2.0, ())]
    assert final.result is not None and final.result.logprobs is not None
    assert [e.to_openai() for e in final.result.logprobs] == [a, b, c]  # OpenAI's chat logprobs.content entries


def test_logprobs_are_none_when_not_asked_and_a_list_when_asked_for_none() -> None:
    plain = StreamAssembler(None)
    assert list(run(plain, [response(b"Hi"), response(b"", b"stop", RESULT_STOP, final=True)])) == [Chunk("Hi"), None]
    final = plain.finish()
    assert final.logprobs is None and final.result is not None and final.result.logprobs is None
    asked = StreamAssembler(None)
    list(run(asked, [lp_response(b"", [], RESULT_STOP, final=True)]))
    final = asked.finish()
    assert final.logprobs == [] and final.result is not None and final.result.logprobs == []


def test_logprobs_to_openai_is_openais_entry_shape() -> None:
    entry = TokenLogprob("\ufffd", [0xE2], -0.125, (TopLogprob("\ufffd", [0xE2], -0.125), TopLogprob("a", [97], -3.0)))
    assert entry.to_openai() == {"token": "\ufffd", "logprob": -0.125, "bytes": [226],
                                 "top_logprobs": [{"token": "\ufffd", "logprob": -0.125, "bytes": [226]},
                                                  {"token": "a", "logprob": -3.0, "bytes": [97]}]}


@pytest.mark.parametrize(("raw", "message"), [
    (b"{", r"^malformed response from server: TOKEN_LOGPROBS: not a UTF-8 JSON array: "),
    (b"\xff", r"^malformed response from server: TOKEN_LOGPROBS: not a UTF-8 JSON array: "),
    (b"{}", r"^malformed response from server: TOKEN_LOGPROBS: expected an array, got dict$"),
    (b"[1]", r"^malformed response from server: TOKEN_LOGPROBS\[0\]: expected an object, got int$"),
    (json.dumps([{**_entry("a", -1.0), "token": 3}]).encode(),
     r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.token: expected a string, got int$"),
    (json.dumps([{**_entry("a", -1.0), "bytes": [256]}]).encode(),
     r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.bytes: expected a list of byte values$"),
    (json.dumps([{**_entry("a", -1.0), "bytes": [True]}]).encode(),
     r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.bytes: expected a list of byte values$"),
    (json.dumps([_entry("a", 0.5)]).encode(),
     r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.logprob: expected a number <= 0, got 0\.5$"),
    (b'[{"token": "a", "bytes": [97], "logprob": NaN, "top_logprobs": []}]',
     r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.logprob: expected a number <= 0, got nan$"),
    (json.dumps([{**_entry("a", -1.0), "top_logprobs": None}]).encode(),
     r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.top_logprobs: expected an array, got NoneType$"),
    (json.dumps([_entry("a", -1.0, ("b", True))]).encode(),
     (r"^malformed response from server: TOKEN_LOGPROBS\[0\]\.top_logprobs\[0\]\.logprob: expected a number <= 0, "
      r"got True$")),
])
def test_logprobs_malformed_are_refused_by_path(raw: bytes, message: str) -> None:
    with pytest.raises(GenerationError, match=message):
        parse_logprobs(raw)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"draft_tokens": 17}, "draft_tokens: must be null (the server's default) or an integer in 0..16, got 17"),
        ({"draft_tokens": 2, "repetition_penalty": 1.2},
         "draft_tokens: prompt-lookup speculation cannot be combined with a repetition, frequency or presence penalty"),
        ({"draft_tokens": 2, "logprobs": 1}, "draft_tokens: prompt-lookup speculation cannot be combined with logprobs"),
    ],
    ids=["too-many", "penalty", "logprobs"],
)
def test_draft_tokens_are_checked_with_the_servers_rule(fields: dict[str, Any], message: str) -> None:
    """The SDK and preprocessing apply the one rule (contract.check_draft_tokens): the same refusal, by name."""
    from grammar_backend.errors import InvalidArgument
    from pipeline.preprocess import PreprocessConfig, RawRequest, parse_fields  # the server's side

    with pytest.raises(InvalidRequest) as client_err:
        GenerateRequest("hi", **fields)
    assert str(client_err.value) == message
    with pytest.raises(InvalidArgument) as server_err:
        parse_fields(RawRequest(prompt=b"hi", **fields), PreprocessConfig(tokenizer="unused"))
    assert str(server_err.value) == message


def test_draft_tokens_travel_as_their_tensor() -> None:
    assert ("DRAFT_TOKENS", "INT32", [1], [4]) in tensors(GenerateRequest("hi", draft_tokens=4).inputs())
    assert all(t[0] != "DRAFT_TOKENS" for t in tensors(GenerateRequest("hi").inputs()))
