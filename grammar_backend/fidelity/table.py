"""What xgrammar 0.2.9 enforces of each JSON Schema keyword (each row pinned by
cases in ``tests/unit/test_fidelity_table.py``), and the constants the walk uses."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import referencing
from jsonschema import Draft202012Validator
from jsonschema_specifications import REGISTRY as _SPECIFICATIONS

from grammar_backend.fidelity.report import Enforcement, KeywordFidelity, RefusedConstruct

XGRAMMAR_VERSION_MEASURED: Final = "0.2.9"
"""The xgrammar release whose behaviour the rules of this package describe."""

# --------------------------------------------------------------------------------------
# The observed keyword table (each row is pinned by cases in tests/unit/test_fidelity_table.py)
# --------------------------------------------------------------------------------------

_E, _C, _N = Enforcement.ENFORCED, Enforcement.CONDITIONAL, Enforcement.NOT_ENFORCED

KEYWORD_TABLE: Final[Mapping[str, KeywordFidelity]] = MappingProxyType(
    {
        row.keyword: row
        for row in (
            KeywordFidelity("type", _E, "Single type and type lists; ignored next to "
                            "$ref/const/enum/anyOf/oneOf/allOf."),
            KeywordFidelity("const", _E, "Exact value; all sibling assertions are ignored (only $ref wins over it)."),
            KeywordFidelity("enum", _E, "Exact values; all sibling assertions except $ref and const are ignored."),
            KeywordFidelity("$ref", _C, "'#' and '#/...' pointers followed (recursion too); any other reference "
                            "compiles to any JSON value; sibling assertions are ignored."),
            KeywordFidelity("$dynamicRef", _N, "Ignored."),
            KeywordFidelity("anyOf", _E, "Each branch compiled alone; sibling assertions are ignored."),
            KeywordFidelity("oneOf", _C, "Compiled as anyOf: exclusivity holds only for disjoint branches; "
                            "sibling assertions are ignored."),
            KeywordFidelity("allOf", _C, "Exactly one subschema: compiled as that subschema (siblings ignored); "
                            "any other count: the whole subschema compiles to any JSON value."),
            KeywordFidelity("not", _N, "Ignored."),
            KeywordFidelity("if", _N, "Ignored, together with then/else."),
            KeywordFidelity("then", _N, "Ignored."),
            KeywordFidelity("else", _N, "Ignored."),
            KeywordFidelity("properties", _C, "Declared order is forced (narrowing); next to propertyNames or "
                            "patternProperties on an open object, declared names can reappear as unchecked "
                            "additional properties."),
            KeywordFidelity("required", _C, "Names declared in properties are enforced; other names are ignored."),
            KeywordFidelity("additionalProperties", _C, "false and schemas enforced; true/{} open; ignored "
                            "(object closed) next to patternProperties; false is ignored next to propertyNames "
                            "when no property is declared."),
            KeywordFidelity("patternProperties", _C, "Alone: keys must fully match a pattern (closed object). With "
                            "declared properties on an open object any further key is accepted with the "
                            "additional schema; declared names that match a pattern are checked against one "
                            "schema only."),
            KeywordFidelity("propertyNames", _C, "Enforced on undeclared keys; names in properties are exempt; "
                            "ignored next to patternProperties; its presence reopens objects (see properties, "
                            "additionalProperties)."),
            KeywordFidelity("unevaluatedProperties", _C, "A schema acts as additionalProperties when that is "
                            "absent; false is ignored on an otherwise open object (non-strict mode, no "
                            "additionalProperties, no patternProperties)."),
            KeywordFidelity("minProperties", _E, ""),
            KeywordFidelity("maxProperties", _E, ""),
            KeywordFidelity("dependentRequired", _N, "Ignored."),
            KeywordFidelity("dependentSchemas", _N, "Ignored."),
            KeywordFidelity("dependencies", _N, "Ignored (draft-07 and before: dependentRequired and "
                            "dependentSchemas in one keyword)."),
            KeywordFidelity("items", _E, "Schema or false; the pre-2020 array form is refused."),
            KeywordFidelity("prefixItems", _E, ""),
            KeywordFidelity("unevaluatedItems", _E, ""),
            KeywordFidelity("minItems", _E, ""),
            KeywordFidelity("maxItems", _E, ""),
            KeywordFidelity("uniqueItems", _N, "Ignored."),
            KeywordFidelity("contains", _N, "Ignored."),
            KeywordFidelity("minContains", _N, "Ignored."),
            KeywordFidelity("maxContains", _N, "Ignored."),
            KeywordFidelity("minLength", _C, "Enforced alone or next to an unsupported format (in code points); "
                            "ignored next to pattern or a supported format."),
            KeywordFidelity("maxLength", _C, "Enforced alone or next to an unsupported format (in code points); "
                            "ignored next to pattern or a supported format."),
            KeywordFidelity("pattern", _C, "Whole-string match (narrowing); lookahead assertions are ignored; the "
                            "pattern is ignored next to a supported format."),
            KeywordFidelity("format", _C, "Supported formats win over pattern and lengths.  Checked "
                            "syntactically: email, uri, uri-reference, uri-template, uuid, ipv6, time, "
                            "duration, json-pointer, relative-json-pointer; with gaps: date and date-time "
                            "(calendar), ipv4 (leading zeros), hostname (lengths); not at all: idn-email, "
                            "idn-hostname, iri, iri-reference, regex (then pattern and lengths apply)."),
            KeywordFidelity("minimum", _E, "Integers and numbers; a bounded number is generated without "
                            "exponent (narrowing)."),
            KeywordFidelity("maximum", _E, "Integers and numbers; a bounded number is generated without "
                            "exponent (narrowing)."),
            KeywordFidelity("exclusiveMinimum", _E, "Integers and numbers."),
            KeywordFidelity("exclusiveMaximum", _E, "Integers and numbers."),
            KeywordFidelity("multipleOf", _C, "type integer only, with a whole 0 < m <= 1024, and either no bound "
                            "or both bounds spanning at most 10,000 integers; ignored otherwise."),
        )
    }
)
"""Keyword -> observed treatment by xgrammar 0.2.9, for every Draft 2020-12 assertion keyword."""

REFUSED_CONSTRUCTS: Final[tuple[RefusedConstruct, ...]] = (
    RefusedConstruct("items_array_form", '{"type":"array","items":[{"type":"integer"}]}',
                     "items must be a boolean or an object"),
    RefusedConstruct("false_in_properties", '{"type":"object","properties":{"a":false}}',
                     "Schema 'false' cannot accept any value"),
    RefusedConstruct("false_in_anyof", '{"anyOf":[false,{"type":"integer"}]}',
                     "Schema 'false' cannot accept any value"),
    RefusedConstruct("false_in_prefixitems", '{"type":"array","prefixItems":[false]}', "prefixItems contains false"),
    RefusedConstruct("false_propertynames", '{"type":"object","propertyNames":false}',
                     "propertyNames must be an object"),
    RefusedConstruct("true_propertynames", '{"type":"object","propertyNames":true}',
                     "propertyNames must be an object"),
    RefusedConstruct("pattern_backreference", '{"type":"string","pattern":"^(a)\\\\1$"}',
                     "Backreference is not supported"),
    RefusedConstruct("pattern_unicode_class", '{"type":"string","pattern":"^\\\\p{L}+$"}',
                     "Unicode character class escape sequence is not supported"),
    RefusedConstruct("pattern_word_boundary", '{"type":"string","pattern":"^a\\\\b$"}',
                     "Word boundary is not supported"),
    RefusedConstruct("pattern_lookbehind", '{"type":"string","pattern":"^a(?<=a)$"}',
                     "Lookbehind is not supported"),
    RefusedConstruct("pattern_inline_flag", '{"type":"string","pattern":"^(?i)a$"}',
                     "Group modifier flag is not supported"),
    RefusedConstruct("pattern_atomic_group", '{"type":"string","pattern":"^(?>a)$"}',
                     "Group modifier flag is not supported"),
    RefusedConstruct("pattern_open_repetition", '{"type":"string","pattern":"^a{,3}$"}', "Invalid repetition count"),
    RefusedConstruct("pattern_unbalanced", '{"type":"string","pattern":"^(a$"}', "The parenthesis is not closed"),
    RefusedConstruct("ref_missing_target", '{"$ref":"#/$defs/nope"}', "Cannot find field"),
    RefusedConstruct("integer_bound_not_whole", '{"type":"integer","minimum":2.5}',
                     "Integer constraint must be a whole number"),
    RefusedConstruct("integer_bound_beyond_int64", '{"type":"integer","maximum":100000000000000000000}',
                     "Integer exceeds maximum limit"),
    RefusedConstruct("multipleof_zero", '{"type":"integer","multipleOf":0}', "multipleOf must be greater than 0"),
    RefusedConstruct("multipleof_no_value_in_range", '{"type":"integer","multipleOf":7,"minimum":1,"maximum":6}',
                     "range contains no multipleOf value"),
    RefusedConstruct("minimum_above_maximum", '{"type":"integer","minimum":3,"maximum":2}',
                     "Invalid range: minimum greater than maximum"),
    RefusedConstruct("number_empty_range", '{"type":"number","minimum":3,"maximum":2}', "Invalid range: empty range"),
    RefusedConstruct("minlength_above_maxlength", '{"type":"string","minLength":3,"maxLength":2}',
                     "minLength 3 is greater than maxLength 2"),
    RefusedConstruct("minitems_above_maxitems", '{"type":"array","minItems":3,"maxItems":2}',
                     "minItems is greater than maxItems"),
    RefusedConstruct("minitems_above_closed_prefix",
                     '{"type":"array","prefixItems":[{"type":"integer"}],"items":false,"minItems":2}',
                     "minItems is greater than the number of prefixItems"),
    RefusedConstruct("minproperties_above_maxproperties", '{"type":"object","minProperties":3,"maxProperties":2}',
                     "minProperties is greater than maxProperties"),
    RefusedConstruct("required_above_maxproperties",
                     '{"type":"object","properties":{"a":{},"b":{}},"required":["a","b"],"maxProperties":1}',
                     "maxProperties is less than the number of required properties"),
    RefusedConstruct("enum_empty", '{"enum":[]}', "enum array must not be empty"),
    RefusedConstruct("type_unknown", '{"type":"foo"}', 'Unsupported type "foo"'),
)
"""Constructs xgrammar 0.2.9 refuses (``RuntimeError`` at compile time), with the
message fragment observed.  ``strict_mode=True`` adds one: ``minProperties`` above
the number of declared properties (``{"type":"object","minProperties":1}``)."""

# The formats Draft 2020-12 defines (section 7.3 of the validation specification).
_SPEC_FORMATS: Final = frozenset(
    {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
     "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
     "relative-json-pointer", "regex"}
)
# Formats and what xgrammar 0.2.9 lets through.  Specification formats in neither
# _FORMATS_SYNTAX_EXACT nor _FORMAT_GAPS are not enforced at all (cases format_idn_email, ...).
_FORMATS_SYNTAX_EXACT: Final = frozenset(
    # No counterexample found by the format_* cases: invalid examples rejected, valid accepted.
    {"email", "uri", "uri-reference", "uri-template", "uuid", "ipv6", "time", "duration",
     "json-pointer", "relative-json-pointer"}
)
_FORMAT_GAPS: Final[Mapping[str, str]] = MappingProxyType(
    {
        # case format_date_calendar: "2024-02-30", "2023-02-29" and "2024-06-31" accepted.
        "date": "checked syntactically only: the day is not checked against the month and leap years",
        "date-time": "checked syntactically only: the day is not checked against the month and leap years",
        # case format_ipv4_leading_zero: "01.2.3.4" accepted.
        "ipv4": "octets with leading zeros are accepted",
        # case format_hostname_long_label: a 64-character label is accepted.
        "hostname": "label (63) and name (253) length limits are not enforced",
    }
)

# The formats xgrammar 0.2.9 compiles to a grammar; any other format is ignored, and then
# pattern and lengths next to it apply (cases pattern_with_unsupported_format,
# max_length_with_unsupported_format).
_XGR_FORMATS: Final = _FORMATS_SYNTAX_EXACT | frozenset(_FORMAT_GAPS)

# Draft 2020-12 assertion keywords: the keywords whose presence can make an instance
# invalid.  jsonschema evaluates then/else inside "if" and minContains/maxContains inside
# "contains", so they are not in its VALIDATORS table.
_ASSERTION_KEYWORDS: Final = frozenset(Draft202012Validator.VALIDATORS) | {"then", "else", "minContains",
                                                                           "maxContains"}
_WINNERS: Final = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Keywords from which xgrammar infers a type for a schema without "type"
# (cases untyped_properties, untyped_additional_properties, untyped_items, untyped_minimum, ...).
_INFER_OBJECT: Final = ("properties", "additionalProperties", "unevaluatedProperties")
_INFER_ARRAY: Final = ("items", "prefixItems", "unevaluatedItems")
# Limits of integer multipleOf in xgrammar 0.2.9 (cases multipleof_1024, multipleof_1025,
# multipleof_range_10000, multipleof_range_10001).
_MULTIPLE_OF_MAX: Final = 1024
_MULTIPLE_OF_RANGE_MAX: Final = 10_000
# Keys of a subschema that are schemas or maps/lists of schemas, for walking the document.
_SCHEMA_MAP_KEYWORDS: Final = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")
_SCHEMA_LIST_KEYWORDS: Final = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_KEYWORDS: Final = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                           "contains", "propertyNames", "not", "if", "then", "else")
_MISSING: Final = object()
_REF_FOLLOW_DEPTH: Final = 32

# Remote references are never fetched: jsonschema's default registry would call urlopen.
_NO_RETRIEVE_REGISTRY: Final = _SPECIFICATIONS.combine(referencing.Registry())


def _checked_tail(fmt: str) -> str:
    if fmt in checked_formats():
        return " (the post-validator checks it)"
    return " (the post-validator does not check it either)"


def checked_formats() -> frozenset[str]:
    """Return the ``format`` values the post-validator actually checks.

    ``jsonschema`` registers a format checker only when its helper package is
    importable.  With the pinned environment (``jsonschema`` 4.26 without the
    ``format`` extras) this is ``date, email, idn-email, idn-hostname, ipv4, ipv6,
    regex, uuid``; ``date-time``, ``time``, ``uri``, ``hostname``, ``duration``,
    ``json-pointer``, ``uri-template``, ``iri`` and the rest are NOT checked.
    Installing ``jsonschema[format-nongpl]`` adds them.

    Returns
    -------
    frozenset of str
        Format names.
    """
    return frozenset(Draft202012Validator.FORMAT_CHECKER.checkers)
