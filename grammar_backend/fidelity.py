"""Schema fidelity of xgrammar decoding, and full post-validation of outputs.

Two questions are answered here, both for JSON Schema (Draft 2020-12)
constraints:

1. **Which keywords of a schema does decoding NOT enforce?**
   :func:`unenforced_keywords` walks a schema and reports every keyword whose
   violation can survive constrained decoding with xgrammar 0.2.9, compiled as
   the grammar engine does (``any_whitespace=False``, ``separators=(",", ":")``,
   ``any_order=False``, ``indent=None``, ``max_whitespace_cnt=None``).  The rules
   are not guesses: every rule below was established by compiling a schema and
   pushing known-valid and known-invalid compact JSON instances through an
   ``xgrammar.GrammarMatcher`` byte by byte, and each rule is pinned by a case in
   ``tests/unit/test_fidelity.py`` (the case names are cited in the comments).
2. **Is a finished output valid?**  :class:`PostValidator` parses the output
   text (with the line and column of a syntax error) and validates it with
   ``jsonschema.Draft202012Validator`` and its format checker, returning every
   violation with a JSON pointer into the instance.  A validator is built once
   per constraint and reused for every output of that constraint.

What xgrammar 0.2.9 does (observed; see :data:`KEYWORD_TABLE` and
:data:`REFUSED_CONSTRUCTS`):

* A subschema is compiled from ONE "winning" keyword when it has any of, in
  this precedence, ``$ref`` > ``const`` > ``enum`` > ``anyOf`` > ``oneOf`` >
  ``allOf``; every other assertion next to the winner is ignored
  (cases ``ref_sibling_minimum``, ``const_sibling_maxlength``, ``enum_sibling_type``,
  ``anyof_sibling_minimum``, ``oneof_sibling_minimum``, ``allof1_sibling_minimum``,
  ``precedence_*``).  For ``const``/``enum`` this matters only when a listed value
  violates a sibling, which is checked exactly with ``jsonschema``.
* ``allOf`` with other than exactly one subschema compiles to *any JSON value*
  (``allof2_int_min``, ``allof2_objects``); ``oneOf`` is compiled as ``anyOf``, so
  exclusivity holds only where the branches are disjoint (``oneof_*``; reported
  unless a sound disjointness proof succeeds: distinct types, distinct
  ``const``/``enum`` values, or a required discriminator property).
* A subschema without ``type`` is compiled as any JSON value unless it has
  ``properties``/``additionalProperties``/``unevaluatedProperties`` (then an
  object) or ``items``/``prefixItems``/``unevaluatedItems`` (then an array), so
  ``{"minimum": 5}`` accepts ``3`` (``untyped_*``).
* Never enforced: ``uniqueItems``, ``contains``/``minContains``/``maxContains``,
  ``dependentRequired``, ``dependentSchemas``, ``if``/``then``/``else``, ``not``,
  ``$dynamicRef``.
* Enforced only in part:

  - ``multipleOf``: integers only, ``0 < m <= 1024``, with no bound or with both
    bounds spanning at most 10,000 integers;
  - strings: a format xgrammar supports wins, and ``pattern`` and
    ``minLength``/``maxLength`` next to it are ignored; ``pattern`` wins over the
    lengths; lookahead assertions in a pattern are ignored; ``date``/``date-time``
    do not check the calendar, ``ipv4`` accepts leading zeros, ``hostname`` has
    no length limits; ``idn-email``, ``idn-hostname``, ``iri``, ``iri-reference``
    and ``regex`` are not enforced;
  - objects: ``required`` names missing from ``properties`` are ignored;
    ``propertyNames`` exempts declared names, is ignored next to
    ``patternProperties``, lets declared names reappear unchecked on an open
    object and keeps an object with no declared property open whatever
    ``additionalProperties``/``unevaluatedProperties``/strict mode say;
    ``patternProperties`` next to declared properties on an open object accepts
    any further key unchecked, and a declared name that matches a pattern is
    checked against one schema only; ``unevaluatedProperties: false`` is
    ignored on an otherwise open object;
  - ``$ref``: only ``#`` and ``#/...`` JSON-pointer references are followed;
    others compile to any JSON value.

* Narrowing (valid instances excluded, never invalid ones admitted, so not
  reported; pinned by ``test_documented_narrowings``): ``pattern`` is matched
  against the whole string (``"^a"`` rejects ``"abc"``), strings under a length
  bound cannot contain escapes, keys must follow the schema order,
  ``patternProperties`` alone closes the object, ``strict_mode=True`` closes
  objects with ``properties``/``required`` and arrays with ``prefixItems`` that
  leave them open, untyped ``properties`` schemas admit only objects, bounded
  numbers admit no exponent form (``{"type":"number","minimum":1.5}`` rejects
  ``2e0``), ``{"const": 1.0}`` admits only ``1``, number bounds beyond what a
  double holds.
* Repeated keys are not prevented among additional or pattern properties (not a
  schema keyword, so not reported here); :class:`PostValidator` reports them as
  ``duplicate-key`` violations because JSON parsers disagree on their meaning.

Refusals (xgrammar raises ``RuntimeError`` at compile time) are a different case:
they never produce an unfaithful grammar, so they are listed in
:data:`REFUSED_CONSTRUCTS` rather than reported per schema.

Costs, measured for a 2.6 kB schema of 50 properties on the shared 2-core
development machine (load average about 6, so upper figures): the Draft 2020-12
meta-schema check dominates building a :class:`PostValidator` or calling
:func:`unenforced_keywords` (7-14 ms); the keyword walk itself is 0.05 ms;
validating a 1.4 kB output takes 0.15-0.3 ms; a :func:`validator_for` cache hit
0.02-0.06 ms.  Build one :class:`PostValidator` per constraint and take
:meth:`PostValidator.unenforced` from it to pay the meta-schema check once.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import jsonschema.validators
import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema_specifications import REGISTRY as _SPECIFICATIONS

from grammar_backend.errors import ConfigError, ConstraintError

__all__ = [
    "KEYWORD_TABLE",
    "REFUSED_CONSTRUCTS",
    "VALIDATOR_CACHE_SIZE",
    "XGRAMMAR_VERSION_MEASURED",
    "Enforcement",
    "KeywordFidelity",
    "PostValidator",
    "RefusedConstruct",
    "UnenforcedKeyword",
    "ValidationReport",
    "Violation",
    "checked_formats",
    "result_json",
    "unenforced_keywords",
    "validate_output",
    "validator_for",
]

XGRAMMAR_VERSION_MEASURED: Final = "0.2.9"
"""The xgrammar release whose behaviour the rules of this module describe."""


# --------------------------------------------------------------------------------------
# Public data types
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnenforcedKeyword:
    """A schema keyword whose violation can survive constrained decoding.

    Attributes
    ----------
    pointer : str
        JSON pointer (RFC 6901) into the schema to the keyword, e.g.
        ``"/properties/tags/uniqueItems"``; for one ``required`` name it points at
        the array element (``"/required/1"``).
    keyword : str
        The keyword, e.g. ``"uniqueItems"``.
    note : str
        Why it is not enforced, in words a client can act on.
    """

    pointer: str
    keyword: str
    note: str


class Enforcement(str, enum.Enum):
    """How xgrammar 0.2.9 treats a keyword during decoding."""

    ENFORCED = "enforced"
    CONDITIONAL = "conditional"
    NOT_ENFORCED = "not_enforced"


@dataclass(frozen=True, slots=True)
class KeywordFidelity:
    """One row of :data:`KEYWORD_TABLE`.

    Attributes
    ----------
    keyword : str
        The Draft 2020-12 assertion keyword.
    enforcement : Enforcement
        Observed treatment.
    detail : str
        The conditions, as observed.
    """

    keyword: str
    enforcement: Enforcement
    detail: str


@dataclass(frozen=True, slots=True)
class RefusedConstruct:
    """A schema construct that xgrammar 0.2.9 refuses to compile.

    Attributes
    ----------
    name : str
        Short identifier.
    schema : str
        A minimal schema (JSON text) that shows the refusal.
    message : str
        A fragment of xgrammar's ``RuntimeError`` message.
    """

    name: str
    schema: str
    message: str


@dataclass(frozen=True, slots=True)
class Violation:
    """One failed assertion of a validated output.

    Attributes
    ----------
    pointer : str
        JSON pointer into the *instance* (``""`` is the whole document).
    message : str
        ``jsonschema``'s message, cut to :data:`_MAX_MESSAGE_CHARS` characters.
    keyword : str
        The failing schema keyword (``"duplicate-key"`` for a repeated object key,
        which is not a schema keyword).
    schema_pointer : str
        JSON pointer into the schema to the failing keyword (``""`` for
        ``duplicate-key``).
    """

    pointer: str
    message: str
    keyword: str
    schema_pointer: str


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """The outcome of validating one output.

    Attributes
    ----------
    parsed : bool
        Whether the text is one JSON value.
    parse_error : str or None
        ``"line L column C: reason"`` when ``parsed`` is false.
    valid : bool or None
        ``None`` when not parsed; otherwise whether there is no violation.
    violations : tuple of Violation
        Sorted by instance location (array indices numerically), then keyword,
        then message.
    truncated : bool
        True when more violations existed than the validator's
        ``max_violations``; only the first ones found are listed.
    """

    parsed: bool
    parse_error: str | None
    valid: bool | None
    violations: tuple[Violation, ...]
    truncated: bool

    def to_dict(self) -> dict[str, Any]:
        """Return the contract's ``json`` object without its ``unenforced`` member.

        Returns
        -------
        dict
            ``{"parsed", "parse_error", "valid", "violations": [{"pointer", "message"}]}``.
        """
        return {
            "parsed": self.parsed,
            "parse_error": self.parse_error,
            "valid": self.valid,
            "violations": [{"pointer": v.pointer, "message": v.message} for v in self.violations],
        }


def result_json(report: ValidationReport, unenforced: Sequence[UnenforcedKeyword]) -> dict[str, Any]:
    """Build the ``json`` member of the ensemble's ``RESULT`` (see the tensor contract).

    Parameters
    ----------
    report : ValidationReport
        The validation of the final output.
    unenforced : sequence of UnenforcedKeyword
        The constraint's unenforced keywords.

    Returns
    -------
    dict
        ``{"parsed", "parse_error", "valid", "violations", "unenforced": [{"pointer", "keyword"}]}``.
    """
    out = report.to_dict()
    out["unenforced"] = [{"pointer": u.pointer, "keyword": u.keyword} for u in unenforced]
    return out


# --------------------------------------------------------------------------------------
# The observed keyword table (each row is pinned by cases in tests/unit/test_fidelity.py)
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
_MAX_MESSAGE_CHARS: Final = 512
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


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _escape(token: str | int) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")


def _pointer(parts: Iterator[str | int] | Sequence[str | int]) -> str:
    return "".join("/" + _escape(p) for p in parts)


def _is_trivially_true(value: Any) -> bool:
    """Whether a subschema accepts everything syntactically (true, {} or annotations only)."""
    if value is True:
        return True
    return isinstance(value, Mapping) and not any(k in _ASSERTION_KEYWORDS for k in value)


def _json_types(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"integer", "number"}) if value.is_integer() else frozenset({"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    if isinstance(value, list):
        return frozenset({"array"})
    return frozenset({"object"})


def _json_equal(a: Any, b: Any) -> bool:
    """JSON Schema equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _types_overlap(a: frozenset[str], b: frozenset[str]) -> bool:
    numeric = {"integer", "number"}
    return bool(a & b) or (bool(a & numeric) and bool(b & numeric))


def _declared_types(node: Mapping[str, Any]) -> frozenset[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list):
        return frozenset(x for x in t if isinstance(x, str))
    return None


def _has_lookahead(pattern: str) -> bool:
    """Whether an ECMA-262 pattern has a lookahead group outside character classes."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "(" and pattern.startswith(("?=", "?!"), i + 1):
            return True
        i += 1
    return False


def _resolve_local(root: Any, ref: str) -> Any:
    """Resolve ``#`` or ``#/a/b`` against ``root``; ``None`` when it does not resolve."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _check_schema(schema: Any) -> None:
    """Raise :class:`ConstraintError` unless ``schema`` is a valid Draft 2020-12 schema."""
    if not isinstance(schema, (Mapping, bool)):
        raise ConstraintError("grammar", f"a JSON Schema must be an object or a boolean, not {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as err:
        where = _pointer(list(err.absolute_path))
        raise ConstraintError(f"grammar#{where}", f"invalid JSON Schema: {_cut(err.message)}") from err


def _cut(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[: _MAX_MESSAGE_CHARS - 1] + "\u2026"


# --------------------------------------------------------------------------------------
# oneOf disjointness (a sound proof: when it says disjoint, no instance matches two arms)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ArmProfile:
    types: frozenset[str] | None  # None: any type
    values: tuple[Any, ...] | None  # None: not a finite set
    discriminators: Mapping[str, tuple[Any, ...]]  # required key -> finite values (objects only)


def _arm_profile(root: Any, arm: Any, depth: int = 0) -> _ArmProfile:
    unknown = _ArmProfile(None, None, {})
    if not isinstance(arm, Mapping) or depth > _REF_FOLLOW_DEPTH:
        return unknown
    ref = arm.get("$ref")
    if isinstance(ref, str):
        # The arm's instances are a subset of the target's, so the target's profile is sound.
        target = _resolve_local(root, ref)
        return _arm_profile(root, target, depth + 1) if target is not None else unknown
    if "const" in arm:
        return _ArmProfile(None, (arm["const"],), {})
    if isinstance(arm.get("enum"), list):
        return _ArmProfile(None, tuple(arm["enum"]), {})
    types = _declared_types(arm)
    discriminators: dict[str, tuple[Any, ...]] = {}
    props = arm.get("properties")
    required = arm.get("required")
    if types == frozenset({"object"}) and isinstance(props, Mapping) and isinstance(required, list):
        for key in required:
            sub = props.get(key) if isinstance(key, str) else None
            if isinstance(sub, Mapping) and "const" in sub:
                discriminators[key] = (sub["const"],)
            elif isinstance(sub, Mapping) and isinstance(sub.get("enum"), list):
                discriminators[key] = tuple(sub["enum"])
    return _ArmProfile(types, None, discriminators)


def _values_disjoint(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return not any(_json_equal(x, y) for x in a for y in b)


def _values_outside_types(values: Sequence[Any], types: frozenset[str] | None) -> bool:
    # _json_types lists every type a value has (1 is an integer and a number), so a plain
    # intersection is exact here: 1.5 is outside {"integer"}, 2.0 is not.
    return types is not None and not any(_json_types(v) & types for v in values)


def _profiles_disjoint(p: _ArmProfile, q: _ArmProfile) -> bool:
    if p.values is not None and q.values is not None:
        return _values_disjoint(p.values, q.values)
    if p.values is not None:
        return _values_outside_types(p.values, q.types)
    if q.values is not None:
        return _values_outside_types(q.values, p.types)
    if p.types is not None and q.types is not None and not _types_overlap(p.types, q.types):
        return True
    common = p.discriminators.keys() & q.discriminators.keys()
    return any(_values_disjoint(p.discriminators[k], q.discriminators[k]) for k in common)


def _arms_disjoint(root: Any, arms: Sequence[Any]) -> bool:
    profiles = [_arm_profile(root, arm) for arm in arms]
    return all(
        _profiles_disjoint(profiles[i], profiles[j]) for i in range(len(profiles)) for j in range(i + 1, len(profiles))
    )


# --------------------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------------------


class _Walker:
    """Collects :class:`UnenforcedKeyword` entries for one schema document."""

    def __init__(self, root: Any, strict_mode: bool, root_validator: Any) -> None:
        self.root = root
        self.strict_mode = strict_mode
        self.root_validator = root_validator
        self.found: list[UnenforcedKeyword] = []
        self.visited: set[str] = set()  # pointers of the subschemas walked
        self.ref_targets: list[list[str | int]] = []  # local $ref targets, walked if not reached otherwise

    def walk(self) -> None:
        """Walk the document, then every local ``$ref`` target that the walk did not reach.

        A target can sit where xgrammar ignores the surrounding schema (e.g. under a
        sibling of another ``$ref``), yet be compiled through the reference.
        """
        self.visit(self.root, [])
        while self.ref_targets:
            target_path = self.ref_targets.pop()
            pointer = _pointer(target_path)
            if pointer not in self.visited:
                self.visit(_resolve_local(self.root, "#" + pointer), target_path)

    def add(self, path: Sequence[str | int], keyword: str, note: str) -> None:
        self.found.append(UnenforcedKeyword(_pointer(path), keyword, note))

    # -- entry --------------------------------------------------------------------------
    def visit(self, node: Any, path: list[str | int], default_type: str | None = None) -> None:
        if not isinstance(node, Mapping):
            return  # true compiles to any value; false is refused by xgrammar
        self.visited.add(_pointer(path))
        # Definitions are compiled where they are referenced; walk them in place.
        for key in ("$defs", "definitions"):
            defs = node.get(key)
            if isinstance(defs, Mapping):
                for name, sub in defs.items():
                    self.visit(sub, [*path, key, name])
        if "$dynamicRef" in node:
            # case dynamic_ref: {"$dynamicRef": "#n"} accepts "a" where "n" is an integer.
            self.add([*path, "$dynamicRef"], "$dynamicRef", "$dynamicRef is ignored by xgrammar")
        winner = next((k for k in _WINNERS if k in node), None)
        if winner is None:
            self.visit_typed(node, path, default_type)
            return
        siblings = [k for k in node if k in _ASSERTION_KEYWORDS and k not in (winner, "$dynamicRef")]
        if winner in ("const", "enum"):
            self.check_finite_siblings(node, path, winner, siblings)
            return
        for key in siblings:
            if not self.vacuous(node, key):
                # cases ref_sibling_minimum, anyof_sibling_minimum, oneof_sibling_minimum,
                # allof1_sibling_minimum, precedence_ref_over_enum, precedence_anyof_over_oneof.
                self.add([*path, key], key, f"ignored next to {winner}: xgrammar compiles only the {winner}")
        if winner == "$ref":
            self.visit_ref(node, path)
        elif winner == "anyOf":
            for i, arm in enumerate(node["anyOf"]):
                self.visit(arm, [*path, "anyOf", i])
        elif winner == "oneOf":
            arms = node["oneOf"]
            for i, arm in enumerate(arms):
                self.visit(arm, [*path, "oneOf", i])
            if len(arms) > 1 and not _arms_disjoint(self.root, arms):
                # cases oneof_int_number, oneof_enum_overlap, oneof_objects_overlap.
                self.add([*path, "oneOf"], "oneOf",
                         "compiled as anyOf: an instance matching more than one branch is not rejected")
        else:  # allOf
            arms = node["allOf"]
            if len(arms) == 1:
                self.visit(arms[0], [*path, "allOf", 0])
            else:
                # cases allof2_int_min, allof2_objects: '"a"' accepted for allOf [integer, minimum].
                self.add([*path, "allOf"], "allOf",
                         f"allOf with {len(arms)} subschemas is compiled as any JSON value: "
                         "none of its subschemas is enforced")

    def visit_ref(self, node: Mapping[str, Any], path: list[str | int]) -> None:
        ref = node["$ref"]
        if ref == "#" or ref.startswith("#/"):
            # The target is walked where it lives (cases ref_recursion, ref_root,
            # ref_target_under_ignored_sibling).
            tokens = [t.replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")] if ref != "#" else []
            self.ref_targets.append(list(tokens))  # "0" and 0 give the same pointer text
            return
        # cases ref_remote, ref_anchor, ref_relative_id: compiled as any JSON value.
        self.add([*path, "$ref"], "$ref",
                 f"xgrammar follows only '#' and '#/...' references; {ref!r} compiles to any JSON value")

    # -- const / enum ---------------------------------------------------------------------
    def check_finite_siblings(
        self, node: Mapping[str, Any], path: list[str | int], winner: str, siblings: list[str]
    ) -> None:
        """Report siblings of const/enum that a listed value violates (xgrammar emits the values as is).

        Cases const_sibling_maxlength, enum_sibling_type, enum_sibling_minimum, enum_type_ok.
        """
        if not siblings:
            return
        values = [node["const"]] if winner == "const" else list(node["enum"])
        rest = {k: v for k, v in node.items() if k != winner}
        validator = self.root_validator.evolve(schema=rest)
        failing: dict[str, Any] = {}
        for value in values:
            for error in validator.iter_errors(value):
                key = str(error.relative_schema_path[0]) if error.relative_schema_path else str(error.validator)
                failing.setdefault(key, value)
        for key in sorted(failing):
            self.add([*path, key], key,
                     f"ignored next to {winner}: the value {json.dumps(failing[key])} can be generated "
                     f"but violates {key}")

    # -- typed subschemas -------------------------------------------------------------------
    def visit_typed(self, node: Mapping[str, Any], path: list[str | int], default_type: str | None) -> None:
        types = _declared_types(node)
        if types is None and default_type is not None:
            types = frozenset({default_type})  # propertyNames subschemas are strings (case property_names_*)
        if types is None:
            if any(k in node for k in _INFER_OBJECT):
                types = frozenset({"object"})
            elif any(k in node for k in _INFER_ARRAY):
                types = frozenset({"array"})
        if types is None:
            # cases untyped_minimum, untyped_min_length, untyped_pattern, untyped_required:
            # with no type and nothing to infer one from, xgrammar emits any JSON value.
            for key in node:
                if key in _ASSERTION_KEYWORDS and key != "$dynamicRef" and not self.vacuous(node, key):
                    self.add([*path, key], key,
                             "ignored: the subschema has no 'type' and xgrammar compiles it as any JSON value")
            return
        if types & {"integer", "number"}:
            self.visit_number(node, path, types)
        if "string" in types:
            self.visit_string(node, path)
        if "array" in types:
            self.visit_array(node, path)
        if "object" in types:
            self.visit_object(node, path)
        self.visit_generic(node, path)

    def visit_generic(self, node: Mapping[str, Any], path: list[str | int]) -> None:
        if "not" in node:
            # case not_const: {"type":"integer","not":{"const":3}} accepts 3.
            self.add([*path, "not"], "not", "not is ignored by xgrammar")
        if "if" in node:
            # case if_then_else: {"type":"integer","if":{"minimum":10},...} accepts 5 and 11.
            for key in ("if", "then", "else"):
                if key in node:
                    self.add([*path, key], key, "if/then/else is ignored by xgrammar")

    def visit_number(self, node: Mapping[str, Any], path: list[str | int], types: frozenset[str]) -> None:
        if "multipleOf" not in node:
            return
        why = self.multiple_of_gap(node, types)
        if why is not None:
            self.add([*path, "multipleOf"], "multipleOf", why)

    @staticmethod
    def multiple_of_gap(node: Mapping[str, Any], types: frozenset[str]) -> str | None:
        m = node["multipleOf"]
        if "number" in types:
            # cases multipleof_number, multipleof_whole_number.
            return "multipleOf is ignored for type number"
        if not (isinstance(m, (int, float)) and float(m).is_integer()):
            # case multipleof_fraction_integer.
            return "multipleOf is ignored for type integer unless it is a whole number"
        if m > _MULTIPLE_OF_MAX:
            # cases multipleof_1024, multipleof_1025.
            return f"multipleOf above {_MULTIPLE_OF_MAX} is ignored"
        low = _int_bound(node, "minimum", "exclusiveMinimum", lower=True)
        high = _int_bound(node, "maximum", "exclusiveMaximum", lower=False)
        if (low is None) != (high is None):
            # cases multipleof_min_only, multipleof_max_only.
            return "multipleOf is ignored when only one of the bounds is given"
        if low is not None and high is not None and high - low + 1 > _MULTIPLE_OF_RANGE_MAX:
            return f"multipleOf is ignored when the bounds span more than {_MULTIPLE_OF_RANGE_MAX} integers"
        return None

    def visit_string(self, node: Mapping[str, Any], path: list[str | int]) -> None:
        fmt = node.get("format") if isinstance(node.get("format"), str) else None
        pattern = node.get("pattern") if isinstance(node.get("pattern"), str) else None
        if fmt is not None and fmt in _XGR_FORMATS:
            # A format xgrammar knows wins: pattern and lengths next to it are ignored
            # (cases pattern_with_format, format_max_length).
            if pattern is not None:
                self.add([*path, "pattern"], "pattern",
                         f"ignored by xgrammar when combined with format {fmt!r} (the format wins)")
            self.report_lengths(node, path, f"format {fmt!r}")
            if fmt in _FORMAT_GAPS:
                self.add([*path, "format"], "format", f"format {fmt!r}: {_FORMAT_GAPS[fmt]}" + _checked_tail(fmt))
            return
        if fmt is not None and fmt in _SPEC_FORMATS:
            # cases format_idn_email, format_idn_hostname, format_iri, format_iri_reference,
            # format_regex.  Formats outside the specification are annotations: no instance can
            # fail them, so they are not reported (case format_unknown).
            self.add([*path, "format"], "format", f"format {fmt!r} is not enforced by xgrammar" + _checked_tail(fmt))
        if pattern is not None:
            if _has_lookahead(pattern):
                # cases pattern_lookahead, pattern_negative_lookahead.
                self.add([*path, "pattern"], "pattern", "lookahead assertions in the pattern are ignored by xgrammar")
            # cases pattern_min_length, pattern_max_length.
            self.report_lengths(node, path, "pattern")

    def report_lengths(self, node: Mapping[str, Any], path: list[str | int], with_what: str) -> None:
        for key in ("minLength", "maxLength"):
            if key in node and not self.vacuous(node, key):
                self.add([*path, key], key, f"ignored by xgrammar when combined with {with_what}")

    def visit_array(self, node: Mapping[str, Any], path: list[str | int]) -> None:
        if node.get("uniqueItems") is True:
            # case unique_items: [1,1] accepted.
            self.add([*path, "uniqueItems"], "uniqueItems", "uniqueItems is ignored by xgrammar")
        if "contains" in node:
            # cases contains, min_contains, max_contains.
            for key in ("contains", "minContains", "maxContains"):
                if key in node:
                    self.add([*path, key], key, "contains/minContains/maxContains are ignored by xgrammar")
        items = node.get("items")
        if isinstance(items, Mapping):
            self.visit(items, [*path, "items"])
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            for i, sub in enumerate(prefix):
                self.visit(sub, [*path, "prefixItems", i])
        unevaluated = node.get("unevaluatedItems")
        if isinstance(unevaluated, Mapping) and "items" not in node:
            self.visit(unevaluated, [*path, "unevaluatedItems"])

    def visit_object(self, node: Mapping[str, Any], path: list[str | int]) -> None:
        props = node.get("properties")
        declared: Mapping[str, Any] = props if isinstance(props, Mapping) else {}
        required = node.get("required")
        if isinstance(required, list):
            for i, name in enumerate(required):
                if name not in declared:
                    # cases required_undeclared, required_undeclared_strict, required_with_pattern_properties.
                    self.add([*path, "required", i], "required",
                             f"required property {json.dumps(name)} is not declared in 'properties', "
                             "and xgrammar does not enforce it")
        for key in ("dependentRequired", "dependentSchemas"):
            if node.get(key):
                # cases dependent_required, dependent_schemas.
                self.add([*path, key], key, f"{key} is ignored by xgrammar")
        self.check_object_keys(node, path, declared)
        self.check_unevaluated_properties(node, path, declared)
        for name, sub in declared.items():
            self.visit(sub, [*path, "properties", name])
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, Mapping):
            for name, sub in pattern_props.items():
                self.visit(sub, [*path, "patternProperties", name])
        additional = node.get("additionalProperties")
        used = declared or not pattern_props  # patternProperties alone closes the object
        if isinstance(additional, Mapping) and used:
            self.visit(additional, [*path, "additionalProperties"])
        unevaluated = node.get("unevaluatedProperties")
        if isinstance(unevaluated, Mapping) and "additionalProperties" not in node and used:
            self.visit(unevaluated, [*path, "unevaluatedProperties"])
        names = node.get("propertyNames")
        if isinstance(names, Mapping) and not pattern_props:  # ignored next to patternProperties
            self.visit(names, [*path, "propertyNames"], default_type="string")

    def check_object_keys(self, node: Mapping[str, Any], path: list[str | int], declared: Mapping[str, Any]) -> None:
        """Gaps in which keys may appear, and which schema checks their values.

        The grammar shapes, read from ``xgrammar.Grammar.from_json_schema`` output and
        pinned by the property_names_* and pattern_properties_* cases:

        * with ``patternProperties`` and no declared property, keys must fully match a
          pattern (closed object); with declared properties, the declared ones come
          first, then each further key is a pattern key with the pattern's schema or,
          when the object is open, ANY key with the additional schema (or any value);
          ``propertyNames`` is ignored next to ``patternProperties``;
        * with ``propertyNames`` (any value, even ``{}``), further keys match
          propertyNames WITHOUT excluding declared names; with no declared property
          the object stays open whatever additionalProperties, unevaluatedProperties
          and strict mode say;
        * "open" means additionalProperties is not false and not (strict mode with
          neither additionalProperties nor a schema-valued unevaluatedProperties).
        """
        patterns = node.get("patternProperties")
        pattern_props: Mapping[str, Any] = patterns if isinstance(patterns, Mapping) else {}
        names_schema = node.get("propertyNames")
        has_names = isinstance(names_schema, Mapping)
        additional = node.get("additionalProperties", _MISSING)
        unevaluated = node.get("unevaluatedProperties", _MISSING)
        open_branch = additional is not False and not (
            self.strict_mode and additional is _MISSING and unevaluated in (_MISSING, False)
        )
        if pattern_props:
            notes: list[str] = []
            if has_names:
                # case property_names_ignored_with_pattern_properties.
                self.add([*path, "propertyNames"], "propertyNames", "ignored by xgrammar next to patternProperties")
            overlap = [n for n in declared if any(re.search(p, n) for p in pattern_props)]
            if overlap:
                # case pattern_properties_overlap_declared.
                notes.append("these declared properties also match a pattern, and xgrammar checks their values "
                             "against only one of the two schemas: " + ", ".join(json.dumps(n) for n in overlap))
            if declared and open_branch:
                # case pattern_properties_open_with_properties.
                notes.append("with declared properties on an open object, xgrammar accepts any further key with "
                             "the additional schema, so pattern keys are not checked against their schemas")
                self.add([*path, "properties"], "properties",
                         "declared properties can appear again as additional properties, whose values are not "
                         "checked against their schemas")
            if notes:
                self.add([*path, "patternProperties"], "patternProperties", "; ".join(notes))
            return
        if not has_names:
            return
        if not declared:
            # cases property_names_ignore_additional_false, property_names_ignore_unevaluated_false_strict.
            if additional is False:
                self.add([*path, "additionalProperties"], "additionalProperties",
                         "false is ignored by xgrammar next to propertyNames when no property is declared")
            elif additional is _MISSING and unevaluated is False:
                self.add([*path, "unevaluatedProperties"], "unevaluatedProperties",
                         "false is ignored by xgrammar next to propertyNames when no property is declared")
            return
        validator = self.root_validator.evolve(schema=names_schema)
        bad = [name for name in declared if not validator.is_valid(name)]
        if bad:
            # cases property_names_declared, property_names_unmatched_declared.
            self.add([*path, "propertyNames"], "propertyNames",
                     "declared properties are exempt in xgrammar; these names violate it: "
                     + ", ".join(json.dumps(b) for b in bad))
        reopened = [name for name in declared if name not in bad]
        if open_branch and reopened:
            # cases property_names_reopen_declared, property_names_required_duplicate.
            self.add([*path, "properties"], "properties",
                     "next to propertyNames, xgrammar lets these declared properties appear again as "
                     "additional properties, whose values are not checked against their schemas: "
                     + ", ".join(json.dumps(n) for n in reopened))

    def check_unevaluated_properties(
        self, node: Mapping[str, Any], path: list[str | int], declared: Mapping[str, Any]
    ) -> None:
        if "unevaluatedProperties" not in node:
            return
        value = node["unevaluatedProperties"]
        if _is_trivially_true(value):
            return
        if "additionalProperties" in node:
            # additionalProperties (whatever its value) evaluates every other key, so
            # unevaluatedProperties can never fail here (case unevaluated_with_additional_true).
            return
        if node.get("patternProperties") and not declared:
            return  # closed to pattern keys (case unevaluated_with_pattern_properties)
        if isinstance(node.get("propertyNames"), Mapping) and not declared and not node.get("patternProperties"):
            return  # reported by check_object_keys
        if value is False and not self.strict_mode:
            # case unevaluated_false: {"a":1,"b":2} accepted in non-strict mode.
            self.add([*path, "unevaluatedProperties"], "unevaluatedProperties",
                     "unevaluatedProperties false is ignored by xgrammar unless strict mode closes the object")

    def vacuous(self, node: Mapping[str, Any], key: str) -> bool:
        """Whether ``key`` can never fail in ``node`` (reporting it would be noise)."""
        value = node[key]
        if key in ("then", "else"):
            return "if" not in node
        if key in ("minContains", "maxContains"):
            return "contains" not in node
        if key in ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames"):
            return _is_trivially_true(value)
        if key == "uniqueItems":
            return value is not True
        if key in ("minLength", "minItems", "minProperties"):
            return value == 0
        if key in ("required", "properties", "patternProperties", "dependentRequired", "dependentSchemas"):
            return not value
        return False


def _int_bound(node: Mapping[str, Any], inclusive: str, exclusive: str, *, lower: bool) -> int | None:
    """The effective inclusive integer bound (xgrammar folds exclusive bounds, case multipleof_exclusive)."""
    candidates: list[int] = []
    if isinstance(node.get(inclusive), (int, float)) and not isinstance(node.get(inclusive), bool):
        candidates.append(int(node[inclusive]))
    if isinstance(node.get(exclusive), (int, float)) and not isinstance(node.get(exclusive), bool):
        candidates.append(int(node[exclusive]) + (1 if lower else -1))
    if not candidates:
        return None
    return max(candidates) if lower else min(candidates)


def _root_validator(schema: Any) -> Any:
    # The schema's own draft when it names one ($schema): draft-04/06/07
    # keywords such as `dependencies` are then checked (the dev set's only
    # uncaught under-constraints were draft-04 `dependencies`); Draft 2020-12 otherwise.
    cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
    return cls(schema, registry=_NO_RETRIEVE_REGISTRY, format_checker=cls.FORMAT_CHECKER)


def _walk(schema: Any, strict_mode: bool, root_validator: Any) -> tuple[UnenforcedKeyword, ...]:
    walker = _Walker(schema, strict_mode, root_validator)
    walker.walk()
    unique = {(u.pointer, u.keyword): u for u in walker.found}
    return tuple(unique[k] for k in sorted(unique))


def unenforced_keywords(schema: Mapping[str, Any] | bool, *, strict_mode: bool) -> tuple[UnenforcedKeyword, ...]:
    """List the keywords of ``schema`` that xgrammar 0.2.9 does not enforce while decoding.

    Parameters
    ----------
    schema : Mapping or bool
        A Draft 2020-12 JSON Schema (already parsed).
    strict_mode : bool
        The ``strict_mode`` the schema is compiled with (the request's
        ``grammar_options.strict``): it decides whether ``unevaluatedProperties:
        false`` is enforced on otherwise open objects.

    Returns
    -------
    tuple of UnenforcedKeyword
        Sorted by pointer then keyword; empty when decoding enforces every keyword.

    Raises
    ------
    ConstraintError
        ``schema`` is not a valid Draft 2020-12 schema (field ``grammar#<pointer>``).

    Notes
    -----
    Constructs that xgrammar refuses to compile (:data:`REFUSED_CONSTRUCTS`) are
    not reported here: compiling them raises.  Narrowings (valid instances that
    the grammar excludes) are not reported either: they cannot produce an invalid
    output.
    """
    _check_schema(schema)
    return _walk(schema, strict_mode, _root_validator(schema))


# --------------------------------------------------------------------------------------
# Post-validation
# --------------------------------------------------------------------------------------


class _DuplicateKeys(Exception):
    """Internal: raised by the pairs hook to restart parsing in duplicate-tracking mode."""


class _ObjectWithDuplicates(dict):  # type: ignore[type-arg]
    """A parsed JSON object that had repeated keys (the last value wins, as in ``json``)."""

    __slots__ = ("duplicates",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.duplicates: list[str] = []
        for key, _ in pairs:
            if key in seen and key not in self.duplicates:
                self.duplicates.append(key)
            seen.add(key)


def _strict_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise _DuplicateKeys
    return result


def _tracking_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    return _ObjectWithDuplicates(pairs) if len(result) != len(pairs) else result


class _NotJsonNumber(Exception):
    """Internal: a token ``json`` would accept that is not a JSON number (or that Python cannot hold)."""

    def __init__(self, token: str, reason: str) -> None:
        super().__init__(token)
        self.token = token
        self.reason = reason


def _reject_constant(name: str) -> Any:
    raise _NotJsonNumber(name, f"{name} is not valid JSON")


def _parse_int(digits: str) -> int:
    try:
        return int(digits)
    except ValueError as err:  # beyond sys.get_int_max_str_digits() (4300 digits by default)
        raise _NotJsonNumber(digits, f"integer of {len(digits)} digits is too long to parse") from err


def _find_outside_strings(text: str, token: str) -> int:
    """Index of the first ``token`` outside JSON strings (0 when absent)."""
    i, n, in_string = 0, len(text), False
    while i < n:
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif text.startswith(token, i):
            return i
        i += 1
    return 0


def _line_column(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _parse(text: str) -> tuple[Any, str | None, bool]:
    """Parse ``text``; return ``(value, error, has_duplicates)``."""
    try:
        try:
            # Fast path: a plain dict per object; repeated keys (rare) restart in tracking mode.
            value = json.loads(text, object_pairs_hook=_strict_pairs, parse_constant=_reject_constant,
                               parse_int=_parse_int)
            return value, None, False
        except _DuplicateKeys:
            value = json.loads(text, object_pairs_hook=_tracking_pairs, parse_constant=_reject_constant,
                               parse_int=_parse_int)
            return value, None, True
    except json.JSONDecodeError as err:
        return None, f"line {err.lineno} column {err.colno}: {err.msg}", False
    except _NotJsonNumber as err:
        line, column = _line_column(text, _find_outside_strings(text, err.token))
        return None, f"line {line} column {column}: {err.reason}", False


def _duplicate_violations(value: Any, path: list[str | int]) -> Iterator[tuple[tuple[Any, ...], Violation]]:
    if isinstance(value, dict):
        if isinstance(value, _ObjectWithDuplicates):
            for key in value.duplicates:
                v = Violation(_pointer(path), f"duplicate key {json.dumps(key)} (the last value is used)",
                              "duplicate-key", "")
                yield _sort_key(v, path), v
        for key, sub in value.items():
            yield from _duplicate_violations(sub, [*path, key])
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _duplicate_violations(sub, [*path, i])


def _sort_key(v: Violation, path: Sequence[str | int]) -> tuple[Any, ...]:
    return (tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in path), v.keyword, v.message)


class PostValidator:
    """Parse and validate outputs against one JSON Schema; build once, reuse per output.

    Parameters
    ----------
    schema : Mapping or bool
        A Draft 2020-12 JSON Schema (already parsed).
    max_violations : int, default 100
        At most this many violations are reported per output (the ``RESULT``
        tensor is one gRPC message); :attr:`ValidationReport.truncated` says when
        more existed.

    Raises
    ------
    ConstraintError
        The schema is not valid Draft 2020-12 (patterns must also compile with
        Python's ``re``, the validator's regex engine), or a ``$ref`` does not
        resolve within the schema (remote references are never fetched).
    ConfigError
        ``max_violations`` is not a positive integer.

    Notes
    -----
    Every format in :func:`checked_formats` is asserted; other formats are not.
    Its only mutable state is the memo of :meth:`unenforced` (a race computes
    the same tuple twice), so one instance can be shared between threads.
    """

    __slots__ = ("_max_violations", "_schema", "_unenforced", "_validator")

    def __init__(self, schema: Mapping[str, Any] | bool, *, max_violations: int = 100) -> None:
        if isinstance(max_violations, bool) or not isinstance(max_violations, int) or max_violations < 1:
            raise ConfigError(f"max_violations: must be a positive integer, got {max_violations!r}")
        _check_schema(schema)
        self._schema = schema
        self._max_violations = max_violations
        self._validator = _root_validator(schema)
        _check_refs(schema)
        self._unenforced: dict[bool, tuple[UnenforcedKeyword, ...]] = {}

    @property
    def schema(self) -> Mapping[str, Any] | bool:
        """The schema this validator checks against."""
        return self._schema

    def unenforced(self, *, strict_mode: bool) -> tuple[UnenforcedKeyword, ...]:
        """Return :func:`unenforced_keywords` for this schema (memoized per ``strict_mode``).

        Parameters
        ----------
        strict_mode : bool
            The ``strict_mode`` the schema is compiled with.

        Returns
        -------
        tuple of UnenforcedKeyword
            As :func:`unenforced_keywords`.
        """
        found = self._unenforced.get(strict_mode)
        if found is None:
            found = _walk(self._schema, strict_mode, self._validator)
            self._unenforced[strict_mode] = found  # idempotent: a race computes the same tuple
        return found

    def validate_text(self, text: str | bytes) -> ValidationReport:
        """Parse ``text`` as one JSON value and validate it.

        Parameters
        ----------
        text : str or bytes
            The output; bytes must be UTF-8.  ``NaN``/``Infinity`` are rejected as
            not JSON.

        Returns
        -------
        ValidationReport
            ``parsed=False`` with ``parse_error`` (line and column) when the text
            is not one JSON value; repeated object keys are reported as
            ``duplicate-key`` violations.
        """
        if isinstance(text, bytes):
            try:
                decoded = text.decode("utf-8")
            except UnicodeDecodeError as err:
                prefix = text[: err.start].decode("utf-8")  # valid up to the first bad byte
                line, column = _line_column(prefix, len(prefix))
                return ValidationReport(False, f"line {line} column {column}: invalid UTF-8 ({err.reason})",
                                        None, (), False)
        elif isinstance(text, str):
            decoded = text
        else:
            raise TypeError(f"text: expected str or bytes, got {type(text).__name__}")
        value, error, has_duplicates = _parse(decoded)
        if error is not None:
            return ValidationReport(False, error, None, (), False)
        extra = tuple(_duplicate_violations(value, [])) if has_duplicates else ()
        return self._validate(value, extra)

    def validate_instance(self, instance: Any) -> ValidationReport:
        """Validate an already-parsed JSON value.

        Parameters
        ----------
        instance : Any
            A JSON-compatible Python value (a ``str`` is a JSON string here, never
            text to parse).

        Returns
        -------
        ValidationReport
            With ``parsed=True``.
        """
        return self._validate(instance, ())

    def _validate(self, value: Any, extra: tuple[tuple[tuple[Any, ...], Violation], ...]) -> ValidationReport:
        keyed = list(extra)
        truncated = False
        for error in self._validator.iter_errors(value):
            if len(keyed) >= self._max_violations:
                truncated = True
                break
            keyed.append(_keyed_violation(error))
        keyed.sort(key=lambda kv: kv[0])
        violations = tuple(v for _, v in keyed)
        return ValidationReport(True, None, not violations, violations, truncated)


def _keyed_violation(error: ValidationError) -> tuple[tuple[Any, ...], Violation]:
    path = list(error.absolute_path)
    keyword = str(error.validator)
    v = Violation(_pointer(path), _cut(error.message), keyword, _pointer(list(error.absolute_schema_path)))
    return _sort_key(v, path), v


def _check_refs(schema: Any) -> None:
    """Raise :class:`ConstraintError` for a ``$ref`` that cannot be resolved without the network."""
    spec = referencing.jsonschema.DRAFT202012
    # The same resolver jsonschema builds for the validator: the root resource over the
    # meta-schema registry, with no retrieval function.
    resolver = _NO_RETRIEVE_REGISTRY.resolver_with_root(spec.create_resource(schema))

    def walk(node: Any, path: list[str | int], res: Any) -> None:
        if not isinstance(node, Mapping):
            return
        if "$id" in node and path:
            res = res.in_subresource(spec.create_resource(node))
        for key in ("$ref", "$dynamicRef"):
            ref = node.get(key)
            if isinstance(ref, str):
                try:
                    res.lookup(ref)
                except referencing.exceptions.Unresolvable as err:
                    raise ConstraintError(f"grammar#{_pointer([*path, key])}",
                                          f"cannot resolve {ref!r} (remote references are not fetched): "
                                          f"{type(err).__name__}") from err
        for sub, sub_path in _children(node, path):
            walk(sub, sub_path, res)

    walk(schema, [], resolver)


def _children(node: Mapping[str, Any], path: list[str | int]) -> Iterator[tuple[Any, list[str | int]]]:
    for key in _SCHEMA_MAP_KEYWORDS:
        sub = node.get(key)
        if isinstance(sub, Mapping):
            for name, child in sub.items():
                yield child, [*path, key, name]
    for key in _SCHEMA_LIST_KEYWORDS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                yield child, [*path, key, i]
    for key in _SCHEMA_KEYWORDS:
        if key in node:
            yield node[key], [*path, key]


# --------------------------------------------------------------------------------------
# Per-schema cache
# --------------------------------------------------------------------------------------

VALIDATOR_CACHE_SIZE: Final = 128
"""How many schemas' validators :func:`validator_for` keeps (least recently used goes first)."""
_cache: OrderedDict[str, PostValidator] = OrderedDict()
_cache_lock = threading.Lock()


def validator_for(schema: Mapping[str, Any] | bool) -> PostValidator:
    """Return the shared :class:`PostValidator` of ``schema`` (LRU of 128 schemas).

    The key is the schema's canonical JSON text (sorted keys), which costs one
    serialization per call (about 0.1 ms for a 50-property schema); a caller that
    validates many outputs of one constraint should keep the returned object.

    Parameters
    ----------
    schema : Mapping or bool
        A Draft 2020-12 JSON Schema.

    Returns
    -------
    PostValidator
        Built on first use, then shared.

    Raises
    ------
    ConstraintError
        As :class:`PostValidator`, or the schema is not JSON-serializable.
    """
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConstraintError("grammar", f"schema is not JSON-serializable: {err}") from err
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    built = PostValidator(schema)  # outside the lock: building can take milliseconds
    with _cache_lock:
        found = _cache.setdefault(key, built)
        _cache.move_to_end(key)
        while len(_cache) > VALIDATOR_CACHE_SIZE:
            _cache.popitem(last=False)
    return found


def validate_output(schema: Mapping[str, Any] | bool, text_or_instance: Any) -> ValidationReport:
    """Validate one output against ``schema`` (through :func:`validator_for`'s cache).

    Parameters
    ----------
    schema : Mapping or bool
        A Draft 2020-12 JSON Schema.
    text_or_instance : str, bytes or JSON value
        ``str``/``bytes`` are parsed as JSON text; anything else is validated as
        an already-parsed instance.

    Returns
    -------
    ValidationReport
        See :meth:`PostValidator.validate_text`.
    """
    validator = validator_for(schema)
    if isinstance(text_or_instance, (str, bytes)):
        return validator.validate_text(text_or_instance)
    return validator.validate_instance(text_or_instance)

