"""End to end over real gRPC: client -> tritonserver (ensemble constrained_llm) -> streamed, valid output.

One server (the real bundled tritonserver behind the gateway on free loopback
ports, the real SmolLM2-135M model on CPU, real xgrammar) serves every test of
this module (fixtures in tests/integration/conftest.py).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from client import Client, Constraint
from client.errors import InvalidConstraint, TruncatedOutput
from deploy.server import TritonServer
from tests.integration.served import grammar_active, metric, wait_active_zero

SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "schemas"

pytestmark = [pytest.mark.triton, pytest.mark.e2e]


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.json").read_text())  # type: ignore[no-any-return]


PROMPTS = ["Invent a person.", "Describe a customer order.", "Make a small tree of numbers.", "What is the weather?"]
COMPLETED: dict[str, int] = {}


@pytest.mark.parametrize("name", ["person", "order", "tree", "tool_weather", "open_object"])
def test_every_completed_json_output_parses_and_validates(client: Client, name: str) -> None:
    """The guarantee: a completed output always parses and validates. Whether a 135M model
    completes within max_tokens is the model's business (it may loop inside a string): that is
    `length`, never reported as a success."""
    schema = _schema(name)
    for prompt in PROMPTS[:2]:
        prompt = f"{prompt} Reply with JSON matching this schema: {json.dumps(schema)}"
        result = client.generate(prompt, constraint=Constraint.json_schema(schema), max_tokens=96,
                                 require_complete=False)
        if not result.complete:
            assert result.finish_reason == "length" and result.usage.completion_tokens == 96
            continue
        COMPLETED[name] = COMPLETED.get(name, 0) + 1
        assert result.finish_reason == "stop"
        parsed = json.loads(result.text)
        assert result.parsed == parsed
        jsonschema.Draft202012Validator(schema).validate(parsed)
        assert result.json is not None and result.json.parsed and result.json.valid


def test_most_schemas_complete() -> None:
    """Runs after the table above (same module, file order): outputs do complete, not only truncate."""
    assert len(COMPLETED) >= 3, COMPLETED


@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        (Constraint.regex(r"[0-9]{3}-[a-z]{2,6}"), r"[0-9]{3}-[a-z]{2,6}"),
        (Constraint.choice(["red", "green", "blue"]), r"red|green|blue"),
        (Constraint.ebnf('root ::= "The answer is " [0-9]+ "."'), r"The answer is [0-9]+\."),
    ],
)
def test_text_constraints_match(client: Client, constraint: Constraint, pattern: str) -> None:
    result = client.generate("Answer briefly.", constraint=constraint, max_tokens=40)
    assert result.finish_reason == "stop" and result.complete
    assert re.fullmatch(pattern, result.text), result.text


@pytest.mark.parametrize("at_least_one", [False, True])
def test_structural_tag_tool_call(client: Client, at_least_one: bool) -> None:
    tool = _schema("tool_weather")
    if at_least_one:  # xgrammar's own format: the output must contain a tool call
        constraint = Constraint.structural_tag_raw({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
            "tags": [{"type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
                      "content": {"type": "json_schema", "json_schema": tool}}]}})
    else:  # the short form: free text, tool calls optional
        constraint = Constraint.structural_tag(
            ["<tool_call>"], [{"begin": "<tool_call>", "schema": tool, "end": "</tool_call>"}])
    result = client.generate("Call the weather tool for Paris.", constraint=constraint, max_tokens=120,
                             require_complete=False)
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", result.text, flags=re.DOTALL)
    if at_least_one:
        assert result.complete and len(calls) == 1, result.text
    for call in calls:
        jsonschema.Draft202012Validator(tool).validate(json.loads(call))


def test_streaming_deltas_concatenate_to_the_result(client: Client) -> None:
    chunks = list(client.stream("Count to five.", constraint=Constraint.regex("[a-z ,]{5,40}"), max_tokens=30,
                                require_complete=False))
    final = chunks[-1].result
    assert final is not None
    assert "".join(c.text for c in chunks) == final.text
    assert sum(1 for c in chunks if c.text) >= 2  # streamed, not one blob


def test_max_tokens_truncation_is_length_not_success(client: Client) -> None:
    with pytest.raises(TruncatedOutput) as info:
        client.generate("Invent a person.", constraint=Constraint.json_schema(_schema("person")), max_tokens=3)
    result = info.value.result
    assert (result.finish_reason, result.complete, result.usage.completion_tokens) == ("length", False, 3)


def test_bad_schema_is_invalid_argument_while_others_complete(client: Client, server: TritonServer) -> None:
    outcomes: dict[str, Any] = {}

    def good(i: int) -> None:
        outcomes[f"good{i}"] = client.generate(PROMPTS[i], constraint=Constraint.regex("[a-z]{3,8}"), max_tokens=20)

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # Valid JSON Schema whose $ref points nowhere: only the server can tell (preprocessing, before any token).
    bad = Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}))
    try:
        with pytest.raises(InvalidConstraint, match=r"^grammar#/properties/a/\$ref: cannot resolve '#/\$defs/nope'"):
            client.generate("x", constraint=bad, max_tokens=10)
    finally:
        for t in threads:
            t.join()
    assert all(outcomes[f"good{i}"].complete for i in range(3))
    assert wait_active_zero(server) == 0
    assert server.is_running()


def test_eight_concurrent_requests_share_one_batch(client: Client, server: TritonServer) -> None:
    results: dict[int, Any] = {}
    barrier = threading.Barrier(8)

    def run(i: int) -> None:
        constraint = Constraint.json_schema(_schema("person")) if i % 2 else None
        barrier.wait()
        results[i] = client.generate(PROMPTS[i % 4], constraint=constraint, max_tokens=48, require_complete=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(8))
    assert metric(server, "llm_batch_size_max") == 8
    for i, result in results.items():
        assert result.finish_reason in ("stop", "length")
        if i % 2 and result.complete:
            jsonschema.Draft202012Validator(_schema("person")).validate(json.loads(result.text))
    assert wait_active_zero(server) == 0


def test_cancelled_stream_frees_its_matcher(client: Client, server: TritonServer) -> None:
    # 1,000 tokens would take a minute or more here; a cancelled request is freed within seconds.
    stream = client.stream("Write a long list of words.", constraint=Constraint.regex("[a-z ]{1,4000}"),
                           max_tokens=1000, require_complete=False)
    for chunk in stream:
        if chunk.text:
            break
    assert grammar_active(server) == 1
    stream.close()  # cancels the gRPC call; the gateway cancels the request inside the server
    assert wait_active_zero(server, timeout_s=15) == 0
    assert metric(server, "grammar_active_sequences") == 0
