"""Post-validation: parse a finished output and check it against the full schema."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema.exceptions import ValidationError

from grammar_backend.errors import ConfigError, ConstraintError
from grammar_backend.fidelity.report import UnenforcedKeyword, ValidationReport, Violation
from grammar_backend.fidelity.table import (
    _NO_RETRIEVE_REGISTRY,
    _SCHEMA_KEYWORDS,
    _SCHEMA_LIST_KEYWORDS,
    _SCHEMA_MAP_KEYWORDS,
)
from grammar_backend.fidelity.walker import _root_validator, _walk
from grammar_backend.lru import Lru
from grammar_backend.spec import check_schema, cut_message, json_pointer

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
                v = Violation(json_pointer(path), f"duplicate key {json.dumps(key)} (the last value is used)",
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
    checked : bool, default False
        The schema already passed :func:`~grammar_backend.spec.check_schema`
        (a validated constraint): the meta-schema check is not repeated.

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

    def __init__(self, schema: Mapping[str, Any] | bool, *, max_violations: int = 100, checked: bool = False) -> None:
        if isinstance(max_violations, bool) or not isinstance(max_violations, int) or max_violations < 1:
            raise ConfigError(f"max_violations: must be a positive integer, got {max_violations!r}")
        if not checked:
            check_schema(schema, "grammar", allow_bool=True)
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
    v = Violation(json_pointer(path), cut_message(error.message), keyword, json_pointer(list(error.absolute_schema_path)))
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
                    raise ConstraintError(f"grammar#{json_pointer([*path, key])}",
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
_cache: Lru[str, PostValidator] = Lru(VALIDATOR_CACHE_SIZE)


def validator_for(schema: Mapping[str, Any] | bool, *, checked: bool = False) -> PostValidator:
    """Return the shared :class:`PostValidator` of ``schema`` (LRU of 128 schemas).

    The key is the schema's canonical JSON text (sorted keys), which costs one
    serialization per call; a caller that validates many outputs of one
    constraint should keep the returned object.

    Parameters
    ----------
    schema : Mapping or bool
        A Draft 2020-12 JSON Schema.
    checked : bool, default False
        As :class:`PostValidator` (only matters when the validator is built).

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
    found = _cache.get(key)
    if found is None:
        # Built outside the cache's lock (milliseconds); a racing build of the same key is dropped.
        found = _cache.put(key, PostValidator(schema, checked=checked))
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
