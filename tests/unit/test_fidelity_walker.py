"""unenforced_keywords (grammar_backend.fidelity.walker): API details."""

from __future__ import annotations

from typing import Any

import pytest
import xgrammar as xgr

from grammar_backend.errors import ConstraintError
from grammar_backend.fidelity import (
    PostValidator,
    UnenforcedKeyword,
    unenforced_keywords,
)
from tests.unit.fidelity_harness import INT, STR, byte_compiler, compile_schema, decodes


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return byte_compiler()


# ------------------------------------------------------------------------------------
# unenforced_keywords: API details
# ------------------------------------------------------------------------------------


def test_unenforced_keywords_notes_and_order() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": STR, "uniqueItems": True},
            "when": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"},
            "a/b": {"type": "array", "contains": INT},
        },
        "required": ["tags", "zz"],
    }
    found = unenforced_keywords(schema, strict_mode=False)
    assert [(u.pointer, u.keyword) for u in found] == [
        ("/properties/a~1b/contains", "contains"),
        ("/properties/day/format", "format"),
        ("/properties/tags/uniqueItems", "uniqueItems"),
        ("/properties/when/format", "format"),
        ("/required/1", "required"),
    ]
    notes = {u.pointer: u.note for u in found}
    assert notes["/properties/when/format"].endswith("(the post-validator does not check it either)")
    assert notes["/properties/day/format"].endswith("(the post-validator checks it)")
    assert notes["/required/1"].startswith('required property "zz"')
    assert isinstance(found[0], UnenforcedKeyword)


def test_unenforced_keywords_walks_defs_and_nested_combinators() -> None:
    schema = {
        "$defs": {"u": {"type": "array", "uniqueItems": True}},
        "type": "object",
        "properties": {"x": {"anyOf": [{"$ref": "#/$defs/u"}, {"type": "object", "dependentRequired": {"a": ["b"]}}]}},
    }
    assert [(u.pointer, u.keyword) for u in unenforced_keywords(schema, strict_mode=True)] == [
        ("/$defs/u/uniqueItems", "uniqueItems"),
        ("/properties/x/anyOf/1/dependentRequired", "dependentRequired"),
    ]


def test_unenforced_keywords_remote_ref(compiler: xgr.GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}, "required": ["a"]}
    compiled = compile_schema(compiler, schema, False)
    assert [decodes(compiled, t) for t in ('{"a":1}', '{"a":"s"}', '{"a":[{}]}')] == [True, True, True]
    assert [(u.pointer, u.keyword) for u in unenforced_keywords(schema, strict_mode=False)] == [
        ("/properties/a/$ref", "$ref")
    ]


def test_boolean_schema_true() -> None:
    assert unenforced_keywords(True, strict_mode=False) == ()


@pytest.mark.parametrize(
    ("schema", "match"),
    [
        ({"type": "object", "properties": {"a": {"type": "text"}}},
         r"^grammar#/properties/a/type: not a valid JSON Schema"),
        ({"type": "string", "minLength": -1}, r"^grammar#/minLength: not a valid JSON Schema"),
        ({"type": "string", "pattern": "(?<n>a)"}, r"^grammar#/pattern: not a valid JSON Schema"),
        ([1, 2], r"^grammar: a JSON schema must be an object or a boolean, got list"),
    ],
)
def test_invalid_schema_is_a_constraint_error(schema: Any, match: str) -> None:
    with pytest.raises(ConstraintError, match=match):
        unenforced_keywords(schema, strict_mode=False)
    with pytest.raises(ConstraintError, match=match):
        PostValidator(schema)
