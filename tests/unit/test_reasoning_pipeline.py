"""The ``reasoning`` option through preprocessing (its authority), the FINISH document and postprocessing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from contract.errors import ConfigError, InvalidArgument
from contract.finish import FinishEvent
from contract.reasoning import Reasoning
from grammar_backend.spec import validated_constraint
from pipeline.finish import finish_json, read_finish, read_finish_reasoning
from pipeline.postprocess import build_result, result_of_finish
from pipeline.preprocess import GenerationParams, PreprocessConfig, Preprocessor, RawRequest

MODEL = Path(__file__).resolve().parents[2] / "build" / "models" / "smollm2-135m-instruct"
CONFIG = PreprocessConfig(tokenizer=str(MODEL), max_prompt_tokens=64, max_tokens_limit=100, default_max_tokens=50)
THINKING = dataclasses.replace(CONFIG, reasoning_start="<think>", reasoning_end="</think>")
SCHEMA = b'{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}'
THINK = Reasoning("</think>", "<think>")


def preprocessor(config: PreprocessConfig) -> Preprocessor:
    if not (MODEL / "tokenizer.json").is_file():
        pytest.skip(f"{MODEL} missing (run `make model`)")
    return Preprocessor.from_config(config)


@pytest.fixture(scope="module")
def plain() -> Preprocessor:
    return preprocessor(CONFIG)


@pytest.fixture(scope="module")
def thinking() -> Preprocessor:
    return preprocessor(THINKING)


@pytest.mark.parametrize(
    ("reasoning", "constrained", "expected"),
    [
        (None, True, None),
        (b"", True, None),
        (b"false", True, None),
        (b'{"end":"</think>","start":"<think>"}', True, THINK),
        (b'{"end":"[[done]]","max_reasoning_tokens":64}', True, Reasoning("[[done]]", "", 64)),
        (b'{"end":"</think>"}', False, Reasoning("</think>")),
    ],
)
def test_reasoning_preprocessing_without_server_markers(plain: Preprocessor, reasoning: bytes | None,
                                                        constrained: bool, expected: Reasoning | None) -> None:
    raw = RawRequest(prompt=b"hi", reasoning=reasoning, grammar_type=b"json_schema" if constrained else None,
                     grammar=SCHEMA if constrained else None)
    _, params = plain(raw)
    assert params.reasoning == expected
    if constrained:
        assert params.constraint is not None
        options = json.loads(params.constraint["options"])
        if expected is None:
            assert "reasoning" not in options  # the wire form of a request without thinking is as it was
        else:
            assert Reasoning(**options["reasoning"]) == expected
            spec = validated_constraint(params.constraint["kind"], params.constraint["payload"],
                                        params.constraint["options"])
            assert spec.options.reasoning == expected
    # REQUEST carries it only when set, and reads back the same
    assert ("reasoning" in json.loads(params.to_json())) is (expected is not None)
    assert GenerationParams.from_json(params.to_json()) == params


@pytest.mark.parametrize(
    ("reasoning", "expected"),
    [
        (None, THINK),  # the server's model reasons: on by default
        (b"true", THINK),
        (b'{"max_reasoning_tokens":9}', Reasoning("</think>", "<think>", 9)),
        (b"false", None),
        (b'{"end":"###"}', Reasoning("###")),
    ],
)
def test_reasoning_preprocessing_with_server_markers(thinking: Preprocessor, reasoning: bytes | None,
                                                     expected: Reasoning | None) -> None:
    _, params = thinking(RawRequest(prompt=b"hi", reasoning=reasoning, grammar_type=b"regex", grammar=b"[a-z]+"))
    assert params.reasoning == expected


@pytest.mark.parametrize(
    ("config", "raw", "match"),
    [
        (CONFIG, RawRequest(prompt=b"x", reasoning=b"true", grammar_type=b"regex", grammar=b"a"),
         r"^reasoning\.end: is required: this server has no default reasoning markers$"),
        (CONFIG, RawRequest(prompt=b"x", reasoning=b"{", grammar_type=b"regex", grammar=b"a"),
         r"^reasoning: invalid JSON at line 1 column 2"),
        (CONFIG, RawRequest(prompt=b"x", reasoning=b'{"end":"</t>","max_reasoning_tokens":0}'),
         r"^reasoning\.max_reasoning_tokens: must be an integer in 1\.\.2147483647, got 0$"),
        (CONFIG, RawRequest(prompt=b"x", reasoning=b'{"end":"<|im_end|>"}', grammar_type=b"regex", grammar=b"a"),
         r"^reasoning\.end: '<\|im_end\|>' holds the special token '<\|im_end\|>', which the output text leaves out$"),
        (CONFIG, RawRequest(prompt=b"x", reasoning=b'{"end":"</t>","start":"<|im_start|>x"}'),
         r"^reasoning\.start: '<\|im_start\|>x' holds the special token"),
        (CONFIG, RawRequest(prompt=b"x", reasoning=b'{"end":"</t>","max_reasoning_tokens":5}'),
         r"^reasoning\.max_reasoning_tokens: needs a constraint \(the grammar side forces the end marker\)"),
        (THINKING, RawRequest(prompt=b"x", reasoning=b'{"max_reasoning_tokens":5}'),
         r"^reasoning\.max_reasoning_tokens: needs a constraint"),
        (CONFIG, RawRequest(prompt=b"x", reasoning=b'{"start":"<think>","end":"k>"}'),
         r"^reasoning\.end: 'k>' overlaps the start marker '<think>'"),
    ],
)
def test_reasoning_preprocessing_refuses(config: PreprocessConfig, raw: RawRequest, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        preprocessor(config)(raw)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"reasoning_start": "<think>"}, r"reasoning_start needs reasoning_end"),
        ({"reasoning_end": "k>", "reasoning_start": "<think>"}, r"preprocessing\.reasoning\.end: 'k>' overlaps"),
        ({"reasoning_end": ""}, r"preprocessing\.reasoning\.end: must not be empty"),
    ],
)
def test_reasoning_server_markers_are_checked_at_load(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(CONFIG, **fields)


def test_reasoning_special_server_markers_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"^preprocessing: reasoning\.end: '<\|im_end\|>' holds the special token"):
        preprocessor(dataclasses.replace(CONFIG, reasoning_end="<|im_end|>"))


CONSTRAINT = {"kind": "json_schema", "payload": SCHEMA.decode(), "options": "{}"}


@pytest.mark.parametrize(
    ("text", "reason", "close", "expected"),
    [
        ('<think>plan</think>{"a":1}', "stop", None,
         {"text": '{"a":1}', "reasoning": "plan", "complete": True, "reasoning_ended": True, "valid": True}),
        ('plan</think>{"a":1}', "length", "budget",
         {"text": '{"a":1}', "reasoning": "plan", "complete": False, "reasoning_ended": True, "valid": True}),
        ("<think>still thinking </thi", "length", None,
         {"text": "", "reasoning": "still thinking </thi", "complete": False, "reasoning_ended": False,
          "valid": None}),
        ('<think>{"a":1}</think>{"a":"x"}', "stop", None,  # the thinking is never validated, the answer is
         {"text": '{"a":"x"}', "reasoning": '{"a":1}', "complete": True, "reasoning_ended": True, "valid": False}),
    ],
)
def test_reasoning_result_splits_and_checks_the_answer(text: str, reason: str, close: str | None,
                                                       expected: dict[str, Any]) -> None:
    final = FinishEvent(reason, text, 5, 20, close_reason=close, reasoning_tokens=7, reasoning_cut=True)  # type: ignore[arg-type]
    result = build_result(final, CONSTRAINT, THINK)
    report = result["json"]
    assert {"text": result["text"], "reasoning": result["reasoning"], "complete": result["complete"],
            "reasoning_ended": result["reasoning_ended"],
            "valid": report["valid"] if report["parsed"] else None} == expected
    assert (result["reasoning_tokens"], result["reasoning_cut"]) == (7, True)


def test_reasoning_finish_document_round_trips() -> None:
    final = FinishEvent("stop", "<think>a</think>b", 1, 4, reasoning_tokens=3)
    doc = finish_json(final, None, THINK)
    assert read_finish_reasoning(doc) == (final, None, THINK)
    assert read_finish(doc) == (final, None)
    plain = finish_json(final, None)
    assert "reasoning" not in json.loads(plain) and read_finish_reasoning(plain) == (final, None, None)
    out = result_of_finish(doc.encode())
    assert json.loads(out.result)["text"] == "b" and not out.postvalidation_failed
