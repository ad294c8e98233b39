"""Constraint specifications sent to the ``constrained_llm`` ensemble.

A :class:`Constraint` is the client-side form of the three request tensors
``GRAMMAR_TYPE``, ``GRAMMAR`` and ``GRAMMAR_OPTIONS``.  The builders check what
is cheap to check locally (types, emptiness, JSON syntax, the JSON Schema
meta-schema) and raise :class:`~client.errors.InvalidConstraint` naming the
field; everything else (compilability, size limits) is the server's call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias

import contract
from client.errors import InvalidConstraint

__all__ = ["BACKEND", "KINDS", "ON_BUDGET", "ON_REPEAT", "Constraint", "Whitespace"]

#: Every ``GRAMMAR_TYPE`` value (the request contract's, shared with the server).
KINDS: Final = frozenset(contract.CONSTRAINT_KINDS)
#: Decoding policies, valid for every kind (default first).
ON_BUDGET: Final = contract.POLICIES["on_budget"]
ON_REPEAT: Final = contract.POLICIES["on_repeat"]
BACKEND: Final = contract.POLICIES["backend"]

#: ``whitespace`` option: ``"compact"``, ``"any"`` or the longest whitespace run allowed.
Whitespace: TypeAlias = Literal["compact", "any"] | int

SchemaLike: TypeAlias = Mapping[str, Any] | str | os.PathLike[str] | type

_EXTENSIONS: Final[Mapping[str, str]] = {
    ".json": "json_schema",
    ".ebnf": "ebnf",
    ".gbnf": "ebnf",
    ".lark": "lark",
    ".regex": "regex",
    ".re": "regex",
}


#: The limit on a constraint payload (UTF-8 bytes), the contract's.
MAX_CONSTRAINT_BYTES: Final = contract.MAX_CONSTRAINT_BYTES


def _dumps(value: object) -> str:
    """Serialise to compact JSON, keeping key order (xgrammar follows the schema's order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _read_text(path: str | os.PathLike[str], field_name: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise InvalidConstraint(field_name, f"no such file: {os.fspath(path)!r}") from err
    except UnicodeDecodeError as err:
        raise InvalidConstraint(field_name, f"{os.fspath(path)!r} is not UTF-8 text: {err}") from err
    except OSError as err:
        raise InvalidConstraint(field_name, f"cannot read {os.fspath(path)!r}: {err.strerror}") from err


def _load_json_text(text: str, field_name: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidConstraint(
            field_name, f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
        ) from err
    except RecursionError as err:
        raise InvalidConstraint(field_name, "is nested too deeply") from err


def _check_schema(schema: Mapping[str, Any], field_name: str) -> None:
    """Check ``schema`` against its meta-schema: :func:`contract.schema_check.check_schema`, cached.

    The server's check (the same function), so the client refuses what the
    server would, with the same field, pointer and reason.  A schema that
    passed is remembered (the last 256 of at most 64 KiB of canonical JSON):
    the same schema again costs its serialization, not the check, which is
    the builder's whole cost (figures: :func:`contract.schema_check.check_schema`).
    """
    # Deferred: only schema constraints pay jsonschema's import (see contract.schema_check).
    from contract import schema_check

    try:
        schema_check.check_schema(schema, field_name, cached=True)
    except contract.ContractError as err:
        raise InvalidConstraint(err.field, err.reason) from err


def _schema_to_dict(schema: object, field_name: str) -> dict[str, Any]:
    """Turn any accepted schema form into a checked JSON Schema object."""
    if isinstance(schema, type):
        dump = getattr(schema, "model_json_schema", None)
        if dump is None:
            raise InvalidConstraint(
                field_name, f"class {schema.__name__} is not a pydantic BaseModel subclass"
            )
        value: Any = dump()
    elif isinstance(schema, Mapping):
        value = dict(schema)
    elif isinstance(schema, str):
        text = schema.strip()
        if not text:
            raise InvalidConstraint(field_name, "must not be empty")
        if text[0] in "{[":
            value = _load_json_text(text, field_name)
        elif Path(text).is_file():
            value = _load_json_text(_read_text(text, field_name), field_name)
        else:
            raise InvalidConstraint(field_name, f"is neither JSON object text nor an existing file: {text!r}")
    elif isinstance(schema, os.PathLike):
        value = _load_json_text(_read_text(schema, field_name), field_name)
    else:
        raise InvalidConstraint(
            field_name,
            "must be a dict, a pydantic BaseModel subclass, JSON text or a path to a .json file, "
            f"got {type(schema).__name__}",
        )
    if not isinstance(value, dict):
        hint = "; use Constraint.json_object() for any JSON" if isinstance(value, bool) else ""
        raise InvalidConstraint(field_name, f"must be a JSON object, got {type(value).__name__}{hint}")
    try:
        size = len(_dumps(value).encode("utf-8"))
    except UnicodeEncodeError as err:  # before ValueError, its base class
        raise InvalidConstraint(field_name, f"is not valid Unicode: {err.reason} at character {err.start}") from err
    except (TypeError, ValueError) as err:
        raise InvalidConstraint(field_name, f"is not JSON-serialisable: {err}") from err
    except RecursionError as err:
        raise InvalidConstraint(field_name, "is nested too deeply") from err
    if size > MAX_CONSTRAINT_BYTES:
        # Checked before the meta-schema check, whose time grows with the schema (docs/benchmarks.md).
        raise InvalidConstraint(field_name, f"is {size} bytes of JSON, over the {MAX_CONSTRAINT_BYTES}-byte limit")
    try:
        _check_schema(value, field_name)
    except RecursionError as err:
        raise InvalidConstraint(field_name, "is nested too deeply") from err
    return value


def _non_empty_str(value: object, field_name: str) -> str:
    if not isinstance(value, str):
        raise InvalidConstraint(field_name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidConstraint(field_name, "must not be empty")
    return value


def _string_list(values: object, field_name: str, *, allow_empty_items: bool) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidConstraint(field_name, f"must be a list of strings, got {type(values).__name__}")
    if not values:
        raise InvalidConstraint(field_name, "must not be empty")
    seen: dict[str, int] = {}
    out: list[str] = []
    for index, item in enumerate(values):
        if not isinstance(item, str):
            raise InvalidConstraint(f"{field_name}[{index}]", f"must be a string, got {type(item).__name__}")
        if not allow_empty_items and not item:
            raise InvalidConstraint(f"{field_name}[{index}]", "must not be empty")
        if item in seen:
            raise InvalidConstraint(f"{field_name}[{index}]", f"duplicate of {field_name}[{seen[item]}]")
        seen[item] = index
        out.append(item)
    return out


def _validate_options(kind: str, options: Mapping[str, object]) -> dict[str, object]:
    """Check option names, types and ranges with the server's rule (:func:`contract.check_options`).

    Returns a plain copy of the options given: the ones left out take the
    server's defaults, so they are not sent.
    """
    if not isinstance(options, Mapping):
        raise InvalidConstraint("grammar_options", f"must be a mapping, got {type(options).__name__}")
    try:
        contract.check_options(kind, options)
    except contract.ContractError as err:
        raise InvalidConstraint(err.field, err.reason) from err
    return dict(options)


def _collect_options(
    strict: bool | None, whitespace: Whitespace | None, indent: int | None, any_order: bool | None
) -> dict[str, object]:
    """Options the caller set (``None`` means "server default", so it is not sent)."""
    given = {"strict": strict, "whitespace": whitespace, "indent": indent, "any_order": any_order}
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class Constraint:
    """One constraint: the ``GRAMMAR_TYPE``, ``GRAMMAR`` and ``GRAMMAR_OPTIONS`` of a request.

    Build instances with the class-method builders rather than directly; direct
    construction is validated the same way (kind, payload type, options).

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    payload : str
        The ``GRAMMAR`` text (empty for ``json_object``).
    options : Mapping[str, object]
        ``GRAMMAR_OPTIONS`` entries: ``strict`` (bool), ``whitespace``
        (``"compact"`` | ``"any"`` | int), ``indent`` (int or None),
        ``any_order`` (bool), which only JSON-producing kinds accept; and
        ``on_budget``, ``on_repeat``, ``jump_forward`` (see :meth:`with_policies`), for every kind.

    Raises
    ------
    InvalidConstraint
        If the kind is unknown, the payload is not text, or an option is unknown
        or ill-typed.
    """

    kind: str
    payload: str
    options: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidConstraint("grammar_type", f"unknown kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if not isinstance(self.payload, str):
            raise InvalidConstraint("grammar", f"must be a string, got {type(self.payload).__name__}")
        if self.kind != "json_object" and not self.payload.strip():
            raise InvalidConstraint("grammar", f"must not be empty for {self.kind} constraints")
        if self.kind == "json_object" and self.payload:
            raise InvalidConstraint("grammar", "must be empty for json_object constraints")
        if self.kind == "structural_tag" and not isinstance(_load_json_text(self.payload, "grammar"), dict):
            raise InvalidConstraint("grammar", "a structural tag must be a JSON object")
        # Frozen: copy into a read-only view so later edits of the caller's dict cannot leak in.
        object.__setattr__(self, "options", MappingProxyType(_validate_options(self.kind, self.options)))

    @property
    def options_json(self) -> str:
        """The ``GRAMMAR_OPTIONS`` text: compact JSON with sorted keys, ``""`` when no option is set."""
        if not self.options:
            return ""
        return json.dumps(dict(self.options), sort_keys=True, separators=(",", ":"))

    def with_policies(self, *, on_budget: str | None = None, on_repeat: str | None = None,
                      jump_forward: bool | None = None, backend: str | None = None,
                      value_retries: int | None = None) -> Constraint:
        """This constraint with decoding policies set (``None`` keeps the current or server default).

        Parameters
        ----------
        on_budget : {"close", "truncate"}, optional
            ``"close"`` (server default): when ``max_tokens`` is about to run
            out, the server forces the shortest completion, so the output still
            parses and matches the constraint; ``RESULT.closed_early`` says so.
            ``"truncate"``: the output is cut at ``max_tokens`` (incomplete).
        on_repeat : {"close", "continue"}, optional
            ``"close"`` (server default): an output that keeps repeating one
            short unit (``"bin/bin/bin..."``) is closed the same way.
        jump_forward : bool, optional
            ``True`` (server default): text the constraint forces (``{"name":"``)
            is appended without sampling, several tokens per forward; the
            output is the same text.  ``False``: every token is sampled.
        backend : {"auto", "xgrammar", "llguidance"}, optional
            ``"auto"`` (server default): llguidance for JSON, xgrammar for
            the other kinds, each falling back to the other where it cannot
            compile the constraint (in time); the others force one engine.
            ``Result.backend`` says which served.
        value_retries : int, optional
            JSON kinds: how many times the server may drop a completed value
            that breaks the schema where the grammar cannot express it
            (``uniqueItems``, a ``format``'s calendar, ``not``...) and
            generate it again (server default ``contract.VALUE_RETRIES``;
            0: off).  ``Result.value_retries`` says how many were used.

        Raises
        ------
        InvalidConstraint
            A value outside the choices above.
        """
        given: dict[str, object] = {"on_budget": on_budget, "on_repeat": on_repeat, "jump_forward": jump_forward,
                                    "backend": backend, "value_retries": value_retries}
        options = {**self.options, **{k: v for k, v in given.items() if v is not None}}
        return Constraint(self.kind, self.payload, options)

    # ------------------------------------------------------------------ builders
    @classmethod
    def json_schema(
        cls,
        schema: SchemaLike,
        *,
        strict: bool | None = None,
        whitespace: Whitespace | None = None,
        indent: int | None = None,
        any_order: bool | None = None,
    ) -> Constraint:
        """Constrain the output to JSON valid under a JSON Schema.

        Parameters
        ----------
        schema : dict, pydantic BaseModel subclass, str or os.PathLike
            The schema as a dict, a pydantic model class (its
            ``model_json_schema()``), JSON text (starting with ``{``), or the
            path of a ``.json`` file.
        strict : bool, optional
            ``True`` closes every object (no additional properties); the server
            default (``False``) honours the schema's ``additionalProperties``.
        whitespace : {"compact", "any"} or int, optional
            Whitespace allowed between JSON tokens; an int is the longest run.
        indent : int, optional
            Pretty-print indentation of the generated JSON.
        any_order : bool, optional
            Allow object properties in any order (default: the schema's order).

        Returns
        -------
        Constraint
            Kind ``json_schema``; the payload is the compact schema JSON, key order kept.

        Raises
        ------
        InvalidConstraint
            ``schema`` is of the wrong type, not a JSON object, unreadable, or
            fails its meta-schema; or an option is invalid.
        """
        value = _schema_to_dict(schema, "schema")
        return cls("json_schema", _dumps(value), _collect_options(strict, whitespace, indent, any_order))

    @classmethod
    def json_object(
        cls, *, whitespace: Whitespace | None = None, indent: int | None = None
    ) -> Constraint:
        """Constrain the output to any JSON object.

        Parameters
        ----------
        whitespace : {"compact", "any"} or int, optional
            Whitespace allowed between JSON tokens.
        indent : int, optional
            Pretty-print indentation.

        Returns
        -------
        Constraint
            Kind ``json_object`` with an empty payload.
        """
        return cls("json_object", "", _collect_options(None, whitespace, indent, None))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Constrain the output to match a regular expression in full.

        Parameters
        ----------
        pattern : str
            The pattern (xgrammar's ECMAScript-like syntax; it is not checked
            locally because Python's ``re`` dialect differs).

        Returns
        -------
        Constraint
            Kind ``regex``.

        Raises
        ------
        InvalidConstraint
            ``pattern`` is not a string or is empty.
        """
        return cls("regex", _non_empty_str(pattern, "regex"))

    @classmethod
    def ebnf(cls, text: str) -> Constraint:
        """Constrain the output to an EBNF grammar (GBNF text is accepted as is).

        Parameters
        ----------
        text : str
            The grammar; its start rule is ``root``.

        Returns
        -------
        Constraint
            Kind ``ebnf``.

        Raises
        ------
        InvalidConstraint
            ``text`` is not a string, is empty, or defines no rule (no ``::=``).
        """
        grammar = _non_empty_str(text, "ebnf")
        if "::=" not in grammar:
            raise InvalidConstraint("ebnf", "defines no rule (no '::=' found)")
        return cls("ebnf", grammar)

    @classmethod
    def lark(cls, text: str) -> Constraint:
        """Constrain the output to a Lark grammar.

        Parameters
        ----------
        text : str
            The Lark grammar text; its start rule is ``start``.

        Returns
        -------
        Constraint
            Kind ``lark``.

        Raises
        ------
        InvalidConstraint
            ``text`` is not a string or is empty.
        """
        return cls("lark", _non_empty_str(text, "lark"))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        """Constrain the output to exactly one of the given strings.

        Parameters
        ----------
        choices : sequence of str
            The alternatives; non-empty, no duplicates.

        Returns
        -------
        Constraint
            Kind ``choice``; the payload is the JSON array of the strings.

        Raises
        ------
        InvalidConstraint
            ``choices`` is a bare string, empty, or holds a non-string or a duplicate.
        """
        return cls("choice", _dumps(_string_list(choices, "choices", allow_empty_items=True)))

    @classmethod
    def structural_tag(
        cls,
        triggers: Sequence[str],
        tags: Sequence[Mapping[str, Any]],
    ) -> Constraint:
        """Constrain tool calls embedded in free text (xgrammar structural tags).

        Text is free until a trigger appears; from a tag's ``begin`` the output
        must be JSON valid under the tag's ``schema``, followed by ``end``.

        Parameters
        ----------
        triggers : sequence of str
            Prefixes that start a tagged region, e.g. ``["<function="]``.
        tags : sequence of mappings
            Each ``{"begin": str, "schema": schema, "end": str}``; ``schema``
            takes any form :meth:`json_schema` accepts; ``begin`` must start
            with one of the triggers.  The JSON-shaping options of
            :meth:`json_schema` do not apply (the server refuses them for
            structural tags: ``contract.JSON_OPTION_KINDS``).

        Returns
        -------
        Constraint
            Kind ``structural_tag`` with the short-form payload
            ``{"triggers": [...], "tags": [{"begin", "schema", "end"}]}``.

        Raises
        ------
        InvalidConstraint
            Empty triggers or tags, a missing or unknown tag key, an invalid
            schema, or a ``begin`` that no trigger prefixes.
        """
        trigger_list = _string_list(triggers, "triggers", allow_empty_items=False)
        if isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Sequence):
            raise InvalidConstraint("tags", f"must be a list of tag mappings, got {type(tags).__name__}")
        if not tags:
            raise InvalidConstraint("tags", "must not be empty")
        tag_list: list[dict[str, Any]] = []
        for index, tag in enumerate(tags):
            where = f"tags[{index}]"
            if not isinstance(tag, Mapping):
                raise InvalidConstraint(where, f"must be a mapping with begin, schema, end, got {type(tag).__name__}")
            unknown = sorted(set(tag) - {"begin", "schema", "end"})
            if unknown:
                raise InvalidConstraint(f"{where}.{unknown[0]}", "unknown key; expected begin, schema, end")
            for key in ("begin", "schema", "end"):
                if key not in tag:
                    raise InvalidConstraint(f"{where}.{key}", "is required")
            begin = _non_empty_str(tag["begin"], f"{where}.begin")
            end = tag["end"]
            if not isinstance(end, str):
                raise InvalidConstraint(f"{where}.end", f"must be a string, got {type(end).__name__}")
            if not any(begin.startswith(trigger) for trigger in trigger_list):
                raise InvalidConstraint(f"{where}.begin", f"{begin!r} does not start with any trigger")
            schema = _schema_to_dict(tag["schema"], f"{where}.schema")
            tag_list.append({"begin": begin, "schema": schema, "end": end})
        payload = _dumps({"triggers": trigger_list, "tags": tag_list})
        return cls("structural_tag", payload)

    @classmethod
    def structural_tag_raw(cls, spec: Mapping[str, Any]) -> Constraint:
        """Pass an xgrammar structural tag through unchanged.

        Parameters
        ----------
        spec : mapping
            Either xgrammar's format ``{"type": "structural_tag", "format": {...}}``
            or the short form ``{"triggers": [...], "tags": [...]}``.

        Returns
        -------
        Constraint
            Kind ``structural_tag``.

        Raises
        ------
        InvalidConstraint
            ``spec`` is not a mapping, not JSON-serialisable, or has neither form.
        """
        if not isinstance(spec, Mapping):
            raise InvalidConstraint("structural_tag", f"must be a mapping, got {type(spec).__name__}")
        if "type" in spec:
            if spec["type"] != "structural_tag":
                raise InvalidConstraint("structural_tag.type", f"must be 'structural_tag', got {spec['type']!r}")
            if not isinstance(spec.get("format"), Mapping):
                raise InvalidConstraint("structural_tag.format", "is required and must be an object")
        elif not ("triggers" in spec and "tags" in spec):
            raise InvalidConstraint(
                "structural_tag", "needs either 'type' + 'format' (xgrammar form) or 'triggers' + 'tags'"
            )
        try:
            payload = _dumps(dict(spec))
        except (TypeError, ValueError) as err:
            raise InvalidConstraint("structural_tag", f"is not JSON-serialisable: {err}") from err
        except RecursionError as err:
            raise InvalidConstraint("structural_tag", "is nested too deeply") from err
        return cls("structural_tag", payload)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        strict: bool | None = None,
        whitespace: Whitespace | None = None,
        indent: int | None = None,
        any_order: bool | None = None,
    ) -> Constraint:
        """Load a constraint from a file, choosing the kind by extension.

        ``.json`` is a JSON Schema, ``.ebnf``/``.gbnf`` an EBNF grammar,
        ``.lark`` a Lark grammar, ``.regex``/``.re`` a regular expression (one
        trailing line break is removed, since editors add it).

        Parameters
        ----------
        path : str or os.PathLike
            The file.
        strict, whitespace, indent, any_order
            As for :meth:`json_schema` (JSON schemas only).

        Returns
        -------
        Constraint

        Raises
        ------
        InvalidConstraint
            Unknown extension, unreadable file, or invalid content.
        """
        suffix = Path(path).suffix.lower()
        kind = _EXTENSIONS.get(suffix)
        if kind is None:
            raise InvalidConstraint(
                "path", f"unknown extension {suffix or '(none)'!r}; expected one of {', '.join(_EXTENSIONS)}"
            )
        options = _collect_options(strict, whitespace, indent, any_order)
        if kind == "json_schema":
            value = _load_json_text(_read_text(path, "path"), "schema")
            if not isinstance(value, dict):
                raise InvalidConstraint("schema", f"must be a JSON object, got {type(value).__name__}")
            return cls.json_schema(value, strict=strict, whitespace=whitespace, indent=indent, any_order=any_order)
        if options:
            raise InvalidConstraint(f"grammar_options.{next(iter(options))}", f"does not apply to {kind} constraints")
        text = _read_text(path, "path")
        if kind == "regex":
            if text.endswith("\r\n"):
                text = text[:-2]
            elif text.endswith("\n"):
                text = text[:-1]
            return cls.regex(text)
        if kind == "ebnf":
            return cls.ebnf(text)
        return cls.lark(text)
