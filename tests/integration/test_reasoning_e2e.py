"""Think, then answer, through the served ensemble: a real tritonserver over gRPC and its OpenAI endpoint.

The default model (SmolLM2-135M) is not a reasoning model: it never writes
the end marker on its own, so every thinking section here is ended by the
server (the forced marker, several SmolLM2 tokens), and the answer must still
parse and validate whenever the shortest one fits in what is left of
``max_tokens``.  The server is rendered with default markers
(``REASONING_START``/``REASONING_END``), so requests also show the default,
the opt-out and markers of their own.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import xgrammar as xgr

from client import Client, Constraint, InvalidConstraint, InvalidRequest, Reasoning
from contract.reasoning import split_reasoning
from deploy.server import TritonServer
from grammar_backend.closing import Closer
from grammar_backend.tokenizer import load_tokenizer
from tests.integration.served import start_ensemble, wait_freed
from tests.support import assets
from tests.support.poll import HANG_S

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

PERSON: Any = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False}
THINK = Reasoning(end="</think>", start="<think>")
#: A prompt that invites thinking first.
ASK = ("Think step by step about who this person could be, inside <think> and </think>, then answer with one "
       "person as JSON.")
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    srv = start_ensemble(tmp_path_factory.mktemp("reasoning"),
                         values={"REASONING_START": "<think>", "REASONING_END": "</think>"}, openai_port=0)
    try:
        yield srv
    finally:
        srv.stop()


# `client` is tests/integration/conftest.py's, over this module's `server`.


@pytest.fixture(scope="module")
def least_budget() -> int:
    """The end marker plus the shortest valid PERSON plus the stop token, in SmolLM2 tokens."""
    bundle = load_tokenizer(assets.smollm2_dir())
    marker = bundle.encode("</think>")
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(bundle.info).compile_json_schema(
        json.dumps(PERSON), any_whitespace=False, separators=(",", ":"), strict_mode=False))
    shortest = Closer(bundle.info).complete(matcher)
    assert shortest is not None and len(marker) > 1
    return len(marker) + len(shortest) + 1


def _check_answer(result: Any, max_tokens: int) -> None:
    """The answer alone parses and validates; the thinking never leaks into it."""
    assert result.reasoning is not None and result.reasoning_ended
    assert "</think>" not in result.text and "<think>" not in result.text
    jsonschema.validate(json.loads(result.text), PERSON)
    assert result.json is not None and result.json.valid is True
    assert result.usage.completion_tokens <= max_tokens
    assert result.reasoning_tokens is not None and 0 < result.reasoning_tokens < result.usage.completion_tokens


@pytest.mark.parametrize("extra", [0, 2, 8, 24, 60])
def test_reasoning_answer_is_valid_at_tight_budgets(client: Client, least_budget: int, extra: int) -> None:
    """From the least budget that holds a valid answer up, the thinking is cut in time and the answer validates."""
    max_tokens = least_budget + extra
    result = client.generate(ASK, constraint=Constraint.json_schema(PERSON), max_tokens=max_tokens,
                             reasoning=THINK, require_complete=False)
    _check_answer(result, max_tokens)
    assert result.reasoning_cut  # SmolLM2 does not end a thinking section on its own
    if extra == 0:  # no room to think: the marker is forced first
        assert result.reasoning == "" and result.closed_early and result.finish_reason == "length"


def test_reasoning_stream_parts_are_labelled(client: Client) -> None:
    chunks = list(client.stream(ASK, constraint=Constraint.json_schema(PERSON), max_tokens=96,
                                reasoning=Reasoning(end="[[answer]]", max_reasoning_tokens=40),
                                require_complete=False))
    result = chunks[-1].result
    assert result is not None
    thinking = "".join(c.reasoning for c in chunks)
    text = "".join(c.text for c in chunks)
    assert (thinking, text) == (result.reasoning, result.text)
    # Every thinking delta comes before the first answer delta, and no marker character reaches either part.
    first_text = next(i for i, c in enumerate(chunks) if c.text)
    assert not any(c.reasoning for c in chunks[first_text + 1:])
    assert "[[answer" not in thinking and "[[" not in text
    assert result.reasoning_tokens == 40 and result.reasoning_cut
    jsonschema.validate(json.loads(text), PERSON)


def test_reasoning_server_markers_by_default_and_the_opt_out(client: Client, server: TritonServer) -> None:
    default = client.generate(ASK, constraint=Constraint.json_schema(PERSON), max_tokens=48, require_complete=False)
    _check_answer(default, 48)
    off = client.generate(ASK, constraint=Constraint.json_schema(PERSON), max_tokens=48, reasoning=False,
                          require_complete=False)
    assert off.reasoning is None and "reasoning" not in off.raw and off.reasoning_tokens is None
    jsonschema.validate(json.loads(off.text), PERSON)
    # Without a thinking section the responses carry no REASONING_TEXT tensor: as before the option existed.
    outputs: list[set[str]] = []
    conn = grpcclient.InferenceServerClient(server.grpc_url)
    done: list[Any] = []
    ended = threading.Event()

    def callback(result: Any, error: Any) -> None:
        if error is not None:
            done.append(error)
            ended.set()
            return
        outputs.append({o.name for o in result.get_response().outputs})
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.append(None)
            ended.set()

    prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"Say hi."], np.object_))
    off_input = grpcclient.InferInput("REASONING", [1], "BYTES")
    off_input.set_data_from_numpy(np.array([b"false"], np.object_))
    limit = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
    limit.set_data_from_numpy(np.array([6], np.int32))
    conn.start_stream(callback)
    try:
        conn.async_stream_infer("constrained_llm", [prompt, off_input, limit], enable_empty_final_response=True)
        assert ended.wait(HANG_S), "no final response"
    finally:
        conn.stop_stream()
        conn.close()
    assert done == [None]
    assert outputs and all(names == {"TEXT", "FINISH_REASON", "RESULT"} for names in outputs)


@pytest.mark.parametrize(
    ("reasoning", "field", "refusal"),
    [
        # The tokenizer's: the server's INVALID_ARGUMENT.
        ({"end": "<|im_end|>"}, "reasoning.end", InvalidConstraint),
        ({"end": "</think>", "start": "<|im_start|>"}, "reasoning.start", InvalidConstraint),
        # The contract's: the SDK refuses it before sending (the server would, with the same words).
        ({"start": "<think>", "end": "k>"}, "reasoning.end", InvalidRequest),
    ],
)
def test_reasoning_bad_markers_are_refused_for_that_request_only(client: Client, reasoning: Any, field: str,
                                                                 refusal: type[InvalidRequest]) -> None:
    with pytest.raises(refusal, match=f"^{field}: ") as err:
        client.generate("hi", constraint=Constraint.regex("[a-z]+"), max_tokens=4, reasoning=reasoning)
    assert err.value.field == field
    ok = client.generate("hi", constraint=Constraint.choice(["yes", "no"]), max_tokens=24, reasoning=False)
    assert ok.text in ("yes", "no")


def test_reasoning_without_a_constraint_only_splits(client: Client) -> None:
    result = client.generate("Think, then say hello.", max_tokens=24, require_complete=False)
    assert result.reasoning is not None and result.reasoning_tokens is None
    thinking, text, ended = split_reasoning(result.reasoning + ("</think>" + result.text if result.reasoning_ended
                                                                 else ""), Reasoning("</think>"))
    assert (thinking, text, ended) == (result.reasoning, result.text, result.reasoning_ended)


def test_reasoning_cli_sends_the_thinking_to_stderr(server: TritonServer) -> None:
    from client.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    code = main(["--url", server.grpc_url, "--schema", json.dumps(PERSON), "--max-tokens", "40",
                 "--reasoning-end", "[[answer]]", "--max-reasoning-tokens", "12", "--allow-incomplete", ASK],
                stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    jsonschema.validate(json.loads(out.getvalue()), PERSON)  # the answer alone on stdout
    assert err.getvalue() and "[[answer" not in err.getvalue()  # the thinking on stderr, no marker


def test_reasoning_openai_returns_reasoning_content(server: TritonServer) -> None:
    front = server.openai
    assert front is not None
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with openai.OpenAI(base_url=front.url, api_key="none", max_retries=0, timeout=120) as oai:
        response = oai.chat.completions.create(
            model="constrained_llm", messages=[{"role": "user", "content": ASK}], response_format=schema,
            max_tokens=64, temperature=0)  # type: ignore[call-overload]
        message = response.choices[0].message
        extra = message.model_extra or {}
        assert isinstance(extra.get("reasoning_content"), str)
        jsonschema.validate(json.loads(message.content or ""), PERSON)
        assert "</think>" not in (message.content or "")
        details = (response.usage.model_extra or {}) if response.usage else {}
        tokens = details["completion_tokens_details"]["reasoning_tokens"] if "completion_tokens_details" in details \
            else response.usage.completion_tokens_details.reasoning_tokens  # type: ignore[union-attr]
        assert 0 < tokens < response.usage.completion_tokens  # type: ignore[union-attr]
        ext = (response.model_extra or {})["constrained_llm"]
        assert ext["reasoning_cut"] is True and ext["reasoning_ended"] is True

        stream = oai.chat.completions.create(
            model="constrained_llm", messages=[{"role": "user", "content": ASK}], response_format=schema,
            max_tokens=64, temperature=0, stream=True)  # type: ignore[call-overload]
        thinking, content, seen_content = "", "", False
        for chunk in stream:
            delta = chunk.choices[0].delta
            part = (delta.model_extra or {}).get("reasoning_content")
            if part:
                assert not seen_content, "thinking after the answer began"
                thinking += part
            if delta.content:
                seen_content = True
                content += delta.content
        assert (thinking, content) == (extra["reasoning_content"], message.content)

        # Tool calls after the thinking: forced, so the default model calls.
        call = oai.chat.completions.create(
            model="constrained_llm", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0)
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert isinstance((choice.message.model_extra or {}).get("reasoning_content"), str)
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),  # type: ignore[union-attr]
                            WEATHER["function"]["parameters"])


def test_reasoning_leaves_no_state(server: TritonServer) -> None:
    assert wait_freed(server) == (0, 0)
