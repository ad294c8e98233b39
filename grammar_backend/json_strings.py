r"""Keep the strings of xgrammar's JSON Schema grammars valid JSON (xgrammar 0.2.9; xgrammar#800).

Every JSON schema xgrammar lowers passes through here: a ``json_schema`` or
``json_object`` constraint (:func:`compile_json_schema`) and the schemas a
structural tag embeds, tool-call arguments (:func:`compile_structural_tag`).

xgrammar 0.2.9 lets a raw character that JSON must escape (U+0000-U+001F,
``"``, ``\``) into a string in two ways, both seen on the pinned release:

* A string with ``minLength`` or ``maxLength`` (``propertyNames`` bounds
  too) is a bounded repetition of ``[^"\\\r\n]``: every other control
  character passes raw.  Greedy decoding of the tiny stand-in under
  ``e2e_bench.PERSON_SCHEMA`` wrote a raw BEL into ``"name"`` (``maxLength``
  40), and the output closed as invalid JSON.  295 of the 2,884 MaskBench
  dev schemas have such a string.  :func:`compile_json_schema` narrows that class to
  ``[^\0-\x1f"\\]`` in place: what the plain string rule (``basic_string_sub``)
  takes unescaped, still one code point per repetition, so the bounds keep
  their meaning.  Escapes stay unreachable in a bounded string, as before: a
  narrowing, never an invalid output.
* A ``pattern`` that names such a character as a literal (``^a"b?$``,
  ``^a\tb$``, ``\w+[\\]\w+``) is lowered literal by literal instead of as a
  JSON-string regex, and the literal goes into the JSON string unescaped.
  Narrowing cannot mend it (the pattern's language needs the character), so
  :func:`compile_json_schema` refuses the schema, naming the pattern and the
  character.  llguidance, which ``auto`` picks for JSON, serves these
  patterns correctly.

Both read xgrammar's own serialized form of a grammar
(:meth:`xgrammar.Grammar.serialize_json`): exact code points, where its
printed EBNF is not (it writes U+0000 as nothing).  The layout read here,
for 0.2.9: ``grammar_expr_data`` holds each expression as ``[type, n, n
values]`` from ``grammar_expr_indptr[i]``; a rule is ``[name, body
expression, lookahead expression, ...]``.  A narrowed grammar is compiled
from EBNF text all the same, because xgrammar's cached compile of a
``Grammar`` object reparses its printed text anyway; :func:`_exact_ebnf`
writes that text so that it reads back exactly.  A schema with no bounded
string is compiled by xgrammar's own call, untouched.

Costs: the bounded-string rewrite converts, serializes and patches the
grammar, then prints and parses it twice, only when the schema text names
``Length``; each distinct pattern is
lowered alone once per process (:data:`_PATTERNS`).  Over a byte vocabulary
the dev set's compiles took 49.0 s against 44.5 s for xgrammar's call alone
(no bench times it; the per-schema figures are in docs/benchmarks.md).
The extra work depends on the grammar's size, not the vocabulary's, so
over a real vocabulary (compiles of seconds) its share is smaller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import xgrammar as xgr

from grammar_backend.errors import GrammarError
from grammar_backend.lru import Lru
from grammar_backend.spec import embedded_schemas, keyword_sites

__all__ = ["compile_json_schema", "compile_structural_tag", "raw_escape_in_pattern"]

# Expression types of xgrammar 0.2.9's serialized grammar (cpp/grammar_impl.h, GrammarExprType).
_BYTES: Final = 0
_CLASS: Final = 1
_CLASS_STAR: Final = 2
_RULE_REF: Final = 4
_SEQUENCE: Final = 5
_CHOICES: Final = 6
_REPEAT: Final = 8
#: Expression types whose values are child expression ids.
_PARENTS: Final = frozenset({_SEQUENCE, _CHOICES})

#: The class xgrammar 0.2.9 repeats for a length-bounded string: negated, ``"``, ``\\``, CR, LF.
_BOUNDED_CHAR: Final = (1, 0x22, 0x22, 0x5C, 0x5C, 0x0D, 0x0D, 0x0A, 0x0A)
#: How the class's expression reads in the serialized grammar (no spaces in xgrammar's JSON).
_BOUNDED_TEXT: Final = ",".join(str(v) for v in (_CLASS, len(_BOUNDED_CHAR), *_BOUNDED_CHAR))
#: Its replacement, as long (the expression keeps its place): negated, U+0000-U+001F, ``"``, ``\\``.
_JSON_CHAR: Final = (1, 0x00, 0x1F, 0x22, 0x22, 0x5C, 0x5C, 0x00, 0x1F)
#: What a JSON string cannot hold unescaped, as inclusive code point ranges.
_MUST_ESCAPE: Final = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
#: A ``\xHH`` escape of xgrammar's EBNF printer (not an escaped backslash before ``x``): group 1 is the
#: even run of backslashes before it, group 2 the two hex digits.
_BYTE_ESCAPE: Final = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9A-Fa-f]{2})")
#: An empty literal inside a sequence (``("" root_0 "</f>")`` of a structural tag), which the parser
#: drops: the one difference a read-back may show (an empty alternative, ``"" |``, stays).
_EMPTY_IN_SEQUENCE: Final = re.compile(r'(?<=\()"" (?!\|)')
#: Pattern -> (its first raw escape-needing character or None,), per process.
_PATTERNS: Final[Lru[str, tuple[int | None]]] = Lru(4096)


def compile_json_schema(compiler: xgr.GrammarCompiler, schema: str, **kwargs: Any) -> xgr.CompiledGrammar:
    """``compiler.compile_json_schema(schema, **kwargs)``, its strings kept valid JSON.

    Parameters
    ----------
    compiler : xgrammar.GrammarCompiler
    schema : str
        The JSON Schema text.
    **kwargs
        ``compile_json_schema``'s formatting arguments.

    Returns
    -------
    xgrammar.CompiledGrammar
        xgrammar's own compile where the schema has no bounded string;
        otherwise the converted grammar with that class narrowed (module
        docstring), compiled from its exact EBNF text (:func:`_exact_ebnf`).

    Raises
    ------
    ValueError
        When a ``pattern`` of the schema names a character JSON must escape;
        the message names the pattern and the character.
    RuntimeError
        xgrammar's own refusals, unchanged.
    """
    _refuse_raw_patterns(schema, lambda: [json.loads(schema)])
    mended = _narrowed(schema, lambda: xgr.Grammar.from_json_schema(schema, **kwargs))
    if mended is None:
        return compiler.compile_json_schema(schema, **kwargs)
    return compiler.compile_grammar(mended)


def compile_structural_tag(compiler: xgr.GrammarCompiler, document: Mapping[str, Any]) -> xgr.CompiledGrammar:
    """``compiler.compile_structural_tag`` of ``document``, mended as :func:`compile_json_schema` mends.

    The JSON schemas a structural tag embeds (tool-call arguments) are
    lowered by the same converter, with the same two defects.

    Raises
    ------
    ValueError
        As :func:`compile_json_schema`, for a pattern of an embedded schema.
    """
    text = json.dumps(document)
    _refuse_raw_patterns(text, lambda: [schema for _, schema in embedded_schemas(document)])
    mended = _narrowed(text, lambda: xgr.Grammar.from_structural_tag(text))
    if mended is None:
        return compiler.compile_structural_tag(text)
    return compiler.compile_grammar(mended)


def _refuse_raw_patterns(text: str, schemas: Callable[[], list[Any]]) -> None:
    """Raise ValueError for the first pattern of ``schemas`` that xgrammar would write raw into a string.

    ``text`` is their source: without ``pattern`` in it nothing is parsed.
    """
    if "pattern" not in text:
        return
    for schema in schemas():
        for pattern in _patterns(schema):
            found = raw_escape_in_pattern(pattern)
            if found is not None:
                raise ValueError(
                    f"the pattern {pattern!r} names the character U+{found:04X} ({chr(found)!r}), which xgrammar "
                    "writes into the JSON string unescaped (invalid JSON); choose backend llguidance for it")


def _narrowed(text: str, convert: Callable[[], xgr.Grammar]) -> str | None:
    """The exact EBNF of ``convert()`` with its bounded-string class narrowed; None where it has none.

    ``text`` is the source: without ``Length`` in it nothing is converted.
    """
    if "Length" not in text:
        return None
    serialized = convert().serialize_json()
    if _BOUNDED_TEXT not in serialized:  # a substring test first: parsing a large grammar's JSON is slow
        return None
    doc = json.loads(serialized)
    if not _narrow_bounded_strings(doc):
        return None
    return _exact_ebnf(xgr.Grammar.deserialize_json(json.dumps(doc)))


def _exact_ebnf(grammar: xgr.Grammar) -> str:
    r"""EBNF text that xgrammar parses back into ``grammar`` exactly.

    A compiler with its cache on compiles a ``Grammar`` object from the
    object's printed EBNF, and the printer writes a code point below U+0100
    as ``\xHH``, which the parser reads greedily: ``"br\xfbl\xe9e"``
    (``brûlée``) came back as ``brûl`` and U+0E9E.  Written as ``\u00HH``
    (four digits, read as four) it comes back whole.  The text is parsed
    and printed again to prove it: any difference but a dropped empty
    literal is an error, never a grammar served with another meaning.

    Raises
    ------
    GrammarError
        The text does not read back as ``grammar`` (INTERNAL).
    """
    text = _printed(grammar)
    again = _printed(xgr.Grammar.from_ebnf(text))
    if _EMPTY_IN_SEQUENCE.sub("", again) != _EMPTY_IN_SEQUENCE.sub("", text):
        raise GrammarError("xgrammar does not read back the EBNF of a mended JSON grammar exactly")
    return text


def _printed(grammar: xgr.Grammar) -> str:
    """xgrammar's EBNF of ``grammar``, every ``\\xHH`` escape written ``\\u00HH`` (read back as written)."""
    return _BYTE_ESCAPE.sub(r"\1\\u00\2", str(grammar))


def raw_escape_in_pattern(pattern: str) -> int | None:
    """The first character JSON must escape that xgrammar writes raw into a string of ``pattern`` (None: none).

    The pattern is lowered alone, as the string ``{"type": "string",
    "pattern": pattern}``.  A pattern xgrammar lowers to a JSON-string regex
    is safe (that matcher admits no such character, escaped or not); one
    lowered literal by literal is scanned.  A pattern
    xgrammar refuses alone was not lowered in the schema that compiled
    (next to a format it ignores the pattern): None.  Cached per process.
    """
    cached = _PATTERNS.get(pattern)
    if cached is None:
        try:
            doc = json.loads(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}))
                             .serialize_json())
        except RuntimeError:
            cached = (None,)
        else:
            cached = (_first_raw_escape(doc),)
        _PATTERNS.put(pattern, cached)
    return cached[0]


def _patterns(schema: Any) -> set[str]:
    found: set[str] = set()
    for _, keyword, value in keyword_sites(schema):
        if keyword == "pattern" and isinstance(value, str):
            found.add(value)
        elif keyword == "patternProperties" and isinstance(value, dict):
            found.update(value)
    return found


def _expr(doc: dict[str, Any], index: int) -> list[int]:
    data: list[int] = doc["grammar_expr_data"]
    start = doc["grammar_expr_indptr"][index]
    return data[start:start + 2 + data[start + 1]]


def _narrow_bounded_strings(doc: dict[str, Any]) -> int:
    """Rewrite every length-bounded string class of the serialized grammar ``doc`` in place; how many."""
    data: list[int] = doc["grammar_expr_data"]
    width = len(_BOUNDED_CHAR)
    patched = 0
    for start in doc["grammar_expr_indptr"]:
        if data[start] == _CLASS and data[start + 1] == width and tuple(data[start + 2:start + 2 + width]) == \
                _BOUNDED_CHAR:
            data[start + 2:start + 2 + width] = _JSON_CHAR
            patched += 1
    return patched


def _first_raw_escape(doc: dict[str, Any]) -> int | None:
    """The first character JSON must escape in a literal or class of the pattern grammar ``doc`` (None: none).

    ``doc`` is the lone pattern's string: ``root ::= "\\"" body "\\""``; the
    body is followed through rules, sequences, choices and repetitions.  A
    JSON-string regex is a leaf, trusted.
    """
    rules: list[list[Any]] = doc["rules"]
    root = _expr(doc, next(rule for rule in rules if rule[0] == "root")[1])  # choices: one sequence
    wrapper = _expr(doc, root[2])
    if root[0] != _CHOICES or root[1] != 1 or wrapper[0] != _SEQUENCE:
        raise GrammarError(f"xgrammar lowered a lone pattern to an unexpected root expression {root}")
    stack, seen = wrapper[3:-1], set()  # between the quotes
    while stack:
        index = stack.pop()
        if index in seen:
            continue
        seen.add(index)
        expr = _expr(doc, index)
        kind, values = expr[0], expr[2:]
        found = None
        if kind == _BYTES:
            found = _first_escaped_byte(values)
        elif kind in (_CLASS, _CLASS_STAR):
            found = _first_escaped_in_class(values)
        elif kind in _PARENTS:
            stack.extend(values)
        elif kind in (_RULE_REF, _REPEAT):
            stack.append(rules[values[0]][1])
        if found is not None:
            return found
    return None


def _first_escaped_byte(values: list[int]) -> int | None:
    # A literal is UTF-8 bytes: lead and continuation bytes are >= 0x80, so a
    # byte below 0x80 is a whole ASCII character.
    return next((b for b in values if b < 0x20 or b in (0x22, 0x5C)), None)


def _first_escaped_in_class(values: list[int]) -> int | None:
    negated, ranges = values[0], list(zip(values[1::2], values[2::2], strict=True))
    for lo, hi in _MUST_ESCAPE:
        for code in range(lo, hi + 1):
            inside = any(a <= code <= b for a, b in ranges)
            if inside != bool(negated):
                return code
    return None
