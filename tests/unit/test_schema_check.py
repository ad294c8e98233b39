"""The meta-schema check of :mod:`contract.schema_check`, and the client and server paths that share it.

Each bad schema gets the same pointer and reason from the contract function,
the client builder (:meth:`client.Constraint.json_schema`, field ``schema``)
and the server (:func:`grammar_backend.spec.parse_constraint`, field ``grammar``).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
from jsonschema.exceptions import SchemaError

from client.constraints import Constraint
from client.errors import InvalidConstraint
from contract import ContractError, schema_check
from grammar_backend.errors import ConstraintError
from grammar_backend.spec import check_schema as server_check_schema
from grammar_backend.spec import parse_constraint

DRAFT_04 = "http://json-schema.org/draft-04/schema#"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"
PREFIX = "not a valid JSON Schema: "
LONG_TYPES = ["string"] * 300
LONG_MESSAGE = f"{LONG_TYPES!r} is not valid under any of the given schemas"

#: (schema, pointer, reason): what every path must answer.
BAD_SCHEMAS: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "strin"}, "/type", "'strin' is not valid under any of the given schemas"),
    ({"properties": {"a": {"minLength": -1}}}, "/properties/a/minLength", "-1 is less than the minimum of 0"),
    # RFC 6901 escapes: the client used to write "/properties/a/b~c/minLength".
    ({"properties": {"a/b~c": {"minLength": -1}}}, "/properties/a~1b~0c/minLength", "-1 is less than the minimum of 0"),
    ({"required": [1]}, "/required/0", "1 is not of type 'string'"),
    ({"enum": "x"}, "/enum", "'x' is not of type 'array'"),
    ({"minimum": "1"}, "/minimum", "'1' is not of type 'number'"),
    ({"$defs": {"x": {"maxItems": 1.5}}}, "/$defs/x/maxItems", "1.5 is not of type 'integer'"),
    # The schema's own draft ($schema), not 2020-12: draft 4's exclusiveMinimum is a boolean.
    ({"$schema": DRAFT_04, "exclusiveMinimum": 5}, "/exclusiveMinimum", "5 is not of type 'boolean'"),
    ({"$schema": DRAFT_07, "additionalItems": {"minLength": -1}}, "/additionalItems/minLength",
     "-1 is less than the minimum of 0"),
    ({"$schema": DRAFT_07, "items": [{"type": 5}]}, "/items", "[{'type': 5}] is not valid under any of the given schemas"),
    # jsonschema's message, cut to MAX_MESSAGE_CHARS with an ellipsis.
    ({"type": LONG_TYPES}, "/type", LONG_MESSAGE[: schema_check.MAX_MESSAGE_CHARS - 1] + "\u2026"),
]
IDS = ["type", "nested", "escaped", "required-item", "enum", "minimum", "defs", "draft4", "draft7-nested",
       "draft7-items", "long-message"]


def _contract(schema: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ContractError) as info:
        schema_check.check_schema(schema, "grammar")
    return info.value.field, info.value.reason


def _contract_cached(schema: dict[str, Any]) -> tuple[str, str]:
    schema_check._check_text.cache_clear()
    for _ in range(2):  # a refusal is never cached: the same answer again
        with pytest.raises(ContractError) as info:
            schema_check.check_schema(schema, "grammar", cached=True)
    assert schema_check._check_text.cache_info().currsize == 0
    return info.value.field, info.value.reason


def _client(schema: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(InvalidConstraint) as info:
        Constraint.json_schema(schema)
    assert isinstance(info.value.__cause__, ContractError)
    assert info.value.field is not None
    return info.value.field.replace("schema#", "grammar#", 1), info.value.reason


def _server(schema: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ConstraintError) as info:
        parse_constraint("json_schema", json.dumps(schema))
    assert isinstance(info.value.__cause__, ContractError)
    return info.value.field, info.value.reason


PATHS: dict[str, Callable[[dict[str, Any]], tuple[str, str]]] = {
    "contract": _contract, "contract-cached": _contract_cached, "client": _client, "server": _server,
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(("schema", "pointer", "reason"), BAD_SCHEMAS, ids=IDS)
def test_every_path_refuses_with_the_same_pointer_and_reason(
    path: str, schema: dict[str, Any], pointer: str, reason: str
) -> None:
    assert PATHS[path](schema) == (f"grammar#{pointer}", PREFIX + reason)


@pytest.mark.parametrize(
    ("field_name", "field"),
    [
        ("grammar", "grammar#/type"),
        ("tags[1].schema", "tags[1].schema#/type"),
        # Already a pointer (a schema embedded in a structural tag): the pointer goes on.
        ("grammar#/format/json_schema", "grammar#/format/json_schema/type"),
    ],
)
def test_the_pointer_goes_after_the_field(field_name: str, field: str) -> None:
    with pytest.raises(ContractError, match=f"^{re.escape(field)}: not a valid JSON Schema: 3 is not valid") as info:
        schema_check.check_schema({"type": 3}, field_name)
    assert info.value.field == field


def test_the_pointer_is_the_absolute_path() -> None:
    # An error from a parent's context (an anyOf branch): its ``path`` is relative to the parent.
    parent = SchemaError("parent", path=deque(["properties", "a"]))
    child = SchemaError("3 is not valid", path=deque(["type"]), parent=parent)
    assert list(child.path) == ["type"]
    assert schema_check.schema_error_field("grammar", child) == "grammar#/properties/a/type"
    assert schema_check.schema_error_reason(child) == "not a valid JSON Schema: 3 is not valid"


@pytest.mark.parametrize(
    ("schema", "allow_bool", "reason"),
    [
        ([1], False, "a JSON schema must be an object, got list"),
        (True, False, "a JSON schema must be an object, got bool"),
        ("{}", True, "a JSON schema must be an object or a boolean, got str"),
    ],
)
def test_a_schema_that_is_not_an_object_is_refused(schema: Any, allow_bool: bool, reason: str) -> None:
    with pytest.raises(ContractError, match=f"^grammar: {reason}$"):
        schema_check.check_schema(schema, "grammar", allow_bool=allow_bool)
    with pytest.raises(ConstraintError, match=f"^grammar: {reason}$"):
        server_check_schema(schema, "grammar", allow_bool=allow_bool)


@pytest.mark.parametrize("schema", [{}, {"type": "object"}, True, False, {"$schema": DRAFT_04, "minimum": 1}])
def test_valid_schemas_pass(schema: Any) -> None:
    schema_check.check_schema(schema, "grammar", allow_bool=True)
    server_check_schema(schema, "grammar", allow_bool=True)


def test_a_passed_schema_is_cached_by_its_canonical_text() -> None:
    schema_check._check_text.cache_clear()
    schema_check.check_schema({"type": "object", "minProperties": 1}, "schema", cached=True)
    schema_check.check_schema({"minProperties": 1, "type": "object"}, "schema", cached=True)
    schema_check.check_schema({"type": "object", "minProperties": 1}, "schema")  # uncached: not counted
    info = schema_check._check_text.cache_info()
    assert (info.misses, info.hits, info.currsize, info.maxsize) == (1, 1, 1, schema_check.CHECKED_MAX)
    assert (schema_check.CHECKED_MAX, schema_check.CHECKED_MAX_CHARS) == (256, 65_536)
