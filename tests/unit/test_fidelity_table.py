"""Observed schema fidelity of xgrammar 0.2.9 and the post-validator.

Every case in ``CASES`` compiles a schema with a real ``xgrammar.GrammarCompiler``
(a 257-token vocabulary: the 256 single bytes plus a stop token) with the engine's
options, then feeds each instance to a ``GrammarMatcher`` one byte-token at a time
followed by the stop token.  Each case states:

* ``valid`` instances (valid under JSON Schema, checked here): xgrammar must accept them;
* ``invalid`` instances (invalid under JSON Schema, checked here): xgrammar must reject all
  of them when ``enforced`` is true, and accept all of them when it is false;
* ``reported``: exactly what :func:`unenforced_keywords` must return.

So the fidelity table in ``grammar_backend.fidelity`` is driven by these observations; when
xgrammar changes, these tests fail first.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import xgrammar as xgr
from jsonschema import Draft202012Validator

from grammar_backend.errors import ConstraintError
from grammar_backend.fidelity import (
    KEYWORD_TABLE,
    REFUSED_CONSTRUCTS,
    XGRAMMAR_VERSION_MEASURED,
    Enforcement,
    PostValidator,
    UnenforcedKeyword,
    checked_formats,
    unenforced_keywords,
)
from tests.unit.fidelity_harness import BOOL, INT, LINKED, OBJ_A, STOP, STR, byte_compiler, compile_schema, decodes


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return byte_compiler()


# ------------------------------------------------------------------------------------
# Ground truth for formats the installed jsonschema does not check
# ------------------------------------------------------------------------------------


def _rfc3339_datetime(s: str) -> bool:
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", s):
        return False
    try:
        dt.datetime.fromisoformat(s)
    except ValueError:
        return False
    return True


def _rfc3339_time(s: str) -> bool:
    m = re.fullmatch(r"(\d\d):(\d\d):(\d\d)(\.\d+)?(Z|[+-](\d\d):(\d\d))", s)
    if not m:
        return False
    h, mi, sec = int(m[1]), int(m[2]), int(m[3])
    off_ok = m[5] == "Z" or (int(m[6]) < 24 and int(m[7]) < 60)
    return h < 24 and mi < 60 and sec <= 60 and off_ok


def _hostname(s: str) -> bool:
    labels = s.split(".")
    return len(s) <= 253 and all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", x) for x in labels)


_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*:"
# Ground truth checked in addition to jsonschema (whose email check is only "contains @").
_EXTRA_ORACLES: dict[str, Callable[[str], bool]] = {
    "email": lambda s: re.fullmatch(r"[^@\s]+@[^@\s]+", s) is not None,
}
_ORACLES: dict[str, Callable[[str], bool]] = {
    "date-time": _rfc3339_datetime,
    "time": _rfc3339_time,
    "hostname": _hostname,
    "uri": lambda s: re.fullmatch(_SCHEME + r"[^\s\\{}<>\"^`|]*", s) is not None,
    "uri-reference": lambda s: re.fullmatch(r"([^\s\\{}<>\"^`|%]|%[0-9A-Fa-f]{2})*", s) is not None,
    "iri": lambda s: re.fullmatch(_SCHEME + r"\S*", s) is not None,
    "iri-reference": lambda s: re.fullmatch(r"[^\s\\]*", s) is not None,
    "uri-template": lambda s: re.fullmatch(r"([^{}]|\{[A-Za-z0-9_,.:*]+\})*", s) is not None,
    "json-pointer": lambda s: re.fullmatch(r"(/([^~/]|~[01])*)*", s) is not None,
    "relative-json-pointer": lambda s: re.fullmatch(r"(0|[1-9][0-9]*)(#|(/([^~/]|~[01])*)*)", s) is not None,
    "duration": lambda s: re.fullmatch(
        r"P((\d+Y(\d+M(\d+D)?)?|\d+M(\d+D)?|\d+D)(T(\d+H(\d+M(\d+S)?)?|\d+M(\d+S)?|\d+S))?"
        r"|T(\d+H(\d+M(\d+S)?)?|\d+M(\d+S)?|\d+S)|\d+W)",
        s,
    )
    is not None,
}


def truly_valid(schema: Any, text: str) -> bool:
    """JSON Schema verdict: jsonschema with its format checker, plus an RFC oracle for the
    formats the installed jsonschema does not check (``checked_formats``)."""
    instance = json.loads(text)
    if not PostValidator(schema).validate_instance(instance).valid:
        return False
    fmt = schema.get("format") if isinstance(schema, Mapping) else None
    if isinstance(fmt, str) and isinstance(instance, str):
        if fmt not in checked_formats() and fmt in _ORACLES:
            return _ORACLES[fmt](instance)
        if fmt in _EXTRA_ORACLES:
            return _EXTRA_ORACLES[fmt](instance)
    return True


# ------------------------------------------------------------------------------------
# The observation table
# ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    rows: tuple[str, ...]  # KEYWORD_TABLE rows this case is evidence for (() = a general rule)
    schema: Any
    valid: tuple[str, ...]
    invalid: tuple[str, ...]
    enforced: bool
    reported: frozenset[tuple[str, str]]
    strict: bool = False


def case(
    id: str,
    rows: str | tuple[str, ...],
    schema: Any,
    valid: list[str],
    invalid: list[str],
    *,
    enforced: bool,
    reported: list[tuple[str, str]] | None = None,
    strict: bool = False,
) -> Case:
    return Case(
        id,
        (rows,) if isinstance(rows, str) else rows,
        schema,
        tuple(valid),
        tuple(invalid),
        enforced,
        frozenset(reported or []),
        strict,
    )



CASES: list[Case] = [
    # --- type / const / enum -----------------------------------------------------------
    case("type_string", "type", STR, ['"a"'], ["1", "null"], enforced=True),
    case("type_list", "type", {"type": ["integer", "null"]}, ["1", "null"], ['"a"', "1.5"], enforced=True),
    case("const_string", "const", {"const": "x"}, ['"x"'], ['"y"'], enforced=True),
    case("const_object", "const", {"const": {"a": [1, 2]}}, ['{"a":[1,2]}'], ['{"a":[1]}'], enforced=True),
    case("enum_mixed", "enum", {"enum": ["a", 1, None]}, ['"a"', "1", "null"], ['"b"', "2"], enforced=True),
    case("enum_objects", "enum", {"enum": [{"a": 1}, [1, 2]]}, ['{"a":1}', "[1,2]"], ['{"a":2}'], enforced=True),
    case("enum_type_ok", "enum", {"type": "string", "enum": ["a", "b"]}, ['"a"'], ['"c"'], enforced=True),
    case("precedence_const_over_enum", "const", {"const": 1, "enum": [1, 2]}, ["1"], ["2"], enforced=True),
    case("precedence_enum_over_anyof", "enum", {"enum": [1, 2], "anyOf": [INT, STR]}, ["1"], ["3", '"a"'],
         enforced=True),
    # Siblings of const/enum are ignored; reported only when a listed value violates one.
    case("const_sibling_maxlength", (), {"type": "string", "const": "abc", "maxLength": 2}, [], ['"abc"'],
         enforced=False, reported=[("/maxLength", "maxLength")]),
    case("enum_sibling_type", (), {"type": "integer", "enum": [1, "a"]}, ["1"], ['"a"'],
         enforced=False, reported=[("/type", "type")]),
    case("enum_sibling_minimum", (), {"type": "integer", "enum": [1, 5, 10], "minimum": 5}, ["5"], ["1"],
         enforced=False, reported=[("/minimum", "minimum")]),
    case("const_nested_ref_sibling", (),
         {"$defs": {"p": INT}, "const": {"a": "x"}, "properties": {"a": {"$ref": "#/$defs/p"}}},
         [], ['{"a":"x"}'], enforced=False, reported=[("/properties", "properties")]),
    # --- $ref / $dynamicRef -------------------------------------------------------------
    case("ref_recursion", "$ref", LINKED, ['{"v":1,"next":{"v":2,"next":null}}'],
         ['{"v":1,"next":{"v":"x","next":null}}'], enforced=True),
    case("ref_root", "$ref",
         {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}, "required": ["c"],
          "additionalProperties": False},
         ['{"c":[{"c":[]}]}'], ['{"c":[1]}'], enforced=True),
    case("ref_definitions", "$ref", {"definitions": {"i": INT}, "type": "array", "items": {"$ref": "#/definitions/i"}},
         ["[1]"], ['["a"]'], enforced=True),
    case("ref_pointer_escape", "$ref", {"$defs": {"a/b": INT}, "$ref": "#/$defs/a~1b"}, ["1"], ['"a"'],
         enforced=True),
    case("ref_sibling_annotations", "$ref", {"$defs": {"i": INT}, "$ref": "#/$defs/i", "description": "d",
                                             "title": "t"}, ["1"], ['"a"'], enforced=True),
    case("ref_anchor", "$ref", {"$defs": {"i": {"$anchor": "intish", "type": "integer"}}, "$ref": "#intish"},
         ["1"], ['"a"'], enforced=False, reported=[("/$ref", "$ref")]),
    case("ref_relative_id", "$ref",
         {"$id": "https://example.com/root.json", "$defs": {"i": {"$id": "int.json", "type": "integer"}},
          "$ref": "int.json"},
         ["1"], ['"a"'], enforced=False, reported=[("/$ref", "$ref")]),
    case("ref_sibling_minimum", (), {"$defs": {"i": INT}, "$ref": "#/$defs/i", "minimum": 5}, ["5"], ["3"],
         enforced=False, reported=[("/minimum", "minimum")]),
    case("ref_sibling_properties", (),
         {"$defs": {"o": {"type": "object", "properties": {"a": INT}, "required": ["a"]}}, "$ref": "#/$defs/o",
          "properties": {"b": STR}, "required": ["b"]},
         ['{"a":1,"b":"x"}'], ['{"a":1}'], enforced=False,
         reported=[("/properties", "properties"), ("/required", "required")]),
    case("ref_target_outside_walked_keywords", "$ref",
         {"type": "object", "properties": {"a": {"$ref": "#/x-defs/u"}},
          "x-defs": {"u": {"type": "array", "items": INT, "uniqueItems": True}}},
         ['{"a":[1]}'], ['{"a":[1,1]}'], enforced=False, reported=[("/x-defs/u/uniqueItems", "uniqueItems")]),
    case("precedence_ref_over_enum", (), {"$defs": {"i": INT}, "$ref": "#/$defs/i", "enum": [1, 2]}, ["1"], ["3"],
         enforced=False, reported=[("/enum", "enum")]),
    case("dynamic_ref", "$dynamicRef", {"$defs": {"i": {"$dynamicAnchor": "n", "type": "integer"}},
                                        "$dynamicRef": "#n"},
         ["1"], ['"a"'], enforced=False, reported=[("/$dynamicRef", "$dynamicRef")]),
    # --- anyOf / oneOf / allOf ----------------------------------------------------------
    case("anyof_types", "anyOf", {"anyOf": [INT, STR]}, ["1", '"a"'], ["true"], enforced=True),
    case("anyof_sibling_minimum", (),
         {"type": "integer", "minimum": 0, "anyOf": [{"type": "integer", "maximum": 5},
                                                     {"type": "integer", "minimum": 10}]},
         ["3", "12"], ["-1"], enforced=False, reported=[("/type", "type"), ("/minimum", "minimum")]),
    case("anyof_untyped_arms", (), {"type": "integer", "minimum": 0, "anyOf": [{"maximum": 5}, {"minimum": 10}]},
         ["3", "12"], ["7", "-1", '"a"'], enforced=False,
         reported=[("/type", "type"), ("/minimum", "minimum"), ("/anyOf/0/maximum", "maximum"),
                   ("/anyOf/1/minimum", "minimum")]),
    case("precedence_anyof_over_oneof", (), {"anyOf": [INT], "oneOf": [STR, {"type": "null"}]}, [], ["1"],
         enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_disjoint_types", "oneOf", {"oneOf": [INT, STR]}, ["1", '"a"'], ["true"], enforced=True),
    case("oneof_disjoint_type_lists", "oneOf", {"oneOf": [{"type": ["integer", "null"]}, STR]},
         ["1", "null", '"a"'], ["true"], enforced=True),
    case("oneof_disjoint_consts", "oneOf", {"oneOf": [{"const": "a"}, {"const": "b"}]}, ['"a"'], ['"c"'],
         enforced=True),
    case("oneof_const_vs_other_type", "oneOf", {"oneOf": [{"const": 1}, STR]}, ["1", '"a"'], ["2"], enforced=True),
    case("oneof_fraction_vs_integer", "oneOf", {"oneOf": [{"enum": [1.5]}, INT]}, ["1.5", "2"], ["2.5"],
         enforced=True),
    case("oneof_whole_float_vs_integer", "oneOf", {"oneOf": [{"enum": [2.0]}, INT]}, ["1"], ["2"],
         enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_discriminator", "oneOf",
         {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}, "v": INT}, "required": ["k"]},
                    {"type": "object", "properties": {"k": {"const": "y"}, "v": STR}, "required": ["k"]}]},
         ['{"k":"x","v":1}', '{"k":"y","v":"s"}'], ['{"k":"x","v":"s"}', '{"k":"z"}'], enforced=True),
    case("oneof_single_arm", "oneOf", {"oneOf": [{"type": "object"}]}, ["{}"], ["1"], enforced=True),
    case("oneof_int_number", "oneOf", {"oneOf": [INT, {"type": "number"}]}, ["1.5"], ["1"],
         enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_enum_overlap", "oneOf", {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}, ['"a"'], ['"b"'],
         enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_one_and_one_point_zero", "oneOf", {"oneOf": [{"const": 1}, {"const": 1.0}]}, [], ["1"],
         enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_const_vs_same_type", "oneOf", {"oneOf": [{"const": "a"}, STR]}, ['"b"'], ['"a"'],
         enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_objects_overlap", "oneOf",
         {"oneOf": [{"type": "object", "properties": {"a": INT}}, {"type": "object", "properties": {"b": INT}}]},
         ['{"a":1,"b":"x"}'], ["{}"], enforced=False, reported=[("/oneOf", "oneOf")]),
    case("oneof_sibling_minimum", (), {"type": "integer", "minimum": 0, "oneOf": [{"type": "integer", "maximum": 5},
                                                                                  STR]},
         ["3"], ["-1"], enforced=False, reported=[("/type", "type"), ("/minimum", "minimum")]),
    case("oneof_required_idiom", (),
         {"type": "object", "properties": {"l": INT, "r": INT}, "additionalProperties": False,
          "oneOf": [{"required": ["l"]}, {"required": ["r"]}]},
         ['{"l":1}', '{"r":1}'], ['{"l":1,"r":2}', "{}"], enforced=False,
         reported=[("/type", "type"), ("/properties", "properties"), ("/additionalProperties", "additionalProperties"),
                   ("/oneOf/0/required", "required"), ("/oneOf/1/required", "required"), ("/oneOf", "oneOf")]),
    case("allof_single", "allOf", {"allOf": [{"type": "integer", "minimum": 3}]}, ["3"], ["2", '"a"'],
         enforced=True),
    case("allof_single_ref", "allOf",
         {"$defs": {"o": {"type": "object", "properties": {"a": INT}, "required": ["a"]}},
          "allOf": [{"$ref": "#/$defs/o"}], "description": "x"},
         ['{"a":1}'], ["{}"], enforced=True),
    case("allof2_int_min", "allOf", {"allOf": [INT, {"minimum": 3}]}, ["3"], ["2", '"a"', '{"x":[1]}'],
         enforced=False, reported=[("/allOf", "allOf")]),
    case("allof2_objects", "allOf",
         {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                    {"type": "object", "properties": {"b": STR}, "required": ["b"]}]},
         ['{"a":1,"b":"x"}'], ['{"a":1}', '{"b":"x"}', "[1]"], enforced=False, reported=[("/allOf", "allOf")]),
    case("allof2_with_siblings", (), {"type": "integer", "allOf": [{"minimum": 3}, {"maximum": 5}]}, ["3"],
         ["2", "6", '"a"'], enforced=False, reported=[("/type", "type"), ("/allOf", "allOf")]),
    case("allof1_sibling_minimum", (), {"type": "integer", "minimum": 5, "allOf": [{"type": "integer",
                                                                                    "maximum": 10}]},
         ["7"], ["3"], enforced=False, reported=[("/type", "type"), ("/minimum", "minimum")]),
    # --- not / if ---------------------------------------------------------------------
    case("not_const", "not", {"type": "integer", "not": {"const": 3}}, ["4"], ["3"], enforced=False,
         reported=[("/not", "not")]),
    case("not_type", "not", {"type": ["integer", "string"], "not": STR}, ["4"], ['"s"'], enforced=False,
         reported=[("/not", "not")]),
    case("if_then_else", ("if", "then", "else"),
         {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}, "else": {"maximum": 0}},
         ["12", "-3"], ["5", "11"], enforced=False, reported=[("/if", "if"), ("/then", "then"), ("/else", "else")]),
    # --- objects ----------------------------------------------------------------------
    case("properties_types", "properties", OBJ_A, ['{"a":1}', "{}"], ['{"a":"s"}'], enforced=True),
    case("required_declared", "required", {**OBJ_A, "required": ["a"]}, ['{"a":1}', '{"a":1,"z":2}'],
         ["{}", '{"z":2}'], enforced=True),
    case("required_undeclared", "required", {**OBJ_A, "required": ["z"]}, ['{"a":1,"z":1}'], ['{"a":1}'],
         enforced=False, reported=[("/required/0", "required")]),
    case("required_undeclared_strict", "required", {**OBJ_A, "required": ["z"]}, [], ['{"a":1}'],
         enforced=False, reported=[("/required/0", "required")], strict=True),
    case("required_with_pattern_properties", "required",
         {"type": "object", "patternProperties": {"^x.*$": INT}, "required": ["x1"]}, ['{"x1":1}'], ["{}"],
         enforced=False, reported=[("/required/0", "required")]),
    case("additional_false", "additionalProperties", {**OBJ_A, "additionalProperties": False}, ['{"a":1}'],
         ['{"a":1,"b":2}'], enforced=True),
    case("additional_schema", "additionalProperties", {**OBJ_A, "additionalProperties": STR},
         ['{"a":1,"b":"x"}'], ['{"a":1,"b":2}'], enforced=True),
    case("pattern_properties", "patternProperties",
         {"type": "object", "patternProperties": {"^x_.*$": INT}, "additionalProperties": False},
         ['{"x_a":1}'], ['{"x_a":"s"}', '{"y":1}'], enforced=True),
    case("pattern_properties_with_properties", "patternProperties",
         {"type": "object", "properties": {"a": INT}, "patternProperties": {"^x_.*$": STR},
          "additionalProperties": False},
         ['{"a":1,"x_q":"s"}'], ['{"a":1,"x_q":1}'], enforced=True),
    case("property_names_pattern", "propertyNames",
         {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": INT},
         ['{"ab":1}'], ['{"AB":1}'], enforced=True),
    case("property_names_max_length", "propertyNames", {"type": "object", "propertyNames": {"maxLength": 2}},
         ['{"ab":1}'], ['{"abc":1}'], enforced=True),
    case("property_names_enum", "propertyNames", {"type": "object", "propertyNames": {"enum": ["a", "b"]}},
         ['{"a":1}'], ['{"c":1}'], enforced=True),
    case("property_names_declared", "propertyNames",
         {"type": "object", "properties": {"Z": INT}, "propertyNames": {"pattern": "^[a-z]+$"}},
         ['{"a":1}'], ['{"Z":1}'], enforced=False, reported=[("/propertyNames", "propertyNames")]),
    case("property_names_reopen_declared", ("properties", "propertyNames"),
         {"type": "object", "properties": {"a": INT}, "propertyNames": {"maxLength": 1}}, ['{"a":1}', '{"b":"s"}'],
         ['{"a":"s"}'], enforced=False, reported=[("/properties", "properties")]),
    case("property_names_empty_reopens_declared", "properties",
         {"type": "object", "properties": {"a": INT}, "propertyNames": {}}, ['{"a":1}'], ['{"a":"s"}'],
         enforced=False, reported=[("/properties", "properties")]),
    case("property_names_required_duplicate", "properties",
         {"type": "object", "properties": {"a": INT}, "required": ["a"], "propertyNames": {"maxLength": 1}},
         ['{"a":1}'], ['{"a":1,"a":"s"}'], enforced=False, reported=[("/properties", "properties")]),
    case("property_names_additional_schema_reopens", "properties",
         {"type": "object", "properties": {"a": STR}, "additionalProperties": INT, "propertyNames": {"maxLength": 1}},
         ['{"a":"s"}', '{"b":1}'], ['{"a":5}'], enforced=False, reported=[("/properties", "properties")]),
    case("property_names_unmatched_declared", "propertyNames",
         {"type": "object", "properties": {"abc": INT}, "propertyNames": {"maxLength": 1}}, ["{}"], ['{"abc":1}'],
         enforced=False, reported=[("/propertyNames", "propertyNames")]),
    case("property_names_closed_by_strict", ("properties", "propertyNames"),
         {"type": "object", "properties": {"a": INT}, "propertyNames": {"maxLength": 1}}, ['{"a":1}'],
         ['{"a":"s"}', '{"ab":1}'], enforced=True, strict=True),
    case("property_names_with_additional_false", ("properties", "additionalProperties"),
         {"type": "object", "properties": {"a": INT}, "propertyNames": {"maxLength": 1},
          "additionalProperties": False},
         ['{"a":1}'], ['{"a":"s"}', '{"b":1}'], enforced=True),
    case("property_names_with_pattern_properties", "patternProperties",
         {"type": "object", "patternProperties": {"^x.*$": BOOL}, "propertyNames": {"maxLength": 1},
          "additionalProperties": INT},
         ['{"x":true}'], ['{"x":0}', '{"a":true}'], enforced=True, reported=[("/propertyNames", "propertyNames")]),
    case("property_names_ignored_with_pattern_properties", "propertyNames",
         {"type": "object", "patternProperties": {"^x.*$": BOOL}, "propertyNames": {"maxLength": 1}},
         ['{"x":true}'], ['{"xy":true}'], enforced=False, reported=[("/propertyNames", "propertyNames")]),
    case("pattern_properties_open_with_properties", ("patternProperties", "properties"),
         {"type": "object", "properties": {"a": STR}, "patternProperties": {"^x_.*$": BOOL}},
         ['{"a":"s","x_q":true}', '{"b":1}'], ['{"x_q":1}', '{"a":true}'], enforced=False,
         reported=[("/patternProperties", "patternProperties"), ("/properties", "properties")]),
    case("pattern_properties_open_additional_schema", "patternProperties",
         {"type": "object", "properties": {"a": STR}, "patternProperties": {"^x_.*$": BOOL},
          "additionalProperties": INT},
         ['{"a":"s","x_q":true,"b":1}'], ['{"x_q":1}', '{"a":1}'], enforced=False,
         reported=[("/patternProperties", "patternProperties"), ("/properties", "properties")]),
    case("pattern_properties_closed_by_strict", "patternProperties",
         {"type": "object", "properties": {"a": STR}, "patternProperties": {"^x_.*$": BOOL}},
         ['{"a":"s","x_q":true}'], ['{"x_q":1}', '{"a":true}'], enforced=True, strict=True),
    case("pattern_properties_overlap_declared", "patternProperties",
         {"type": "object", "properties": {"x_a": STR}, "patternProperties": {"^x_.*$": BOOL},
          "additionalProperties": False},
         ["{}"], ['{"x_a":true}', '{"x_a":"s"}'], enforced=False,
         reported=[("/patternProperties", "patternProperties")]),
    case("unevaluated_with_pattern_and_properties", "unevaluatedProperties",
         {"type": "object", "properties": {"a": INT}, "patternProperties": {"^x.*$": INT},
          "unevaluatedProperties": False},
         ['{"a":1,"x1":2}'], ['{"a":1,"b":2}'], enforced=False,
         reported=[("/patternProperties", "patternProperties"), ("/properties", "properties"),
                   ("/unevaluatedProperties", "unevaluatedProperties")]),
    case("property_names_ignore_additional_false", "additionalProperties",
         {"type": "object", "propertyNames": {"maxLength": 1}, "additionalProperties": False}, ["{}"], ['{"a":1}'],
         enforced=False, reported=[("/additionalProperties", "additionalProperties")]),
    case("property_names_ignore_additional_false_strict", "additionalProperties",
         {"type": "object", "propertyNames": {"maxLength": 1}, "additionalProperties": False}, ["{}"], ['{"a":1}'],
         enforced=False, reported=[("/additionalProperties", "additionalProperties")], strict=True),
    case("property_names_ignore_unevaluated_false_strict", "unevaluatedProperties",
         {"type": "object", "propertyNames": {"maxLength": 1}, "unevaluatedProperties": False}, ["{}"],
         ['{"a":1}'], enforced=False, reported=[("/unevaluatedProperties", "unevaluatedProperties")], strict=True),
    case("min_properties", "minProperties",
         {"type": "object", "additionalProperties": INT, "minProperties": 2}, ['{"a":1,"b":2}'], ['{"a":1}'],
         enforced=True),
    case("min_properties_declared", "minProperties",
         {"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 1}, ['{"a":1}'], ["{}"],
         enforced=True),
    case("max_properties", "maxProperties",
         {"type": "object", "additionalProperties": INT, "maxProperties": 1}, ['{"a":1}'], ['{"a":1,"b":2}'],
         enforced=True),
    case("dependent_required", "dependentRequired",
         {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
         ['{"a":1,"b":2}'], ['{"a":1}'], enforced=False, reported=[("/dependentRequired", "dependentRequired")]),
    case("dependent_schemas", "dependentSchemas",
         {"type": "object", "properties": {"a": INT, "b": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
         ['{"a":1,"b":2}'], ['{"a":1}'], enforced=False, reported=[("/dependentSchemas", "dependentSchemas")]),
    # draft-07's form of both (WashingtonPost wp_37 of maskbench-dev: xgrammar accepted an instance it breaks).
    case("dependencies", "dependencies",
         {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
          "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
         ['{"a":1,"b":2}'], ['{"a":1}'], enforced=False, reported=[("/dependencies", "dependencies")]),
    case("unevaluated_schema", "unevaluatedProperties", {**OBJ_A, "unevaluatedProperties": STR},
         ['{"a":1,"b":"s"}'], ['{"a":1,"b":2}'], enforced=True),
    case("unevaluated_false_strict", "unevaluatedProperties", {**OBJ_A, "unevaluatedProperties": False},
         ['{"a":1}'], ['{"a":1,"b":2}'], enforced=True, strict=True),
    case("unevaluated_with_pattern_properties", "unevaluatedProperties",
         {"type": "object", "patternProperties": {"^x.*$": INT}, "unevaluatedProperties": False},
         ['{"x1":1}'], ['{"x1":1,"y":2}'], enforced=True),
    case("unevaluated_with_additional_true", "unevaluatedProperties",
         {**OBJ_A, "additionalProperties": True, "unevaluatedProperties": False}, ['{"a":1,"b":2}'], ['{"a":"s"}'],
         enforced=True),
    case("unevaluated_false", "unevaluatedProperties", {**OBJ_A, "unevaluatedProperties": False}, ['{"a":1}'],
         ['{"a":1,"b":2}'], enforced=False, reported=[("/unevaluatedProperties", "unevaluatedProperties")]),
    case("unevaluated_false_bare", "unevaluatedProperties", {"type": "object", "unevaluatedProperties": False},
         ["{}"], ['{"a":1}'], enforced=False, reported=[("/unevaluatedProperties", "unevaluatedProperties")]),
    # --- arrays -----------------------------------------------------------------------
    case("items_schema", "items", {"type": "array", "items": INT}, ["[1]", "[]"], ['["a"]', "{}"], enforced=True),
    case("items_false", "items", {"type": "array", "prefixItems": [INT], "items": False}, ["[1]"], ["[1,2]"],
         enforced=True),
    case("prefix_items", "prefixItems", {"type": "array", "prefixItems": [INT, STR], "items": False},
         ['[1,"a"]'], ['["a",1]', '[1,"a",2]'], enforced=True),
    case("unevaluated_items_false", "unevaluatedItems",
         {"type": "array", "prefixItems": [INT], "unevaluatedItems": False}, ["[1]"], ["[1,2]"], enforced=True),
    case("unevaluated_items_schema", "unevaluatedItems",
         {"type": "array", "prefixItems": [INT], "unevaluatedItems": STR}, ['[1,"a"]'], ["[1,2]"], enforced=True),
    case("min_items", "minItems", {"type": "array", "items": INT, "minItems": 2}, ["[1,2]"], ["[1]"],
         enforced=True),
    case("max_items", "maxItems", {"type": "array", "items": INT, "maxItems": 2}, ["[1,2]"], ["[1,2,3]"],
         enforced=True),
    case("prefix_items_max_items", "maxItems", {"type": "array", "prefixItems": [INT], "items": STR, "maxItems": 2},
         ['[1,"a"]'], ['[1,"a","b"]', '["a"]'], enforced=True),
    case("unique_items", "uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, ["[1,2]"], ["[1,1]"],
         enforced=False, reported=[("/uniqueItems", "uniqueItems")]),
    case("unique_items_strict", "uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, ["[1,2]"],
         ["[1,1]"], enforced=False, reported=[("/uniqueItems", "uniqueItems")], strict=True),
    case("contains", "contains", {"type": "array", "items": INT, "contains": {"const": 5}}, ["[5]"], ["[1]"],
         enforced=False, reported=[("/contains", "contains")]),
    case("min_contains", "minContains", {"type": "array", "items": INT, "contains": {"const": 5}, "minContains": 2},
         ["[5,5]"], ["[5,1]"], enforced=False, reported=[("/contains", "contains"), ("/minContains", "minContains")]),
    case("max_contains", "maxContains", {"type": "array", "items": INT, "contains": {"const": 5}, "maxContains": 1},
         ["[5,1]"], ["[5,5]"], enforced=False, reported=[("/contains", "contains"), ("/maxContains", "maxContains")]),
    # --- strings ----------------------------------------------------------------------
    case("min_length", "minLength", {"type": "string", "minLength": 3}, ['"abc"'], ['"ab"'], enforced=True),
    case("max_length", "maxLength", {"type": "string", "maxLength": 3}, ['"abc"'], ['"abcd"'], enforced=True),
    case("length_code_points", ("minLength", "maxLength"), {"type": "string", "minLength": 2, "maxLength": 2},
         ['"\u00e9\u00e9"'], ['"\u00e9"', '"\u00e9\u00e9\u00e9"'], enforced=True),
    case("pattern_min_length", "minLength", {"type": "string", "pattern": "^[a-c]+$", "minLength": 3},
         ['"abc"'], ['"ab"'], enforced=False, reported=[("/minLength", "minLength")]),
    case("pattern_max_length", "maxLength", {"type": "string", "pattern": "^[a-c]+$", "maxLength": 3},
         ['"abc"'], ['"abca"'], enforced=False, reported=[("/maxLength", "maxLength")]),
    case("format_max_length", "maxLength", {"type": "string", "format": "uuid", "maxLength": 10},
         [], ['"123e4567-e89b-12d3-a456-426614174000"'], enforced=False, reported=[("/maxLength", "maxLength")]),
    case("pattern_anchored", "pattern", {"type": "string", "pattern": "^[a-c]+$"}, ['"abc"'], ['"abd"'],
         enforced=True),
    case("pattern_escapes_quote", "pattern", {"type": "string", "pattern": "^[^x]+$"}, ['"ab"'], ['"axb"'],
         enforced=True),
    case("pattern_escaped_paren", "pattern", {"type": "string", "pattern": "^\\(?=$"}, ['"(="', '"="'], ['"a"'],
         enforced=True),
    case("pattern_lookahead_in_class", "pattern", {"type": "string", "pattern": "^[(?=]+$"}, ['"(?="'], ['"a"'],
         enforced=True),
    case("pattern_lookahead", "pattern", {"type": "string", "pattern": "^(?=.*[A-Z]).{3,}$"}, ['"Abc"'], ['"abc"'],
         enforced=False, reported=[("/pattern", "pattern")]),
    case("pattern_negative_lookahead", "pattern", {"type": "string", "pattern": "^(?!a)[a-z]$"}, ['"b"'], ['"a"'],
         enforced=False, reported=[("/pattern", "pattern")]),
    # --- format -----------------------------------------------------------------------
    case("format_date_time", "format", {"type": "string", "format": "date-time"},
         ['"2024-01-02T03:04:05Z"', '"2024-01-02T03:04:05.123+01:00"'],
         ['"2024-13-02T03:04:05Z"', '"2024-01-02T24:04:05Z"', '"2024-01-02T03:04:05"'],
         enforced=True, reported=[("/format", "format")]),
    case("format_date_time_calendar", "format", {"type": "string", "format": "date-time"},
         ['"2024-02-29T00:00:00Z"'], ['"2024-02-30T00:00:00Z"', '"2023-02-29T00:00:00Z"'],
         enforced=False, reported=[("/format", "format")]),
    case("format_date", "format", {"type": "string", "format": "date"}, ['"2024-01-02"'],
         ['"2024-13-45"', '"2024-01-32"', '"2024-1-02"'], enforced=True, reported=[("/format", "format")]),
    case("format_date_calendar", "format", {"type": "string", "format": "date"}, ['"2024-02-29"'],
         ['"2024-02-30"', '"2023-02-29"', '"2024-06-31"'], enforced=False, reported=[("/format", "format")]),
    case("format_time", "format", {"type": "string", "format": "time"}, ['"03:04:05Z"', '"23:59:59+01:00"'],
         ['"25:04:05Z"', '"03:04:05"', '"23:60:00Z"', '"23:59:59+01:60"'], enforced=True),
    case("format_email", "format", {"type": "string", "format": "email"}, ['"a.b+c@d-e.fg"'],
         ['"not-an-email"', '"a@"', '"@b.c"'], enforced=True),
    case("format_uri", "format", {"type": "string", "format": "uri"}, ['"https://x.org/a?b#c"', '"urn:isbn:1"'],
         ['"not a uri"', '"/relative"', '"http://exa mple.com"'], enforced=True),
    case("format_uri_reference", "format", {"type": "string", "format": "uri-reference"}, ['"/a/b"', '"#f"'],
         ['"a b"', '"%zz"'], enforced=True),
    case("format_uri_template", "format", {"type": "string", "format": "uri-template"}, ['"/a/{b}"'],
         ['"/a/{"', '"/}"'], enforced=True),
    case("format_uuid", "format", {"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'],
         ['"123e4567"', '"g23e4567-e89b-12d3-a456-426614174000"'], enforced=True),
    case("format_ipv4", "format", {"type": "string", "format": "ipv4"}, ['"1.2.3.4"', '"255.255.255.255"'],
         ['"1.2.3.999"', '"1.2.3"'], enforced=True, reported=[("/format", "format")]),
    case("format_ipv4_leading_zero", "format", {"type": "string", "format": "ipv4"}, ['"1.2.3.4"'],
         ['"01.2.3.4"'], enforced=False, reported=[("/format", "format")]),
    case("format_ipv6", "format", {"type": "string", "format": "ipv6"}, ['"::1"', '"2001:db8::1"'],
         ['"::g"', '"1::2::3"', '"1:2:3:4:5:6:7:8:9"'], enforced=True),
    case("format_hostname", "format", {"type": "string", "format": "hostname"}, ['"a.b.com"'],
         ['"-bad-"', '"a..b"', '"a_b.com"'], enforced=True, reported=[("/format", "format")]),
    case("format_hostname_long_label", "format", {"type": "string", "format": "hostname"}, ['"a.com"'],
         ['"' + "a" * 64 + '.com"', '"' + ".".join(["a" * 63] * 4) + '.com"'],
         enforced=False, reported=[("/format", "format")]),
    case("format_duration", "format", {"type": "string", "format": "duration"}, ['"P1Y2M3DT4H5M6S"', '"P1W"'],
         ['"1D"', '"P"', '"PT"', '"P1Y1W"'], enforced=True),
    case("format_json_pointer", "format", {"type": "string", "format": "json-pointer"}, ['"/a~0b"', '""'],
         ['"a"', '"/a~2"'], enforced=True),
    case("format_relative_json_pointer", "format", {"type": "string", "format": "relative-json-pointer"},
         ['"0/a"', '"1#"'], ['"/a"', '"01"'], enforced=True),
    case("format_idn_email", "format", {"type": "string", "format": "idn-email"}, ['"a@b.co"'], ['"nope"'],
         enforced=False, reported=[("/format", "format")]),
    case("format_idn_hostname", "format", {"type": "string", "format": "idn-hostname"}, ['"a.com"'], ['"-x-"'],
         enforced=False, reported=[("/format", "format")]),
    case("format_iri", "format", {"type": "string", "format": "iri"}, ['"https://x.org"'], ['"nope"'],
         enforced=False, reported=[("/format", "format")]),
    case("format_iri_reference", "format", {"type": "string", "format": "iri-reference"}, ['"/a"'], ['"a\\\\b"'],
         enforced=False, reported=[("/format", "format")]),
    case("format_regex", "format", {"type": "string", "format": "regex"}, ['"a+"'], ['"("'],
         enforced=False, reported=[("/format", "format")]),
    case("pattern_with_format", "pattern", {"type": "string", "format": "uuid", "pattern": "^0.*$"},
         ['"023e4567-e89b-12d3-a456-426614174000"'], ['"123e4567-e89b-12d3-a456-426614174000"'],
         enforced=False, reported=[("/pattern", "pattern")]),
    case("pattern_with_unsupported_format", "pattern", {"type": "string", "format": "made-up", "pattern": "^a+$"},
         ['"a"'], ['"b"'], enforced=True),
    case("pattern_with_unenforced_format", ("pattern", "format"),
         {"type": "string", "format": "idn-email", "pattern": "^.+@.+$"}, ['"a@b"'], ['"ab"'], enforced=True,
         reported=[("/format", "format")]),
    case("max_length_with_unsupported_format", "maxLength", {"type": "string", "format": "made-up", "maxLength": 1},
         ['"a"'], ['"aa"'], enforced=True),
    case("format_unknown", (), {"type": "string", "format": "made-up"}, ['"x"'], [], enforced=True),
    case("format_on_integer", (), {"type": "integer", "format": "int32"}, ["1"], ['"1"'], enforced=True),
    # --- numbers ----------------------------------------------------------------------
    case("minimum", "minimum", {"type": "integer", "minimum": 5}, ["5"], ["4"], enforced=True),
    case("maximum", "maximum", {"type": "integer", "maximum": 5}, ["5"], ["6"], enforced=True),
    case("exclusive_minimum", "exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, ["6"], ["5"],
         enforced=True),
    case("exclusive_maximum", "exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 5}, ["4"], ["5"],
         enforced=True),
    case("minimum_number", "minimum", {"type": "number", "minimum": 1.5}, ["1.5", "20.25"], ["1.4", "-1E1"],
         enforced=True),
    case("maximum_number_exponent", "maximum", {"type": "number", "maximum": 5}, ["5", "4.9", "-0.5"],
         ["1e1", "6E0", "5.1"], enforced=True),
    case("exclusive_minimum_number", "exclusiveMinimum", {"type": "number", "exclusiveMinimum": 1.5}, ["1.6"],
         ["1.5"], enforced=True),
    case("exclusive_maximum_number", "exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, ["1.4"],
         ["1.5"], enforced=True),
    case("multipleof_integer", "multipleOf", {"type": "integer", "multipleOf": 3}, ["6", "-6", "0"], ["7", "-7"],
         enforced=True),
    case("multipleof_whole_float", "multipleOf", {"type": "integer", "multipleOf": 3.0}, ["6"], ["7"],
         enforced=True),
    case("multipleof_type_list", "multipleOf", {"type": ["integer", "null"], "multipleOf": 3}, ["6", "null"],
         ["7"], enforced=True),
    case("multipleof_1024", "multipleOf", {"type": "integer", "multipleOf": 1024}, ["2048"], ["2049"],
         enforced=True),
    case("multipleof_range", "multipleOf", {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100},
         ["99"], ["98", "102"], enforced=True),
    case("multipleof_range_10000", "multipleOf",
         {"type": "integer", "multipleOf": 3, "minimum": -5000, "maximum": 4999}, ["-4998"], ["-4999"],
         enforced=True),
    case("multipleof_exclusive", "multipleOf",
         {"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "exclusiveMaximum": 10001}, ["5"], ["6", "0"],
         enforced=True),
    case("multipleof_1025", "multipleOf", {"type": "integer", "multipleOf": 1025}, ["2050"], ["2051"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    case("multipleof_range_10001", "multipleOf",
         {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000}, ["9999"], ["9998"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    case("multipleof_min_only", "multipleOf", {"type": "integer", "multipleOf": 3, "minimum": 0}, ["9"], ["10"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    case("multipleof_max_only", "multipleOf", {"type": "integer", "multipleOf": 3, "maximum": 0}, ["-9"], ["-10"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    case("multipleof_fraction_integer", "multipleOf", {"type": "integer", "multipleOf": 2.5}, ["5"], ["4"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    case("multipleof_number", "multipleOf", {"type": "number", "multipleOf": 0.5}, ["1.5"], ["1.3"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    case("multipleof_whole_number", "multipleOf", {"type": "number", "multipleOf": 2}, ["4"], ["3"],
         enforced=False, reported=[("/multipleOf", "multipleOf")]),
    # --- subschemas without "type" ----------------------------------------------------
    case("untyped_properties", (), {"properties": {"a": INT}, "required": ["a"]}, ['{"a":1}'], ['{"a":"s"}'],
         enforced=True),
    case("untyped_additional_properties", (), {"additionalProperties": False}, ["{}"], ['{"a":1}'],
         enforced=True),
    case("untyped_items", (), {"items": INT}, ["[1]"], ['["a"]'], enforced=True),
    case("untyped_minimum", (), {"minimum": 5}, ["5", '"a"'], ["3"], enforced=False,
         reported=[("/minimum", "minimum")]),
    case("untyped_min_length", (), {"minLength": 2}, ['"ab"', "1"], ['"a"'], enforced=False,
         reported=[("/minLength", "minLength")]),
    case("untyped_pattern", (), {"pattern": "^a$"}, ['"a"'], ['"b"'], enforced=False,
         reported=[("/pattern", "pattern")]),
    case("untyped_format", (), {"format": "date"}, ['"2024-01-01"', "1"], ['"x"'], enforced=False,
         reported=[("/format", "format")]),
    case("untyped_required", (), {"required": ["a"]}, ['{"a":1}', "1"], ["{}"], enforced=False,
         reported=[("/required", "required")]),
    case("untyped_min_items", (), {"minItems": 1}, ["[1]"], ["[]"], enforced=False,
         reported=[("/minItems", "minItems")]),
    case("untyped_property_minimum", (), {"type": "object", "properties": {"age": {"minimum": 0}}},
         ['{"age":1}'], ['{"age":-1}'], enforced=False, reported=[("/properties/age/minimum", "minimum")]),
]


def _ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


def test_case_ids_are_unique() -> None:
    assert len(set(_ids(CASES))) == len(CASES)


def test_measured_version_is_installed() -> None:
    # The table describes one xgrammar release; a different one must be re-measured.
    assert importlib.metadata.version("xgrammar") == XGRAMMAR_VERSION_MEASURED


@pytest.mark.parametrize("c", CASES, ids=_ids(CASES))
def test_instances_have_the_stated_json_schema_verdict(c: Case) -> None:
    """Ground truth: each 'valid' instance is valid and each 'invalid' one invalid."""
    assert [truly_valid(c.schema, t) for t in c.valid] == [True] * len(c.valid)
    assert [truly_valid(c.schema, t) for t in c.invalid] == [False] * len(c.invalid)


@pytest.mark.parametrize("c", CASES, ids=_ids(CASES))
def test_xgrammar_observed_behaviour(compiler: xgr.GrammarCompiler, c: Case) -> None:
    compiled = compile_schema(compiler, c.schema, c.strict)
    assert [decodes(compiled, t) for t in c.valid] == [True] * len(c.valid)
    # enforced: every invalid instance is rejected; not enforced: every one gets through.
    assert [decodes(compiled, t) for t in c.invalid] == [not c.enforced] * len(c.invalid)


@pytest.mark.parametrize("c", CASES, ids=_ids(CASES))
def test_unenforced_keywords_report_exactly_the_observations(c: Case) -> None:
    found = unenforced_keywords(c.schema, strict_mode=c.strict)
    assert {(u.pointer, u.keyword) for u in found} == c.reported
    assert PostValidator(c.schema).unenforced(strict_mode=c.strict) == found
    if not c.enforced:
        assert found, "an unenforced case must be reported"


def test_byte_tokens_and_accept_string_agree(compiler: xgr.GrammarCompiler) -> None:
    compiled = compile_schema(compiler, LINKED, False)
    for text, expected in [('{"v":1,"next":null}', True), ('{"v":1,"next":{"v":"x","next":null}}', False)]:
        matcher = xgr.GrammarMatcher(compiled)
        by_string = matcher.accept_string(text) and matcher.accept_token(STOP) and matcher.is_terminated()
        assert (decodes(compiled, text), by_string) == (expected, expected)


# ------------------------------------------------------------------------------------
# The keyword table agrees with the observations
# ------------------------------------------------------------------------------------


def test_keyword_table_covers_every_draft_2020_12_assertion_keyword() -> None:
    # then/else and minContains/maxContains are evaluated inside the "if" and "contains" validators;
    # dependencies is draft-07's (a schema naming that draft is validated by it: fidelity.walker._root_validator).
    extra = {"then", "else", "minContains", "maxContains", "dependencies"}
    assert set(KEYWORD_TABLE) == set(Draft202012Validator.VALIDATORS) | extra


def test_siblings_without_their_anchor_keyword_are_not_reported() -> None:
    # then/else without if and minContains without contains can never fail.
    schema = {"anyOf": [INT], "then": {"minimum": 3}, "minContains": 2, "if": True}
    assert [(u.pointer, u.keyword) for u in unenforced_keywords(schema, strict_mode=False)] == [
        ("/if", "if"),
        ("/then", "then"),
    ]
    assert unenforced_keywords({"anyOf": [INT], "else": {"minimum": 3}}, strict_mode=False) == ()
    assert all(row.keyword == key for key, row in KEYWORD_TABLE.items())


@pytest.mark.parametrize("keyword", sorted(KEYWORD_TABLE))
def test_keyword_table_row_matches_observed_cases(keyword: str) -> None:
    observed = {c.enforced for c in CASES if keyword in c.rows}
    expected = {
        Enforcement.ENFORCED: {True},
        Enforcement.NOT_ENFORCED: {False},
        Enforcement.CONDITIONAL: {True, False},
    }[KEYWORD_TABLE[keyword].enforcement]
    assert observed == expected


# ------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("construct", REFUSED_CONSTRUCTS, ids=[r.name for r in REFUSED_CONSTRUCTS])
def test_refused_constructs_raise_at_compile_time(compiler: xgr.GrammarCompiler, construct: Any) -> None:
    with pytest.raises(RuntimeError, match=re.escape(construct.message)):
        compile_schema(compiler, json.loads(construct.schema), False)


def test_strict_mode_refuses_min_properties_above_declared(compiler: xgr.GrammarCompiler) -> None:
    schema = {"type": "object", "minProperties": 1}
    compiled = compile_schema(compiler, schema, False)
    assert decodes(compiled, '{"a":1}')
    with pytest.raises(RuntimeError, match="minProperties is greater than the number of properties"):
        compile_schema(compiler, schema, True)


# ------------------------------------------------------------------------------------
# strict_mode, exactly
# ------------------------------------------------------------------------------------

STRICT_TABLE = [
    # (id, schema, text, accepted with strict_mode=False, accepted with strict_mode=True)
    ("props_declared_only", OBJ_A, '{"a":1}', True, True),
    ("props_extra", OBJ_A, '{"a":1,"b":2}', True, False),
    ("props_empty_object", OBJ_A, "{}", True, True),
    ("props_additional_false", {**OBJ_A, "additionalProperties": False}, '{"a":1,"b":2}', False, False),
    ("props_additional_true", {**OBJ_A, "additionalProperties": True}, '{"a":1,"b":2}', True, True),
    ("props_additional_empty", {**OBJ_A, "additionalProperties": {}}, '{"a":1,"b":2}', True, True),
    ("props_additional_schema_ok", {**OBJ_A, "additionalProperties": STR}, '{"a":1,"b":"x"}', True, True),
    ("props_additional_schema_bad", {**OBJ_A, "additionalProperties": STR}, '{"a":1,"b":2}', False, False),
    ("empty_properties", {"type": "object", "properties": {}}, '{"a":1}', True, False),
    ("required_only", {"type": "object", "required": ["a"]}, '{"a":1}', True, False),
    ("bare_object", {"type": "object"}, '{"a":1}', True, True),
    ("bare_object_additional_true", {"type": "object", "additionalProperties": True}, '{"a":1}', True, True),
    ("unevaluated_false", {**OBJ_A, "unevaluatedProperties": False}, '{"a":1,"b":2}', True, False),
    ("unevaluated_false_bare", {"type": "object", "unevaluatedProperties": False}, '{"a":1}', True, False),
    ("unevaluated_true", {**OBJ_A, "unevaluatedProperties": True}, '{"a":1,"b":2}', True, True),
    ("prefix_items_extra", {"type": "array", "prefixItems": [INT]}, "[1,2]", True, False),
    ("prefix_items_exact", {"type": "array", "prefixItems": [INT]}, "[1]", True, True),
    ("prefix_items_items_true", {"type": "array", "prefixItems": [INT], "items": True}, "[1,2]", True, True),
    ("bare_array", {"type": "array"}, '[1,"a"]', True, True),
]


@pytest.mark.parametrize(("schema", "text", "loose", "strict"), [r[1:] for r in STRICT_TABLE],
                         ids=[r[0] for r in STRICT_TABLE])
def test_strict_mode_closes_only_what_is_observed(
    compiler: xgr.GrammarCompiler, schema: Any, text: str, loose: bool, strict: bool
) -> None:
    observed = (decodes(compile_schema(compiler, schema, False), text),
                decodes(compile_schema(compiler, schema, True), text))
    assert observed == (loose, strict)


def test_non_strict_honours_additional_properties_of_the_schema(compiler: xgr.GrammarCompiler) -> None:
    # strict_mode=False: the grammar agrees with jsonschema on additionalProperties, both ways.
    for addl in (False, True, {}, STR, INT):
        schema = {**OBJ_A, "additionalProperties": addl}
        compiled = compile_schema(compiler, schema, False)
        for text in ('{"a":1}', '{"a":1,"b":2}', '{"a":1,"b":"x"}'):
            assert decodes(compiled, text) == truly_valid(schema, text), (addl, text)


# ------------------------------------------------------------------------------------
# Soundness on generated schemas: whatever xgrammar lets through is reported
# ------------------------------------------------------------------------------------

_GEN_STRINGS = ["", "a", "ab", "abc", "A", "2024-01-02", "x_a", "1.2.3.4", "a@b.co", "aaaa"]
_GEN_KEYS = ["a", "b", "z", "x_a"]


class _Generator:
    """Small random schemas and instances over a vocabulary chosen to collide often."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def value(self, depth: int = 0) -> Any:
        r = self.r.random()
        if depth >= 2 or r < 0.5:
            return self.r.choice([None, True, False, self.r.randint(-3, 12), self.r.choice([0.5, 2.0, -1.25]),
                                  self.r.choice(_GEN_STRINGS)])
        if r < 0.75:
            return [self.value(depth + 1) for _ in range(self.r.randint(0, 3))]
        return {k: self.value(depth + 1) for k in self.r.sample(_GEN_KEYS, self.r.randint(0, 3))}

    def schema(self, depth: int = 0) -> dict[str, Any]:
        r, maybe = self.r, lambda p: self.r.random() < p
        t = r.choice(["integer", "number", "string", "array", "object", "boolean", "null", None])
        s: dict[str, Any] = {}
        if t:
            s["type"] = t if maybe(0.85) else [t, r.choice(["null", "string", "integer"])]
        x = r.random()
        if depth < 2 and x < 0.12:
            s[r.choice(["anyOf", "oneOf", "allOf"])] = [self.schema(depth + 1) for _ in range(r.randint(1, 3))]
        if x > 0.95:
            s["const"] = self.value(1)
        elif x > 0.9:
            s["enum"] = [self.value(1) for _ in range(r.randint(1, 3))]
        options: list[tuple[str, float, Any]] = []
        if t in ("integer", "number", None):
            options += [("minimum", 0.3, r.randint(-2, 5)), ("maximum", 0.3, r.randint(3, 10)),
                        ("exclusiveMinimum", 0.2, r.randint(-2, 2)), ("multipleOf", 0.2, r.choice([2, 3, 0.5]))]
        if t in ("string", None):
            options += [("minLength", 0.3, r.randint(0, 2)), ("maxLength", 0.3, r.randint(2, 4)),
                        ("pattern", 0.2, r.choice(["^a+$", "^[a-c]*$", "a", "^(?!b).*$"])),
                        ("format", 0.2, r.choice(["date", "email", "ipv4", "uuid", "idn-email", "made"]))]
        for key, p, v in options:
            if maybe(p):
                s[key] = v
        makers: list[tuple[str, float, Callable[[], Any]]] = []
        if t in ("array", None) and depth < 2:
            makers += [
                ("items", 0.5, lambda: self.schema(depth + 1)),
                ("prefixItems", 0.2, lambda: [self.schema(depth + 1)]),
                ("minItems", 0.2, lambda: r.randint(0, 2)), ("maxItems", 0.2, lambda: r.randint(2, 3)),
                ("uniqueItems", 0.2, lambda: True), ("contains", 0.1, lambda: self.schema(depth + 1)),
                ("unevaluatedItems", 0.1, lambda: False),
            ]
        if t in ("object", None) and depth < 2:
            makers += [
                ("properties", 0.6, lambda: {k: self.schema(depth + 1) for k in r.sample(_GEN_KEYS, r.randint(0, 3))}),
                ("required", 0.5, lambda: r.sample(_GEN_KEYS, r.randint(0, 2))),
                ("additionalProperties", 0.3, lambda: r.choice([False, True, INT])),
                ("patternProperties", 0.1, lambda: {"^x_.*$": self.schema(depth + 1)}),
                ("propertyNames", 0.1, lambda: {"maxLength": 1}), ("minProperties", 0.1, lambda: 1),
                ("maxProperties", 0.1, lambda: 2), ("dependentRequired", 0.1, lambda: {"a": ["b"]}),
                ("unevaluatedProperties", 0.1, lambda: r.choice([False, STR])),
            ]
        for key, p, make in makers:
            if maybe(p):
                s[key] = make()
        if maybe(0.05):
            s["not"] = self.schema(depth + 1)
        if maybe(0.05):
            s["if"], s["then"] = self.schema(depth + 1), self.schema(depth + 1)
        return s


def _covered(violation: str, reports: tuple[UnenforcedKeyword, ...]) -> bool:
    """A violation is explained by a report at, above or below its schema location (or, for a
    declared property, by a propertyNames/patternProperties report on its object)."""
    for u in reports:
        p = u.pointer
        if p == violation or violation.startswith(p + "/") or p.startswith(violation + "/"):
            return True
        parent = p.rsplit("/", 1)[0]
        if u.keyword in ("properties", "patternProperties") and violation.startswith(parent + "/properties/"):
            return True
    return False


@pytest.mark.parametrize("seed", range(4))
def test_soundness_on_generated_schemas(compiler: xgr.GrammarCompiler, seed: int) -> None:
    gen = _Generator(seed)
    accepted_invalid = 0
    for _ in range(30):
        schema = gen.schema()
        try:
            validator = PostValidator(schema)
        except ConstraintError:
            continue  # the generator can produce invalid schemas (e.g. minimum 1.5 for an integer)
        for strict in (False, True):
            try:
                compiled = compile_schema(compiler, schema, strict)
            except RuntimeError:
                continue  # a refusal, not an unfaithful grammar
            reports = validator.unenforced(strict_mode=strict)
            for _ in range(40):
                value = gen.value()
                if not decodes(compiled, json.dumps(value, separators=(",", ":"))):
                    continue
                report = validator.validate_instance(value)
                if report.valid:
                    continue
                accepted_invalid += 1
                uncovered = [v.schema_pointer for v in report.violations if not _covered(v.schema_pointer, reports)]
                assert uncovered == [], (strict, json.dumps(schema), value, reports)
    assert accepted_invalid > 0  # the check did exercise unenforced keywords


# ------------------------------------------------------------------------------------
# Narrowings: valid instances the grammar excludes (documented, never reported)
# ------------------------------------------------------------------------------------

NARROWINGS = [
    # (id, schema, a valid instance that xgrammar rejects, strict_mode, expected report)
    ("pattern_is_a_whole_match", {"type": "string", "pattern": "^a"}, '"abc"', False, ()),
    ("unanchored_pattern_is_a_whole_match", {"type": "string", "pattern": "[0-9]"}, '"a1b"', False, ()),
    ("no_escapes_under_length_bound", {"type": "string", "maxLength": 1}, '"\\n"', False, ()),
    ("no_unicode_escapes_under_length_bound", {"type": "string", "minLength": 1}, '"\\u00e9"', False, ()),
    ("keys_in_schema_order", {**OBJ_A, "properties": {"a": INT, "b": INT}}, '{"b":2,"a":1}', False, ()),
    ("extra_keys_after_declared", {**OBJ_A, "required": ["a"]}, '{"b":2,"a":1}', False, ()),
    ("pattern_properties_close_the_object", {"type": "object", "patternProperties": {"^x_.*$": INT}},
     '{"x_a":1,"y":"s"}', False, ()),
    ("strict_closes_declared_object", OBJ_A, '{"a":1,"b":2}', True, ()),
    ("untyped_properties_admit_only_objects", {"properties": {"a": INT}}, "1", False, ()),
    ("bounded_number_without_exponent", {"type": "number", "minimum": 1.5}, "2e0", False, ()),
    ("huge_number_bound", {"type": "number", "minimum": 1e300}, "1e301", False, ()),
    ("const_number_text", {"const": 1.0}, "1.0", False, ()),
    ("undeclared_required_makes_declared_mandatory", {**OBJ_A, "required": ["z"]}, '{"z":1}', False,
     (("/required/0", "required"),)),
]


@pytest.mark.parametrize(("schema", "text", "strict", "reported"), [n[1:] for n in NARROWINGS],
                         ids=[n[0] for n in NARROWINGS])
def test_documented_narrowings(
    compiler: xgr.GrammarCompiler, schema: Any, text: str, strict: bool, reported: tuple[tuple[str, str], ...]
) -> None:
    assert truly_valid(schema, text)
    assert not decodes(compile_schema(compiler, schema, strict), text)
    assert tuple((u.pointer, u.keyword) for u in unenforced_keywords(schema, strict_mode=strict)) == reported
