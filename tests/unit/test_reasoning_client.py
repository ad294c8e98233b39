"""The thinking section at the edges: the SDK's stream and result, the CLI flags, the OpenAI shapes."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from client.__main__ import build_parser, request_from_args
from client.errors import GenerationError, InvalidRequest
from client.sdk import Result, StreamAssembler, Usage, parse_result
from contract.reasoning import Reasoning
from openai_api.errors import BadRequest
from openai_api.request import EXTENSION, parse_chat
from openai_api.response import Renderer, usage

THINK = Reasoning("</think>", "<think>")


def response(text: bytes = b"", thinking: bytes | None = None, result: str = "", *,
             final: bool = False) -> grpcclient.InferResult:
    """A real InferResult as the ensemble streams it (REASONING_TEXT only when given)."""
    message = service_pb2.ModelInferResponse(model_name="constrained_llm", id="r1")
    outputs = [("TEXT", text), ("REASONING_TEXT", thinking), ("FINISH_REASON", b"stop" if result else b""),
               ("RESULT", result.encode())]
    for name, value in outputs:
        if value is None:
            continue
        tensor = message.outputs.add()
        tensor.name = name
        tensor.datatype = "BYTES"
        tensor.shape.extend([1])
        message.raw_output_contents.append(serialize_byte_tensor(np.array([value], dtype=np.object_)).item())
    message.parameters["triton_final_response"].bool_param = final
    return grpcclient.InferResult(message)


def result_json(**fields: Any) -> str:
    doc = {"finish_reason": "stop", "complete": True, "closed_early": False, "close_reason": None,
           "stop_string": False, "backend": "llguidance", "value_retries": 0, "value_dropped_tokens": 0,
           "text": '{"a":1}', "usage": {"prompt_tokens": 3, "completion_tokens": 9}, "error": None, "status": None,
           "json": None, "reasoning": "plan \u00e9", "reasoning_tokens": 5, "reasoning_cut": True,
           "reasoning_ended": True}
    doc.update(fields)
    return json.dumps(doc)


def test_reasoning_stream_chunks_carry_both_parts() -> None:
    assembler = StreamAssembler("json_schema")
    thinking = "plan \u00e9".encode()
    chunks = [assembler.feed(r) for r in [
        response(b"", thinking[:6]),  # a character split across responses
        response(b"", thinking[6:]),
        response(b'{"a"', None),
        response(b":1}", None, result_json(), final=True),
    ]]
    assert [(c.text, c.reasoning) if c else None for c in chunks] == [
        ("", "plan "), ("", "\u00e9"), ('{"a"', ""), None]
    last = assembler.finish()
    assert (last.text, last.reasoning) == (":1}", "")
    assert last.result is not None and last.result.parsed == {"a": 1}
    assert (last.result.reasoning, last.result.reasoning_tokens, last.result.reasoning_cut,
            last.result.reasoning_ended) == ("plan \u00e9", 5, True, True)


def test_reasoning_result_without_the_option_has_none() -> None:
    doc = json.loads(result_json())
    for key in ("reasoning", "reasoning_tokens", "reasoning_cut", "reasoning_ended"):
        del doc[key]
    out = parse_result(json.dumps(doc), "json_schema")
    assert (out.reasoning, out.reasoning_tokens, out.reasoning_cut, out.reasoning_ended) == (None, None, False, True)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"reasoning": 3}, r"RESULT\.reasoning: expected str, got int"),
        ({"reasoning_tokens": "5"}, r"RESULT\.reasoning_tokens: expected int, got str"),
        ({"reasoning_cut": None}, r"RESULT\.reasoning_cut: expected bool, got NoneType"),
    ],
)
def test_reasoning_malformed_result(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(GenerationError, match=match):
        parse_result(result_json(**fields), "json_schema")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], None),
        (["--no-reasoning"], False),
        (["--reasoning-end", "</think>", "--reasoning-start", "<think>"], THINK),
        (["--reasoning-end", "</think>", "--max-reasoning-tokens", "32"], Reasoning("</think>", "", 32)),
        (["--max-reasoning-tokens", "32"], {"max_reasoning_tokens": 32}),
    ],
)
def test_reasoning_cli_flags(argv: list[str], expected: Any) -> None:
    args = build_parser().parse_args([*argv, "--regex", "[a-z]+", "p"])
    assert request_from_args(args, io.StringIO()).reasoning == expected


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--no-reasoning", "--reasoning-end", "</t>"], r"^reasoning: --no-reasoning and --reasoning-end contradict"),
        (["--reasoning-start", "<t>"], r"^reasoning\.end: --reasoning-start needs --reasoning-end$"),
        (["--reasoning-end", "</t>", "--max-reasoning-tokens", "0"],
         r"^reasoning\.max_reasoning_tokens: must be an integer in 1\.\.2147483647, got 0$"),
    ],
)
def test_reasoning_cli_refuses(argv: list[str], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        request_from_args(build_parser().parse_args([*argv, "p"]), io.StringIO())


# -- OpenAI ----------------------------------------------------------------------------------------------------
def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def reasoning_input(plan: Any) -> Any:
    for tensor in plan.inputs:
        if tensor.name() == "REASONING":
            return json.loads(deserialize_bytes_tensor(tensor._get_content())[0])
    return None


@pytest.mark.parametrize(
    ("extension", "expected"),
    [
        ({}, None),
        ({"reasoning": False}, False),
        ({"reasoning": {"end": "</think>", "max_reasoning_tokens": 9}}, {"end": "</think>", "max_reasoning_tokens": 9}),
        ({"reasoning": True, "regex": "[a-z]+"}, True),
    ],
)
def test_reasoning_openai_extension(extension: dict[str, Any], expected: Any) -> None:
    plan = parse_chat(chat(**({EXTENSION: extension} if extension else {})), 16)
    assert reasoning_input(plan) == expected


def test_reasoning_openai_extension_refuses_naming_the_path() -> None:
    with pytest.raises(BadRequest) as err:
        parse_chat(chat(**{EXTENSION: {"reasoning": {"end": ""}}}), 16)
    assert err.value.param == f"{EXTENSION}.reasoning.end"
    plan = parse_chat(chat(), 16)
    assert plan.param_of("reasoning.end") == f"{EXTENSION}.reasoning.end"


def sdk_result(**fields: Any) -> Result:
    return Result(text='{"a":1}', finish_reason="stop", complete=True, usage=Usage(11, 9), parsed=None, json=None,
                  error=None, **fields)


def test_reasoning_openai_body_and_stream() -> None:
    thought = sdk_result(reasoning="plan", reasoning_tokens=5, reasoning_cut=True)
    body = Renderer(parse_chat(chat(), 16)).body(thought)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"a":1}', "refusal": None,
                                             "reasoning_content": "plan"}
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20,
                             "completion_tokens_details": {"reasoning_tokens": 5}}
    assert (body[EXTENSION]["reasoning_cut"], body[EXTENSION]["reasoning_ended"]) == (True, True)
    renderer = Renderer(parse_chat(chat(stream=True), 16))
    chunks = renderer.chunks("", "pl") + renderer.chunks('{"a"', "an") + renderer.final_chunks(":1}", thought, "")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"reasoning_content": "pl"},
                      {"reasoning_content": "an"}, {"content": '{"a"'}, {"content": ":1}"}, {}]
    plain = sdk_result()
    assert "reasoning_content" not in Renderer(parse_chat(chat(), 16)).body(plain)["choices"][0]["message"]
    assert usage(plain) == {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20}
