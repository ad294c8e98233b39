"""Constraint specification: parse, validate and canonicalize a request constraint.

Everything here runs *before* any compile, so a malformed constraint costs a
parse, never a compiler run.  Each failure is a
:class:`~grammar_backend.errors.ConstraintError` naming the request field
(``grammar``, ``grammar_type``, ``grammar_options.<name>``, or a JSON pointer
inside the payload such as ``grammar#/properties/age``) and the reason.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import contract
from contract import schema_check
from contract.reasoning import Reasoning
from grammar_backend.errors import ConfigError, ConstraintError
from grammar_backend.lru import Lru
from grammar_backend.regex_dialect import portable_regex
from grammar_backend.satisfiable import check_satisfiable

Whitespace = Literal["compact", "any"] | int

#: The contract's values (contract/__init__.py is their one home).
ON_BUDGET: Final = contract.POLICIES["on_budget"]
ON_REPEAT: Final = contract.POLICIES["on_repeat"]


class ConstraintKind(str, enum.Enum):
    """The kinds of constraint a request may carry."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    EBNF = "ebnf"
    LARK = "lark"
    CHOICE = "choice"
    STRUCTURAL_TAG = "structural_tag"

    @property
    def is_json(self) -> bool:
        """Whether the output is a JSON document (post-validation applies)."""
        return self in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)



@dataclass(frozen=True)
class SpecLimits:
    """Bounds checked before any parse or compile.

    Parameters
    ----------
    max_payload_bytes : int
        Largest accepted payload (UTF-8 bytes).  MaskBench's largest dev-set
        schema is about 1.1 MB, so the default admits all of it.
    max_depth : int
        Deepest accepted JSON nesting of the payload (objects and arrays).
        Checked on the raw text, so a hostile payload cannot exhaust the
        stack of the JSON parser.
    max_choices : int
        Most alternatives in a ``choice`` constraint.
    max_key_chars : int
        Longest object key in a JSON constraint.  xgrammar builds property
        names into a trie recursively, and the ``grammar`` stub's threads have
        small stacks: through the served ensemble, a 1 MB property
        name (``JSONSchemaConverter::BuildTrieBody``, ~30,800 frames) and a
        60,000-character one both killed the stub.  The longest key in the
        2,890 maskbench-dev schemas is 151 characters.
    max_string_chars : int
        Longest string value (longest in maskbench-dev: 9,369 characters).
    """

    max_payload_bytes: int = contract.MAX_CONSTRAINT_BYTES
    max_depth: int = contract.MAX_CONSTRAINT_DEPTH
    max_choices: int = 4096
    max_key_chars: int = 1024
    max_string_chars: int = 65_536

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_depth", "max_choices", "max_key_chars", "max_string_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SpecLimits.{name} must be positive")


@dataclass(frozen=True)
class ConstraintOptions:
    """Options that shape the compiled grammar.

    Parameters
    ----------
    strict : bool
        False (default): honour the schema's own ``additionalProperties``.
        True: close every object that the schema leaves open (OpenAI style).
    whitespace : {"compact", "any"} or int
        ``"compact"`` (default) allows no free whitespace, so the model
        cannot loop on whitespace; an int bounds each whitespace run;
        ``"any"`` allows unbounded whitespace and is only used on request.
    indent : int or None
        Pretty-print with this indent (JSON kinds only).
    any_order : bool
        Allow object keys in any order instead of the schema's order.
    on_budget : {"close", "truncate"}
        What happens when ``max_tokens`` runs out (see :data:`ON_BUDGET`).
    on_repeat : {"close", "continue"}
        What happens to a runaway value (see :data:`ON_REPEAT`).
    backend : {"auto", "xgrammar", "llguidance"}
        The grammar engine (``contract.POLICIES``; the compile-cache key
        names the backend that compiled it, see :mod:`grammar_service.engine`).
    jump_forward : bool
        Append forced text without sampling it (see :mod:`grammar_backend.jump`).
    value_retries : int
        Times an output may drop tokens to retry a value that breaks the
        schema (see :mod:`grammar_backend.values`; JSON kinds; 0: off).
    reasoning : contract.reasoning.Reasoning or None
        The output begins with a thinking section, and the constraint applies
        after its end marker (:mod:`grammar_backend.reasoning`).  Not a
        ``grammar_options`` field: preprocessing sets it from the request's
        ``REASONING`` field, so that it rides with the constraint to the
        grammar side (absent from :meth:`ConstraintSpec.wire` when None).

    ``on_budget``, ``on_repeat``, ``backend``, ``jump_forward`` and
    ``reasoning`` apply to every kind, ``value_retries`` to the JSON kinds;
    none of them is part of :meth:`canonical`: one compiled grammar serves
    requests with and without a thinking section.
    """

    strict: bool = False
    whitespace: Whitespace = "compact"
    indent: int | None = None
    any_order: bool = False
    on_budget: str = "close"
    on_repeat: str = "close"
    backend: str = "auto"
    jump_forward: bool = contract.DECODING_FLAGS["jump_forward"]
    value_retries: int = contract.VALUE_RETRIES
    reasoning: Reasoning | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reasoning, Mapping):  # from the wire form's JSON
            object.__setattr__(self, "reasoning", Reasoning(**self.reasoning))

    def canonical(self) -> list[Any]:
        """A JSON-serializable canonical form of what shapes the grammar, used in the cache key."""
        return [self.strict, self.whitespace, self.indent, self.any_order]


#: Bumped whenever what a constraint compiles to changes without its text
#: changing (2: ``json_object`` means an object, not any JSON value), so a
#: persistent grammar store never serves a grammar of the old meaning.
GRAMMAR_FORMAT: Final = 2

#: Every option name (the JSON-shaping ones apply to json_schema and json_object,
#: the decoding policies to every kind): the contract's.
OPTION_NAMES: Final = contract.OPTION_NAMES


@dataclass(frozen=True)
class ConstraintSpec:
    """One validated, canonical request constraint.

    Build it with :func:`parse_constraint`; never construct it from unchecked input.

    Attributes
    ----------
    kind : ConstraintKind
    payload : str
        Canonical text of the payload: compact JSON (key order preserved,
        because xgrammar emits keys in schema order, so two schemas that
        differ only in key order compile to different grammars) for JSON
        payloads, the text itself for regex and grammars.
    options : ConstraintOptions
    document : Any
        The parsed JSON payload (schema, choice list or structural tag), or
        None for text payloads.  Not part of equality.
    """

    kind: ConstraintKind
    payload: str
    options: ConstraintOptions = field(default_factory=ConstraintOptions)
    document: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def schema(self) -> Mapping[str, Any] | None:
        """The JSON schema this output must satisfy (``json_object``: any object), else None."""
        if self.kind is ConstraintKind.JSON_SCHEMA:
            return self.document  # type: ignore[no-any-return]
        if self.kind is ConstraintKind.JSON_OBJECT:
            return json.loads(contract.JSON_OBJECT_SCHEMA)  # type: ignore[no-any-return]
        return None

    @functools.cached_property
    def segments(self) -> Segments:
        """Where a structural tag's output may open a new tagged segment (:class:`Segments`; empty for other kinds)."""
        if self.kind is not ConstraintKind.STRUCTURAL_TAG:
            return Segments((), ())
        begins: list[str] = []
        separators: list[str] = []
        _collect_segments(self.document, begins, separators)
        return Segments(tuple(dict.fromkeys(begins)), tuple(dict.fromkeys(separators)))

    def wire(self) -> dict[str, str]:
        """The validated constraint as preprocessing passes it on: ``{kind, payload, options}``.

        ``options`` is the JSON object of every option.  Later stages rebuild
        the spec with :func:`validated_constraint` instead of validating again.
        """
        options = dataclasses.asdict(self.options)
        if options["reasoning"] is None:
            del options["reasoning"]  # the wire form of a request without thinking is as it was
        return {"kind": self.kind.value, "payload": self.payload,
                "options": json.dumps(options, separators=(",", ":"))}

    def cache_key(self, tokenizer_fingerprint: str, xgrammar_version: str) -> str:
        """Hex sha256 of (grammar format, kind, payload, options, tokenizer fingerprint, xgrammar version)."""
        material = json.dumps(
            [
                GRAMMAR_FORMAT,
                self.kind.value,
                self.payload,
                self.options.canonical(),
                tokenizer_fingerprint,
                xgrammar_version,
            ],
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return hashlib.sha256(material.encode("utf-8")).hexdigest()


def parse_constraint(
    kind: str,
    payload: str | bytes,
    options: str | bytes | Mapping[str, Any] | None = None,
    limits: SpecLimits = SpecLimits(),
) -> ConstraintSpec:
    """Validate a request constraint and return its canonical spec.

    Parameters
    ----------
    kind : str
        One of :class:`ConstraintKind`'s values.
    payload : str or bytes
        The constraint text (bytes must be UTF-8).
    options : str, bytes, mapping or None
        A JSON object (text or mapping) of :class:`ConstraintOptions` fields.
    limits : SpecLimits
        Size, depth and count bounds.

    Returns
    -------
    ConstraintSpec

    Raises
    ------
    ConstraintError
        Naming the field (``grammar_type``, ``grammar``, ``grammar#<pointer>``
        or ``grammar_options.<name>``) and the reason.
    """
    try:
        ckind = ConstraintKind(kind)
    except ValueError as err:
        allowed = ", ".join(k.value for k in ConstraintKind)
        raise ConstraintError("grammar_type", f"unknown kind {kind!r}; expected one of {allowed}") from err
    opts = parse_options(options, ckind.value)
    text = _decode("grammar", payload)
    size = len(text.encode("utf-8"))
    if size > limits.max_payload_bytes:
        raise ConstraintError("grammar", f"payload is {size} bytes; the limit is {limits.max_payload_bytes}")

    if ckind is ConstraintKind.JSON_OBJECT:
        if text.strip():
            raise ConstraintError("grammar", "must be empty for json_object (use json_schema for a schema)")
        return ConstraintSpec(ckind, "", opts, None)
    if ckind in (ConstraintKind.REGEX, ConstraintKind.EBNF, ConstraintKind.LARK):
        if not text.strip():
            raise ConstraintError("grammar", f"empty {ckind.value}")
        # Their syntax is checked by the backend's own parser at compile time
        # (Python's `re` is a different dialect, so it cannot pre-check a regex);
        # a regex's dialect is checked here (regex_dialect.portable_regex).
        if ckind is ConstraintKind.REGEX:
            portable_regex(text)
        return ConstraintSpec(ckind, text, opts, None)

    doc = parse_json("grammar", text, limits.max_depth)
    _check_string_lengths(doc, limits.max_key_chars, limits.max_string_chars)
    if ckind is ConstraintKind.CHOICE:
        _check_choices(doc, limits.max_choices)
    elif ckind is ConstraintKind.STRUCTURAL_TAG:
        doc = _normalize_structural_tag(doc)
    canonical = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    try:
        canonical.encode("utf-8")
    except UnicodeEncodeError as err:
        # A JSON escape such as "\\ud800" decodes to an unpaired surrogate: no
        # compiler or tokenizer can take it (it raised UnicodeEncodeError as INTERNAL).
        raise ConstraintError("grammar", f"contains an unpaired surrogate escape "
                                         f"(\\u{ord(canonical[err.start]):04x})") from err
    if ckind is ConstraintKind.JSON_SCHEMA:
        _check_schema_once(doc, canonical)
    return ConstraintSpec(ckind, canonical, opts, doc)


#: Specs rebuilt from their wire form, by (kind, payload, options).
_VALIDATED: Lru[tuple[str, str, str], ConstraintSpec] = Lru(256)


def validated_constraint(kind: str, payload: str, options_json: str) -> ConstraintSpec:
    """Rebuild the spec of a constraint that preprocessing validated (:meth:`ConstraintSpec.wire`).

    Validation happens once, in preprocessing (the authority).  ``grammar``
    (reachable only from ``llm``, which forwards preprocessing's output) and
    ``postprocessing`` trust the wire form: no limit, option range,
    structural-tag or meta-schema check is repeated, and the JSON payload is
    parsed once per process (cached; a schema sent again costs a lookup).
    It saves the meta-schema check (its cost: :data:`_CHECKED`).

    Raises
    ------
    ConfigError
        The input is not a wire form (a caller bug, never a client's input).
    """
    key = (kind, payload, options_json)
    spec = _VALIDATED.get(key)
    if spec is None:
        try:
            ckind = ConstraintKind(kind)
            options = ConstraintOptions(**json.loads(options_json))
            document = json.loads(payload) if ckind in _JSON_PAYLOADS else None
        except (ValueError, TypeError) as err:
            raise ConfigError(f"not a validated constraint ({kind!r}): {err}") from err
        spec = ConstraintSpec(ckind, payload, options, document)
        _VALIDATED.put(key, spec)
    return spec


def constraint_spec(kind: str, payload: str | bytes, options: str | bytes, limits: SpecLimits,
                    *, validated: bool) -> ConstraintSpec:
    """:func:`validated_constraint` of a wire form when ``validated``, else :func:`parse_constraint`."""
    if validated:
        text = payload if isinstance(payload, str) else payload.decode("utf-8")
        return validated_constraint(kind, text, options if isinstance(options, str) else options.decode("utf-8"))
    return parse_constraint(kind, payload, options, limits)


_JSON_PAYLOADS: Final = frozenset({ConstraintKind.JSON_SCHEMA, ConstraintKind.CHOICE, ConstraintKind.STRUCTURAL_TAG})

#: Digests of schemas that passed the meta-schema check.  The check dominates
#: request validation (``bench/grammar_bench.py ../shared/data/maskbench-dev``, row
#: ``parse_constraint, new schema``: p50 1.7 ms, p99 15-75 ms), for every request of a
#: schema that clients send again and again.
_CHECKED: Lru[str, bool] = Lru(4096)


def _check_schema_once(schema: Any, canonical: str) -> None:
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    if _CHECKED.get(digest) is None:
        check_schema(schema, "grammar")
        # A schema that provably admits no instance is refused before any compile
        # (none of the 2,890 maskbench-dev schemas is refused; its cost: grammar_backend.satisfiable).
        check_satisfiable(schema, "grammar")
        _CHECKED.put(digest, True)


def parse_options(options: str | bytes | Mapping[str, Any] | None, kind: str = "json_schema") -> ConstraintOptions:
    """Parse ``grammar_options`` (a JSON object) into :class:`ConstraintOptions`.

    The names, values and ranges are the request contract's
    (:func:`contract.check_options`, shared with the client).

    Raises
    ------
    ConstraintError
        On malformed JSON, an unknown option, a JSON option on another kind
        or a value of the wrong type or range.
    """
    if options is None:
        raw: Any = {}
    elif isinstance(options, (str, bytes)):
        text = _decode("grammar_options", options)
        raw = parse_json("grammar_options", text, 4) if text.strip() else {}
    else:
        raw = options
    if not isinstance(raw, Mapping):
        raise ConstraintError("grammar_options", "must be a JSON object")
    try:
        checked = contract.check_options(kind, raw)
    except contract.ContractError as err:
        raise ConstraintError(err.field, err.reason) from err
    return ConstraintOptions(**checked)  # type: ignore[arg-type]


def parse_json(field_name: str, text: str, max_depth: int) -> Any:
    """Parse JSON text after checking its nesting depth on the raw text.

    Raises
    ------
    ConstraintError
        ``<field>: invalid JSON at line L column C: <reason>`` or a depth error.
    """
    depth = json_depth(text)
    if depth > max_depth:
        raise ConstraintError(field_name, f"JSON nesting depth {depth} exceeds the limit {max_depth}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConstraintError(
            field_name, f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
        ) from err


def _check_string_lengths(doc: Any, key_limit: int, limit: int) -> None:
    """Refuse a key or string value over its limit (iterative: no recursion)."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                where = pointer + json_pointer([key[:40]])
                if len(key) > key_limit:
                    raise ConstraintError(f"grammar#{where}", f"key is {len(key)} characters; the limit is {key_limit}")
                stack.append((value, where))
        elif isinstance(node, list):
            stack.extend((value, f"{pointer}/{i}") for i, value in enumerate(node))
        elif isinstance(node, str) and len(node) > limit:
            raise ConstraintError(f"grammar#{pointer}", f"string is {len(node)} characters; the limit is {limit}")


def json_depth(text: str) -> int:
    """Maximum bracket nesting of JSON text, skipping string contents (O(n), no recursion)."""
    depth = best = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def check_schema(schema: Any, field_name: str, *, allow_bool: bool = False) -> None:
    """Check ``schema`` against its draft's meta-schema (``$schema``; Draft 2020-12 by default).

    The server's side of :func:`contract.schema_check.check_schema` (the
    client's check too), for the request's constraint, the schemas of a
    structural tag and post-validation.  ``allow_bool``: ``true`` and
    ``false`` are schemas too (post-validation takes them; a constraint
    payload must be an object).

    Raises
    ------
    ConstraintError
        Naming ``<field>#<JSON pointer>`` of the offending keyword.
    """
    try:
        schema_check.check_schema(schema, field_name, allow_bool=allow_bool)
    except contract.ContractError as err:
        raise ConstraintError(err.field, err.reason) from err


#: The RFC 6901 pointer of a path, and jsonschema's message cut short: the contract's
#: (:mod:`contract.schema_check`, shared with the client).
json_pointer: Final = schema_check.json_pointer
cut_message: Final = schema_check.cut_message
MAX_MESSAGE_CHARS: Final = schema_check.MAX_MESSAGE_CHARS


#: Keywords whose values are data, never schemas (not walked).
DATA_KEYWORDS: Final = frozenset({"enum", "const", "default", "examples", "required", "description", "title",
                                  "$comment", "x-guidance"})
#: Keywords whose values map names to schemas (the names are not keywords); ``dependencies``
#: maps names to schemas or to lists of names (draft 4-7).
SCHEMA_MAPS: Final = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                                "dependencies"})


def keyword_sites(schema: Any) -> Iterator[tuple[str, str, Any]]:
    """``(pointer, keyword, value)`` of every keyword of every subschema of ``schema``.

    A property named like a keyword (``"properties": {"format": {...}}``) is a
    name, never reported; data (``enum``, ``default``...) is not walked.
    """
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{pointer}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            at = pointer + json_pointer([key])
            yield at, key, value
            if key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((sub, at + json_pointer([name])) for name, sub in value.items())
            elif key not in DATA_KEYWORDS:
                stack.append((value, at))


def _decode(field_name: str, value: str | bytes) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConstraintError(field_name, f"not valid UTF-8 at byte {err.start}") from err


def _check_choices(doc: Any, max_choices: int) -> None:
    if not isinstance(doc, list) or not doc:
        raise ConstraintError("grammar", "choice needs a non-empty JSON array of strings")
    if len(doc) > max_choices:
        raise ConstraintError("grammar", f"{len(doc)} choices; the limit is {max_choices}")
    for i, item in enumerate(doc):
        if not isinstance(item, str) or not item:
            raise ConstraintError(f"grammar#/{i}", f"each choice must be a non-empty string, got {item!r}")


def _normalize_structural_tag(doc: Any) -> dict[str, Any]:
    """Accept xgrammar's format, or the short ``{"triggers", "tags"}`` form for tool calls.

    Returns the xgrammar form ``{"type": "structural_tag", "format": ...}``
    with every embedded JSON schema checked against the meta-schema.
    """
    import xgrammar as xgr
    from pydantic import ValidationError

    if not isinstance(doc, dict):
        raise ConstraintError("grammar", "a structural tag must be a JSON object")
    if "type" not in doc:
        unknown = sorted(set(doc) - {"triggers", "tags"})
        if unknown:
            raise ConstraintError(f"grammar#/{unknown[0]}", "unknown field; expected triggers and tags")
        triggers, tags = doc.get("triggers"), doc.get("tags")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ConstraintError("grammar#/triggers", "must be a non-empty array of non-empty strings")
        if not isinstance(tags, list) or not tags:
            raise ConstraintError("grammar#/tags", "must be a non-empty array of {begin, schema, end}")
        for i, tag in enumerate(tags):
            if not isinstance(tag, dict) or set(tag) != {"begin", "schema", "end"}:
                raise ConstraintError(f"grammar#/tags/{i}", "must be an object with exactly begin, schema and end")
            if not any(tag["begin"].startswith(t) for t in triggers if isinstance(tag["begin"], str)):
                raise ConstraintError(f"grammar#/tags/{i}/begin", "must start with one of the triggers")
        doc = {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": triggers,
                "tags": [
                    {"type": "tag", "begin": t["begin"], "end": t["end"],
                     "content": {"type": "json_schema", "json_schema": t["schema"]}}
                    for t in tags
                ],
            },
        }
    try:
        xgr.StructuralTag.model_validate(doc)
    except ValidationError as err:
        errors = [(_document_pointer(doc, e["loc"]), e["msg"]) for e in err.errors()]
        pointer = errors[0][0]
        # One field of a union fails once per branch (a json_schema is a bool, a string or an object).
        reasons = list(dict.fromkeys(msg for at, msg in errors if at == pointer))
        raise ConstraintError(f"grammar#{pointer}", f"invalid structural tag: {'; or '.join(reasons)}") from err
    for pointer, schema in embedded_schemas(doc, ""):
        check_schema(schema, f"grammar#{pointer}")
    _bound_whitespace(doc)
    return dict(doc)


def _bound_whitespace(node: Any) -> None:
    """Bound every whitespace run of the JSON a structural tag embeds (in place; see
    :data:`contract.TAG_WHITESPACE_RUN`), where its format does not bound it itself.

    xgrammar's own default lets a run go on without end: a tool call's arguments
    ran ``[\n "metrics",\n \n \n ...`` to ``max_tokens``.
    """
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and node.get("max_whitespace_cnt") is None:
            node["max_whitespace_cnt"] = contract.TAG_WHITESPACE_RUN
        for key, value in node.items():
            if key != "json_schema":
                _bound_whitespace(value)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value)


def _document_pointer(doc: Any, loc: Sequence[str | int]) -> str:
    """The JSON pointer into ``doc`` of a pydantic error location.

    pydantic's ``loc`` also names the union branches it tried (a
    discriminator's value, ``tag``; a type, ``bool``), which are no place in
    the client's document: only the steps that exist in ``doc`` are kept.
    """
    steps: list[str | int] = []
    node = doc
    for step in loc:
        in_dict = isinstance(node, dict) and isinstance(step, str) and step in node
        if not (in_dict or isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)):
            continue
        node = node[step]
        steps.append(step)
    return json_pointer(steps)


@dataclass(frozen=True)
class Segments:
    """The text that opens a new tagged segment of a structural tag (a tool call).

    Attributes
    ----------
    begins : tuple of str
        Every tag's ``begin`` (a trigger is a prefix of the begins it triggers).
    separators : tuple of str
        The ``separator`` between the tags of every ``tags_with_separator``.
    """

    begins: tuple[str, ...]
    separators: tuple[str, ...]

    @property
    def openers(self) -> bytes:
        """The first UTF-8 byte of every begin and separator: a token holding one may open a segment."""
        return bytes(sorted({text.encode("utf-8")[0] for text in (*self.begins, *self.separators) if text}))


def _collect_segments(node: Any, begins: list[str], separators: list[str]) -> None:
    if isinstance(node, dict):
        if node.get("type") == "tag" and isinstance(node.get("begin"), str):
            begins.append(node["begin"])
        if node.get("type") == "tags_with_separator" and isinstance(node.get("separator"), str):
            separators.append(node["separator"])
        for key, value in node.items():
            if key != "json_schema":
                _collect_segments(value, begins, separators)
    elif isinstance(node, list):
        for value in node:
            _collect_segments(value, begins, separators)


def embedded_schemas(node: Any, pointer: str = "") -> list[tuple[str, Any]]:
    """JSON schemas embedded in a structural tag (``json_schema`` of json_schema formats)."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            schema = node["json_schema"]
            if isinstance(schema, str):
                schema = parse_json(f"grammar#{pointer}/json_schema", schema, SpecLimits().max_depth)
            found.append((f"{pointer}/json_schema", schema))
        for key, value in node.items():
            if key != "json_schema":
                found.extend(embedded_schemas(value, pointer + json_pointer([key])))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(embedded_schemas(value, f"{pointer}/{i}"))
    return found


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings.

    Pure Python (no grammar library): the ``llm`` model's native mode maps a
    ``choice`` constraint with it inside TensorRT-LLM's environment, where the
    project's xgrammar is never imported (``python -m deploy.image_check llm``).
    """
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            # Escapes keep control characters and non-ASCII out of the grammar
            # source; xgrammar's EBNF parser reads \uXXXX as one code point.
            out.extend(f"\\u{unit:04x}" for unit in _utf16_units(ch))
    return '"' + "".join(out) + '"'


def _utf16_units(ch: str) -> list[int]:
    code = ord(ch)
    if code < 0x10000:
        return [code]
    code -= 0x10000
    return [0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)]
