"""Value checks (grammar_backend.values): where values are checked, the scanner, and the backtrack on real matchers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from contract.finish import FinishEvent
from grammar_backend.bitmask import allowed_tokens
from grammar_backend.fidelity import UnenforcedKeyword
from grammar_backend.llg import LlgBackend
from grammar_backend.llg import unenforced_keywords as llg_unenforced
from grammar_backend.protocol import CloseState
from grammar_backend.spec import parse_constraint
from grammar_backend.values import ValueRules, ValueScanner, rules_for
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from pipeline.postprocess import build_result

QWEN_VOCAB = 151_936
#: One token per byte: the scanner's unit tests need no tokenizer.
BYTES = [bytes([b]) for b in range(256)]


def _u(pointer: str) -> UnenforcedKeyword:
    return UnenforcedKeyword(pointer, pointer.rsplit("/", 1)[-1], "test")


@pytest.mark.parametrize(
    ("schema", "unenforced", "anchors", "unique"),
    [
        ({"type": "array", "uniqueItems": True}, ["/uniqueItems"], {""}, {""}),
        ({"properties": {"d": {"type": "string", "format": "date"}}}, [], {"/properties/d"}, set()),
        # Through a pure $ref: the location is the reference's target.
        ({"$defs": {"d": {"format": "date"}}, "properties": {"a": {"$ref": "#/$defs/d"}}}, [], {"/$defs/d"}, set()),
        # Below a branch nothing is known: the value holding anyOf is checked whole.
        ({"properties": {"x": {"anyOf": [{"properties": {"d": {"format": "date"}}}, {"type": "integer"}]}}}, [],
         {"/properties/x"}, set()),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["/dependentRequired"], {""}, set()),
        ({"items": {"type": "array", "uniqueItems": True}}, ["/items/uniqueItems"], {"/items"}, {"/items"}),
        ({"prefixItems": [{"not": {"const": 0}}]}, ["/prefixItems/0/not"], {"/prefixItems/0"}, set()),
        ({"type": "object", "properties": {"n": {"type": "integer"}}}, [], set(), set()),
        # A format in an unknown keyword's value is data (a vendor annotation): nothing is checked or held.
        ({"type": "array", "items": {"type": "string"}, "self": {"format": "jsonschema", "vendor": "x"}}, [],
         set(), set()),
        ({"items": [{"format": "date"}], "allOf": [{"not": {"format": "email"}}], "x-meta": {"items": {"format": "uri"}}},
         [], {"/items/0", ""}, set()),
    ],
    ids=["unique-root", "format", "ref", "anyof", "dependent-required", "items", "prefix-items", "nothing",
         "vendor-format", "format-sites"],
)
def test_anchors(schema: dict[str, Any], unenforced: list[str], anchors: set[str], unique: set[str]) -> None:
    rules = ValueRules(schema, [_u(p) for p in unenforced])
    assert (set(rules.anchors), set(rules.unique), bool(rules)) == (anchors, unique, bool(anchors))


CHILD_SCHEMA: dict[str, Any] = {
    "$defs": {"n": {"type": "integer"}},
    "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"type": "string"}, "c": {"anyOf": [{"type": "object"}]}},
    "patternProperties": {"^x": {"type": "number"}, "^xy": {"type": "number"}},
    "additionalProperties": {"type": "boolean"},
}


@pytest.mark.parametrize(
    ("schema", "parent", "key", "expected"),
    [
        (CHILD_SCHEMA, "", "a", "/$defs/n"),
        (CHILD_SCHEMA, "", "b", "/properties/b"),
        (CHILD_SCHEMA, "", "xa", "/patternProperties/^x"),
        (CHILD_SCHEMA, "", "xy", None),  # two patterns match: ambiguous
        (CHILD_SCHEMA, "", "zz", "/additionalProperties"),
        (CHILD_SCHEMA, "/properties/c", "k", None),  # below anyOf
        (CHILD_SCHEMA, None, "a", None),
        ({"prefixItems": [{}, {}], "items": {"type": "integer"}}, "", 1, "/prefixItems/1"),
        ({"prefixItems": [{}, {}], "items": {"type": "integer"}}, "", 2, "/items"),
        ({"items": [{}, {}], "additionalItems": {"type": "integer"}}, "", 5, "/additionalItems"),
        ({"type": "array"}, "", 0, None),
    ],
)
def test_child_locations(schema: dict[str, Any], parent: str | None, key: str | int, expected: str | None) -> None:
    assert ValueRules(schema, []).child(parent, key) == expected


def _scan(schema: dict[str, Any], unenforced: list[str], text: str) -> tuple[ValueScanner, Any]:
    scanner = ValueScanner(ValueRules(schema, [_u(p) for p in unenforced]), BYTES)
    return scanner, scanner.push(list(text.encode()))


@pytest.mark.parametrize(
    ("schema", "unenforced", "text", "found"),
    [
        ({"type": "array", "uniqueItems": True}, ["/uniqueItems"], "[1,2,3]", None),
        # The repeated item, as it completes (its span: the third item).
        ({"type": "array", "uniqueItems": True}, ["/uniqueItems"], "[1,2,1.0,", (5, 8, 7, "repeats")),
        ({"type": "array", "uniqueItems": True}, ["/uniqueItems"], '[{"a":1,"b":2},{"b":2,"a":1}]',
         (15, 28, 27, "repeats")),
        ({"properties": {"d": {"format": "date"}}}, [], '{"d":"2023-02-30"}', (5, 17, 16, "is not a 'date'")),
        ({"properties": {"d": {"format": "date"}}}, [], '{"d":"2024-02-29"}', None),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["/dependentRequired"], '{"a":1}',
         (0, 7, 6, "'b' is a dependency of 'a'")),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["/dependentRequired"], '{"a":1,"b":2}', None),
        # An error inside the checked value points at the offending member's span.
        ({"properties": {"x": {"anyOf": [{"properties": {"n": {"multipleOf": 7}}}]}}}, ["/properties/x/anyOf"],
         '{"x":{"m":1,"n":22}}', (16, 18, 17, "not valid under any")),
        ({"prefixItems": [{"not": {"const": 0}}]}, ["/prefixItems/0/not"], "[0]", (1, 2, 1, "should not be valid")),
        ({"items": {"multipleOf": 3}}, ["/items/multipleOf"], "[3, 6 ,  10 ]", (9, 11, 10, "multiple of 3")),
        ({"items": {"not": {"const": True}}}, ["/items/not"], "[false,true]", (7, 11, 10, "should not be valid")),
        # A repeated key, in any object: refused at its closing quote (the key's span).
        ({"type": "object"}, [], '{"a":1,"b":{"a":2},"a"', (19, 22, 21, "repeats the key 'a'")),
        ({"type": "object"}, [], '{"a":1,"b":{"a":2},"c":3}', None),
    ],
    ids=["unique", "repeat", "repeat-objects", "date", "leap-day", "dependent-required", "dependent-ok",
         "anyof-member", "not", "number-spaces", "literal", "repeated-key", "keys-ok"],
)
def test_violations(schema: dict[str, Any], unenforced: list[str], text: str,
                    found: tuple[int, int, int, str] | None) -> None:
    _, violation = _scan(schema, unenforced, text)
    if found is None:
        assert violation is None
    else:
        assert violation is not None
        assert (violation.start, violation.end, violation.last_byte) == found[:3]
        assert found[3] in violation.message


@pytest.mark.parametrize(
    ("text", "hold"),
    [
        ('{"a":[1,', 3),  # the checked array began at byte 5: 3 tokens may still go
        ('{"a":[1,2],', 0),  # it completed and passed
        ('{"a":[1,2],"b":"x', 0),  # b is not checked
        ('{"a":', 0),
        ('{"a":[1,2],"bc', 0),  # a key that no earlier key begins with cannot repeat one: it streams
        ('{"bc', 0),  # the first key of an object never repeats
        ('{"a":[1,2],"b":"x","b', 2),  # it begins "b": it may repeat it, held until it closes or differs
        ('{"b":"x","a":[1,2],"b', 2),
        ('{"bcd":1,"bc', 3),  # a prefix of an earlier key
        ('{"bcd":1,"bx', 0),
        ('{"b":1,"\\u00', 5),  # an escape: its spelling may still repeat "b"
    ],
)
def test_hold_counts_what_a_check_may_still_drop(text: str, hold: int) -> None:
    schema = {"properties": {"a": {"type": "array", "uniqueItems": True}, "b": {"type": "string"}}}
    scanner, violation = _scan(schema, ["/properties/a/uniqueItems"], text)
    assert (violation, scanner.hold()) == (None, hold)


@pytest.mark.parametrize(
    ("schema", "unenforced", "forced", "safe"),
    [
        ({"properties": {"b": {"type": "string"}}}, [], '{"b":', 5),  # a first key cannot repeat: all of it
        ({"properties": {"b": {"type": "string"}}}, [], '{"b', 3),  # even open: no earlier key to repeat
        ({"type": "object", "minProperties": 2}, ["/minProperties"], '{"b":', 0),  # an anchored root: none
        ({"type": "array", "uniqueItems": True}, ["/uniqueItems"], "[1,1,", 0),
        ({"properties": {"a": {"type": "array", "uniqueItems": True}}}, ["/properties/a/uniqueItems"],
         '{"a":[1,', 5),  # up to where the checked array opens
    ],
)
def test_the_first_forced_run_says_what_of_it_streams_at_once(schema: dict[str, Any], unenforced: list[str],
                                                             forced: str, safe: int) -> None:
    scanner, _ = _scan(schema, unenforced, "")
    assert scanner.safe_prefix(list(forced.encode())) == safe
    assert scanner.tokens == []  # left as it was


def _push_bytewise(scanner: ValueScanner, token: int) -> Any:
    """One token through the byte machine alone: the reference :meth:`ValueScanner.push`'s whole-piece step inside a
    string must agree with."""
    index = len(scanner.tokens)
    scanner.tokens.append(token)
    scanner.offsets.append(scanner._bytes)
    found = None
    for byte in scanner._vocab[token]:
        bad = scanner._byte(byte, index)
        found = found or bad
        scanner._bytes += 1
    return found


def _seen(scanner: ValueScanner, found: Any) -> tuple[Any, ...]:
    pending = scanner.pending()
    scalar = scanner._scalar
    return (scanner.hold(), scanner.offsets[-1], scanner._bytes, scanner._escape, scanner._in_key,
            None if scalar is None else (bytes(scalar.raw), scalar.start, scalar.end),
            None if found is None else (found.start, found.end, found.last_byte, found.message),
            None if pending is None else pending.message)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize(
    "text",
    [
        '{"s":"abcdefghijklm","b":"x"}',  # a string over its maxLength
        '{"b":"a quote \\" and a backslash \\\\ in it","s":"ok"}',  # escapes, split across pieces
        '{"b":"\\u00e9t\\u00e9 and more","bb":1,"b',  # a key held while it may repeat one
        '{"a":["xylophone","x\\u0079lophone"],"b":"\u00e9\u4e2d\u6587"}',  # an item repeated by an escape; UTF-8
        '{"beehive":"xyz","beehive":"y"}',  # a repeated key
    ],
    ids=["max-length", "escapes", "held-key", "unique-escape", "repeated-key"],
)
def test_a_piece_inside_a_string_is_taken_whole_as_byte_by_byte(text: str, size: int) -> None:
    schema = {"properties": {"s": {"type": "string", "maxLength": 5}, "a": {"type": "array", "uniqueItems": True},
                             "b": {"type": "string"}}}
    rules = ValueRules(schema, [_u("/properties/s/maxLength"), _u("/properties/a/uniqueItems")])
    data = text.encode()
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    vocab = [*BYTES, *pieces]
    whole, bytewise = ValueScanner(rules, vocab), ValueScanner(rules, vocab)
    calls = {"whole": 0, "bytewise": 0}
    for name, scanner in (("whole", whole), ("bytewise", bytewise)):
        def counted(*args: Any, _inner: Any = scanner._string_byte, _name: str = name) -> Any:
            calls[_name] += 1
            return _inner(*args)
        scanner._string_byte = counted  # type: ignore[method-assign,assignment]
    for token in range(256, len(vocab)):
        found = whole.push([token])
        assert _seen(whole, found) == _seen(bytewise, _push_bytewise(bytewise, token)), vocab[token]
    assert whole.tokens == bytewise.tokens
    assert calls["whole"] < calls["bytewise"]  # the whole-piece step was taken


def test_rollback_rescans_and_drops_later_bans() -> None:
    scanner, _ = _scan({"type": "array", "uniqueItems": True}, ["/uniqueItems"], "[1,2")
    scanner.bans = {2: np.zeros(1, np.int32), 4: np.zeros(1, np.int32)}
    scanner.rollback(2)
    assert (scanner.tokens, sorted(scanner.bans), scanner.hold()) == (list(b"[1"), [2], 2)
    # The rescan knows the items again: a repeat is still caught.
    violation = scanner.push(list(b",1,"))
    assert violation is not None and "repeats" in violation.message


def test_rules_are_cached_and_only_for_json() -> None:
    """Every JSON output is scanned (repeated keys), with or without anchors; other kinds are not."""
    plain = parse_constraint("json_schema", '{"type":"object","properties":{"n":{"type":"integer"}}}')
    dated = parse_constraint("json_schema", '{"type":"string","format":"date"}')
    rules = rules_for(plain, "xgrammar")
    assert rules is not None and not rules.anchors
    assert rules_for(dated, "llguidance") is rules_for(dated, "llguidance") is not None
    assert rules_for(parse_constraint("json_object", ""), "llguidance") is not None
    assert rules_for(parse_constraint("regex", "a+"), "xgrammar") is None


def test_result_reports_the_retries() -> None:
    result = build_result(FinishEvent("stop", "[1]", 1, 4, value_retries=3, value_dropped_tokens=9), None)
    assert (result["value_retries"], result["value_dropped_tokens"]) == (3, 9)


# -- the engine: real matchers over the Qwen3 vocabulary ---------------------------------------------


@pytest.fixture(scope="module")
def engine(qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo) -> Iterator[GrammarEngine]:
    stops = [int(t) for t in qwen_info.stop_token_ids]
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=2),
                        encode=lambda text: qwen_tokenizer.encode(text, add_special_tokens=False),
                        llg=LlgBackend(qwen_tokenizer, QWEN_VOCAB, stops))
    yield eng
    eng.close()


def _feed(eng: GrammarEngine, ids: list[int]) -> list[tuple[int, int]]:
    """Step sequence 1 through ``ids`` until a value check drops tokens; each step's (dropped, hold)."""
    seen = []
    for token in ids:
        res = eng.step(np.array([1], np.uint64), np.array([[token]], np.int32), np.array([1], np.int32))
        assert res.errors[0] is None
        seen.append((int(res.dropped[0]), int(res.hold[0])))
        if res.dropped[0]:
            break
    return seen


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_repeated_item_is_dropped_and_banned(engine: GrammarEngine, qwen_tokenizer: Any, backend: str) -> None:
    """``[3,7,3`` : the third item repeats the first; the step drops it, and its mask bans ``3`` there."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    spec = parse_constraint("json_schema", json.dumps(schema), {"backend": backend})
    ids = [qwen_tokenizer.convert_tokens_to_ids(t) for t in ["[", "3", ",", "7", ",", "3", ","]]
    engine.start(1, spec, value_checks=True)
    before = engine.values.backtracks
    try:
        seen = _feed(engine, ids)
        assert engine.values.backtracks == before + 1  # grammar_value_retries_total
        # Every token since "[" may go; the item "3" completes at the comma after it: both go, and "3" is
        # banned after "[3,7,", where the array is still open (5 tokens held).
        assert seen == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (2, 5)]
        seq = engine.table.get(1)
        assert seq.values is not None and (seq.tokens_accepted, seq.values.retries_left) == (5, 7)
        res = engine.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
        allowed = set(allowed_tokens(res.bitmask[0], QWEN_VOCAB).tolist())
        assert ids[5] not in allowed and qwen_tokenizer.convert_tokens_to_ids("5") in allowed
    finally:
        engine.end([1])


def test_a_date_that_does_not_exist_goes_back_to_its_last_choice(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    """xgrammar's date grammar takes ``2023-02-30``: the check drops back to the day's last digit."""
    spec = parse_constraint("json_schema", '{"type":"string","format":"date"}', {"backend": "xgrammar"})
    ids = qwen_tokenizer.encode('"2023-02-30"', add_special_tokens=False)
    engine.start(1, spec, value_checks=True)
    try:
        seen = _feed(engine, ids)
        assert seen[-1] == (2, 10) and len(seen) == len(ids)  # the string is open again: its 10 tokens held
        assert qwen_tokenizer.decode(ids[: engine.table.get(1).tokens_accepted]) == '"2023-02-3'
    finally:
        engine.end([1])


@pytest.mark.parametrize(
    ("retries", "checks", "on_repeat", "drops", "closing"),
    [(1, True, "continue", [2, 0], CloseState.OPEN), (1, True, "close", [2, 3], CloseState.REPETITION),
     (0, True, "close", [0, 0], CloseState.OPEN), (8, False, "close", [0, 0], CloseState.OPEN)],
    ids=["budget-of-one", "budget-of-one-then-closed", "option-off", "caller-cannot-drop"])
def test_the_retry_budget_and_who_can_drop(engine: GrammarEngine, qwen_tokenizer: Any, retries: int, checks: bool,
                                           on_repeat: str, drops: list[int], closing: CloseState) -> None:
    """With the budget spent, a repeat stands; or, with runaway closing on, it goes too and the output closes
    before it, its separator too (``[1,2`` then ``]``)."""
    spec = parse_constraint("json_schema", '{"type":"array","uniqueItems":true}',
                            {"backend": "llguidance", "value_retries": retries, "on_repeat": on_repeat})
    one, comma, two = (qwen_tokenizer.convert_tokens_to_ids(t) for t in ("1", ",", "2"))
    engine.start(1, spec, value_checks=checks)
    try:
        _feed(engine, [qwen_tokenizer.convert_tokens_to_ids("["), one, comma])
        got = [_feed(engine, [two, comma, one, comma])[-1][0], _feed(engine, [two, comma])[-1][0]]
        assert got == drops
        seq = engine.table.get(1)
        assert seq.close_state == closing
        if closing == CloseState.REPETITION:
            assert (seq.tokens_accepted, qwen_tokenizer.decode(seq.close.forced)) == (4, "]")  # after "[1,2"
    finally:
        engine.end([1])


def test_a_property_named_like_a_keyword_is_a_name() -> None:
    """``format`` as a property name (and under draft-4 ``dependencies``) is no keyword: llguidance's report and
    the anchors see only the real ``format`` below it (this schema once failed a start with a TypeError)."""
    schema = {"type": "object", "dependencies": {"format": {"required": ["a"]}},
              "properties": {"format": {"type": "object", "properties": {"at": {"type": "string", "format": "date"}}}}}
    spec = parse_constraint("json_schema", json.dumps(schema), {"backend": "llguidance"})
    rules = rules_for(spec, "llguidance")
    assert rules is not None and set(rules.anchors) == {"", "/properties/format/properties/at"}
    assert [(u.pointer, u.keyword) for u in llg_unenforced(spec)] == [("/dependencies", "dependencies")]


@pytest.mark.parametrize(
    ("schema", "unenforced", "text", "may_grow"),
    [
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["/dependentRequired"], '{"a":1}', True),
        ({"type": "array", "contains": {"const": 2}}, ["/contains"], "[1]", True),
        ({"type": "object", "not": {"required": ["a"]}}, ["/not"], '{"a":1}', False),
        ({"type": "array", "not": {"maxItems": 1}}, ["/not"], "[1]", False),
        ({"not": {"const": "x"}}, ["/not"], '"x"', True),  # a scalar: its closing quote is a choice too
    ],
)
def test_a_retry_adds_members_only_where_some_are_missing(schema: dict[str, Any], unenforced: list[str], text: str,
                                                          may_grow: bool) -> None:
    _, violation = _scan(schema, unenforced, text)
    assert violation is not None and violation.may_grow is may_grow


@pytest.mark.parametrize(
    ("text", "done"),
    [('{"n":4,"m":{"k":[1,2]},"o":5}', True), ('{"n":4}', True), ('{"n":4 ,"m":"x"', False)],
)
def test_a_violation_does_not_lose_the_structure_after_it(text: str, done: bool) -> None:
    """The number's terminator is structure: the scan goes on after a violation that is left standing
    (no choice point, or the budget spent), and a rescan that passes the same number stays in step."""
    schema = {"properties": {"n": {"multipleOf": 3}}}
    scanner, violation = _scan(schema, ["/properties/n/multipleOf"], text)
    assert violation is not None and (violation.start, violation.end) == (5, 6)
    assert (scanner._done, len(scanner._stack)) == (done, 0 if done else 1)
    scanner.rollback(0)  # the rescan, unchecked
    assert (scanner._done, len(scanner._stack), scanner.push(list(b" "))) == (done, 0 if done else 1, None)


# -- a top-level scalar: its end is the end of the output ---------------------------------------------

#: A byte vocabulary with a stop token (id 256) whose text must never be scanned as output.
STOPPED = [*BYTES, b"<|im_end|>"]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2, 3, 4, 5, 6, 7, 8]}}


@pytest.mark.parametrize(
    ("schema", "text", "pending"),
    [
        (DIGIT, "1", (0, 1, 0, "should not be valid")),
        (DIGIT, "9", None),
        ({"type": "number", "not": {"const": 12}}, "12", (0, 2, 1, "should not be valid")),
        ({"type": "number", "not": {"const": 12}}, "1", None),
        ({"type": "number", "not": {"const": 1}}, "1.", None),  # no number yet: the grammar cannot end here
        ({"type": "number", "not": {"const": 1}}, "-", None),
        ({"type": "array", "items": {"not": {"const": 1}}}, "[1", None),  # not top-level
    ],
    ids=["digit", "digit-ok", "two-digits", "prefix-ok", "fraction-open", "sign", "inner"],
)
def test_a_top_level_number_is_checked_as_if_the_output_ended(schema: dict[str, Any], text: str,
                                                               pending: tuple[int, int, int, str] | None) -> None:
    scanner = ValueScanner(ValueRules(schema, [_u("/not"), _u("/items/not")]), STOPPED, frozenset({256}))
    assert scanner.push(list(text.encode())) is None
    found = scanner.pending()
    if pending is None:
        assert found is None
    else:
        assert found is not None
        assert (found.start, found.end, found.last_byte, found.may_grow) == (*pending[:3], True)
        assert pending[3] in found.message
    # The stop token is no output: its text (`<` would end the number) is not scanned.
    assert scanner.push([256]) is None
    assert (scanner.tokens[-1], scanner.offsets[-1], scanner._bytes) == (256, len(text), len(text))
    assert (scanner.pending() is None) is (pending is None)


def test_a_top_level_string_and_literal_complete_on_their_last_byte() -> None:
    for schema, text, end in [({"type": "string", "not": {"const": "ab"}}, '"ab"', 4),
                              ({"type": "boolean", "not": {"const": True}}, "true", 4)]:
        _, violation = _scan(schema, ["/not"], text)
        assert violation is not None and (violation.start, violation.end) == (0, end)


def _step(eng: GrammarEngine, ids: list[int]) -> tuple[bool, int, set[int]]:
    """One step of sequence 1 fed ``ids``: (terminated, dropped, the next mask's tokens)."""
    res = eng.step(np.array([1], np.uint64), np.array([ids or [0]], np.int32), np.array([len(ids)], np.int32))
    assert res.errors[0] is None
    return bool(res.terminated[0]), int(res.dropped[0]), set(allowed_tokens(res.bitmask[0], QWEN_VOCAB).tolist())


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("together", [False, True], ids=["apart", "with-the-stop"])
def test_a_top_level_number_that_breaks_the_schema_does_not_end_the_output(
        engine: GrammarEngine, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo, backend: str,
        together: bool) -> None:
    """The issue's digit: ``1`` then the stop.  After ``1`` only the stop is allowed, so the check drops ``1`` at
    once and bans it; fed with the stop in one step, both go.  The retry takes ``9``, which ends the output."""
    stop = int(qwen_info.stop_token_ids[0])
    one, nine = (qwen_tokenizer.convert_tokens_to_ids(t) for t in ("1", "9"))
    spec = parse_constraint("json_schema", json.dumps(DIGIT), {"backend": backend})
    engine.start(1, spec, value_checks=True)
    try:
        done, dropped, allowed = _step(engine, [one, stop] if together else [one])
        assert (done, dropped, engine.table.get(1).tokens_accepted) == (False, 2 if together else 1, 0)
        assert one not in allowed and nine in allowed and stop not in allowed
        assert _step(engine, [nine])[:2] == (False, 0)
        assert _step(engine, [stop])[:2] == (True, 0)
        values = engine.table.get(1).values
        assert values is not None and values.retries_left == spec.options.value_retries - 1
    finally:
        engine.end([1])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_where_the_number_may_grow_its_end_is_refused(engine: GrammarEngine, qwen_tokenizer: Any,
                                                      qwen_info: xgr.TokenizerInfo, backend: str) -> None:
    """``1`` under ``maximum: 99, not: {const: 1}``: the stop is banned after ``1`` (a digit may follow); a stop
    fed there anyway is refused and dropped alone; ``12`` then ends."""
    stop = int(qwen_info.stop_token_ids[0])
    one, two = (qwen_tokenizer.convert_tokens_to_ids(t) for t in ("1", "2"))
    schema = {"type": "integer", "minimum": 0, "maximum": 99, "not": {"const": 1}}
    engine.start(1, parse_constraint("json_schema", json.dumps(schema), {"backend": backend}), value_checks=True)
    try:
        done, dropped, allowed = _step(engine, [one])
        assert (done, dropped, stop in allowed, two in allowed) == (False, 0, False, True)
        done, dropped, allowed = _step(engine, [stop])
        assert (done, dropped, engine.table.get(1).tokens_accepted, stop in allowed) == (False, 1, 1, False)
        done, dropped, allowed = _step(engine, [two])
        assert (done, dropped, stop in allowed) == (False, 0, True)
        assert _step(engine, [stop])[:2] == (True, 0)
    finally:
        engine.end([1])


@pytest.mark.parametrize(
    ("schema", "text", "retries", "drops"),
    [
        (DIGIT, "9", 8, [0]),  # valid: it ends at once, no retry spent
        (DIGIT, "1", 1, [1, 0]),  # the one retry drops it; the second `1` stands and ends the output
        ({"type": "string", "not": {"const": "ab"}}, '"ab"', 8, None),  # checked at its closing quote
        ({"type": "boolean", "not": {"const": True}}, "true", 8, None),
    ],
    ids=["valid", "budget-spent", "string", "literal"],
)
def test_top_level_scalars_end_or_retry(engine: GrammarEngine, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo,
                                        schema: dict[str, Any], text: str, retries: int,
                                        drops: list[int] | None) -> None:
    stop = int(qwen_info.stop_token_ids[0])
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    engine.start(1, parse_constraint("json_schema", json.dumps(schema),
                                     {"backend": "llguidance", "value_retries": retries}), value_checks=True)
    try:
        if drops is None:  # a string or literal: dropped before any stop, as it completes
            seen = _feed(engine, [*ids, stop])
            assert seen[-1][0] > 0 and len(seen) == len(ids)
            return
        got = [_step(engine, ids)[1]]
        if got[0]:
            got.append(_step(engine, ids)[1])
        assert got == drops
        assert _step(engine, [stop])[:2] == (True, 0)
    finally:
        engine.end([1])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_runaway_of_repeated_keys_closes_before_the_last_one(engine: GrammarEngine, qwen_tokenizer: Any,
                                                                backend: str) -> None:
    """budget_bench's served miss: an open object filling with keys that repeat earlier ones.  Past the retries,
    the repeated key goes whole, its separator too, and the object closes (rolled back only into the key, its
    shortest completion was the same key again)."""
    spec = parse_constraint("json_schema", '{"type":"object"}', {"backend": backend, "value_retries": 1})
    engine.start(1, spec, value_checks=True)
    out: list[int] = []
    try:
        for text in ('{"":1,"":', 'x":1,"x":'):  # each time a key repeats: retried once, then the end
            for token in qwen_tokenizer.encode(text, add_special_tokens=False):
                out.append(token)
                dropped, _ = _feed(engine, [token])[0]
                if dropped:
                    del out[-dropped:]
                    break
        seq = engine.table.get(1)
        # the retries spent and the value dropped: the checks are over, the output closes
        assert (seq.values, seq.close_state, seq.tokens_accepted) == (None, CloseState.REPETITION, len(out))
        assert seq.close.forced is not None
        assert qwen_tokenizer.decode(out) + qwen_tokenizer.decode(seq.close.forced) == '{"":1,"x":1}'
    finally:
        engine.end([1])
