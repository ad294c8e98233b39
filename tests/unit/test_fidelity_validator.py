"""PostValidator, validator_for and validate_output (grammar_backend.fidelity.validator)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from grammar_backend.errors import ConfigError, ConstraintError
from grammar_backend.fidelity import (
    VALIDATOR_CACHE_SIZE,
    PostValidator,
    UnenforcedKeyword,
    ValidationReport,
    Violation,
    checked_formats,
    result_json,
    validate_output,
    validator_for,
)
from tests.unit.fidelity_harness import INT, LINKED, OBJ_A, STR, byte_compiler, compile_schema, decodes


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return byte_compiler()


# ------------------------------------------------------------------------------------
# PostValidator
# ------------------------------------------------------------------------------------

ITEMS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "a/b": STR,
        "m~n": INT,
    },
    "required": ["items"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "line 1 column 1: Expecting value"),
        ('{"items":[1,', "line 1 column 13: Expecting value"),
        ('{"items":[1],', "line 1 column 14: Expecting property name enclosed in double quotes"),
        ('{"items":[]}\n{"items":[]}', "line 2 column 1: Extra data"),
        ('{"items":["abc', "line 1 column 11: Unterminated string starting at"),
        ('{"items":[1,\n NaN]}', "line 2 column 2: NaN is not valid JSON"),
        ('{"a/b":"Infinity","items":[-Infinity]}', "line 1 column 28: -Infinity is not valid JSON"),
        ('{"items":[\n' + "9" * 5000 + "]}", "line 2 column 1: integer of 5000 digits is too long to parse"),
        (b'{"items":[],"a/b":"\xff"}', "line 1 column 20: invalid UTF-8 (invalid start byte)"),
    ],
)
def test_parse_errors_name_line_and_column(text: str | bytes, error: str) -> None:
    report = PostValidator(ITEMS_SCHEMA).validate_text(text)
    assert report == ValidationReport(False, error, None, (), False)


def test_violations_have_instance_pointers_sorted_numerically() -> None:
    items: list[Any] = [0] * 12
    items[2], items[10] = -1, "x"
    text = json.dumps({"items": items, "a/b": 1, "m~n": "s", "zz": 0}, separators=(",", ":"))
    report = PostValidator(ITEMS_SCHEMA).validate_text(text)
    assert (report.parsed, report.parse_error, report.valid, report.truncated) == (True, None, False, False)
    assert [(v.pointer, v.keyword, v.schema_pointer) for v in report.violations] == [
        ("", "additionalProperties", "/additionalProperties"),
        ("/a~1b", "type", "/properties/a~1b/type"),
        ("/items/2", "minimum", "/properties/items/items/minimum"),
        ("/items/10", "type", "/properties/items/items/type"),
        ("/m~0n", "type", "/properties/m~0n/type"),
    ]
    assert report.violations[2].message == "-1 is less than the minimum of 0"


def test_valid_output() -> None:
    report = PostValidator(ITEMS_SCHEMA).validate_text(' {"items":[1,2],"a/b":"x"}\n')
    assert report == ValidationReport(True, None, True, (), False)


def test_duplicate_keys_are_violations() -> None:
    report = PostValidator(ITEMS_SCHEMA).validate_text('{"items":[1],"items":[2],"a/b":"x"}')
    assert report.valid is False
    assert report.violations == (
        Violation("", 'duplicate key "items" (the last value is used)', "duplicate-key", ""),
    )
    nested = PostValidator({"type": "array"}).validate_text('[0,{"k":1,"k":2,"j":{"x":1,"x":1}}]')
    assert [(v.pointer, v.keyword) for v in nested.violations] == [("/1", "duplicate-key"), ("/1/j", "duplicate-key")]


def test_repeated_additional_keys_pass_decoding_and_are_flagged(compiler: xgr.GrammarCompiler) -> None:
    # xgrammar cannot prevent a repeated key among additional properties; a declared key is not repeated.
    compiled = compile_schema(compiler, OBJ_A, False)
    assert [decodes(compiled, t) for t in ('{"a":1,"b":2,"b":"x"}', '{"a":1,"a":2}')] == [True, False]
    report = PostValidator(OBJ_A).validate_text('{"a":1,"b":2,"b":"x"}')
    assert [(v.pointer, v.keyword) for v in report.violations] == [("", "duplicate-key")]


def test_installed_format_checkers() -> None:
    # An environment fact: jsonschema 4.26 without its "format" extras, and jsonpointer (requirements.txt).
    # If this changes (extras installed), the notes of unenforced_keywords change with it.
    assert checked_formats() == {"date", "email", "idn-email", "idn-hostname", "ipv4", "ipv6", "regex", "uuid",
                                 "json-pointer", "relative-json-pointer"}
    dates = PostValidator({"type": "string", "format": "date"})
    assert [v.keyword for v in dates.validate_instance("2024-02-30").violations] == ["format"]
    assert PostValidator({"type": "string", "format": "date-time"}).validate_instance("2024-02-30T00:00:00Z").valid


def test_max_violations_truncates() -> None:
    validator = PostValidator({"type": "array", "items": INT}, max_violations=2)
    report = validator.validate_instance(["a", "b", "c", "d"])
    assert (report.valid, report.truncated, [v.pointer for v in report.violations]) == (False, True, ["/0", "/1"])
    assert validator.validate_instance(["a", "b"]).truncated is False


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_violations_must_be_positive(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"^max_violations: must be a positive integer"):
        PostValidator({"type": "string"}, max_violations=bad)


def test_long_messages_are_cut() -> None:
    report = PostValidator({"anyOf": [STR, {"type": "null"}]}).validate_instance(list(range(1000)))
    (violation,) = report.violations
    assert len(violation.message) == 512 and violation.message.endswith("\u2026")


@pytest.mark.parametrize(
    ("schema", "match"),
    [
        ({"$ref": "https://example.com/s.json"}, r"^grammar#/\$ref: cannot resolve 'https://example.com/s.json'"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}},
         r"^grammar#/properties/a/\$ref: cannot resolve '#/\$defs/nope'"),
        ({"$ref": "other.json#/x"}, r"^grammar#/\$ref: cannot resolve 'other.json#/x'"),
    ],
)
def test_unresolvable_refs_fail_at_build_without_network(schema: Any, match: str) -> None:
    with pytest.raises(ConstraintError, match=match):
        PostValidator(schema)


def test_resolvable_refs_build() -> None:
    relative = {"$id": "https://example.com/root.json", "$defs": {"i": {"$id": "int.json", "type": "integer"}},
                "$ref": "int.json"}
    assert PostValidator(relative).validate_instance("a").valid is False
    meta = {"$ref": "https://json-schema.org/draft/2020-12/schema"}
    assert PostValidator(meta).validate_instance({"type": "string"}).valid is True
    assert PostValidator(LINKED).validate_text('{"v":1,"next":{"v":2,"next":null}}').valid is True


def test_validate_text_rejects_other_types() -> None:
    with pytest.raises(TypeError, match=r"^text: expected str or bytes, got int"):
        PostValidator(STR).validate_text(1)  # type: ignore[arg-type]


def test_validate_output_dispatch_and_cache() -> None:
    schema = {"type": "object", "properties": {"a": INT}, "required": ["a"]}
    same = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    assert validator_for(schema) is validator_for(same)
    assert validator_for(schema) is not validator_for({**schema, "maxProperties": 3})
    assert validate_output(schema, '{"a":1}').valid is True
    assert validate_output(schema, b'{"a":"x"}').valid is False
    assert validate_output(schema, {"a": 1}).valid is True
    assert validate_output(STR, "x").parsed is False  # a str is text to parse ...
    assert validator_for(STR).validate_instance("x").valid is True  # ... validate_instance takes the value


def test_validator_cache_is_bounded() -> None:
    first = validator_for({"type": "integer", "minimum": -1})
    for i in range(VALIDATOR_CACHE_SIZE):
        validator_for({"type": "integer", "minimum": i})
    assert validator_for({"type": "integer", "minimum": -1}) is not first


def test_result_json_matches_the_contract() -> None:
    report = PostValidator(ITEMS_SCHEMA).validate_text('{"items":[-1]}')
    unenforced = (UnenforcedKeyword("/x/uniqueItems", "uniqueItems", "note"),)
    assert result_json(report, unenforced) == {
        "parsed": True,
        "parse_error": None,
        "valid": False,
        "violations": [{"pointer": "/items/0", "message": "-1 is less than the minimum of 0"}],
        "unenforced": [{"pointer": "/x/uniqueItems", "keyword": "uniqueItems"}],
    }
    unparsed = PostValidator(ITEMS_SCHEMA).validate_text("{")
    assert result_json(unparsed, ())["valid"] is None
