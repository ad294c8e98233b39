"""The final RESULT built by the postprocessing model."""

from __future__ import annotations

import json

import pytest

from grammar_backend.fidelity import validator as validator_module
from grammar_backend.fidelity import walker
from grammar_backend.spec import parse_constraint
from pipeline.finish import MAX_ERROR_CHARS, FinalState, finish_json
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
        (FinalState("stop", '{"name":"Al","age":3}', 5, 9), PERSON,
         {"parsed": True, "parse_error": None, "valid": True, "violations": [], "unenforced": []}),
        (FinalState("stop", '{"name":"Al","age":200,"email":"x"}', 5, 9), PERSON,
         {"parsed": True, "parse_error": None, "valid": False, "unenforced": [],
          "violations": [{"pointer": "/age", "message": "200 is greater than the maximum of 150"},
                         {"pointer": "/email", "message": "'x' is not a 'email'"}]}),
        (FinalState("length", '{"name":"Al"', 5, 3), PERSON,
         {"parsed": False, "parse_error": "line 1 column 13: Expecting ',' delimiter", "valid": None,
          "violations": [], "unenforced": []}),
        (FinalState("stop", "[1,1]", 5, 4), UNIQUE,
         {"parsed": True, "parse_error": None, "valid": False,
          "violations": [{"pointer": "", "message": "[1, 1] has non-unique elements"}],
          "unenforced": [{"pointer": "/uniqueItems", "keyword": "uniqueItems"}]}),
        # json_object is validated as the contract's any-object schema.
        (FinalState("stop", '{"a":[1]}', 5, 4), OBJECT,
         {"parsed": True, "parse_error": None, "valid": True, "violations": [], "unenforced": []}),
        (FinalState("stop", "[1]", 5, 4), OBJECT,
         {"parsed": True, "parse_error": None, "valid": False, "unenforced": [],
          "violations": [{"pointer": "", "message": "[1] is not of type 'object'"}]}),
    ],
)
def test_json_result(final: FinalState, constraint: dict[str, str], expected_json: dict[str, object]) -> None:
    result = build_result(final, constraint)
    assert result["json"] == expected_json
    assert result["complete"] is (final.finish_reason == "stop")
    assert result["usage"] == {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens}


@pytest.mark.parametrize(
    ("final", "constraint", "expected"),
    [
        # Closed at the budget: "length", valid, yet not complete (values may be cut short).
        (FinalState("length", '{"name":"Al","age":0}', 5, 12, close_reason="budget"), PERSON,
         {"finish_reason": "length", "complete": False, "closed_early": True, "close_reason": "budget",
          "stop_string": False, "valid": True}),
        (FinalState("stop", '{"name":"Al","age":0}', 5, 40, close_reason="repetition"), PERSON,
         {"finish_reason": "stop", "complete": False, "closed_early": True, "close_reason": "repetition",
          "stop_string": False, "valid": True}),
        # A stop string cuts a constrained output wherever it matched: never complete.
        (FinalState("stop", '{"name":"namen",', 5, 6, stop_string=True), PERSON,
         {"finish_reason": "stop", "complete": False, "closed_early": False, "close_reason": None,
          "stop_string": True, "valid": None}),
        # Without a constraint a stop string is the normal end.
        (FinalState("stop", "Hello", 5, 2, stop_string=True), None,
         {"finish_reason": "stop", "complete": True, "closed_early": False, "close_reason": None,
          "stop_string": True, "valid": None}),
    ],
)
def test_closed_early_and_stop_string(final: FinalState, constraint: dict[str, str] | None,
                                      expected: dict[str, object]) -> None:
    result = build_result(final, constraint)
    report = result["json"]
    assert {**{k: result[k] for k in expected if k != "valid"},
            "valid": None if report is None else report["valid"]} == expected


@pytest.mark.parametrize(
    ("final", "constraint"),
    [
        (FinalState("stop", "abc", 1, 2), wire("regex", "[a-c]+")),
        (FinalState("stop", "free text", 1, 2), None),
        (FinalState("error", "", 1, 0, error="sequence 7: token 5 at position 0 is rejected by the grammar"), PERSON),
    ],
)
def test_non_json_results_have_no_report(final: FinalState, constraint: dict[str, str] | None) -> None:
    result = build_result(final, constraint)
    assert result["json"] is None
    assert (result["finish_reason"], result["error"]) == (final.finish_reason, final.error)


def test_unknown_finish_reason_is_a_bug() -> None:
    with pytest.raises(ValueError, match=r"^finish_reason must be one of"):
        build_result(FinalState("done", "", 0, 0), None)


def test_the_schema_draft_is_honoured() -> None:
    """Draft-04 `dependencies` (decoding does not enforce it) is checked after decoding."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
              "dependencies": {"card": ["billing"]}}
    constraint = wire("json_schema", json.dumps(schema))
    report = build_result(FinalState("stop", '{"card":"1234"}', 1, 6), constraint)["json"]
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
    result = build_result(FinalState("stop", '{"d":"2024-01-02","u":[1]}', 1, 9, backend=backend), constraint)
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
        report = build_result(FinalState("stop", text, 1, 6), constraint)["json"]
        assert (report["valid"], report["unenforced"]) == (valid, [])
    assert len(walks) == 1


def test_finish_round_trip_and_errors_as_data() -> None:
    final = FinalState("error", "", 0, 0, error="max_tokens: must be in 1..1024, got 0", status="INVALID_ARGUMENT")
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
    result = build_result(FinalState("error", "", 0, 0, error="x" * 5000, status="INVALID_ARGUMENT"), None)
    assert result["error"] == "x" * MAX_ERROR_CHARS + "... (5000 characters)"


AGE = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}


@pytest.mark.parametrize(
    ("final", "failed"),
    [
        (FinalState("stop", '{"age": 3}', 1, 5), False),
        (FinalState("stop", '{"age": -3}', 1, 5), True),  # ended cleanly, yet invalid: not enforced
        (FinalState("length", '{"age": -3', 1, 5), False),  # truncated: nobody claims it is valid
        (FinalState("length", '{"age": -3}', 1, 5, close_reason="budget"), True),
        (FinalState("stop", '{"age": -3}', 1, 5, stop_string=True), False),  # cut by a stop string
    ],
)
def test_finished_output_labels(final: FinalState, failed: bool) -> None:
    constraint = wire("json_schema", json.dumps(AGE))
    out = result_of_finish(finish_json(final, constraint).encode())
    assert (out.finish_reason, out.kind, out.close_reason, out.postvalidation_failed) == (
        final.finish_reason, "json_schema", final.close_reason, failed)
