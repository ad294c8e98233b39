"""Unit tests of client.constraints: builders, options, validation, from_file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from client import Constraint, InvalidConstraint, InvalidRequest


class Person(BaseModel):
    name: str
    age: int


class Team(BaseModel):
    lead: Person


class NotAModel:
    pass


PERSON_PAYLOAD = (
    '{"properties":{"name":{"title":"Name","type":"string"},"age":{"title":"Age","type":"integer"}},'
    '"required":["name","age"],"title":"Person","type":"object"}'
)
ORDERED_SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
ORDERED_PAYLOAD = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'


# ----------------------------------------------------------------------------- json_schema
@pytest.mark.parametrize(
    ("schema", "payload"),
    [
        (ORDERED_SCHEMA, ORDERED_PAYLOAD),  # key order kept (xgrammar follows it)
        (json.dumps(ORDERED_SCHEMA, indent=2), ORDERED_PAYLOAD),
        ('  {"const": "é"}  ', '{"const":"é"}'),  # non-ASCII kept verbatim
        (Person, PERSON_PAYLOAD),
        (
            Team,
            '{"$defs":{"Person":' + PERSON_PAYLOAD + '},"properties":{"lead":{"$ref":"#/$defs/Person"}},'
            '"required":["lead"],"title":"Team","type":"object"}',
        ),
    ],
    ids=["dict", "json-text", "unicode", "pydantic", "pydantic-defs"],
)
def test_json_schema_payload(schema: Any, payload: str) -> None:
    constraint = Constraint.json_schema(schema)
    assert constraint.kind == "json_schema"
    assert constraint.payload == payload
    assert dict(constraint.options) == {}
    assert constraint.options_json == ""


def test_json_schema_from_path_str_and_pathlike(tmp_path: Path) -> None:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(ORDERED_SCHEMA, indent=4), encoding="utf-8")
    assert Constraint.json_schema(str(path)).payload == ORDERED_PAYLOAD
    assert Constraint.json_schema(path).payload == ORDERED_PAYLOAD


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {}
    for _ in range(depth):
        node = {"not": node}
    return node


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (42, r"^schema: must be a dict, a pydantic BaseModel subclass, JSON text or a path to a \.json file, got int$"),
        (True, r"^schema: must be a dict, .* got bool$"),
        ("[1, 2]", r"^schema: must be a JSON object, got list$"),
        ("", r"^schema: must not be empty$"),
        ('{"a": }', r"^schema: invalid JSON at line 1 column 7: Expecting value$"),
        ("no/such/file.json", r"^schema: is neither JSON object text nor an existing file: 'no/such/file.json'$"),
        (NotAModel, r"^schema: class NotAModel is not a pydantic BaseModel subclass$"),
        ({"type": "strin"},
         r"^schema#/type: not a valid JSON Schema: 'strin' is not valid under any of the given schemas$"),
        ({"properties": {"a": {"minLength": -1}}},
         r"^schema#/properties/a/minLength: not a valid JSON Schema: -1 is less than the minimum of 0$"),
        ({"const": float("nan")}, r"^schema: is not JSON-serialisable: Out of range float values"),
        ({"const": object()}, r"^schema: is not JSON-serialisable: Object of type object"),
        (_nested(100_000), r"^schema: is nested too deeply$"),
        ("[" * 100_000 + "]" * 100_000, r"^schema: is nested too deeply$"),
        ({"const": "\ud800"}, r"^schema: is not valid Unicode: surrogates not allowed at character 10$"),
        ({"enum": ["x" * 1000] * 5000}, r"^schema: is 5015010 bytes of JSON, over the 2097152-byte limit$"),
    ],
    ids=["int", "bool", "array", "empty", "bad-json", "missing-file", "not-a-model", "meta-type",
         "meta-nested", "nan", "object", "deep-dict", "deep-text", "surrogate", "too-large"],
)
def test_json_schema_rejects(schema: Any, message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.json_schema(schema)


def test_json_schema_boolean_text_hints_json_object(tmp_path: Path) -> None:
    path = tmp_path / "true.json"
    path.write_text("true", encoding="utf-8")
    with pytest.raises(InvalidConstraint, match=r"^schema: must be a JSON object, got bool; use Constraint\.json_object"):
        Constraint.json_schema(path)


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("kwargs", "options", "options_json"),
    [
        ({"strict": True}, {"strict": True}, '{"strict":true}'),
        ({"strict": False}, {"strict": False}, '{"strict":false}'),
        ({"whitespace": "any"}, {"whitespace": "any"}, '{"whitespace":"any"}'),
        ({"whitespace": 0}, {"whitespace": 0}, '{"whitespace":0}'),
        ({"indent": 2}, {"indent": 2}, '{"indent":2}'),
        ({"any_order": True}, {"any_order": True}, '{"any_order":true}'),
        (
            {"strict": False, "whitespace": "compact", "indent": 0, "any_order": True},
            {"strict": False, "whitespace": "compact", "indent": 0, "any_order": True},
            '{"any_order":true,"indent":0,"strict":false,"whitespace":"compact"}',
        ),
    ],
)
def test_options_are_sent_only_when_set(kwargs: dict[str, Any], options: dict[str, Any], options_json: str) -> None:
    constraint = Constraint.json_schema({"type": "object"}, **kwargs)
    assert dict(constraint.options) == options
    assert constraint.options_json == options_json


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strict": "yes"}, r"^grammar_options\.strict: must be a boolean, got 'yes'$"),
        ({"any_order": 1}, r"^grammar_options\.any_order: must be a boolean, got 1$"),
        ({"whitespace": "tabs"}, r"^grammar_options\.whitespace: must be \"compact\", \"any\" or an integer 0..64, got 'tabs'$"),
        ({"whitespace": True}, r"^grammar_options\.whitespace: must be \"compact\", \"any\" or an integer 0..64, got True$"),
        ({"whitespace": -1}, r"^grammar_options\.whitespace: must be \"compact\", \"any\" or an integer 0..64, got -1$"),
        ({"whitespace": 65}, r"^grammar_options\.whitespace: must be \"compact\", \"any\" or an integer 0..64, got 65$"),
        ({"indent": -2}, r"^grammar_options\.indent: must be null or an integer 0..16, got -2$"),
        ({"indent": 17}, r"^grammar_options\.indent: must be null or an integer 0..16, got 17$"),
        ({"indent": 1.5}, r"^grammar_options\.indent: must be null or an integer 0..16, got 1.5$"),
    ],
)
def test_options_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.json_schema({"type": "object"}, **kwargs)


def test_direct_construction_rejects_unknown_and_misplaced_options() -> None:
    with pytest.raises(InvalidConstraint, match=r"^grammar_options\.colour: unknown option; expected one of strict"):
        Constraint("json_object", "", {"colour": 1})
    with pytest.raises(InvalidConstraint, match=r"^grammar_options\.strict: only applies to json_schema and json_object, not regex$"):
        Constraint("regex", "a+", {"strict": True})


@pytest.mark.parametrize(
    ("kind", "payload", "message"),
    [
        ("yaml", "x", r"^grammar_type: unknown kind 'yaml'"),
        ("regex", "", r"^grammar: must not be empty for regex constraints$"),
        ("ebnf", "   ", r"^grammar: must not be empty for ebnf constraints$"),
        ("json_object", "{}", r"^grammar: must be empty for json_object constraints$"),
        ("regex", b"a", r"^grammar: must be a string, got bytes$"),
    ],
)
def test_direct_construction_validates(kind: str, payload: Any, message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint(kind, payload)


def test_constraint_is_frozen_hashable_and_isolated_from_caller_dict() -> None:
    options: dict[str, object] = {"indent": 2}
    constraint = Constraint("json_object", "", options)
    options["indent"] = 4
    assert constraint.options["indent"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        constraint.kind = "regex"  # type: ignore[misc]
    with pytest.raises(TypeError):
        constraint.options["indent"] = 3  # type: ignore[index]
    twin = Constraint.json_object(indent=2)
    assert twin == constraint
    assert hash(twin) == hash(constraint)
    assert Constraint.json_object(indent=3) != constraint


def test_invalid_constraint_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^regex: must not be empty$") as info:
        Constraint.regex("")
    assert isinstance(info.value, InvalidRequest)
    assert info.value.field == "regex"
    assert info.value.reason == "must not be empty"
    assert info.value.status is None


# ----------------------------------------------------------------------------- other kinds
@pytest.mark.parametrize(
    ("constraint", "kind", "payload"),
    [
        (Constraint.json_object(), "json_object", ""),
        (Constraint.regex(r"\d{3}-\d{4}"), "regex", r"\d{3}-\d{4}"),
        (Constraint.ebnf('root ::= "yes" | "no"'), "ebnf", 'root ::= "yes" | "no"'),
        (
            Constraint.ebnf('# GBNF\nroot ::= item+\nitem ::= [a-z] "\\n"\n'),
            "ebnf",
            '# GBNF\nroot ::= item+\nitem ::= [a-z] "\\n"\n',
        ),
        (Constraint.lark('start: "a" | "b"'), "lark", 'start: "a" | "b"'),
        (Constraint.choice(["yes", "no"]), "choice", '["yes","no"]'),
        (Constraint.choice(("é", "", 'say "hi"')), "choice", '["é","","say \\"hi\\""]'),
    ],
    ids=["json_object", "regex", "ebnf", "gbnf", "lark", "choice", "choice-escapes"],
)
def test_builder_payloads(constraint: Constraint, kind: str, payload: str) -> None:
    assert constraint.kind == kind
    assert constraint.payload == payload
    assert constraint.options_json == ""


def test_json_object_options() -> None:
    constraint = Constraint.json_object(whitespace=2, indent=4)
    assert constraint.options_json == '{"indent":4,"whitespace":2}'


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Constraint.regex(""), r"^regex: must not be empty$"),
        (lambda: Constraint.regex(5), r"^regex: must be a string, got int$"),  # type: ignore[arg-type]
        (lambda: Constraint.ebnf("root = 'a'"), r"^ebnf: defines no rule \(no '::=' found\)$"),
        (lambda: Constraint.ebnf(""), r"^ebnf: must not be empty$"),
        (lambda: Constraint.lark("  \n"), r"^lark: must not be empty$"),
        (lambda: Constraint.choice("yes"), r"^choices: must be a list of strings, got str$"),
        (lambda: Constraint.choice([]), r"^choices: must not be empty$"),
        (lambda: Constraint.choice(["a", 1]), r"^choices\[1\]: must be a string, got int$"),  # type: ignore[list-item]
        (lambda: Constraint.choice(["a", "b", "a"]), r"^choices\[2\]: duplicate of choices\[0\]$"),
    ],
    ids=["regex-empty", "regex-int", "ebnf-no-rule", "ebnf-empty", "lark-blank", "choice-str",
         "choice-empty", "choice-int", "choice-dup"],
)
def test_builders_reject(build: Any, message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        build()


# ----------------------------------------------------------------------------- structural tags
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_JSON = '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}'


def test_structural_tag_short_form_payload() -> None:
    constraint = Constraint.structural_tag(
        ["<function="],
        [
            {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
            {"begin": "<function=person>", "schema": Person, "end": "</function>"},
        ],
    )
    assert constraint.kind == "structural_tag"
    assert constraint.payload == (
        '{"triggers":["<function="],"tags":['
        '{"begin":"<function=get_weather>","schema":' + WEATHER_JSON + ',"end":"</function>"},'
        '{"begin":"<function=person>","schema":' + PERSON_PAYLOAD + ',"end":"</function>"}]}'
    )
    assert constraint.options_json == ""


GOOD_TAG = {"begin": "<tool>", "schema": WEATHER, "end": "</tool>"}


@pytest.mark.parametrize(
    ("triggers", "tags", "message"),
    [
        ([], [GOOD_TAG], r"^triggers: must not be empty$"),
        ("<tool>", [GOOD_TAG], r"^triggers: must be a list of strings, got str$"),
        ([""], [GOOD_TAG], r"^triggers\[0\]: must not be empty$"),
        (["<tool>"], [], r"^tags: must not be empty$"),
        (["<tool>"], GOOD_TAG, r"^tags: must be a list of tag mappings, got dict$"),
        (["<tool>"], ["x"], r"^tags\[0\]: must be a mapping with begin, schema, end, got str$"),
        (["<tool>"], [{"begin": "<tool>", "schema": WEATHER}], r"^tags\[0\]\.end: is required$"),
        (["<tool>"], [{**GOOD_TAG, "name": "w"}], r"^tags\[0\]\.name: unknown key; expected begin, schema, end$"),
        (["<fn"], [GOOD_TAG], r"^tags\[0\]\.begin: '<tool>' does not start with any trigger$"),
        (["<tool>"], [{**GOOD_TAG, "begin": ""}], r"^tags\[0\]\.begin: must not be empty$"),
        (["<tool>"], [{**GOOD_TAG, "end": None}], r"^tags\[0\]\.end: must be a string, got NoneType$"),
        (["<tool>"], [{**GOOD_TAG, "schema": "[1]"}], r"^tags\[0\]\.schema: must be a JSON object, got list$"),
        (["<tool>"], [GOOD_TAG, {**GOOD_TAG, "schema": {"type": 3}}],
         r"^tags\[1\]\.schema#/type: not a valid JSON Schema: 3 is not valid"),
    ],
)
def test_structural_tag_rejects(triggers: Any, tags: Any, message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.structural_tag(triggers, tags)


def test_structural_tag_raw_passes_xgrammar_form_through() -> None:
    spec = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool>"],
            "tags": [{"begin": "<tool>", "content": {"type": "json_schema", "json_schema": WEATHER}, "end": "</tool>"}],
        },
    }
    constraint = Constraint.structural_tag_raw(spec)
    assert constraint.kind == "structural_tag"
    assert json.loads(constraint.payload) == spec
    assert constraint.payload == json.dumps(spec, separators=(",", ":"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("x", r"^structural_tag: must be a mapping, got str$"),
        ({"type": "json"}, r"^structural_tag\.type: must be 'structural_tag', got 'json'$"),
        ({"type": "structural_tag"}, r"^structural_tag\.format: is required and must be an object$"),
        ({"triggers": ["<a"]}, r"^structural_tag: needs either 'type' \+ 'format'"),
        ({"triggers": [], "tags": [set()]}, r"^structural_tag: is not JSON-serialisable"),
        ({"triggers": ["<a"], "tags": [float("nan")]}, r"^structural_tag: is not JSON-serialisable: Out of range"),
        ({"triggers": [], "tags": _nested(5_000)}, r"^structural_tag: is nested too deeply$"),
    ],
)
def test_structural_tag_raw_rejects(spec: Any, message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.structural_tag_raw(spec)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not json", r"^grammar: invalid JSON at line 1 column 1: Expecting value$"),
        ("[1]", r"^grammar: a structural tag must be a JSON object$"),
        ("[" * 100_000, r"^grammar: is nested too deeply$"),
    ],
)
def test_a_structural_tag_payload_must_be_a_json_object(payload: str, message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint("structural_tag", payload)


# ----------------------------------------------------------------------------- from_file
@pytest.mark.parametrize(
    ("name", "content", "kind", "payload"),
    [
        ("s.json", json.dumps(ORDERED_SCHEMA, indent=2) + "\n", "json_schema", ORDERED_PAYLOAD),
        ("S.JSON", json.dumps(ORDERED_SCHEMA), "json_schema", ORDERED_PAYLOAD),
        ("g.ebnf", 'root ::= "a"\n', "ebnf", 'root ::= "a"\n'),
        ("g.gbnf", 'root ::= [0-9]+\n', "ebnf", 'root ::= [0-9]+\n'),
        ("g.lark", 'start: "a"\n', "lark", 'start: "a"\n'),
        ("p.regex", "\\d+\n", "regex", "\\d+"),
        ("p.re", "a|b\r\n", "regex", "a|b"),
        ("p2.re", "a\n\n", "regex", "a\n"),  # only one trailing line break is an editor artefact
    ],
)
def test_from_file_by_extension(tmp_path: Path, name: str, content: str, kind: str, payload: str) -> None:
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8"))
    constraint = Constraint.from_file(path)
    assert (constraint.kind, constraint.payload) == (kind, payload)
    assert Constraint.from_file(str(path)) == constraint


def test_from_file_json_options(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"type": "object"}', encoding="utf-8")
    constraint = Constraint.from_file(path, strict=True, indent=2)
    assert constraint.options_json == '{"indent":2,"strict":true}'


@pytest.mark.parametrize(
    ("name", "content", "kwargs", "message"),
    [
        ("g.txt", b"x", {}, r"^path: unknown extension '\.txt'; expected one of \.json, \.ebnf"),
        ("noext", b"x", {}, r"^path: unknown extension '\(none\)'"),
        ("g.ebnf", b'root ::= "a"', {"strict": True}, r"^grammar_options\.strict: does not apply to ebnf constraints$"),
        ("p.regex", b"\xff\xfe", {}, r"^path: '.*p\.regex' is not UTF-8 text"),
        ("s.json", b"[1]", {}, r"^schema: must be a JSON object, got list$"),
        ("s.json", b'"other.json"', {}, r"^schema: must be a JSON object, got str$"),
        ("s.json", b"{", {}, r"^schema: invalid JSON at line 1 column 2"),
        ("p.regex", b"\n", {}, r"^regex: must not be empty$"),
    ],
)
def test_from_file_rejects(tmp_path: Path, name: str, content: bytes, kwargs: dict[str, Any], message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.from_file(path, **kwargs)


def test_from_file_missing(tmp_path: Path) -> None:
    with pytest.raises(InvalidConstraint, match=r"^path: no such file: '.*missing\.lark'$") as info:
        Constraint.from_file(tmp_path / "missing.lark")
    assert isinstance(info.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize(
    ("constraint", "policies", "options_json"),
    [
        (Constraint.regex("[a-z]+"), {"on_budget": "truncate"}, '{"on_budget":"truncate"}'),
        (Constraint.json_schema({"type": "object"}, strict=True), {"on_repeat": "continue", "on_budget": None},
         '{"on_repeat":"continue","strict":true}'),
        (Constraint("regex", "a+"), {"jump_forward": False}, '{"jump_forward":false}'),
        (Constraint.json_schema({"type": "array"}), {"value_retries": 0}, '{"value_retries":0}'),
        (Constraint.choice(["a", "b"]), {}, ""),
    ],
)
def test_with_policies(constraint: Constraint, policies: dict[str, Any], options_json: str) -> None:
    assert constraint.with_policies(**policies).options_json == options_json


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ({"on_budget": "stop"}, r"^grammar_options\.on_budget: must be one of 'close', 'truncate', got 'stop'$"),
        ({"on_repeat": "close "}, r"^grammar_options\.on_repeat: must be one of 'close', 'continue', got 'close '$"),
    ],
)
def test_with_policies_rejects(policies: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        Constraint.regex("a").with_policies(**policies)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"prompt": "a\ud800b"}, r"^prompt: is not valid Unicode: surrogates not allowed at character 1 \('\\ud800'\)$"),
        ({"messages": [{"role": "user", "content": "\udfff"}]},
         r"^messages: is not valid Unicode: surrogates not allowed at character 27"),
        ({"prompt": "x", "constraint": Constraint.regex("a\ud800")},
         r"^grammar: is not valid Unicode: surrogates not allowed at character 1"),
        ({"prompt": "x", "stop": ["ok", "\ud800"]}, r"^stop\[1\]: is not valid Unicode"),
    ],
    ids=["prompt", "messages", "regex", "stop"],
)
def test_lone_surrogates_are_invalid_requests(call: dict[str, Any], message: str) -> None:
    from client.sdk import build_inputs

    with pytest.raises(InvalidRequest, match=message):
        build_inputs(**call)


def test_a_schema_that_passed_its_meta_check_is_not_checked_again() -> None:
    from contract import schema_check

    schema = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}, "required": ["cache_probe"]}
    schema_check._check_text.cache_clear()
    Constraint.json_schema(schema)
    Constraint.json_schema(dict(reversed(list(schema.items()))))  # the same schema, keys in another order
    info = schema_check._check_text.cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)
    bad = {"type": "object", "properties": {"a": {"type": 5}}}
    for _ in range(2):  # a refusal is never remembered: refused, with its pointer, every time
        with pytest.raises(InvalidConstraint, match=r"^schema#/properties/a/type: not a valid JSON Schema: 5 is not"):
            Constraint.json_schema(bad)
    assert schema_check._check_text.cache_info().currsize == 1
    # Over the size bound: checked every time, never kept.
    big = {"type": "object", "description": "x" * schema_check.CHECKED_MAX_CHARS}
    Constraint.json_schema(big)
    assert schema_check._check_text.cache_info().currsize == 1
