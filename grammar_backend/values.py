"""Value checks: enforce at value boundaries what the grammar cannot express.

Neither backend's grammar can say "the items are unique", "this date exists",
"if ``a`` is present ``b`` is too", ``not``, lookahead patterns, large
``multipleOf``...  (their fidelity reports list them per schema).  Decoding
used to let such values through and post-validation flagged the finished
output.  Here, while a sequence decodes:

1. :class:`ValueScanner` follows the accepted bytes as JSON and reports each
   value as it completes (a string's closing quote, a number's terminator, a
   literal's last letter, a container's closing bracket), with its token span
   and its location in the schema (:meth:`ValueRules.child`).
2. :class:`ValueRules` knows the schema locations whose values must be checked
   (the *anchors*: where the serving backend leaves a keyword unenforced,
   and every ``format``), and validates a completed value against the full
   subschema of its anchor with ``jsonschema``; an array with
   ``uniqueItems`` is also checked item by item, so a repeated item is caught
   as it completes, not at the closing bracket.  In every object, anchored or
   not, a key that repeats an earlier one is refused as its closing quote
   arrives: both grammars let an open object (``additionalProperties``)
   repeat a key, JSON parsers disagree on what that means, and post-validation
   flags it.  Before this check it was the most common invalid output of
   SmolLM2 on dev-set schemas (5 of 7 invalid outputs, ``bench/value_bench.py
   ../shared/data/maskbench-dev``): the model echoes the schema's ``"type"`` keys.
3. On a violation, :meth:`ValueChecks.backtrack` rolls the matcher back
   to the latest choice point inside the offending value (the last position
   where the grammar allowed another token), bans the token taken there (or,
   where that token also closed the value, every token spelling the same
   ending) and reports how many tokens the engine must drop.  Each sequence
   has a retry budget (the ``value_retries`` option); after it, or where the
   value has no choice point, the value stands and post-validation reports it,
   except that with ``on_repeat: close`` the next violation after the budget is
   dropped too and the output closed before it (a runaway no period shows).

:class:`ValuePolicy` is one sequence's share: its scanner, its retries left,
and the retry loop its sequence runs after each accept.

Only engines that can drop tokens use this (the embedded scheduler): a
logits processor or TensorRT-LLM's native decoder cannot take tokens back, so
their sequences start without checks (:meth:`GrammarEngine.start`'s
``value_checks``).  Streaming holds back the tokens that a check may still
revoke: :meth:`ValueScanner.hold` counts the tokens since the start of the
outermost open anchored value.

Costs: scanning is a Python loop over bytes (:meth:`ValueScanner.hold`
included), paid at every token; a check is one ``jsonschema`` validation of
the completed value; a backtrack fills one mask per candidate position, and
happens only on a violation (figures: docs/benchmarks.md, component costs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote

import numpy as np
import xgrammar as xgr

from grammar_backend import llg
from grammar_backend.bitmask import Matcher, pack_tokens
from grammar_backend.errors import SequenceError
from grammar_backend.fidelity import UnenforcedKeyword, validator_for
from grammar_backend.fidelity.walker import _root_validator
from grammar_backend.jump import PrefixIndex
from grammar_backend.lru import Lru
from grammar_backend.protocol import bitmask_width
from grammar_backend.satisfiable import json_canonical
from grammar_backend.spec import SCHEMA_MAPS, ConstraintSpec, json_pointer, keyword_sites

__all__ = ["GROWING", "MAX_SEARCH", "ValueChecks", "ValuePolicy", "ValueRules", "ValueScanner", "Violation",
           "rules_for", "unenforced_for"]

#: A value location's keywords that make where its children are ambiguous
#: (which branch, which of several schemas): below them no child location is
#: known, so the whole value is checked when it completes.
_AMBIGUOUS: Final = frozenset({
    "anyOf", "oneOf", "allOf", "if", "then", "else", "not", "dependentSchemas", "$dynamicRef",
    "unevaluatedProperties", "unevaluatedItems", "dependencies",
})
#: Keys that may sit next to ``$ref`` without changing what it means.
_ANNOTATIONS: Final = frozenset({"$comment", "description", "title", "default", "examples", "$id", "$schema",
                                 "deprecated", "readOnly", "writeOnly"})
#: Schema keys whose next pointer segment names a child schema that is itself a value location.
_NAMED_CHILDREN: Final = frozenset({"properties", "patternProperties", "$defs", "definitions", "prefixItems"})
_ONE_CHILD: Final = frozenset({"additionalProperties", "additionalItems"})
#: Keywords a container breaks by lacking members or items: a retry may add one instead of closing.
GROWING: Final = frozenset({"dependentRequired", "dependencies", "required", "contains", "minContains",
                            "minProperties", "minItems"})
#: Most positions a backtrack examines (one mask fill each) before the value is left as it is.
MAX_SEARCH: Final = 64
#: Most child locations remembered per schema (an open object's keys are the client's to choose).
_MAX_CHILD_MEMO: Final = 4096
#: Deepest ``$ref`` chain followed.
_MAX_REF_HOPS: Final = 32


def unenforced_for(spec: ConstraintSpec, backend: str | None) -> tuple[UnenforcedKeyword, ...]:
    """The keywords of ``spec``'s schema that ``backend``'s grammar leaves unenforced (its fidelity report).

    llguidance's come from its own warnings (:func:`grammar_backend.llg.unenforced_keywords`),
    xgrammar's from the fidelity table (:func:`grammar_backend.fidelity.unenforced_keywords`).
    """
    schema = spec.schema
    if schema is None:
        return ()
    if backend == "llguidance":
        return llg.unenforced_keywords(spec)
    return validator_for(schema, checked=True).unenforced(strict_mode=spec.options.strict)


def _unescape(segment: str) -> str:
    return segment.replace("~1", "/").replace("~0", "~")


def _segments(pointer: str) -> list[str]:
    return [_unescape(s) for s in pointer.split("/")[1:]] if pointer else []


class ValueRules:
    """Where the values of one schema are checked, and the checks (one per constraint and backend).

    Parameters
    ----------
    schema : Mapping or bool
        The constraint's (validated) JSON schema.
    unenforced : iterable of UnenforcedKeyword
        The serving backend's fidelity report (:func:`unenforced_for`).
    """

    def __init__(self, schema: Mapping[str, Any] | bool, unenforced: Iterable[UnenforcedKeyword]) -> None:
        self._root = schema
        self._validator = _root_validator(schema)
        self._nodes: dict[str, Any] = {}
        self._subs: dict[str, Any] = {}
        self._children: dict[tuple[str, str | int], str | None] = {}
        pointers = {u.pointer for u in unenforced}
        pointers.update(_format_pointers(schema))
        anchors = {self.locate(self._anchor(p)) for p in pointers}
        self.anchors: frozenset[str] = frozenset(a for a in anchors if a is not None)
        self.unique: frozenset[str] = frozenset(
            a for a in self.anchors if isinstance(self.node(a), dict) and self.node(a).get("uniqueItems") is True)
        self.root: str | None = self.locate("")

    def __bool__(self) -> bool:
        """Whether any value is checked."""
        return bool(self.anchors)

    def node(self, pointer: str) -> Any:
        """The schema node at ``pointer`` (None: no such node)."""
        found = self._nodes.get(pointer, self)
        if found is self:
            found = self._root
            for seg in _segments(pointer):
                if isinstance(found, dict):
                    found = found.get(seg)
                elif isinstance(found, list) and seg.isdigit() and int(seg) < len(found):
                    found = found[int(seg)]
                else:
                    found = None
                    break
            self._nodes[pointer] = found
        return found

    def locate(self, pointer: str) -> str | None:
        """``pointer`` after following pure ``$ref`` chains (a ``$ref`` with only annotations beside it).

        None where a reference is not local (``#...``) or the chain is too long.
        """
        for _ in range(_MAX_REF_HOPS):
            node = self.node(pointer)
            if not isinstance(node, dict) or "$ref" not in node or any(k not in _ANNOTATIONS for k in node
                                                                         if k != "$ref"):
                return pointer
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
                return None
            pointer = unquote(ref[1:])
        return None

    def _anchor(self, pointer: str) -> str:
        """The value location a keyword at ``pointer`` is checked at: the deepest one reached by plain steps."""
        segs = _segments(pointer)
        node: Any = self._root
        loc, at, i = "", "", 0
        while i < len(segs) and isinstance(node, dict):
            seg = segs[i]
            child = node.get(seg)
            if seg in _NAMED_CHILDREN or (seg == "items" and isinstance(child, list)):
                if i + 1 >= len(segs) or not isinstance(child, (dict, list)):
                    break
                name = segs[i + 1]
                node = child.get(name) if isinstance(child, dict) else (
                    child[int(name)] if name.isdigit() and int(name) < len(child) else None)
                at += json_pointer([seg, name])
                i += 2
            elif seg == "items" or seg in _ONE_CHILD:
                node = child
                at = f"{at}/{seg}"
                i += 1
            else:
                break
            if isinstance(node, dict):
                loc = at
        return loc

    def child(self, parent: str | None, key: str | int) -> str | None:
        """The location of a value's member ``key`` (an object key or an array index), None when unknown."""
        if parent is None:
            return None
        memo = (parent, key)
        if memo in self._children:
            return self._children[memo]
        found = self._child(parent, key)
        if len(self._children) < _MAX_CHILD_MEMO:
            self._children[memo] = found
        return found

    def _child(self, parent: str, key: str | int) -> str | None:
        node = self.node(parent)
        if not isinstance(node, dict) or "$ref" in node or any(k in node for k in _AMBIGUOUS):
            return None
        if isinstance(key, str):
            props = node.get("properties")
            if isinstance(props, dict) and key in props:
                return self.locate(parent + json_pointer(["properties", key]))
            patterns = node.get("patternProperties")
            if isinstance(patterns, dict):
                try:
                    hits = [p for p in patterns if re.search(p, key)]
                except re.error:  # never after the schema check, which compiles every pattern with re
                    return None
                if len(hits) > 1:
                    return None
                if hits:
                    return self.locate(parent + json_pointer(["patternProperties", hits[0]]))
            extra = node.get("additionalProperties")
            return self.locate(f"{parent}/additionalProperties") if isinstance(extra, dict) else None
        prefix = node.get("prefixItems")
        if isinstance(prefix, list) and key < len(prefix):
            return self.locate(f"{parent}/prefixItems/{key}")
        items = node.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            if key < len(items):
                return self.locate(f"{parent}/items/{key}")
            extra = node.get("additionalItems")
            return self.locate(f"{parent}/additionalItems") if isinstance(extra, dict) else None
        return self.locate(f"{parent}/items") if isinstance(items, dict) else None

    def errors(self, pointer: str, value: Any) -> list[tuple[tuple[str | int, ...], str, str]]:
        """Violations of the subschema at ``pointer`` by ``value``: (instance path within ``value``, keyword, message).

        Path and keyword are the deepest among the error and its branch errors
        (``anyOf``: where a branch failed).
        """
        sub = self._subs.get(pointer)
        if sub is None:
            sub = self._subs[pointer] = self._validator.evolve(schema=self.node(pointer))
        return [(*_deepest(e), e.message) for e in sub.iter_errors(value)]


def _deepest(error: Any) -> tuple[tuple[str | int, ...], str]:
    """The deepest instance path, and its keyword, among ``error`` and the branch errors under it."""
    best: tuple[str | int, ...] = tuple(error.absolute_path)
    keyword = str(error.validator)
    for inner in error.context or ():
        path, inner_keyword = _deepest(inner)
        if len(path) > len(best):
            best, keyword = path, inner_keyword
    return best, keyword


def _format_pointers(schema: Any) -> Iterable[str]:
    """Pointers of every ``format`` keyword of a subschema: the calendar, address ranges... are checked by no
    grammar.  A ``format`` inside an unknown keyword's value (``"self": {"format": "jsonschema"}``, a
    vendor annotation in MaskBench's Github schemas) is data: anchored at the root, it held the whole
    output back until its end."""
    return (at for at, key, value in keyword_sites(schema)
            if key == "format" and isinstance(value, str) and _in_subschema(schema, at))


#: Keywords whose value is one subschema, and those whose value is a list of subschemas.
_ONE_SUBSCHEMA: Final = frozenset({"items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
                                   "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties"})
_SUBSCHEMA_LISTS: Final = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})


def _in_subschema(schema: Any, pointer: str) -> bool:
    """Whether the keyword at ``pointer`` belongs to a subschema: every step to it goes through a keyword
    that holds subschemas (``properties``, ``items``, ``anyOf``...), none through an unknown one."""
    segs = _segments(pointer)[:-1]
    node, i = schema, 0
    while i < len(segs):
        if not isinstance(node, dict):
            return False
        seg = segs[i]
        child = node.get(seg)
        if seg in SCHEMA_MAPS and isinstance(child, dict) and i + 1 < len(segs):
            node, i = child.get(segs[i + 1]), i + 2
        elif seg in _SUBSCHEMA_LISTS and isinstance(child, list) and i + 1 < len(segs) and segs[i + 1].isdigit():
            k = int(segs[i + 1])
            node, i = (child[k] if k < len(child) else None), i + 2
        elif seg in _ONE_SUBSCHEMA:
            node, i = child, i + 1
        else:
            return False
    return isinstance(node, dict)


_RULES: Lru[tuple[ConstraintSpec, str], ValueRules] = Lru(1024)


def rules_for(spec: ConstraintSpec, backend: str) -> ValueRules | None:
    """The value rules of ``spec`` served by ``backend`` (cached; None: not a JSON kind).

    Every JSON output is scanned, anchors or not: a repeated key is refused
    in every object (:class:`ValueScanner`).
    """
    schema = spec.schema
    if schema is None:
        return None
    memo = (spec, backend)
    rules = _RULES.get(memo)
    if rules is None:
        rules = _RULES.put(memo, ValueRules(schema, unenforced_for(spec, backend)))
    return rules


@dataclass(frozen=True, slots=True)
class Violation:
    """A completed value that breaks its subschema.

    Attributes
    ----------
    start, end : int
        Token span of the offending value: its first byte is in token
        ``start``, its last in token ``end - 1``.
    last_byte : int
        Offset of the value's last byte in the sequence's output bytes.
    message : str
        The first violation, for logs and tests.
    may_grow : bool
        Whether a retry may keep the value open where it closed: true for
        a scalar, and for a container that lacks a member or an item
        (``dependentRequired``, ``contains``...: :data:`GROWING`); false for
        a container whose content is wrong (``not``, ``oneOf``...), where
        adding members would only repeat keys.
    """

    start: int
    end: int
    last_byte: int
    message: str
    may_grow: bool = True


_OBJ, _ARR, _STR, _NUM, _LIT = range(5)
# What a container expects next.
_KEY, _COLON, _VALUE, _NEXT = range(4)
_NUMBER_BYTES: Final = frozenset(b"0123456789+-.eE")
#: What may stand between two values of a container (:meth:`ValueChecks.drop_value`).
_SEPARATORS: Final = b", \t\n\r"
_SPACE: Final = frozenset(b" \t\n\r")


class _Node:
    """A value being scanned (or just completed)."""

    __slots__ = ("children", "end", "expect", "key", "keys_raw", "kind", "last_byte", "pointer", "raw", "seen",
                 "start", "value")

    def __init__(self, kind: int, pointer: str | None, start: int) -> None:
        self.kind = kind
        self.pointer = pointer
        self.start = start
        self.end = start + 1
        self.last_byte = -1
        self.raw = bytearray()  # scalars (and an object's key being read)
        self.value: Any = {} if kind == _OBJ else [] if kind == _ARR else None
        self.children: dict[str | int, _Node] | None = {} if kind <= _ARR else None
        self.expect = _KEY if kind == _OBJ else _VALUE
        self.key: str | int | None = None
        self.seen: set[str] | None = None  # canonical items of a uniqueItems array
        self.keys_raw: list[bytes] = []  # an object's keys as written (quotes included), in order


class ValueScanner:
    """Follows one sequence's output as JSON and checks each value as it completes.

    Parameters
    ----------
    rules : ValueRules
    vocab : list of bytes
        Each token's bytes (the tokenizer's decoded vocabulary).
    stops : frozenset of int
        The stop tokens: they end the output and are no part of it (their
        decoded text, ``<|im_end|>``, is not scanned as output bytes).
    """

    def __init__(self, rules: ValueRules, vocab: list[bytes], stops: frozenset[int] = frozenset()) -> None:
        self.rules = rules
        self._vocab = vocab
        self._stops = stops
        self.tokens: list[int] = []
        #: Output byte offset at which each token starts.
        self.offsets: list[int] = []
        #: Banned choices by position (tokens accepted before them): the packed mask of what stays allowed.
        self.bans: dict[int, np.ndarray] = {}
        self._reset()

    def _reset(self) -> None:
        self._stack: list[_Node] = []
        self._scalar: _Node | None = None
        self._in_key = False
        self._escape = False
        self._done = False
        self._bytes = 0

    def push(self, tokens: Iterable[int], *, check: bool = True) -> Violation | None:
        """Follow ``tokens``; the first violation of a value they complete (None: none, or ``check`` off)."""
        found: Violation | None = None
        for token in tokens:
            index = len(self.tokens)
            self.tokens.append(token)
            self.offsets.append(self._bytes)
            if token in self._stops:
                continue
            piece = self._vocab[token]
            scalar = self._scalar
            if (scalar is not None and scalar.kind == _STR and not self._escape and piece
                    and b'"' not in piece and b"\\" not in piece):
                # Inside a string, a piece without a quote or a backslash only lengthens it, as
                # _string_byte would byte by byte: most of a JSON output's tokens, in one step.
                scalar.raw += piece
                scalar.end = index + 1
                self._bytes += len(piece)
                continue
            for byte in piece:
                bad = self._byte(byte, index)
                if bad is not None and check and found is None:
                    found = bad
                self._bytes += 1
        return found

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens (rescans the rest without checking: they passed)."""
        kept = self.tokens[: len(self.tokens) - count]
        self.tokens, self.offsets = [], []
        # A ban holds for the prefix it was made after: gone once that prefix is.
        for position in [p for p in self.bans if p > len(kept)]:
            del self.bans[position]
        self._reset()
        self.push(kept, check=False)

    def hold(self) -> int:
        """How many of the last tokens a check may still revoke: those since the outermost open anchored
        value began, or else since the key being read began, while it may still repeat an earlier one."""
        anchors = self.rules.anchors
        for node in self._stack:
            if node.pointer in anchors:
                return len(self.tokens) - node.start
        scalar = self._scalar
        if scalar is not None and ((self._in_key and self._may_repeat(scalar)) or scalar.pointer in anchors):
            return len(self.tokens) - scalar.start
        return 0

    def safe_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, at the start of an output, no check can drop once they are accepted.

        The longest prefix after which nothing is held (:meth:`hold`): what
        of the output's first forced run (``{"name":`` after a new object)
        streams at once instead of a step later, however much of the run the
        caller takes.  None past a value that breaks its schema.  This
        scanner is left as it is.
        """
        probe = ValueScanner(self.rules, self._vocab, self._stops)
        safe = 0
        for k, token in enumerate(tokens, 1):
            if probe.push((token,)) is not None:
                break
            if probe.hold() == 0:
                safe = k
        return safe

    def pending(self) -> Violation | None:
        """The violation of the open top-level number, were the output to end here (None: none).

        A top-level number has no terminator but the end of the output (the
        stop token), so no byte completes it: without this, ``1`` under
        ``{"maximum": 9, "not": {"enum": [0, ..., 8]}}`` ended the output
        unchecked.  Strings and literals complete on their own last byte.
        An unfinished spelling (``-``, ``1.``, ``1e``) is no value yet: None.
        One ``jsonschema`` validation per call while such a number is open;
        nothing otherwise.
        """
        node = self._scalar
        if node is None or node.kind != _NUM or self._stack or node.pointer not in self.rules.anchors:
            return None
        try:
            value = json.loads(bytes(node.raw))
        except ValueError:
            return None
        errors = self.rules.errors(node.pointer, value)
        if not errors:
            return None
        return Violation(node.start, node.end, self._bytes - 1, errors[0][2])

    def _may_repeat(self, key: _Node) -> bool:
        """Whether the key being read may still turn out to repeat one of its object's keys.

        Only while its bytes so far begin one written before (or an escape
        makes its spelling uncertain): the first key of an object, and a key
        once it differs from every earlier one, stream at once.  Holding
        every key until its closing quote put the first text of a JSON output
        two or three steps after an unconstrained one's.
        """
        raw = bytes(key.raw)
        if b"\\" in raw:
            return True
        return any(earlier.startswith(raw) for earlier in self._stack[-1].keys_raw)

    # -- the byte machine ---------------------------------------------------------------

    def _byte(self, byte: int, index: int) -> Violation | None:
        scalar = self._scalar
        if scalar is not None:
            if scalar.kind == _STR:
                return self._string_byte(scalar, byte, index)
            if scalar.kind == _NUM:
                if byte in _NUMBER_BYTES:
                    self._extend(scalar, byte, index)
                    return None
                bad = self._complete(scalar)
                after = self._structure(byte, index)  # the terminator, whatever the number was
                return bad or after
            self._extend(scalar, byte, index)
            if len(scalar.raw) == len(_LITERALS[scalar.raw[0]]):
                return self._complete(scalar)
            return None
        return self._structure(byte, index)

    def _string_byte(self, node: _Node, byte: int, index: int) -> Violation | None:
        if self._escape:
            self._escape = False
        elif byte == 0x5C:  # backslash
            self._escape = True
        elif byte == 0x22:  # closing quote
            if self._in_key:
                self._in_key = False
                self._scalar = None
                parent = self._stack[-1]
                parent.key = key = json.loads(bytes(node.raw) + b'"')
                parent.keys_raw.append(bytes(node.raw) + b'"')
                parent.expect = _COLON
                if key in parent.value:  # the grammar lets an open object repeat a key; parsers disagree on it
                    return Violation(node.start, index + 1, self._bytes, f"repeats the key {key!r}")
                return None
            self._extend(node, byte, index)
            return self._complete(node)
        self._extend(node, byte, index)
        return None

    @staticmethod
    def _extend(node: _Node, byte: int, index: int) -> None:
        node.raw.append(byte)
        node.end = index + 1

    def _structure(self, byte: int, index: int) -> Violation | None:
        if byte in _SPACE or self._done:
            return None
        stack = self._stack
        top = stack[-1] if stack else None
        if top is not None and top.kind == _OBJ and top.expect != _VALUE:
            if byte == 0x22 and top.expect == _KEY:  # a key
                name = _Node(_STR, None, index)
                name.raw.append(byte)
                self._scalar, self._in_key = name, True
            elif byte == 0x3A:  # colon
                top.expect = _VALUE
            elif byte == 0x2C:  # comma
                top.expect = _KEY
            elif byte == 0x7D:  # closing brace
                return self._close(top, byte, index)
            return None
        if top is not None and top.kind == _ARR:
            if byte == 0x2C:
                top.expect = _VALUE
                return None
            if byte == 0x5D:
                return self._close(top, byte, index)
        # A value begins.
        if top is None:
            pointer = self.rules.root
        else:
            key: str | int = top.key if top.kind == _OBJ and top.key is not None else len(top.value)
            if top.kind == _ARR:
                top.key = key
            pointer = self.rules.child(top.pointer, key)
            top.expect = _NEXT
        if byte == 0x7B:
            stack.append(_Node(_OBJ, pointer, index))
        elif byte == 0x5B:
            node = _Node(_ARR, pointer, index)
            if pointer in self.rules.unique:
                node.seen = set()
            stack.append(node)
        else:
            kind = _STR if byte == 0x22 else _NUM if byte in _NUMBER_BYTES else _LIT
            node = _Node(kind, pointer, index)
            node.raw.append(byte)
            node.last_byte = self._bytes
            self._scalar = node
        return None

    def _close(self, node: _Node, byte: int, index: int) -> Violation | None:
        node.end = index + 1
        node.last_byte = self._bytes
        self._stack.pop()
        return self._completed(node)

    def _complete(self, node: _Node) -> Violation | None:
        self._scalar = None
        node.last_byte = self._bytes - 1 if node.kind == _NUM else self._bytes
        try:
            node.value = json.loads(bytes(node.raw))
        except ValueError:
            node.value = None  # never with a grammar-accepted output; not checked
            return None
        return self._completed(node)

    def _completed(self, node: _Node) -> Violation | None:
        stack = self._stack
        found: Violation | None = None
        parent = stack[-1] if stack else None
        if parent is None:
            self._done = True
        else:
            key = parent.key
            if parent.kind == _OBJ and isinstance(key, str):
                parent.value[key] = node.value
                parent.key = None
            else:
                parent.value.append(node.value)
            if parent.children is not None and key is not None:  # always: set when the value began
                parent.children[key] = node
            if parent.seen is not None:
                canon = json_canonical(node.value)
                if canon in parent.seen:
                    found = Violation(node.start, node.end, node.last_byte, "repeats an earlier item (uniqueItems)")
                parent.seen.add(canon)
        if found is None and node.pointer in self.rules.anchors:
            errors = self.rules.errors(node.pointer, node.value)
            if errors:
                path, keyword, message = max(errors, key=lambda e: len(e[0]))
                target = node
                for step in path:
                    inner = target.children.get(step) if target.children is not None else None
                    if inner is None:
                        break
                    target = inner
                grow = target.children is None or keyword in GROWING
                found = Violation(target.start, target.end, target.last_byte, message, grow)
        return found


_LITERALS: Final = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}



class ValueChecks:
    """The engine-level half of the value checks: the vocabulary, and the backtrack.

    Parameters
    ----------
    tokenizer_info : xgrammar.TokenizerInfo
    index : PrefixIndex, optional
        Shared with jump-forward (built here when not given).
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, index: PrefixIndex | None = None) -> None:
        self._info = tokenizer_info
        self._index = index
        self.vocab_size = int(tokenizer_info.vocab_size)
        self._row = np.zeros((1, bitmask_width(self.vocab_size)), dtype=np.int32)
        #: The stop tokens, and the packed mask of every other token (what a refused end leaves allowed).
        self.stops: frozenset[int] = frozenset(int(t) for t in tokenizer_info.stop_token_ids)
        self._no_stop = np.invert(pack_tokens(sorted(self.stops), self.vocab_size))
        #: Backtracks done, and violations left standing (no choice point in reach).
        self.backtracks = 0
        self.unfixable = 0

    @property
    def index(self) -> PrefixIndex:
        """The sorted vocabulary (built on first use)."""
        if self._index is None:
            self._index = PrefixIndex(self._info)
        return self._index

    def refuse_end(self, matcher: Matcher, scanner: ValueScanner, violation: Violation) -> int | None:
        """Keep the output from ending with the top-level number ``violation`` is about (:meth:`ValueScanner.pending`).

        Where the grammar allows more than a stop token here (``1`` may
        become ``12``), the stop tokens are banned at this position: the
        number must grow.  Where it allows nothing else (``1`` under
        ``maximum: 9``), the number's last choice is undone (:meth:`backtrack`).
        One mask fill, only on a violation.

        Returns
        -------
        int or None
            Tokens dropped (0: the end was banned, nothing dropped); None
            when nothing changed (no choice point in reach): the value stands.
        """
        position = len(scanner.tokens)
        keep = self._no_stop.copy()
        earlier = scanner.bans.get(position)
        if earlier is not None:
            np.bitwise_and(keep, earlier, out=keep)
        matcher.fill_next_token_bitmask(self._row, 0)
        if np.bitwise_and(self._row[0], keep).any():
            scanner.bans[position] = keep
            self.backtracks += 1
            return 0
        return self.backtrack(matcher, scanner, violation) or None

    def ends_refused(self, scanner: ValueScanner, token: int) -> bool:
        """Whether the stop ``token`` is banned where ``scanner`` stands (:meth:`refuse_end` banned it)."""
        keep = scanner.bans.get(len(scanner.tokens))
        return keep is not None and not (int(keep[token >> 5]) >> (token & 31)) & 1

    def drop_value(self, matcher: Matcher, scanner: ValueScanner, violation: Violation) -> int:
        """Roll ``matcher`` back to before the offending value, and the separator before it: the output then
        ends after the value before it, where its container may close.  Tokens dropped (the scanner too).

        The end of a runaway whose retries are spent (:meth:`ValuePolicy.scan`): rolled back only to its
        choice point, the value's shortest completion may be the same value again (a duplicate key ``""``
        closed by its quote).
        A separator in the token that also ends the value before (``1,``) stays: the value would change.
        """
        tokens, vocab = scanner.tokens, self.index.vocab
        keep = violation.start
        while keep > 0 and not vocab[tokens[keep - 1]].strip(_SEPARATORS):
            keep -= 1  # a token of separators and whitespace only
        dropped = len(tokens) - keep
        if dropped:
            matcher.rollback(dropped)
            scanner.rollback(dropped)
        return dropped

    def backtrack(self, matcher: Matcher, scanner: ValueScanner, violation: Violation) -> int:
        """Roll ``matcher`` back to the latest choice point inside the offending value and ban the choice taken there.

        Walks back from the last accepted token; a position inside the
        value's span is a choice point when its mask, less the bans already
        there and less the choice taken, still allows a token.  The choice
        taken is the token itself, or, where that token also ends the value
        (``"}`` closing a string), every token that starts with the same bytes
        up to the value's end: any of them would end the value the same way.

        Returns
        -------
        int
            Tokens dropped (the matcher and the scanner are rolled back by as
            many); 0 when no choice point is within :data:`MAX_SEARCH`
            positions: then nothing changed.
        """
        tokens, offsets, vocab = scanner.tokens, scanner.offsets, self.index.vocab
        total = len(tokens)
        lowest = max(violation.start, total - MAX_SEARCH)
        row, words = self._row, self._row[0]
        for position in range(total - 1, lowest - 1, -1):
            matcher.rollback(1)
            if position >= violation.end:
                continue
            token = tokens[position]
            piece = vocab[token]
            cut = violation.last_byte - offsets[position] + 1
            if cut <= len(piece) and not violation.may_grow:
                continue  # this token closes the container: keep it, change what is inside
            taken = self.index.starting(piece[:cut]) if 0 < cut < len(piece) else np.array([token], np.int64)
            ban = pack_tokens(taken, self.vocab_size)
            keep = np.invert(ban, out=ban)
            earlier = scanner.bans.get(position)
            if earlier is not None:
                np.bitwise_and(keep, earlier, out=keep)
            matcher.fill_next_token_bitmask(row, 0)
            if np.bitwise_and(words, keep).any():
                scanner.bans[position] = keep
                scanner.rollback(total - position)
                self.backtracks += 1
                return total - position
        for token in tokens[lowest:]:  # no choice point: restore the matcher
            matcher.accept_token(token)
        self.unfixable += 1
        return 0


#: What a scanner that fails on an output raises: a bug of ours, reported as that row's error only.
_SCAN_FAILURES = (LookupError, TypeError, ValueError, AttributeError)


class ValuePolicy:
    """One sequence's value checks: its scanner, the engine's checks, and the retries it has left.

    Its sequence (:class:`~grammar_backend.sequences.GrammarSequence`) asks
    :meth:`refuses_end` before the matcher takes a stop token, and hands every
    token run the matcher took to :meth:`scan`, which retries a value that
    breaks the schema and says how many tokens went.

    Parameters
    ----------
    seq_id : int
        The sequence's id (its errors name it).
    checks : ValueChecks
    rules : ValueRules
    retries : int
        The ``value_retries`` option (positive).
    """

    __slots__ = ("checks", "over", "retries_left", "scanner", "seq_id")

    def __init__(self, seq_id: int, checks: ValueChecks, rules: ValueRules, retries: int) -> None:
        self.seq_id = seq_id
        self.checks = checks
        self.retries_left = retries
        self.scanner = ValueScanner(rules, checks.index.vocab, checks.stops)
        #: Whether the checks are over (the retries spent): what completes from now on stands.
        self.over = False

    def refuses_end(self, token: int) -> bool:
        """Whether the stop ``token`` would end the output where a top-level number breaks the schema."""
        return self.checks.ends_refused(self.scanner, token)

    def scan(self, matcher: Matcher, tokens: list[int], *, checking: bool, runaway: bool) -> tuple[int, bool]:
        """Follow ``tokens``, which the matcher just took; retry a value they complete that breaks the schema.

        Parameters
        ----------
        matcher : Matcher
            The sequence's matcher, rolled back here by what is dropped.
        tokens : list of int
        checking : bool
            Whether values are checked now (not while the closer forces a completion or keeps the row calm:
            that is the closer's plan, not second-guessed).
        runaway : bool
            Whether runaway closing is on (``on_repeat: close``): with the retries spent, a value that
            breaks the schema once more is dropped and the output closed before it.

        Returns
        -------
        dropped : int
            Tokens the matcher and the scanner dropped (0: none).
        close : bool
            Whether the output must close where it now stands.

        Raises
        ------
        SequenceError
            The scanner failed on this output (this row's error, never the batch's).
        """
        try:
            found = self.scanner.push(tokens, check=checking)
        except _SCAN_FAILURES as err:
            raise SequenceError(self.seq_id, f"value check failed: {err!r}") from err
        if found is not None:
            return self._retry(matcher, found, at_end=False, runaway=runaway)
        if checking and self.retries_left > 0:
            return self._retry(matcher, self._pending(), at_end=True, runaway=runaway)
        return 0, False

    def _retry(self, matcher: Matcher, found: Violation | None, *, at_end: bool, runaway: bool) -> tuple[int, bool]:
        """Retry the value ``found`` says breaks the schema (``at_end``: the top-level number, were the output to
        end here), while the retries last; returns :meth:`scan`'s answer.  A backtrack may leave a top-level
        number that breaks the schema in turn (``19`` back to ``1`` under ``not: {enum: [1, 19]}``): its end is
        refused too.

        With the retries spent, a value that breaks the schema once more stands, unless runaway closing is
        on: a model that keeps writing values the schema refuses is a runaway no period shows (budget_bench's
        served part: invented keys in an open object, each new one refused as a duplicate of an earlier one).
        That value is dropped whole, with the separator before it (:meth:`ValueChecks.drop_value`), and the
        output closed there.
        """
        checks, total = self.checks, 0
        while found is not None:
            spent = not self.retries_left
            if spent and (at_end or not runaway):
                break  # the value stands
            if spent:
                dropped = checks.drop_value(matcher, self.scanner, found) or None
            else:
                dropped = (checks.refuse_end(matcher, self.scanner, found) if at_end
                           else checks.backtrack(matcher, self.scanner, found) or None)
            if dropped is None:  # no choice point in reach: the value stands
                break
            if not spent:
                self.retries_left -= 1
            if not dropped:  # (never once spent: only an end's refusal drops nothing)
                # The end is banned here: the number must grow.  The scanner stays, even with the
                # retries spent, so that the ban holds.
                break
            total += dropped
            if spent:
                self.over = True
                return total, True
            if not self.retries_left and not runaway:  # the retries are spent: what completes now stands
                self.over = True
                break
            found, at_end = self._pending(), True
        return total, False

    def _pending(self) -> Violation | None:
        """:meth:`ValueScanner.pending`, its failures as this row's error (like the scan's)."""
        try:
            return self.scanner.pending()
        except _SCAN_FAILURES as err:
            raise SequenceError(self.seq_id, f"value check failed: {err!r}") from err
