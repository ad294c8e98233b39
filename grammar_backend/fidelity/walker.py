"""The walk: which keywords of a schema xgrammar 0.2.9 leaves unenforced (rules in :mod:`.table`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema.validators
import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema import Draft202012Validator

from grammar_backend.fidelity.report import UnenforcedKeyword
from grammar_backend.fidelity.table import (
    _ASSERTION_KEYWORDS,
    _FORMAT_GAPS,
    _INFER_ARRAY,
    _INFER_OBJECT,
    _MISSING,
    _MULTIPLE_OF_MAX,
    _MULTIPLE_OF_RANGE_MAX,
    _NO_RETRIEVE_REGISTRY,
    _REF_FOLLOW_DEPTH,
    _SPEC_FORMATS,
    _WINNERS,
    _XGR_FORMATS,
    _checked_tail,
)
from grammar_backend.spec import check_schema, json_pointer

#: The draft every reference is resolved with (xgrammar follows JSON pointers only).
_DRAFT = referencing.jsonschema.DRAFT202012

# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


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
    """Resolve ``#`` or ``#/a/b`` against the document ``root`` (as xgrammar does: the root's
    pointers only, whatever ``$id`` says); ``None`` when it does not resolve."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    resolver = _NO_RETRIEVE_REGISTRY.resolver_with_root(_DRAFT.create_resource(root))
    try:
        return resolver.lookup(ref).contents
    except referencing.exceptions.Unresolvable:
        return None


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
            pointer = json_pointer(target_path)
            if pointer not in self.visited:
                self.visit(_resolve_local(self.root, "#" + pointer), target_path)

    def add(self, path: Sequence[str | int], keyword: str, note: str) -> None:
        self.found.append(UnenforcedKeyword(json_pointer(path), keyword, note))

    # -- entry --------------------------------------------------------------------------
    def visit(self, node: Any, path: list[str | int], default_type: str | None = None) -> None:
        if not isinstance(node, Mapping):
            return  # true compiles to any value; false is refused by xgrammar
        self.visited.add(json_pointer(path))
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
        for key in ("dependentRequired", "dependentSchemas", "dependencies"):
            if node.get(key):
                # cases dependent_required, dependent_schemas, dependencies (draft-07 and before: both in one).
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
            return bool(value == 0)
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
    check_schema(schema, "grammar", allow_bool=True)
    return _walk(schema, strict_mode, _root_validator(schema))
