"""OpenAI's strict mode (``openai_api.strict.check_strict``): what it takes, and each refusal's field and reason."""

from __future__ import annotations

from typing import Any

import pytest

from openai_api.errors import BadRequest
from openai_api.strict import (
    LARGE_ENUM,
    MAX_DEPTH,
    MAX_ENUM_VALUES,
    MAX_LARGE_ENUM_CHARS,
    MAX_PROPERTIES,
    MAX_STRING_CHARS,
    check_strict,
)

P = "response_format.json_schema.schema"


def obj(**properties: Any) -> dict[str, Any]:
    """A strict object schema: every property required, nothing else allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


STRING = {"type": "string"}


def _nest(depth: int) -> dict[str, Any]:
    """``depth`` levels of strict objects, one inside the other."""
    schema = obj(leaf=STRING)
    for _ in range(depth - 1):
        schema = obj(x=schema)
    return schema


# OpenAI's own examples (Structured Outputs guide) and the shapes its clients send.
ACCEPTED = [
    obj(),
    obj(location=STRING, unit={"type": ["string", "null"], "enum": ["F", "C", None]}),
    obj(name={"type": "string", "description": "full name", "title": "Name"},
        age={"type": "integer", "minimum": 0, "maximum": 150},
        score={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.01},
        email={"type": "string", "format": "email"}, zip={"type": "string", "pattern": "^[0-9]{5}$"},
        tags={"type": "array", "items": STRING, "minItems": 1, "maxItems": 5},
        ok={"type": "boolean"}, kind={"const": "person"}, nothing={"type": "null"}),
    # anyOf below the root, each branch strict; $defs and a recursive $ref.
    obj(value={"anyOf": [STRING, {"type": "number"}, obj(column=STRING)]}),
    {**obj(root={"$ref": "#/$defs/node"}),
     "$defs": {"node": obj(value=STRING, children={"type": "array", "items": {"$ref": "#/$defs/node"}})}},
    {**obj(linked={"anyOf": [{"$ref": "#"}, {"type": "null"}]}, item={"$ref": "#/definitions/item"}),
     "definitions": {"item": obj(n={"type": "integer"})}},
    # The deepest nesting allowed.
    _nest(MAX_DEPTH),
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_accepted(schema: dict[str, Any]) -> None:
    check_strict(schema, P)


REFUSED = [
    # The root.
    ({"anyOf": [obj(), obj()]}, P, r"the root schema must not be anyOf$"),
    ({"type": "array", "items": STRING}, P, r"the root schema must be of type object, got 'array'$"),
    ({"properties": {}}, P, r"the root schema must be of type object, got None$"),
    # Every object closed, every property required.
    ({"type": "object", "properties": {"a": STRING}, "required": ["a"]}, f"{P}.additionalProperties",
     r"must be false for every object$"),
    ({**obj(a=STRING), "additionalProperties": True}, f"{P}.additionalProperties", r"must be false"),
    ({"type": "object", "properties": {"a": STRING, "b": STRING}, "required": ["a"], "additionalProperties": False},
     f"{P}.required", r"every property must be required; missing 'b' \(make a field optional"),
    ({**obj(a=STRING), "required": ["a", "c"]}, f"{P}.required", r"'c' is required but not among the properties$"),
    (obj(inner={"type": "object", "properties": {"x": STRING}, "additionalProperties": False}),
     f"{P}.properties.inner.required", r"every property must be required; missing 'x' "),
    (obj(items={"type": "array", "items": {"type": "object", "properties": {}}}),
     f"{P}.properties.items.items.additionalProperties", r"must be false"),
    (obj(v={"anyOf": [STRING, {"type": "object", "properties": {}, "required": []}]}),
     f"{P}.properties.v.anyOf[1].additionalProperties", r"must be false"),
    # Keywords outside the subset, named.
    (obj(a={"allOf": [STRING]}), f"{P}.properties.a.allOf", r"keyword 'allOf' is not supported$"),
    (obj(a={"type": "string", "not": {"const": "x"}}), f"{P}.properties.a.not", r"keyword 'not' is not supported$"),
    (obj(a={"type": "string", "minLength": 1}), f"{P}.properties.a.minLength", r"keyword 'minLength' is not"),
    ({**obj(a=STRING), "patternProperties": {"^x": STRING}}, f"{P}.patternProperties",
     r"keyword 'patternProperties' is not supported$"),
    ({**obj(a=STRING), "if": {}, "then": {}}, f"{P}.if", r"keyword 'if' is not supported$"),
    (obj(a={"type": "array", "items": STRING, "uniqueItems": True}), f"{P}.properties.a.uniqueItems",
     r"keyword 'uniqueItems' is not supported$"),
    # A keyword of another type: where the type does not admit it.
    (obj(a={"type": "integer", "pattern": "^1$"}), f"{P}.properties.a.pattern",
     r"keyword 'pattern' is only allowed with type string$"),
    (obj(a={"type": "string", "minItems": 1}), f"{P}.properties.a.minItems",
     r"keyword 'minItems' is only allowed with type array$"),
    (obj(a={"type": "string", "format": "uri"}), f"{P}.properties.a.format", r"format 'uri' is not supported; one of"),
    (obj(a={"type": "strin"}), f"{P}.properties.a.type", r"unknown type 'strin'$"),
    (obj(a={"type": []}), f"{P}.properties.a.type", r"must be a type name or a non-empty list of them$"),
    (obj(a={"description": "no type"}), f"{P}.properties.a", r"every schema needs a type"),
    (obj(a="string"), f"{P}.properties.a", r"must be a schema \(a JSON object\)$"),
    (obj(a={"anyOf": []}), f"{P}.properties.a.anyOf", r"must be a non-empty list of schemas$"),
    (obj(a={"type": "string", "enum": []}), f"{P}.properties.a.enum", r"must be a non-empty list$"),
    # References: the root's own definitions only.
    (obj(a={"$ref": "#/$defs/missing"}), f"{P}.properties.a.$ref", r"\$ref '#/\$defs/missing' names no definition$"),
    (obj(a={"$ref": "https://example.com/s.json"}), f"{P}.properties.a.$ref",
     r"\$ref must be '#' or point into the root's \$defs, got 'https://example\.com/s\.json'$"),
    (obj(a={**obj(), "$defs": {"x": STRING}}), f"{P}.properties.a", r"\$defs are taken at the root only$"),
    ({**obj(a={"$ref": "#/$defs/x"}), "$defs": {"x": {"type": "object", "properties": {}}}},
     f"{P}.$defs.x.additionalProperties", r"must be false"),
    ({**obj(), "$defs": {"x": "string"}}, f"{P}.$defs.x", r"must be a schema \(a JSON object\)$"),
    # Limits.
    (_nest(MAX_DEPTH + 1), P + ".properties.x" * MAX_DEPTH, rf"more than {MAX_DEPTH} levels of nested objects$"),
    (obj(**{f"p{i}": STRING for i in range(MAX_PROPERTIES + 1)}), P,
     rf"{MAX_PROPERTIES + 1} object properties; at most {MAX_PROPERTIES}$"),
    (obj(a={"type": "string", "enum": [f"v{i}" for i in range(MAX_ENUM_VALUES + 1)]}), P,
     rf"{MAX_ENUM_VALUES + 1} enum values; at most {MAX_ENUM_VALUES}$"),
    (obj(a={"type": "string", "enum": [f"{i:060d}" for i in range(LARGE_ENUM + 1)]}), f"{P}.properties.a.enum",
     (rf"an enum of more than {LARGE_ENUM} strings holds at most {MAX_LARGE_ENUM_CHARS} characters; got "
     rf"{LARGE_ENUM + 1} strings of {60 * (LARGE_ENUM + 1)}$")),
    (obj(a={"const": "x" * (MAX_STRING_CHARS + 1)}), P, rf"{MAX_STRING_CHARS + 2} characters of property names"),
]


@pytest.mark.parametrize(("schema", "param", "reason"), REFUSED)
def test_refused(schema: dict[str, Any], param: str, reason: str) -> None:
    with pytest.raises(BadRequest, match=rf"^{_escape(param)}: (strict mode: )?" + reason) as info:
        check_strict(schema, P)
    assert info.value.param == param
    assert (info.value.http_status, info.value.type) == (400, "invalid_request_error")


def _escape(param: str) -> str:
    return param.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]").replace("$", r"\$")


def test_limits_count_across_the_schema() -> None:
    """Two enums under the per-schema total each, over it together; names count toward the characters."""
    half = MAX_ENUM_VALUES // 2 + 1
    schema = obj(a={"type": "integer", "enum": list(range(half))}, b={"type": "integer", "enum": list(range(half))})
    with pytest.raises(BadRequest, match=rf"{2 * half} enum values; at most {MAX_ENUM_VALUES}$"):
        check_strict(schema, P)
    check_strict(obj(a={"type": "integer", "enum": list(range(MAX_ENUM_VALUES))}), P)
    names = obj(**{"n" * 60_000: STRING, "m" * 60_001: STRING})
    with pytest.raises(BadRequest, match=rf"120001 characters .*; at most {MAX_STRING_CHARS}$"):
        check_strict(names, P)
