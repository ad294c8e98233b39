"""The final RESULT built by the postprocessing model."""

from __future__ import annotations

import json
from typing import get_args

import pytest

import contract
from contract.errors import InvalidArgument
from contract.finish import FinishEvent, FinishReason
from grammar_backend.fidelity import validator as validator_module
from grammar_backend.fidelity import walker
from grammar_backend.spec import parse_constraint
from pipeline.finish import MAX_ERROR_CHARS, finish_json, read_finish
from pipeline.postprocess import build_result, result_of_finish
from tests.unit.conftest import load_schema


def wire(kind: str, payload: str = "", options: str | None = None) -> dict[str, str]:
    """A constraint as preprocessing passes it on (validated, canonical)."""
    return parse_constraint(kind, payload, options).wire()


PERSON = wire("json_schema", json.dumps(load_schema("person")), '{"strict": false}')
UNIQUE = wire("json_schema", '{"type":"array","items":{"type":"integer"},"uniqueItems":true}')
OBJECT = wire("json_object")


@pytest.mark.parametrize(
    ("final", "constraint", "expected_json"),
    [
        (FinishEvent("stop", '{"name":"Al","age":3}', 5, 9), PERSON,
         {"parsed": True, "parse_error": None, "valid": True, "violations": [], "unenforced": []}),
        (FinishEvent("stop", '{"name":"Al","age":200,"email":"x"}', 5, 9), PERSON,
         {"parsed": True, "parse_error": None, "valid": False, "unenforced": [],
          "violations": [{"pointer": "/age", "message": "200 is greater than the maximum of 150"},
                         {"pointer": "/email", "message": "'x' is not a 'email'"}]}),
        (FinishEvent("length", '{"name":"Al"', 5, 3), PERSON,
         {"parsed": False, "parse_error": "line 1 column 13: Expecting ',' delimiter", "valid": None,
          "violations": [], "unenforced": []}),
        (FinishEvent("stop", "[1,1]", 5, 4), UNIQUE,
         {"parsed": True, "parse_error": None, "valid": False,
          "violations": [{"pointer": "", "message": "[1, 1] has non-unique elements"}],
          "unenforced": [{"pointer": "/uniqueItems", "keyword": "uniqueItems"}]}),
        # json_object is validated as the contract's any-object schema.
        (FinishEvent("stop", '{"a":[1]}', 5, 4), OBJECT,
         {"parsed": True, "parse_error": None, "valid": True, "violations": [], "unenforced": []}),
        (FinishEvent("stop", "[1]", 5, 4), OBJECT,
         {"parsed": True, "parse_error": None, "valid": False, "unenforced": [],
          "violations": [{"pointer": "", "message": "[1] is not of type 'object'"}]}),
    ],
)
def test_json_result(final: FinishEvent, constraint: dict[str, str], expected_json: dict[str, object]) -> None:
    result = build_result(final, constraint)
    assert result["json"] == expected_json
    assert result["complete"] is (final.finish_reason == "stop")
    assert result["usage"] == {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens}


@pytest.mark.parametrize(
    ("final", "constraint", "expected"),
    [
        # Closed at the budget: "length", valid, yet not complete (values may be cut short).
        (FinishEvent("length", '{"name":"Al","age":0}', 5, 12, close_reason="budget"), PERSON,
         {"finish_reason": "length", "complete": False, "closed_early": True, "close_reason": "budget",
          "stop_string": False, "valid": True}),
        (FinishEvent("stop", '{"name":"Al","age":0}', 5, 40, close_reason="repetition"), PERSON,
         {"finish_reason": "stop", "complete": False, "closed_early": True, "close_reason": "repetition",
          "stop_string": False, "valid": True}),
        # A stop string cuts a constrained output wherever it matched: never complete.
        (FinishEvent("stop", '{"name":"namen",', 5, 6, stop_string=True), PERSON,
         {"finish_reason": "stop", "complete": False, "closed_early": False, "close_reason": None,
          "stop_string": True, "valid": None}),
        # Without a constraint a stop string is the normal end.
        (FinishEvent("stop", "Hello", 5, 2, stop_string=True), None,
         {"finish_reason": "stop", "complete": True, "closed_early": False, "close_reason": None,
          "stop_string": True, "valid": None}),
    ],
)
def test_closed_early_and_stop_string(final: FinishEvent, constraint: dict[str, str] | None,
                                      expected: dict[str, object]) -> None:
    result = build_result(final, constraint)
    report = result["json"]
    assert {**{k: result[k] for k in expected if k != "valid"},
            "valid": None if report is None else report["valid"]} == expected


@pytest.mark.parametrize(
    ("final", "constraint"),
    [
        (FinishEvent("stop", "abc", 1, 2), wire("regex", "[a-c]+")),
        (FinishEvent("stop", "free text", 1, 2), None),
        (FinishEvent("error", "", 1, 0, error="sequence 7: token 5 at position 0 is rejected by the grammar"), PERSON),
    ],
)
def test_non_json_results_have_no_report(final: FinishEvent, constraint: dict[str, str] | None) -> None:
    result = build_result(final, constraint)
    assert result["json"] is None
    assert (result["finish_reason"], result["error"]) == (final.finish_reason, final.error)


def test_unknown_finish_reason_is_a_bug() -> None:
    with pytest.raises(ValueError, match=r"^finish_reason must be one of"):
        build_result(FinishEvent("done", "", 0, 0), None)  # type: ignore[arg-type]  # a bad reason on purpose


def test_the_schema_draft_is_honoured() -> None:
    """Draft-04 `dependencies` (decoding does not enforce it) is checked after decoding."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
              "dependencies": {"card": ["billing"]}}
    constraint = wire("json_schema", json.dumps(schema))
    report = build_result(FinishEvent("stop", '{"card":"1234"}', 1, 6), constraint)["json"]
    assert (report["valid"], report["violations"]) == (False, [{"pointer": "", "message": "'billing' is a dependency of 'card'"}])


@pytest.mark.parametrize(
    ("backend", "unenforced"),
    [
        ("xgrammar", [{"pointer": "/properties/d/format", "keyword": "format"},
                      {"pointer": "/properties/u/uniqueItems", "keyword": "uniqueItems"}]),
        # llguidance enforces format date; it ignores uniqueItems (its own warnings, grammar_backend.llg).
        ("llguidance", [{"pointer": "/properties/u/uniqueItems", "keyword": "uniqueItems"}]),
    ],
)
def test_the_fidelity_report_is_the_serving_backends(backend: str, unenforced: list[dict[str, str]]) -> None:
    constraint = wire("json_schema", json.dumps({"type": "object", "properties": {
        "d": {"type": "string", "format": "date"}, "u": {"type": "array", "uniqueItems": True}}}))
    result = build_result(FinishEvent("stop", '{"d":"2024-01-02","u":[1]}', 1, 9, backend=backend), constraint)
    assert (result["backend"], result["json"]["valid"], result["json"]["unenforced"]) == (backend, True, unenforced)


def test_the_wire_form_is_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preprocessing checked the schema: postprocessing neither re-checks it nor re-walks it per output."""
    constraint = wire("json_schema", json.dumps({"type": "object", "properties": {"trusted_b": {"type": "integer"}},
                                                  "required": ["trusted_b"]}))
    walks = []

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("postprocessing validated the schema again")

    def counted_walk(*args: object) -> object:
        walks.append(1)
        return walker._walk(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(validator_module, "check_schema", never)
    monkeypatch.setattr(validator_module, "_walk", counted_walk)
    for text, valid in (('{"trusted_b":1}', True), ('{"trusted_b":"x"}', False), ("{}", False)):
        report = build_result(FinishEvent("stop", text, 1, 6), constraint)["json"]
        assert (report["valid"], report["unenforced"]) == (valid, [])
    assert len(walks) == 1


def test_finish_round_trip_and_errors_as_data() -> None:
    final = FinishEvent("error", "", 0, 0, error="max_tokens: must be in 1..1024, got 0", status="INVALID_ARGUMENT")
    out = result_of_finish(finish_json(final, None).encode())
    result = json.loads(out.result)
    assert (out.finish_reason, out.kind, out.close_reason, out.postvalidation_failed) == ("error", "none", None, False)
    assert (result["finish_reason"], result["complete"], result["status"], result["error"]) == (
        "error", False, "INVALID_ARGUMENT", "max_tokens: must be in 1..1024, got 0")


def test_an_unreadable_finish_is_an_internal_result_not_an_exception() -> None:
    out = result_of_finish(b"{not json")
    result = json.loads(out.result)
    assert (out.finish_reason, result["status"], out.kind) == ("error", "INTERNAL", "none")
    assert result["error"].startswith("internal error in postprocessing: JSONDecodeError(")


def test_long_errors_are_cut() -> None:
    result = build_result(FinishEvent("error", "", 0, 0, error="x" * 5000, status="INVALID_ARGUMENT"), None)
    assert result["error"] == "x" * MAX_ERROR_CHARS + "... (5000 characters)"


AGE = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}


@pytest.mark.parametrize(
    ("final", "failed"),
    [
        (FinishEvent("stop", '{"age": 3}', 1, 5), False),
        (FinishEvent("stop", '{"age": -3}', 1, 5), True),  # ended cleanly, yet invalid: not enforced
        (FinishEvent("length", '{"age": -3', 1, 5), False),  # truncated: nobody claims it is valid
        (FinishEvent("length", '{"age": -3}', 1, 5, close_reason="budget"), True),
        (FinishEvent("stop", '{"age": -3}', 1, 5, stop_string=True), False),  # cut by a stop string
    ],
)
def test_finished_output_labels(final: FinishEvent, failed: bool) -> None:
    constraint = wire("json_schema", json.dumps(AGE))
    out = result_of_finish(finish_json(final, constraint).encode())
    assert (out.finish_reason, out.kind, out.close_reason, out.postvalidation_failed) == (
        final.finish_reason, "json_schema", final.close_reason, failed)


#: The keys of the FINISH document, in order: the wire between ``llm`` and ``postprocessing``.
FINISH_KEYS = ["finish_reason", "text", "prompt_tokens", "completion_tokens", "error", "status", "close_reason",
               "stop_string", "backend", "value_retries", "value_dropped_tokens", "reasoning_tokens", "reasoning_cut",
               "seed", "constraint"]


@pytest.mark.parametrize(
    ("final", "constraint"),
    [
        (FinishEvent("stop", "free text", 3, 2), None),
        (FinishEvent("stop", "seeded", 3, 2, seed=2**64 - 1), None),
        (FinishEvent(finish_reason="length", text='{"name":"Al","age":0}', prompt_tokens=5, completion_tokens=12,
                     error=None, status=None, close_reason="budget", stop_string=False, backend="llguidance",
                     value_retries=2, value_dropped_tokens=7), PERSON),
        (FinishEvent("stop", "naïve «ünïcode» ✓", 1, 4, stop_string=True, backend="xgrammar"), wire("regex", ".+")),
        (FinishEvent("error", "", 1, 0, error="request cancelled", status="CANCELLED"), None),
    ],
)
def test_finish_round_trip(final: FinishEvent, constraint: dict[str, str] | None) -> None:
    # What a generator hands the llm model is what postprocessing reads back, through the wire format.
    finish = finish_json(final, constraint)
    assert list(json.loads(finish)) == FINISH_KEYS
    assert read_finish(finish.encode()) == (final, constraint)


def test_rejected_final_state() -> None:
    err = InvalidArgument("max_tokens", "must be a positive integer, got 0")
    assert FinishEvent.rejected(err) == FinishEvent("error", "", 0, 0, error=str(err), status="INVALID_ARGUMENT")


def test_finish_reasons_match_the_contract() -> None:
    assert get_args(FinishReason) == contract.FINISH_REASONS
