"""The JSON Schema meta-schema check: the one check the client SDK and the server share.

The client (:mod:`client.constraints`, for early feedback) and the server
(:func:`grammar_backend.spec.check_schema`, the authority) both call
:func:`check_schema`, so both refuse the same schemas with the same field,
pointer and reason (``tests/unit/test_schema_check.py``).  It raises
:class:`contract.ContractError`; each side re-raises it as its own error type.

Unlike the rest of :mod:`contract` this module needs ``jsonschema`` (a
dependency of the client and of the server alike), so :mod:`contract` does not
import it: ``import contract`` stays standard library only, and the client
imports this module only when it checks a schema (``jsonschema``'s import
costs about 0.1 s: ``.venv/bin/python -X importtime -c "import jsonschema"``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

import jsonschema.validators
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from contract import ContractError

__all__ = [
    "CHECKED_MAX",
    "CHECKED_MAX_CHARS",
    "MAX_MESSAGE_CHARS",
    "check_schema",
    "cut_message",
    "json_pointer",
    "schema_error_field",
    "schema_error_reason",
]

#: Longest message quoted from jsonschema (a 10,000-value enum is quoted whole otherwise).
MAX_MESSAGE_CHARS: Final = 512

#: Schemas (as canonical JSON text) that passed the meta-schema check, and the bound on
#: what is kept: a client front (the OpenAI endpoint) sees the same few schemas again
#: and again, on its event loop.
CHECKED_MAX: Final = 256
CHECKED_MAX_CHARS: Final = 65_536


def check_schema(schema: Any, field_name: str, *, allow_bool: bool = False, cached: bool = False) -> None:
    """Check ``schema`` against its draft's meta-schema (``$schema``; Draft 2020-12 by default).

    Parameters
    ----------
    schema : Any
        The JSON schema (a parsed JSON document).
    field_name : str
        The request field that holds it, e.g. ``"grammar"`` or ``"schema"``;
        it may already be a pointer (``"grammar#/format/json_schema"``, a
        schema embedded in a structural tag).
    allow_bool : bool
        ``true`` and ``false`` are schemas too (post-validation takes them; a
        constraint payload must be an object).
    cached : bool
        Remember a schema that passed by its canonical JSON text (sorted keys;
        the last :data:`CHECKED_MAX` of at most :data:`CHECKED_MAX_CHARS`
        characters): the same schema again costs its serialization instead
        of the check (p50 1.7 ms a new schema: ``bench/grammar_bench.py
        ../shared/data/maskbench-dev``, row ``parse_constraint, new
        schema``).  A refusal is never remembered.  The
        client asks for it; the server keeps its own cache, which also covers
        the satisfiability check (:mod:`grammar_backend.spec`).

    Raises
    ------
    ContractError
        ``field`` is :func:`schema_error_field` (``<field>#<JSON pointer>`` of the
        offending keyword), ``reason`` is :func:`schema_error_reason`; or
        ``field`` is ``field_name`` when ``schema`` is not an object (or boolean).
    RecursionError
        ``schema`` is nested deeper than the interpreter's recursion limit.
    """
    if not (isinstance(schema, Mapping) or (allow_bool and isinstance(schema, bool))):
        kinds = "an object or a boolean" if allow_bool else "an object"
        raise ContractError(field_name, f"a JSON schema must be {kinds}, got {type(schema).__name__}")
    key: str | None = None
    if cached:
        try:
            key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError):
            key = None  # not JSON: checked uncached (the payload's own encoding then names the problem)
    try:
        if key is not None and len(key) <= CHECKED_MAX_CHARS:
            _check_text(key)
        else:
            _meta_check(schema)
    except SchemaError as err:
        raise ContractError(schema_error_field(field_name, err), schema_error_reason(err)) from err


def schema_error_field(field_name: str, err: SchemaError) -> str:
    """``<field>#<pointer>`` of the keyword ``err`` refuses (``<field><pointer>`` when ``field_name`` has a ``#``).

    The pointer is ``err.absolute_path``, never ``err.path``: ``path`` is
    relative to the error's parent, so for an error taken from another's
    ``context`` (an ``anyOf`` branch, as :func:`jsonschema.exceptions.best_match`
    returns) it drops the parent's part and points at the wrong keyword.  The
    two agree for the top-level error ``check_schema`` raises in jsonschema
    4.26; ``absolute_path`` stays right if that ever changes.
    """
    pointer = json_pointer(err.absolute_path)
    return f"{field_name}{pointer}" if "#" in field_name else f"{field_name}#{pointer}"


def schema_error_reason(err: SchemaError) -> str:
    """``not a valid JSON Schema: <jsonschema's message, cut to MAX_MESSAGE_CHARS>``."""
    return f"not a valid JSON Schema: {cut_message(err.message)}"


def json_pointer(parts: Iterable[str | int]) -> str:
    """The RFC 6901 pointer of a path (``""`` for the root)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def cut_message(message: str) -> str:
    """``message``, cut to :data:`MAX_MESSAGE_CHARS` with an ellipsis."""
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "\u2026"


@functools.lru_cache(maxsize=CHECKED_MAX)
def _check_text(text: str) -> None:
    """:func:`_meta_check` of the schema ``text``; a refusal raises, so only passes are cached."""
    _meta_check(json.loads(text))


def _meta_check(schema: Any) -> None:
    """Raise ``jsonschema``'s ``SchemaError`` unless ``schema`` fits its meta-schema."""
    # The schema's own draft when it names one ($schema), else Draft 2020-12.
    jsonschema.validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
