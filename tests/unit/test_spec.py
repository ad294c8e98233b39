"""Constraint parsing and validation: every rejection names its field and reason."""

from __future__ import annotations

import json
from typing import Any

import pytest

import contract
from grammar_backend import spec as spec_module
from grammar_backend.errors import ConfigError, ConstraintError
from grammar_backend.spec import (
    OPTION_NAMES,
    ConstraintKind,
    ConstraintOptions,
    Segments,
    SpecLimits,
    constraint_spec,
    json_depth,
    parse_constraint,
    parse_options,
    validated_constraint,
)
from tests.unit.conftest import load_schema


@pytest.mark.parametrize(
    ("kind", "payload", "expected_payload"),
    [
        ("json_schema", '{ "type" : "object" ,"properties":{"b":{},"a":{}}}',
         '{"type":"object","properties":{"b":{},"a":{}}}'),
        ("json_object", "", ""),
        ("regex", r"[a-z]{3}", r"[a-z]{3}"),
        ("ebnf", 'root ::= "yes" | "no"', 'root ::= "yes" | "no"'),
        ("lark", 'start: "a"+', 'start: "a"+'),
        ("choice", '["red", "green"]', '["red","green"]'),
    ],
)
def test_valid_constraints_are_canonical(kind: str, payload: str, expected_payload: str) -> None:
    spec = parse_constraint(kind, payload)
    assert spec.kind is ConstraintKind(kind)
    assert spec.payload == expected_payload
    assert spec.options == ConstraintOptions()


@pytest.mark.parametrize(
    ("kind", "payload", "options", "match"),
    [
        ("yaml", "x", None, r"^grammar_type: unknown kind 'yaml'; expected one of json_schema"),
        ("json_schema", '{"type": "object",}', None, r"^grammar: invalid JSON at line 1 column 19: Expecting property name"),
        ("json_schema", '{\n  "type":\n}', None, r"^grammar: invalid JSON at line 3 column 1: "),
        ("json_schema", "[1]", None, r"^grammar: a JSON schema must be an object, got list"),
        ("json_schema", '{"type": "strin"}', None, r"^grammar#/type: not a valid JSON Schema: 'strin' is not valid"),
        ("json_schema", '{"properties": {"a": {"minLength": -1}}}', None,
         r"^grammar#/properties/a/minLength: not a valid JSON Schema: -1 is less than the minimum of 0"),
        ("json_schema", b'{"a": "\xff"}', None, r"^grammar: not valid UTF-8 at byte 7$"),
        ("json_object", "{}", None, r"^grammar: must be empty for json_object"),
        ("regex", "  ", None, r"^grammar: empty regex$"),
        ("choice", "[]", None, r"^grammar: choice needs a non-empty JSON array of strings$"),
        ("choice", '["a", 3]', None, r"^grammar#/1: each choice must be a non-empty string, got 3$"),
        ("regex", "a+", '{"indent": 2}', r"^grammar_options.indent: only applies to json_schema and json_object"),
        ("json_schema", "{}", '{"colour": 1}', r"^grammar_options.colour: unknown option; expected one of strict"),
        ("json_schema", "{}", '{"strict": "yes"}', r"^grammar_options.strict: must be a boolean, got 'yes'$"),
        ("json_schema", "{}", '{"whitespace": 65}', r'^grammar_options.whitespace: must be "compact", "any" or'),
        ("json_schema", "{}", '{"whitespace": true}', r"^grammar_options.whitespace: "),
        ("json_schema", "{}", '{"indent": -1}', r"^grammar_options.indent: must be null or an integer 0..16"),
        ("regex", "a+", '{"on_budget": "stop"}',
         r"^grammar_options.on_budget: must be one of 'close', 'truncate', got 'stop'$"),
        ("choice", '["a"]', '{"on_repeat": true}',
         r"^grammar_options.on_repeat: must be one of 'close', 'continue', got True$"),
        ("json_schema", "{}", "[1]", r"^grammar_options: must be a JSON object$"),
        ("json_schema", "{}", "{", r"^grammar_options: invalid JSON at line 1 column 2"),
        ("structural_tag", '{"triggers": ["<f"], "tags": []}', None, r"^grammar#/tags: must be a non-empty array"),
        ("structural_tag", '{"triggers": ["<f"], "tags": [{"begin": "<g>", "schema": {}, "end": "</g>"}]}', None,
         r"^grammar#/tags/0/begin: must start with one of the triggers$"),
        ("structural_tag",
         '{"triggers": ["<f"], "tags": [{"begin": "<f>", "schema": {"type": 5}, "end": "</f>"}]}', None,
         r"^grammar#/format/tags/0/content/json_schema/type: not a valid JSON Schema"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', None,
         r"^grammar#/format: invalid structural tag: Input tag 'nope' found using 'type' does not match"),
        # pydantic's own steps (the union branch tried: tag, bool) are no place in the document.
        ("structural_tag", ('{"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", '
                            '"content": {"type": "json_schema", "json_schema": 5}}}'), None,
         (r"^grammar#/format/content/json_schema: invalid structural tag: Input should be a valid boolean, unable "
         r"to interpret input; or Input should be a valid dictionary$")),
        # A schema that provably admits no instance (grammar_backend.satisfiable), refused before any compile.
        ("json_schema", ('{"type": "object", "required": ["tags"], "properties": {"tags": {"type": "array", '
                         '"items": {"enum": ["a", "b"]}, "minItems": 3, "uniqueItems": true}}}'), None,
         (r"^grammar: schema admits no instance at /properties/tags: uniqueItems with minItems 3 but items allow "
          r"only 2 values$")),
        ("json_schema", '{"type": "integer", "minimum": 10, "maximum": 9}', None,
         r"^grammar: schema admits no instance at the root: minimum 10 and maximum 9 leave no number$"),
        # The meta-schema check comes first.
        ("json_schema", '{"type": "integer", "minimum": "10", "maximum": 9}', None,
         r"^grammar#/minimum: not a valid JSON Schema"),
    ],
)
def test_invalid_constraints_name_field_and_reason(
    kind: str, payload: str | bytes, options: str | None, match: str
) -> None:
    with pytest.raises(ConstraintError, match=match):
        parse_constraint(kind, payload, options)


def test_payload_size_limit_is_checked_before_parsing() -> None:
    limits = SpecLimits(max_payload_bytes=10)
    with pytest.raises(ConstraintError, match=r"^grammar: payload is 11 bytes; the limit is 10$"):
        parse_constraint("json_schema", "{" * 11, limits=limits)


def test_depth_limit_protects_the_parser() -> None:
    deep = '{"items":' * 200 + "{}" + "}" * 200
    with pytest.raises(ConstraintError, match=r"^grammar: JSON nesting depth 201 exceeds the limit 128$"):
        parse_constraint("json_schema", deep)


@pytest.mark.parametrize(
    ("text", "depth"),
    [("{}", 1), ('{"a": [1, {"b": 2}]}', 3), ('{"a": "[[[{{{"}', 1), (r'{"a": "\"[["}', 1), ("3", 0)],
)
def test_json_depth_skips_strings(text: str, depth: int) -> None:
    assert json_depth(text) == depth


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, ConstraintOptions()),
        ("", ConstraintOptions()),
        ('{"strict": true, "whitespace": "any"}', ConstraintOptions(strict=True, whitespace="any")),
        ({"whitespace": 4, "indent": 2, "any_order": True},
         ConstraintOptions(whitespace=4, indent=2, any_order=True)),
        ('{"on_budget": "truncate", "on_repeat": "continue"}',
         ConstraintOptions(on_budget="truncate", on_repeat="continue")),
    ],
)
def test_options(options: str | dict[str, object] | None, expected: ConstraintOptions) -> None:
    assert parse_options(options) == expected


def test_structural_tag_short_form_is_normalized() -> None:
    schema = load_schema("tool_weather")
    short = {"triggers": ["<tool_call>"], "tags": [{"begin": "<tool_call>", "schema": schema, "end": "</tool_call>"}]}
    spec = parse_constraint("structural_tag", json.dumps(short))
    assert spec.document == {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": [{"type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
                      "content": {"type": "json_schema", "json_schema": schema,
                                  "max_whitespace_cnt": contract.TAG_WHITESPACE_RUN}}],
        },
    }


@pytest.mark.parametrize(
    ("content", "bound"),
    [
        ({"type": "json_schema", "json_schema": {"type": "object"}}, 1),  # the server's bound
        ({"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": None}, 1),
        ({"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": 6}, 6),  # the client's
    ],
)
def test_every_json_a_structural_tag_embeds_bounds_its_whitespace(content: dict[str, Any], bound: int) -> None:
    doc = {"type": "structural_tag", "format": {"type": "tags_with_separator", "separator": "\n", "tags": [
        {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"},
        {"type": "tag", "begin": "<b>", "content": {"type": "or", "elements": [content]}, "end": "</b>"}]}}
    spec = parse_constraint("structural_tag", json.dumps(doc))
    tags = spec.document["format"]["tags"]
    assert [tags[0]["content"]["max_whitespace_cnt"], tags[1]["content"]["elements"][0]["max_whitespace_cnt"]] == [
        bound, bound]
    assert spec.segments == Segments(("<a>", "<b>"), ("\n",))
    assert spec.segments.openers == b"\n<"


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_only_a_structural_tag_has_segments(kind: str) -> None:
    payload = {"json_schema": '{"type": "object"}', "regex": "a+", "choice": '["a"]'}[kind]
    assert parse_constraint(kind, payload).segments == Segments((), ())


@pytest.mark.parametrize("kind", ["regex", "json_schema"])
def test_decoding_policies_apply_to_every_kind_and_share_the_compiled_grammar(kind: str) -> None:
    base = parse_constraint(kind, '{"type": "object"}')
    other = parse_constraint(kind, '{"type": "object"}', '{"on_budget": "truncate", "on_repeat": "continue"}')
    assert (base.options.on_budget, other.options.on_budget) == ("close", "truncate")
    assert base.cache_key("fp", "0.2.9") == other.cache_key("fp", "0.2.9")


def test_cache_key_covers_every_input() -> None:
    base = parse_constraint("json_schema", '{"type": "object"}')
    key = base.cache_key("fp", "0.2.9")
    assert len(key) == 64
    assert parse_constraint("json_schema", '{ "type":"object" }').cache_key("fp", "0.2.9") == key
    others = {
        parse_constraint("json_schema", '{"type": "object"}', '{"strict": true}').cache_key("fp", "0.2.9"),
        parse_constraint("json_schema", '{"type": "array"}').cache_key("fp", "0.2.9"),
        parse_constraint("regex", '{"type": "object"}').cache_key("fp", "0.2.9"),
        base.cache_key("other-fp", "0.2.9"),
        base.cache_key("fp", "0.3.0"),
    }
    assert key not in others and len(others) == 5


def test_key_order_is_kept_because_it_changes_the_grammar() -> None:
    ab = parse_constraint("json_schema", '{"properties": {"a": {}, "b": {}}}')
    ba = parse_constraint("json_schema", '{"properties": {"b": {}, "a": {}}}')
    assert ab.cache_key("fp", "v") != ba.cache_key("fp", "v")


@pytest.mark.parametrize("name", ["person", "order", "tree", "tool_weather", "open_object"])
def test_fixture_schemas_parse(name: str) -> None:
    spec = parse_constraint("json_schema", json.dumps(load_schema(name)))
    assert spec.schema == load_schema(name)


def test_the_schema_draft_is_honoured() -> None:
    """`exclusiveMinimum: true` is draft-04 syntax: valid there, invalid under Draft 2020-12."""
    body = '"type": "number", "minimum": 0, "exclusiveMinimum": true'
    parse_constraint("json_schema", '{"$schema": "http://json-schema.org/draft-04/schema#", ' + body + "}")
    with pytest.raises(ConstraintError, match=r"^grammar#/exclusiveMinimum: not a valid JSON Schema: True is not"):
        parse_constraint("json_schema", "{" + body + "}")


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"type": "object", "properties": {"k" * 1025: {"type": "string"}}},
         r"^grammar#/properties/k{40}: key is 1025 characters; the limit is 1024$"),
        ({"enum": ["ok", "v" * 65_537]}, r"^grammar#/enum/1: string is 65537 characters; the limit is 65536$"),
    ],
)
def test_overlong_keys_and_strings_are_refused(doc: dict[str, object], match: str) -> None:
    """A 60,000-character property name killed the grammar stub (xgrammar's recursive key trie)."""
    with pytest.raises(ConstraintError, match=match):
        parse_constraint("json_schema", json.dumps(doc).encode(), None)
    parse_constraint("json_schema", json.dumps({"properties": {"k" * 1024: {}}}).encode(), None)


# ------------------------------------------------------------------ validate once: the wire form
TOOL_TAG = '{"triggers": ["<f"], "tags": [{"begin": "<f=w>", "schema": {"type": "object"}, "end": "</f>"}]}'


@pytest.mark.parametrize(
    ("kind", "payload", "options"),
    [
        ("json_schema", json.dumps({"type": "object", "properties": {"wire_a": {"type": "integer"}}}),
         '{"strict": true, "whitespace": 2, "indent": 4, "any_order": true}'),
        ("json_object", "", '{"on_budget": "truncate", "on_repeat": "continue", "jump_forward": false}'),
        ("regex", "[a-z]{3}", None),
        ("ebnf", 'root ::= "yes" | "no"', None),
        ("lark", 'start: "a"+', None),
        ("choice", '["red", "green"]', None),
        ("structural_tag", TOOL_TAG, None),
    ],
)
def test_the_wire_form_rebuilds_the_spec_without_validating_again(
    monkeypatch: pytest.MonkeyPatch, kind: str, payload: str, options: str | None
) -> None:
    spec = parse_constraint(kind, payload, options)
    wire = spec.wire()
    assert set(wire) == {"kind", "payload", "options"} and tuple(json.loads(wire["options"])) == OPTION_NAMES

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a validated constraint was validated again")

    for name in ("check_schema", "parse_options", "parse_json", "_normalize_structural_tag", "_check_string_lengths"):
        monkeypatch.setattr(spec_module, name, never)
    again = validated_constraint(wire["kind"], wire["payload"], wire["options"])
    assert again == spec and again.document == spec.document and again.schema == spec.schema
    assert constraint_spec(wire["kind"], wire["payload"].encode(), wire["options"].encode(), SpecLimits(),
                           validated=True) == spec


@pytest.mark.parametrize(
    ("kind", "payload", "options", "match"),
    [
        ("nope", "x", "{}", r"^not a validated constraint \('nope'\): 'nope' is not a valid ConstraintKind$"),
        ("regex", "a", "", r"^not a validated constraint \('regex'\): Expecting value"),
        ("regex", "a", '{"colour": 1}', r"^not a validated constraint \('regex'\): .*unexpected keyword argument 'colour'"),
        ("json_schema", "{", "{}", r"^not a validated constraint \('json_schema'\): Expecting property name"),
    ],
)
def test_a_malformed_wire_form_is_a_bug_not_a_client_error(kind: str, payload: str, options: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validated_constraint(kind, payload, options)


def test_without_the_marker_the_constraint_is_validated() -> None:
    with pytest.raises(ConstraintError, match=r"^grammar: payload is 12 bytes; the limit is 4$"):
        constraint_spec("regex", "[a-z]{1,100}", "", SpecLimits(max_payload_bytes=4), validated=False)
