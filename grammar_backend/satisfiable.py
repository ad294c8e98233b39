"""A cheap, conservative proof that a JSON schema admits no instance.

A schema that no value satisfies (``items`` an enum of 2 values with
``minItems: 3`` and ``uniqueItems``) compiles, and the model then decodes
until a budget runs out or a value check gives up, to an output that
post-validation must refuse.  :func:`check_satisfiable` refuses such a
schema before any compile, where a simple contradiction proves it empty.

It never refuses a satisfiable schema: it reasons about the seven kinds of
JSON value (null, boolean, object, array, string, integer, non-integer
number) and marks a kind *dead* at a schema location only where a keyword
there provably excludes every value of that kind.  A location whose kinds
are all dead admits nothing.  Composition keeps that sound: ``allOf`` (and
``$ref`` beside other keywords, from draft 2019-09 on) kills what any member
kills; ``anyOf``/``oneOf`` only what every branch kills; ``if``/``then``/
``else`` what both ``then`` and ``else`` kill.  An object dies through its
required properties, an array through the items its ``minItems`` needs.
What it cannot decide (patterns, formats, remote references, a ``$ref``
cycle still being examined) it leaves alive.

Bounded: at most :data:`MAX_NODES` locations are examined (each once, results
memoized by JSON pointer) and ``$ref`` chains at most :data:`MAX_DEPTH` deep.
On the 2,890 maskbench-dev schemas it takes p99 0.51 ms (inside ``bench/grammar_bench.py
../shared/data/maskbench-dev``'s ``parse_constraint, new schema`` row; the run
that timed it alone: docs/benchmarks.md), refuses none of them, and none has
a valid test instance it would contradict.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Final, NamedTuple
from urllib.parse import unquote

import jsonschema.validators
from jsonschema import Draft4Validator, Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator

from grammar_backend.errors import ConstraintError

__all__ = ["MAX_DEPTH", "MAX_NODES", "check_satisfiable", "json_canonical", "json_normal", "unsatisfiable"]

#: Most schema locations examined per schema; past it the rest counts as satisfiable.
MAX_NODES: Final = 20_000
#: Deepest nesting of locations (properties, items, ``$ref`` hops...) followed.
MAX_DEPTH: Final = 64
#: Most ``enum`` values validated one by one (a larger enum is only checked for the kinds of its values).
MAX_ENUM_CHECKS: Final = 64

#: The kinds of JSON value; ``number`` is ``integer`` plus ``fraction``.
_KINDS: Final = ("null", "boolean", "object", "array", "string", "integer", "fraction")
_ALL: Final = frozenset(_KINDS)
_TYPE_KINDS: Final = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
                      "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"}}
#: Keys that say nothing about the instance.
_ANNOTATIONS: Final = frozenset({"$comment", "description", "title", "default", "examples", "$id", "$schema",
                                 "deprecated", "readOnly", "writeOnly", "$anchor", "$defs", "definitions",
                                 "$vocabulary", "contentMediaType", "contentEncoding", "format"})
#: The drafts reasoned about (draft 3's ``required``, ``type`` and ``disallow`` mean other things: not checked).
_DRAFTS: Final = (Draft4Validator, Draft6Validator, Draft7Validator, Draft201909Validator, Draft202012Validator)
#: Keywords without subschemas, validated on each enum value (``pattern``: Python's dialect differs, left out).
_LOCAL: Final = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                 "maxLength", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "required")


class _Cause(NamedTuple):
    """Why one kind of value is dead at a location: where, why, and whether only a ``type`` keyword said so."""

    pointer: str
    reason: str
    by_type: bool = False


_Dead = dict[str, _Cause]


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return "fraction"


def _escape(segment: str) -> str:
    return segment.replace("~", "~0").replace("/", "~1")


def _number(value: Any) -> Fraction | None:
    """``value`` as an exact fraction (None: not a finite number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return Fraction(value)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class _Prover:
    """One schema's analysis (memoized by location)."""

    def __init__(self, root: Mapping[str, Any] | bool) -> None:
        self.root = root
        self.cls = jsonschema.validators.validator_for(root, default=Draft202012Validator) \
            if isinstance(root, Mapping) else Draft202012Validator
        self.draft4 = self.cls is Draft4Validator
        #: Draft 4-7: ``$ref`` overrides its siblings; 2019-09 on: they apply beside it.
        self.ref_alone = self.cls in (Draft4Validator, Draft6Validator, Draft7Validator)
        #: Before 2020-12 ``items`` may be a list (the tuple form) and ``prefixItems`` means nothing.
        self.tuples = self.cls is not Draft202012Validator
        self.memo: dict[str, _Dead] = {}
        self.busy: set[str] = set()
        self.nodes = 0
        #: A location below the root names its own base (``$id``): a ``#/...`` inside it means that
        #: resource, not this document, so no reference is followed any more.
        self.scoped = False
        self._id = "id" if self.draft4 else "$id"

    # -- locations ------------------------------------------------------------------

    def dead(self, node: Any, pointer: str, depth: int) -> _Dead:
        """The kinds of value no instance of ``node`` (at ``pointer``) can be, with their causes."""
        found = self.memo.get(pointer)
        if found is not None:
            return found
        if pointer in self.busy or depth > MAX_DEPTH or self.nodes >= MAX_NODES:
            return {}  # a cycle being examined, or past the bounds: alive, as far as this check knows
        self.nodes += 1
        self.busy.add(pointer)
        try:
            found = self._dead(node, pointer, depth)
        finally:
            self.busy.discard(pointer)
        self.memo[pointer] = found
        return found

    def empty(self, node: Any, pointer: str, depth: int) -> _Cause | None:
        """Why ``node`` admits no instance (None: it may admit one)."""
        dead = self.dead(node, pointer, depth)
        return summary(dead, pointer, node) if len(dead) == len(_KINDS) else None

    def resolve(self, ref: Any) -> tuple[Any, str] | None:
        """A local ``$ref`` (``#`` or ``#/...``): its target and pointer; None for any other reference."""
        if self.scoped or not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
            return None
        pointer = unquote(ref[1:])
        node: Any = self.root
        for raw in pointer.split("/")[1:]:
            seg = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and seg in node:
                node = node[seg]
            elif isinstance(node, list) and seg.isdigit() and int(seg) < len(node):
                node = node[int(seg)]
            else:
                return None
            if isinstance(node, dict) and isinstance(node.get(self._id), str):
                return None  # into an embedded resource: its references are its own
        return node, pointer

    def _dead(self, node: Any, pointer: str, depth: int) -> _Dead:
        if node is True:
            return {}
        if node is False:
            return dict.fromkeys(_KINDS, _Cause(pointer, "false admits no instance"))
        if not isinstance(node, dict):
            return {}
        dead: _Dead = {}
        if pointer and isinstance(node.get(self._id), str):
            self.scoped = True
        if "$ref" in node:
            target = self.resolve(node["$ref"])
            inner = {} if target is None else self.dead(target[0], target[1], depth + 1)
            if self.ref_alone:
                return inner
            dead.update(inner)
        types = node.get("type")
        if types is not None:
            allowed: set[str] = set()
            for name in [types] if isinstance(types, str) else types if isinstance(types, list) else ():
                allowed.update(_TYPE_KINDS.get(name, ()))
            if isinstance(types, (str, list)) and allowed != _ALL:
                cause = _Cause(pointer, f"type {types!r} excludes it", True)
                for kind in _ALL - allowed:
                    dead.setdefault(kind, cause)
        self._values(node, pointer, dead)
        # Only the kinds still alive are examined (a string's location skips the rest).
        if "integer" not in dead or "fraction" not in dead:
            self._numbers(node, pointer, dead)
        if "string" not in dead:
            self._strings(node, pointer, dead)
        if "array" not in dead:
            self._arrays(node, pointer, depth, dead)
        if "object" not in dead:
            self._objects(node, pointer, depth, dead)
        self._logic(node, pointer, depth, dead)
        return dead

    # -- keywords ---------------------------------------------------------------------

    def _values(self, node: dict[str, Any], pointer: str, dead: _Dead) -> None:
        """``enum`` / ``const``: only the kinds of the listed values live, and of those only the values that pass
        the location's own simple keywords (validated one by one for small enums)."""
        if "enum" in node and isinstance(node["enum"], list):
            values, where = node["enum"], f"{pointer}/enum"
        elif "const" in node and not self.draft4:
            values, where = [node["const"]], f"{pointer}/const"
        else:
            return
        if not values:
            cause = _Cause(where, "enum is empty")
            for kind in _KINDS:
                dead.setdefault(kind, cause)
            return
        kinds = {_kind(v) for v in values}
        local = {k: node[k] for k in _LOCAL if k in node}
        if local and len(values) <= MAX_ENUM_CHECKS:
            check = self.cls(local)
            # Enum membership is JSON equality (1 equals 1.0), but draft 4's "integer" refuses 1.0: either
            # spelling passing proves the value admitted.
            kinds = {_kind(v) for v in values if check.is_valid(v) or check.is_valid(json_normal(v))}
        what = "enum value" if where.endswith("/enum") else "const"
        cause = _Cause(where, f"no {what} satisfies the keywords beside it" if local else f"no {what} is of this kind")
        for kind in _ALL - kinds:
            dead.setdefault(kind, cause)

    def _numbers(self, node: dict[str, Any], pointer: str, dead: _Dead) -> None:
        lo, lo_x = _number(node.get("minimum")), False
        hi, hi_x = _number(node.get("maximum")), False
        exmin, exmax = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        if isinstance(exmin, bool):  # draft 4: it qualifies minimum
            lo_x = exmin and lo is not None
        elif (bound := _number(exmin)) is not None and (lo is None or bound >= lo):
            lo, lo_x = bound, True
        if isinstance(exmax, bool):
            hi_x = exmax and hi is not None
        elif (bound := _number(exmax)) is not None and (hi is None or bound <= hi):
            hi, hi_x = bound, True
        if lo is None or hi is None:
            return
        shown = f"{'exclusive ' if lo_x else ''}minimum {_show(lo)} and {'exclusive ' if hi_x else ''}maximum {_show(hi)}"
        if lo > hi or (lo == hi and (lo_x or hi_x)):
            for kind in ("integer", "fraction"):
                dead.setdefault(kind, _Cause(pointer, f"{shown} leave no number"))
            return
        if lo == hi and lo.denominator == 1:
            dead.setdefault("fraction", _Cause(pointer, f"{shown} leave only an integer"))
        first = math.floor(lo) + 1 if lo_x else math.ceil(lo)
        last = math.ceil(hi) - 1 if hi_x else math.floor(hi)
        step = _number(node.get("multipleOf"))
        if step is not None and step > 0 and step.denominator == 1:  # integers that are multiples of an integer
            first, last = -(-first // int(step)), last // int(step)
            if first > last:
                dead.setdefault("integer", _Cause(pointer, f"{shown} leave no multiple of {_show(step)}"))
        elif first > last:
            dead.setdefault("integer", _Cause(pointer, f"{shown} leave no integer"))

    @staticmethod
    def _strings(node: dict[str, Any], pointer: str, dead: _Dead) -> None:
        least, most = node.get("minLength", 0), node.get("maxLength")
        if isinstance(most, int) and isinstance(least, int) and least > most:
            dead.setdefault("string", _Cause(pointer, f"minLength {least} exceeds maxLength {most}"))

    def _arrays(self, node: dict[str, Any], pointer: str, depth: int, dead: _Dead) -> None:
        least, most = node.get("minItems", 0), node.get("maxItems")
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        most = most if isinstance(most, int) and not isinstance(most, bool) else None
        if most is not None and least > most:
            dead["array"] = _Cause(pointer, f"minItems {least} exceeds maxItems {most}")
            return
        items = node.get("items")
        prefix: list[Any] = []
        rest: Any = True
        rest_at = ""
        if self.tuples and isinstance(items, list):
            prefix, rest, rest_at = items, node.get("additionalItems", True), "/additionalItems"
            prefix_at = "/items"
        else:
            if not self.tuples and isinstance(node.get("prefixItems"), list):
                prefix = node["prefixItems"]
            prefix_at = "/prefixItems"
            if "items" in node:
                rest, rest_at = items, "/items"
        for k in range(min(least, len(prefix))):
            cause = self.empty(prefix[k], f"{pointer}{prefix_at}/{k}", depth + 1)
            if cause is not None:
                dead["array"] = cause
                return
        if least > len(prefix) and rest_at:
            cause = self.empty(rest, pointer + rest_at, depth + 1)
            if cause is not None:
                dead["array"] = cause
                return
            if node.get("uniqueItems") is True and not prefix:
                size = self._domain(rest, depth + 1)
                if size is not None and size < least:
                    dead["array"] = _Cause(pointer, f"uniqueItems with minItems {least} but items allow only "
                                                    f"{_count(size, 'value')}")
                    return
        if "contains" in node and not self.draft4:
            self._contains(node, pointer, depth, least, most, dead)

    def _contains(self, node: dict[str, Any], pointer: str, depth: int, least: int, most: int | None,
                  dead: _Dead) -> None:
        modern = self.cls not in (Draft6Validator, Draft7Validator)  # minContains/maxContains: 2019-09 on
        low = node.get("minContains", 1) if modern else 1
        high = node.get("maxContains") if modern else None
        if not isinstance(low, int) or isinstance(low, bool) or low < 1:
            return
        if isinstance(high, int) and not isinstance(high, bool) and high < low:
            dead["array"] = _Cause(pointer, f"minContains {low} exceeds maxContains {high}")
        elif most is not None and low > most:
            dead["array"] = _Cause(pointer, f"{'minContains' if modern and 'minContains' in node else 'contains'} "
                                            f"needs {_count(low, 'item')} but maxItems is {most}")
        elif (cause := self.empty(node["contains"], f"{pointer}/contains", depth + 1)) is not None:
            dead["array"] = cause

    def _domain(self, node: Any, depth: int) -> int | None:
        """How many distinct values ``node`` admits at most, where it is a small finite set (None: unknown)."""
        for _ in range(MAX_DEPTH - depth):
            # Beside a $ref (2019-09 on) the node's own enum still bounds it; before, the $ref alone counts.
            if not isinstance(node, dict) or "$ref" not in node or not (
                    self.ref_alone or set(node) <= _ANNOTATIONS | {"$ref"}):
                break
            target = self.resolve(node["$ref"])
            if target is None:
                return None
            node = target[0]
        if node is False:
            return 0
        if not isinstance(node, dict):
            return None
        if "enum" in node and isinstance(node["enum"], list):
            return len({json_canonical(v) for v in node["enum"]})
        if "const" in node and not self.draft4:
            return 1
        types = node.get("type")
        names = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
        if names is not None and names <= {"boolean", "null"}:
            return 2 * ("boolean" in names) + ("null" in names)
        return None

    def _objects(self, node: dict[str, Any], pointer: str, depth: int, dead: _Dead) -> None:
        least, most = node.get("minProperties", 0), node.get("maxProperties")
        required = node.get("required")
        names = list(dict.fromkeys(n for n in required if isinstance(n, str))) if isinstance(required, list) else []
        if isinstance(most, int) and isinstance(least, int) and least > most:
            dead["object"] = _Cause(pointer, f"minProperties {least} exceeds maxProperties {most}")
            return
        if isinstance(most, int) and len(names) > most:
            noun = "property" if len(names) == 1 else "properties"
            dead["object"] = _Cause(pointer, f"{len(names)} required {noun} but maxProperties {most}")
            return
        if not self.draft4 and "propertyNames" in node and (names or (isinstance(least, int) and least > 0)):
            # Names are strings: a propertyNames that admits no string admits no name.
            cause = self.dead(node["propertyNames"], f"{pointer}/propertyNames", depth + 1).get("string")
            if cause is not None:
                reason = "propertyNames admits no string" if cause.by_type else cause.reason
                dead["object"] = _Cause(cause.pointer, f"{reason}, and a property is needed")
                return
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        patterns = node.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        for name in names:
            where = []  # every subschema the value of `name` must satisfy
            if name in props:
                where.append((props[name], f"{pointer}/properties/{_escape(name)}"))
            unsure = False
            for pattern, sub in patterns.items():
                try:
                    hit = re.search(pattern, name) is not None
                except re.error:  # an ECMA pattern Python cannot read: it may match
                    unsure = True
                    continue
                if hit:
                    where.append((sub, f"{pointer}/patternProperties/{_escape(pattern)}"))
            if not where and not unsure and "additionalProperties" in node:
                extra = node["additionalProperties"]
                if extra is False:
                    dead["object"] = _Cause(pointer, f"required property {name!r} is forbidden by "
                                                     "additionalProperties: false")
                    return
                where.append((extra, f"{pointer}/additionalProperties"))
            for sub, at in where:
                cause = self.empty(sub, at, depth + 1)
                if cause is not None:
                    dead["object"] = cause
                    return

    def _logic(self, node: dict[str, Any], pointer: str, depth: int, dead: _Dead) -> None:
        members = node.get("allOf")
        if isinstance(members, list):
            for k, member in enumerate(members):
                for kind, cause in self.dead(member, f"{pointer}/allOf/{k}", depth + 1).items():
                    dead.setdefault(kind, cause)
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                each = [self.dead(b, f"{pointer}/{key}/{k}", depth + 1) for k, b in enumerate(branches)]
                for kind in _KINDS:
                    causes = [d.get(kind) for d in each]
                    if kind not in dead and all(c is not None for c in causes):
                        dead[kind] = _Cause(f"{pointer}/{key}", f"no {key} branch admits an instance",
                                            all(c is not None and c.by_type for c in causes))
        if "not" in node:
            negated = node["not"]
            if negated is True or (isinstance(negated, dict) and set(negated) <= _ANNOTATIONS):
                for kind in _KINDS:
                    dead.setdefault(kind, _Cause(f"{pointer}/not", "not of a schema every value satisfies"))
            elif isinstance(negated, dict) and set(negated) <= _ANNOTATIONS | {"type"}:
                types = negated.get("type")
                for name in [types] if isinstance(types, str) else types if isinstance(types, list) else ():
                    for kind in _TYPE_KINDS.get(name, ()):
                        dead.setdefault(kind, _Cause(f"{pointer}/not", f"not excludes type {name!r}"))
        if "if" in node and ("then" in node or "else" in node):
            then = self.dead(node.get("then", True), f"{pointer}/then", depth + 1)
            other = self.dead(node.get("else", True), f"{pointer}/else", depth + 1)
            for kind in set(then) & set(other):
                dead.setdefault(kind, _Cause(pointer, "neither then nor else admits an instance"))


def summary(dead: _Dead, pointer: str, node: Any) -> _Cause:
    """One cause for a location whose every kind is dead: the one that is not just its ``type``, else a sum."""
    causes = list(dict.fromkeys(c for c in dead.values() if not c.by_type))
    if len(causes) == 1:
        return causes[0]
    if not causes:
        return _Cause(pointer, "its types allow nothing in common" if not (isinstance(node, dict) and "allOf" in node)
                      else "allOf members with contradictory types")
    return _Cause(pointer, "no kind of value is left (" + "; ".join(f"{c.pointer or '/'}: {c.reason}"
                                                                   for c in causes) + ")")


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def json_normal(value: Any) -> Any:
    """``value`` with every integral float an int (JSON Schema equality does not tell them apart)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [json_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: json_normal(v) for k, v in value.items()}
    return value


def json_canonical(value: Any) -> str:
    """One text per JSON value under JSON Schema equality (``1`` equals ``1.0``; key order is irrelevant)."""
    return json.dumps(json_normal(value), sort_keys=True, separators=(",", ":"))


def unsatisfiable(schema: Mapping[str, Any] | bool) -> tuple[str, str] | None:
    """Where and why ``schema`` provably admits no instance: ``(JSON pointer, reason)``; None when not proved.

    Conservative: None for every satisfiable schema, and for the empty ones
    this cheap check cannot prove (see the module docstring).
    """
    prover = _Prover(schema)
    if prover.cls not in _DRAFTS:
        return None
    cause = prover.empty(schema, "", 0)
    return None if cause is None else (cause.pointer, cause.reason)


def check_satisfiable(schema: Mapping[str, Any] | bool, field_name: str = "grammar") -> None:
    """Refuse a schema that provably admits no instance (:func:`unsatisfiable`).

    Raises
    ------
    ConstraintError
        ``grammar: schema admits no instance at <pointer>: <reason>``
        (``at the root`` for the schema itself).
    """
    found = unsatisfiable(schema)
    if found is not None:
        pointer, reason = found
        raise ConstraintError(field_name, f"schema admits no instance at {pointer or 'the root'}: {reason}")
