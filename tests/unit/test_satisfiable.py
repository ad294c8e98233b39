"""The static emptiness check (grammar_backend.satisfiable): what it proves, and what it must never refuse."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema.validators
import pytest
from jsonschema import Draft202012Validator

from grammar_backend.errors import ConstraintError, InvalidArgument
from grammar_backend.satisfiable import MAX_DEPTH, MAX_NODES, check_satisfiable, unsatisfiable
from grammar_backend.spec import parse_constraint

#: A satisfiable-table entry without a witness instance.
NO_WITNESS: Any = object()
TAGS = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "uniqueItems": True}


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        ({}, 1),
        (True, "x"),
        ({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "uniqueItems": True}, ["a", "b"]),
        # Not required, so the object may leave it out.
        ({"type": "object", "properties": {"tags": TAGS}}, {}),
        # Required, but the root may be something else than an object.
        ({"properties": {"tags": TAGS}, "required": ["tags"]}, 7),
        ({"anyOf": [{"type": "string", "minLength": 3, "maxLength": 1}, {"type": "integer"}]}, 4),
        ({"oneOf": [False, {"const": 3}]}, 3),
        # A $ref cycle: the tree is satisfiable (its leaves need no children).
        ({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
          "$ref": "#/$defs/node"}, {"kids": [{}]}),
        # A loop of pure references: undecided (jsonschema itself recurses forever on it), so left alone.
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, NO_WITNESS),
        ({"not": {"type": "integer"}}, "x"),
        ({"not": {"not": True}}, 0),
        ({"type": "number", "minimum": 1, "maximum": 1}, 1),
        ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, 1.5),  # no integer, but 1.5
        ({"type": "integer", "minimum": 0.5, "maximum": 1.5}, 1),
        ({"type": "integer", "minimum": 5, "maximum": 7, "multipleOf": 3}, 6),
        ({"type": "integer", "minimum": 0.1, "maximum": 1.9, "multipleOf": 0.5}, 1),  # a fraction step: not examined
        ({"type": ["string", "null"], "minLength": 4, "maxLength": 2}, None),
        ({"enum": [1, "x"], "type": "string"}, "x"),
        ({"type": "object", "required": ["a"], "additionalProperties": False, "patternProperties": {"^a$": {}}},
         {"a": 1}),
        # Draft 7: a $ref overrides its siblings, so the contradiction beside it says nothing.
        ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"n": {"type": "integer"}},
          "$ref": "#/definitions/n", "minimum": 5, "maximum": 1}, 3),
        # Draft 4: const is no keyword there.
        ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "const": "x"}, 2),
        # An embedded resource's "#/..." is its own: not followed.
        # (Followed from the root, "#/$defs/z" would be false.)
        ({"$defs": {"z": False}, "type": "object", "required": ["r"],
          "properties": {"r": {"$id": "https://x.test/r", "$defs": {"z": {"type": "string"}}, "type": "object",
                               "properties": {"p": {"$ref": "#/$defs/z"}}, "required": ["p"]}}}, {"r": {"p": "s"}}),
        ({"if": {"type": "string"}, "then": False, "else": {"type": "integer"}}, 3),
        ({"type": "array", "contains": {"const": 1}, "minContains": 0, "maxContains": 0}, []),
        ({"type": "object", "required": ["a"], "propertyNames": {"maxLength": 3}}, {"a": 1}),
        # Enum membership is JSON equality: under draft 4, 1.0 lists the integer 1.
        ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "enum": [1.0]}, 1),
        # Draft 7: the $ref alone counts, not the enum beside it, so items have 3 values.
        ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"t": {"enum": [1, 2, 3]}},
          "type": "array", "uniqueItems": True, "minItems": 3, "items": {"$ref": "#/definitions/t", "enum": [1]}},
         [1, 2, 3]),
    ],
    ids=["empty", "true", "unique-enough", "optional", "root-may-be-other", "anyof-one-branch", "oneof-one-branch",
         "ref-tree", "ref-loop", "not-type", "not-not", "equal-bounds", "fraction-between", "integer-between",
         "multiple-in-range", "fraction-multiple", "nullable", "enum-kind", "pattern-allows", "draft7-ref-alone",
         "draft4-const", "embedded-id", "if-else", "contains-zero", "property-names", "draft4-integral-float",
         "draft7-ref-domain"],
)
def test_satisfiable_schemas_pass(schema: Any, instance: Any) -> None:
    assert unsatisfiable(schema) is None
    check_satisfiable(schema)
    if instance is NO_WITNESS:
        return
    # The table's own witness: the schema really admits it.
    cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator) if schema is not True \
        else Draft202012Validator
    assert cls(schema).is_valid(instance)


@pytest.mark.parametrize(
    ("schema", "pointer", "reason"),
    [
        ({"type": "object", "properties": {"tags": TAGS}, "required": ["tags"]}, "/properties/tags",
         "uniqueItems with minItems 3 but items allow only 2 values"),
        (False, "", "false admits no instance"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "", "minItems 3 exceeds maxItems 2"),
        ({"type": "string", "minLength": 5, "maxLength": 4}, "", "minLength 5 exceeds maxLength 4"),
        ({"type": "number", "minimum": 3, "maximum": 2}, "", "minimum 3 and maximum 2 leave no number"),
        ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "",
         "minimum 2 and exclusive maximum 2 leave no number"),
        ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 2,
          "exclusiveMinimum": True, "maximum": 2}, "", "exclusive minimum 2 and maximum 2 leave no number"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "",
         "exclusive minimum 1 and exclusive maximum 2 leave no integer"),
        ({"type": "integer", "minimum": 0.2, "maximum": 0.8}, "", "minimum 0.2 and maximum 0.8 leave no integer"),
        ({"type": "integer", "minimum": 4, "maximum": 5, "multipleOf": 3}, "",
         "minimum 4 and maximum 5 leave no multiple of 3"),
        ({"type": "object", "minProperties": 3, "maxProperties": 1}, "", "minProperties 3 exceeds maxProperties 1"),
        ({"type": "object", "required": ["a", "b", "a"], "maxProperties": 1}, "",
         "2 required properties but maxProperties 1"),
        ({"enum": []}, "/enum", "enum is empty"),
        ({"type": "string", "enum": [1, 2]}, "/enum", "no enum value satisfies the keywords beside it"),
        ({"type": "integer", "maximum": 3, "enum": [5, 7]}, "/enum", "no enum value satisfies the keywords beside it"),
        ({"type": ["integer", "null"], "const": "x"}, "/const", "no const satisfies the keywords beside it"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, "",
         "required property 'b' is forbidden by additionalProperties: false"),
        ({"type": "object", "required": ["b"], "additionalProperties": {"type": "string", "maxLength": 1, "minLength": 2}},
         "/additionalProperties", "minLength 2 exceeds maxLength 1"),
        ({"type": "object", "required": ["a"], "properties": {"a": False}}, "/properties/a", "false admits no instance"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "", "allOf members with contradictory types"),
        ({"allOf": [{"type": "string"}, {"minLength": 2, "maxLength": 1}]}, "/allOf/1",
         "minLength 2 exceeds maxLength 1"),
        ({"anyOf": [{"type": "string", "minLength": 2, "maxLength": 1}, False]}, "/anyOf",
         "no anyOf branch admits an instance"),
        ({"not": {}}, "/not", "not of a schema every value satisfies"),
        ({"type": "integer", "not": {"type": "number"}}, "/not", "not excludes type 'number'"),
        ({"$defs": {"e": {"enum": []}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/e"}},
          "required": ["x"]}, "/$defs/e/enum", "enum is empty"),
        ({"type": "array", "prefixItems": [{"type": "integer"}, False], "minItems": 2}, "/prefixItems/1",
         "false admits no instance"),
        ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "/items", "false admits no instance"),
        ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 3}, "",
         "uniqueItems with minItems 3 but items allow only 2 values"),
        ({"type": "array", "items": {"const": 0}, "uniqueItems": True, "minItems": 2}, "",
         "uniqueItems with minItems 2 but items allow only 1 value"),
        ({"type": "array", "contains": {"type": "string"}, "minContains": 3, "maxItems": 2}, "",
         "minContains needs 3 items but maxItems is 2"),
        ({"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 1}, "",
         "minContains 2 exceeds maxContains 1"),
        ({"type": "array", "contains": False}, "/contains", "false admits no instance"),
        ({"type": "object", "required": ["a"], "propertyNames": False}, "/propertyNames",
         "false admits no instance, and a property is needed"),
        ({"type": "object", "minProperties": 1, "propertyNames": {"type": "integer"}}, "/propertyNames",
         "propertyNames admits no string, and a property is needed"),
        ({"if": {"type": "string"}, "then": False, "else": False}, "", "neither then nor else admits an instance"),
        ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "null"}]}, "",
         "its types allow nothing in common"),
    ],
    ids=["unique-tags", "false", "items", "length", "range", "exclusive-max", "draft4-exclusive", "no-integer",
         "no-integer-fraction-bounds", "no-multiple", "properties", "required-count", "empty-enum", "enum-kind",
         "enum-bounds", "const-kind", "closed-object", "additional-empty", "required-false", "allof-types",
         "allof-member", "anyof-all", "not-everything", "not-own-type", "ref-target", "prefix-false", "items-false",
         "unique-booleans", "unique-const", "min-contains", "max-contains", "contains-false", "property-names",
         "property-names-type", "if-both", "anyof-types"],
)
def test_unsatisfiable_schemas_are_refused(schema: Any, pointer: str, reason: str) -> None:
    assert unsatisfiable(schema) == (pointer, reason)
    where = pointer or "the root"
    with pytest.raises(ConstraintError, match=f"^grammar: schema admits no instance at {re.escape(where)}: "
                                              f"{re.escape(reason)}$") as caught:
        check_satisfiable(schema)
    assert (caught.value.field, caught.value.status) == ("grammar", "INVALID_ARGUMENT")
    # And the refusal holds: the validator finds no instance among a few obvious candidates.
    cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator) if schema is not False \
        else Draft202012Validator
    candidates: list[Any] = [None, True, 0, 1, 2.5, "", "xx", [], [1, 2, 3], {}, {"a": 1, "b": 2, "x": ""},
                             ["a", "b", "c"], [True, False, True]]
    assert not any(cls(schema).is_valid(c) for c in candidates)


def test_parse_constraint_refuses_before_compile() -> None:
    schema = {"type": "object", "properties": {"tags": TAGS}, "required": ["tags"]}
    with pytest.raises(InvalidArgument, match=re.escape(
            "grammar: schema admits no instance at /properties/tags: uniqueItems with minItems 3 but items allow "
            "only 2 values")):
        parse_constraint("json_schema", json.dumps(schema))
    # Refused every time (the meta-schema memo keeps only schemas that passed).
    with pytest.raises(ConstraintError, match="admits no instance"):
        parse_constraint("json_schema", json.dumps(schema))
    assert parse_constraint("json_schema", json.dumps({"type": "object", "properties": {"tags": TAGS}})).schema


def test_draft3_is_not_reasoned_about() -> None:
    """Draft 3's ``required`` is a boolean inside the property: the check says nothing about such a schema."""
    schema = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "integer", "minimum": 3, "maximum": 2}
    assert unsatisfiable(schema) is None


@pytest.mark.parametrize(("length", "refused"), [(3, True), (MAX_DEPTH + 5, False)])
def test_ref_chains_are_followed_to_a_depth(length: int, refused: bool) -> None:
    """Past :data:`MAX_DEPTH` hops a location counts as satisfiable (as far as the check knows)."""
    schema: dict[str, Any] = {"$defs": {f"n{i}": {"$ref": f"#/$defs/n{i + 1}"} for i in range(length)}}
    schema["$defs"][f"n{length}"] = False
    schema["$ref"] = "#/$defs/n0"
    assert unsatisfiable(schema) == ((f"/$defs/n{length}", "false admits no instance") if refused else None)


@pytest.mark.parametrize(("branches", "refused"), [(10, True), (MAX_NODES + 1, False)])
def test_the_walk_examines_a_bounded_number_of_locations(branches: int, refused: bool) -> None:
    schema = {"anyOf": [False] * branches}
    assert (unsatisfiable(schema) is not None) is refused
