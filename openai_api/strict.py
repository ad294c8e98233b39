"""OpenAI's strict mode: the JSON Schema subset that ``"strict": true`` takes, checked before anything compiles.

A request with ``response_format.json_schema.strict`` or a tool's
``function.strict`` set is refused by OpenAI unless its schema keeps to the
subset its Structured Outputs guide documents; a client written against
OpenAI relies on that refusal (a schema OpenAI would reject must not quietly
work here, and the reverse).  The rules, as documented (February 2026):

- the root is an object schema (``"type": "object"``), not ``anyOf``;
- every object sets ``additionalProperties: false`` and lists every one of
  its ``properties`` in ``required`` (optional is ``"type": [T, "null"]``);
- keywords: ``type`` (one or a list, ``"null"`` included), ``enum``,
  ``const``, ``anyOf`` (not at the root), ``$ref`` to the schema's own
  ``$defs``/``definitions`` or to ``#`` (recursion), annotations
  (``title``, ``description``, ...); strings ``pattern`` and ``format``
  (one of :data:`FORMATS`); numbers ``minimum``, ``maximum``,
  ``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf``; arrays
  ``items``, ``minItems``, ``maxItems``; anything else (``allOf``,
  ``not``, ``if``, ``minLength``, ``patternProperties``, ...) is refused by
  name;
- limits: :data:`MAX_PROPERTIES` object properties in all,
  :data:`MAX_DEPTH` levels of nested objects, :data:`MAX_STRING_CHARS`
  characters of property names, definition names, enum and const values,
  :data:`MAX_ENUM_VALUES` enum values in all, and a string enum of more than
  :data:`LARGE_ENUM` values at most :data:`MAX_LARGE_ENUM_CHARS` characters.

Every refusal is a :class:`~openai_api.errors.BadRequest` whose ``param`` is
the dotted path of the subschema at fault (``...schema.properties.a``) and
whose reason names the keyword.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from openai_api.errors import BadRequest

__all__ = [
    "FORMATS",
    "LARGE_ENUM",
    "MAX_DEPTH",
    "MAX_ENUM_VALUES",
    "MAX_LARGE_ENUM_CHARS",
    "MAX_PROPERTIES",
    "MAX_STRING_CHARS",
    "check_strict",
]

MAX_PROPERTIES: Final = 5_000
MAX_DEPTH: Final = 10
MAX_STRING_CHARS: Final = 120_000
MAX_ENUM_VALUES: Final = 1_000
LARGE_ENUM: Final = 250
MAX_LARGE_ENUM_CHARS: Final = 15_000
FORMATS: Final = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})

_TYPES: Final = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
#: Keywords any subschema may carry; annotations change nothing the model may emit.
_COMMON: Final = frozenset(
    {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "title", "description", "$comment",
     "$schema", "$id", "examples", "default"})
#: Keywords that apply to one type, allowed where ``type`` admits it.
_BY_TYPE: Final[Mapping[str, frozenset[str]]] = {
    "string": frozenset({"pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
}
_REF_PREFIXES: Final = ("#/$defs/", "#/definitions/")


@dataclass
class _Totals:
    """Running totals against the schema-wide limits."""

    properties: int = 0
    chars: int = 0
    enum_values: int = 0


def check_strict(schema: Mapping[str, Any], param: str) -> None:
    """Refuse ``schema`` unless OpenAI's strict mode takes it.

    Parameters
    ----------
    schema : mapping
        The JSON schema (already known to be a JSON object).
    param : str
        Its dotted path in the request body
        (``response_format.json_schema.schema``, ``tools[0].function.parameters``).

    Raises
    ------
    BadRequest
        The first rule broken, ``param`` extended to the subschema at fault.
    """
    if "anyOf" in schema:
        raise BadRequest(param, "strict mode: the root schema must not be anyOf")
    if schema.get("type") != "object":
        raise BadRequest(param, f"strict mode: the root schema must be of type object, got {schema.get('type')!r}")
    totals = _Totals()
    defs = _definitions(schema, param, totals)
    _check(schema, param, defs, totals, depth=0)
    for where, sub in defs.items():
        _sub(sub, f"{param}.{where}", defs, totals, depth=0)
    if totals.properties > MAX_PROPERTIES:
        raise BadRequest(param, f"strict mode: {totals.properties} object properties; at most {MAX_PROPERTIES}")
    if totals.chars > MAX_STRING_CHARS:
        raise BadRequest(param, f"strict mode: {totals.chars} characters of property names, definition names, "
                                f"enum and const values; at most {MAX_STRING_CHARS}")
    if totals.enum_values > MAX_ENUM_VALUES:
        raise BadRequest(param, f"strict mode: {totals.enum_values} enum values; at most {MAX_ENUM_VALUES}")


def _definitions(schema: Mapping[str, Any], param: str, totals: _Totals) -> dict[str, Any]:
    """The root's ``$defs``/``definitions`` by path (``$defs.name``); their names count against the limits."""
    out: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        table = schema.get(key)
        if table is None:
            continue
        if not isinstance(table, Mapping):
            raise BadRequest(f"{param}.{key}", "must be an object of schemas")
        for name, sub in table.items():
            if not isinstance(sub, Mapping):
                raise BadRequest(f"{param}.{key}.{name}", "must be a schema (a JSON object)")
            totals.chars += len(name)
            out[f"{key}.{name}"] = sub
    return out


def _types(schema: Mapping[str, Any], param: str) -> frozenset[str]:
    raw = schema.get("type")
    if raw is None:
        return frozenset()
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise BadRequest(f"{param}.type", "must be a type name or a non-empty list of them")
    unknown = [n for n in names if n not in _TYPES]
    if unknown:
        raise BadRequest(f"{param}.type", f"unknown type {unknown[0]!r}")
    return frozenset(names)


def _check(schema: Mapping[str, Any], param: str, defs: Mapping[str, Any], totals: _Totals, depth: int) -> None:
    types = _types(schema, param)
    allowed = set(_COMMON)
    for name in types:
        allowed |= _BY_TYPE.get(name, frozenset())
    for key in schema:
        if key not in allowed:
            owner = next((t for t, keys in _BY_TYPE.items() if key in keys), None)
            why = f"only allowed with type {owner}" if owner is not None else "not supported"
            raise BadRequest(f"{param}.{key}", f"strict mode: keyword {key!r} is {why}")
    if not types and not {"enum", "const", "anyOf", "$ref"} & schema.keys():
        raise BadRequest(param, "strict mode: every schema needs a type (or enum, const, anyOf, $ref)")
    if "$ref" in schema:
        _ref(schema["$ref"], f"{param}.$ref", defs)
    if "enum" in schema:
        _enum(schema["enum"], f"{param}.enum", totals)
    if "const" in schema:
        totals.chars += len(schema["const"]) if isinstance(schema["const"], str) else 0
    if "format" in schema and schema["format"] not in FORMATS:
        raise BadRequest(f"{param}.format", f"strict mode: format {schema['format']!r} is not supported; one of "
                                            f"{', '.join(sorted(FORMATS))}")
    if "anyOf" in schema:
        branches = schema["anyOf"]
        if not isinstance(branches, list) or not branches:
            raise BadRequest(f"{param}.anyOf", "must be a non-empty list of schemas")
        for i, sub in enumerate(branches):
            _sub(sub, f"{param}.anyOf[{i}]", defs, totals, depth)
    if "object" in types:
        _object(schema, param, defs, totals, depth + 1)
    if "array" in types and "items" in schema:
        _sub(schema["items"], f"{param}.items", defs, totals, depth)


def _sub(sub: Any, param: str, defs: Mapping[str, Any], totals: _Totals, depth: int) -> None:
    if not isinstance(sub, Mapping):
        raise BadRequest(param, "must be a schema (a JSON object)")
    if "$defs" in sub or "definitions" in sub:
        raise BadRequest(param, "strict mode: $defs are taken at the root only")
    _check(sub, param, defs, totals, depth)


def _object(schema: Mapping[str, Any], param: str, defs: Mapping[str, Any], totals: _Totals, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise BadRequest(param, f"strict mode: more than {MAX_DEPTH} levels of nested objects")
    if schema.get("additionalProperties") is not False:
        raise BadRequest(f"{param}.additionalProperties", "strict mode: must be false for every object")
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping):
        raise BadRequest(f"{param}.properties", "must be an object of schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BadRequest(f"{param}.required", "must be a list of property names")
    missing = [name for name in properties if name not in required]
    if missing:
        raise BadRequest(f"{param}.required", f"strict mode: every property must be required; missing "
                                              f"{', '.join(repr(m) for m in missing)} (make a field optional with "
                                              "a type list that includes \"null\")")
    extra = [name for name in required if name not in properties]
    if extra:
        raise BadRequest(f"{param}.required", f"{extra[0]!r} is required but not among the properties")
    totals.properties += len(properties)
    for name, sub in properties.items():
        totals.chars += len(name)
        _sub(sub, f"{param}.properties.{name}", defs, totals, depth)


def _ref(ref: Any, param: str, defs: Mapping[str, Any]) -> None:
    if ref == "#":
        return
    if not isinstance(ref, str) or not ref.startswith(_REF_PREFIXES):
        raise BadRequest(param, f"strict mode: $ref must be '#' or point into the root's $defs, got {ref!r}")
    key = ref[2:].replace("/", ".", 1)
    if key not in defs:
        raise BadRequest(param, f"strict mode: $ref {ref!r} names no definition")


def _enum(values: Any, param: str, totals: _Totals) -> None:
    if not isinstance(values, list) or not values:
        raise BadRequest(param, "must be a non-empty list")
    totals.enum_values += len(values)
    strings = [v for v in values if isinstance(v, str)]
    chars = sum(len(v) for v in strings)
    totals.chars += chars
    if len(strings) > LARGE_ENUM and chars > MAX_LARGE_ENUM_CHARS:
        raise BadRequest(param, f"strict mode: an enum of more than {LARGE_ENUM} strings holds at most "
                                f"{MAX_LARGE_ENUM_CHARS} characters; got {len(strings)} strings of {chars}")
