"""The llguidance backend behind the engine's matcher interface, and ``backend: auto`` (Qwen3 BPE)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.bitmask import allowed_tokens
from grammar_backend.errors import (
    BackendFailed,
    CompileError,
    CompileQueueFull,
    CompileTimeout,
    ConfigError,
    GrammarError,
    TokenRejected,
)
from grammar_backend.llg import LlgBackend, json_compile_options, refusal
from grammar_backend.llg import unenforced_keywords as llg_unenforced
from grammar_backend.spec import ConstraintOptions, parse_constraint
from grammar_service import engine as engine_module
from grammar_service.auto_switch import OUTCOMES, AutoSwitch, replay
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from grammar_service.llg_spread import TemplateSpread
from tests.support.poll import HANG_S
from tests.unit.conftest import load_schema
from triton_support.service import GrammarService

QWEN_VOCAB = 151_936
#: ``\p{L}``: xgrammar 0.2.9 refuses it ("Unicode character class escape sequence is not supported yet").
LETTERS = r"\p{L}+"


@pytest.fixture(scope="module")
def engine(qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo) -> Iterator[GrammarEngine]:
    stops = [int(t) for t in qwen_info.stop_token_ids]
    encode = lambda text: qwen_tokenizer.encode(text, add_special_tokens=False)
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=2), encode=encode,
                        llg=LlgBackend(qwen_tokenizer, QWEN_VOCAB, stops))
    yield eng
    eng.close()


def _drive(eng: GrammarEngine, seq_id: int, ids: list[int], stop: int) -> list[np.ndarray]:
    """Accept ``ids`` then the stop token one step at a time; returns each step's mask row."""
    rows = []
    out = eng.step(np.array([seq_id], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
    for token in [*ids, stop]:
        rows.append(out.bitmask[0].copy())
        out = eng.step(np.array([seq_id], np.uint64), np.array([[token]], np.int32), np.ones(1, np.int32))
        assert out.errors == (None,), (token, out.errors)
    assert out.terminated.tolist() == [True]
    return rows


@pytest.mark.parametrize(
    ("kind", "payload", "options", "output"),
    [
        ("json_schema", json.dumps(load_schema("tool_weather")), None, '{"city":"Paris","unit":"celsius"}'),
        ("json_schema", json.dumps(load_schema("tool_weather")), {"whitespace": 2},
         '{ "city": "Paris",  "unit":"celsius"}'),
        ("json_object", "", None, '{"a":[1,{"b":null}]}'),
        ("regex", r"order-[0-9]{3}: (shipped|pending)", None, "order-042: shipped"),
        ("choice", json.dumps(["internationalization", 'say "hi"', "naïve"]), None, 'say "hi"'),
        ("ebnf", 'root ::= "yes" | "no" " way"', None, "no way"),
    ],
)
def test_both_backends_accept_the_same_output(engine: GrammarEngine, qwen_tokenizer: Any, kind: str, payload: str,
                                              options: dict[str, object] | None, output: str) -> None:
    """Each backend's mask allows every token of a valid output, and its matcher accepts them and ends."""
    ids = qwen_tokenizer.encode(output, add_special_tokens=False)
    stop = int(engine.tokenizer_info.stop_token_ids[0])
    for seq_id, backend in ((1, "xgrammar"), (2, "llguidance")):
        spec = parse_constraint(kind, payload, {**(options or {}), "backend": backend})
        engine.start(seq_id, spec)
        assert engine.table.get(seq_id).backend == backend
        try:
            for row, token in zip(_drive(engine, seq_id, ids, stop), [*ids, stop], strict=True):
                assert token in set(allowed_tokens(row, QWEN_VOCAB).tolist())
        finally:
            engine.end([seq_id])


def test_llguidance_masks_are_the_grammar(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    """Exact masks where the grammar leaves one choice: the llguidance row has the same width and bit layout."""
    engine.start(3, parse_constraint("choice", '["yes","no"]', {"backend": "llguidance"}))
    try:
        out = engine.step(np.array([3], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
        first = {qwen_tokenizer.decode([t]) for t in allowed_tokens(out.bitmask[0], QWEN_VOCAB).tolist()}
        assert first == {"y", "ye", "yes", "n", "no"}
        yes = qwen_tokenizer.encode("yes", add_special_tokens=False)
        out = engine.step(np.array([3], np.uint64), np.array([yes], np.int32), np.array([len(yes)], np.int32))
        assert allowed_tokens(out.bitmask[0], QWEN_VOCAB).tolist() == [int(engine.tokenizer_info.stop_token_ids[0])]
    finally:
        engine.end([3])


def test_a_rejected_token_leaves_the_llguidance_matcher_usable(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    engine.start(4, parse_constraint("regex", "[a-z]{2,6}", {"backend": "llguidance"}))
    try:
        digit, word = qwen_tokenizer.encode("7", add_special_tokens=False), qwen_tokenizer.encode("ab", add_special_tokens=False)
        out = engine.step(np.array([4], np.uint64), np.array([digit], np.int32), np.ones(1, np.int32))
        assert isinstance(out.errors[0], TokenRejected)
        out = engine.step(np.array([4], np.uint64), np.array([word], np.int32), np.array([len(word)], np.int32))
        assert out.errors == (None,)
        # Rolled back past the last step, then forward again: the same mask.
        before = out.bitmask[0].copy()
        assert engine.rollback([4], [len(word)]) == (None,)
        out = engine.step(np.array([4], np.uint64), np.array([word], np.int32), np.array([len(word)], np.int32))
        assert np.array_equal(out.bitmask[0], before)
    finally:
        engine.end([4])


@pytest.mark.parametrize(
    ("schema", "text", "complete_before_last"),
    [
        ({"type": "array", "items": {"type": "integer"}}, "[1,2]", False),  # only the stop is left: llguidance stopped
        ({"type": "integer", "maximum": 9}, "1", False),  # the same, by a bound
        ({"type": "integer"}, "12", True),  # a digit may still follow: the stop goes into llguidance's history
    ],
)
def test_a_rolled_back_stop_token_leaves_the_output_complete(engine: GrammarEngine, qwen_tokenizer: Any,
                                                           schema: dict[str, Any], text: str,
                                                           complete_before_last: bool) -> None:
    # A draft stop token is accepted, then rolled back (grammar_service.engine._drafts): the output before
    # it must still end there, and the token before it must still be there.
    llg = engine.llg
    assert llg is not None
    stop = int(qwen_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    spec = parse_constraint("json_schema", json.dumps(schema), {"backend": "llguidance"})
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    matcher = llg.matcher(llg.compile(spec))
    for token in ids:
        assert matcher.accept_token(token)
    assert matcher.accept_token(stop) and matcher.is_terminated()
    matcher.rollback(1)
    assert (matcher.is_terminated(), matcher.is_completed()) == (False, True)
    matcher.rollback(1)  # and the output's last token, as a value check's backtrack would
    assert matcher.is_completed() is complete_before_last
    assert matcher.accept_token(ids[-1]) and matcher.accept_token(stop)


def test_auto_serves_what_xgrammar_cannot_compile_with_llguidance(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    with pytest.raises(CompileError, match="Unicode character class escape sequence is not supported"):
        engine.start(5, parse_constraint("regex", LETTERS, {"backend": "xgrammar"}))
    spec = parse_constraint("regex", LETTERS)  # backend: auto
    assert engine.backends(spec) == ("xgrammar", "llguidance")
    engine.start(5, spec)
    try:
        assert engine.table.get(5).backend == "llguidance"
        assert engine.backends(spec) == ("llguidance",)  # remembered: xgrammar is not asked again
        _drive(engine, 5, qwen_tokenizer.encode("Größe", add_special_tokens=False),
               int(engine.tokenizer_info.stop_token_ids[0]))
    finally:
        engine.end([5])


def test_auto_serves_a_slow_xgrammar_compile_with_llguidance(engine: GrammarEngine, qwen_info: xgr.TokenizerInfo,
                                                             qwen_tokenizer: Any) -> None:
    """Past ``auto_timeout_s`` the start is served by the second backend; the first one's compile goes on and is
    cached.  (A 1,500-word choice takes xgrammar about 0.05 s through its worker process; the limit here is 5 ms.)"""
    words = [f"item-{i:05d}-{i * 7919 % 100_003}" for i in range(1500)]
    spec = parse_constraint("choice", json.dumps(words))
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1, auto_timeout_s=0.005), llg=engine.llg)
    try:
        assert eng.backends(spec) == ("xgrammar", "llguidance")
        eng.start(1, spec)
        assert eng.table.get(1).backend == "llguidance"
        _drive(eng, 1, qwen_tokenizer.encode(words[1234], add_special_tokens=False), int(qwen_info.stop_token_ids[0]))
        eng.compile(spec)  # still compiling, then cached for xgrammar requests
        assert (eng.cache.stats().entries, eng.cache.stats().timeouts) == (1, 1)
        assert (eng.starts(), eng.fallbacks) == ({"llguidance": 1}, 1)
        snap = GrammarService(eng).metrics_snapshot().values
        assert [snap[("grammar_starts_total", (("backend", b),))] for b in ("xgrammar", "llguidance")] == [0.0, 1.0]
        assert snap[("grammar_backend_fallbacks_total", ())] == 1.0
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("kind", "payload", "options", "order"),
    [
        # Measured on maskbench-dev: llguidance first for JSON (grammar_backend.backends.auto_order).
        ("json_schema", '{"type":"object"}', None, ("llguidance", "xgrammar")),
        ("json_object", "", {"whitespace": "any"}, ("llguidance", "xgrammar")),
        ("regex", "[a-z]+", None, ("xgrammar", "llguidance")),
        ("choice", '["a","b"]', None, ("xgrammar", "llguidance")),
        # What llguidance cannot honour stays on xgrammar.
        ("json_schema", '{"type":"object"}', {"indent": 2}, ("xgrammar",)),
        ("json_schema", '{"type":"object"}', {"strict": True}, ("xgrammar",)),
        ("structural_tag", '{"triggers":["<f"],"tags":[{"begin":"<f>","schema":{"type":"object"},"end":"</f>"}]}',
         None, ("xgrammar",)),
        # Forced.
        ("json_schema", '{"type":"object"}', {"backend": "xgrammar"}, ("xgrammar",)),
        ("regex", "[a-z]+", {"backend": "llguidance"}, ("llguidance",)),
    ],
)
def test_auto_order(qwen_info: xgr.TokenizerInfo, engine: GrammarEngine, kind: str, payload: str,
                    options: dict[str, object] | None, order: tuple[str, ...]) -> None:
    fresh = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1), llg=engine.llg)
    try:
        assert fresh.backends(parse_constraint(kind, payload, options)) == order
    finally:
        fresh.close()


def test_auto_keeps_xgrammar_where_it_compiles(engine: GrammarEngine) -> None:
    engine.start(6, parse_constraint("regex", "[0-9]+"))
    try:
        assert engine.table.get(6).backend == "xgrammar"
    finally:
        engine.end([6])


#: JSON constraints llguidance serves first under ``backend: auto``, an output of each, and the replay's outcome.
SWITCHES = [
    # Both enforce every keyword; xgrammar fills a bounded string's masks far more cheaply (docs/benchmarks.md).
    ('{"type":"object","properties":{"name":{"type":"string","maxLength":20}},"additionalProperties":false}',
     '{"name":"Ada King Lovelace"}', "switched", "xgrammar"),
    # xgrammar would leave the calendar of format: date unenforced where llguidance checks it.
    ('{"type":"object","properties":{"d":{"type":"string","format":"date"}},"required":["d"]}', '{"d":"2024-02-29"}',
     "keywords", "llguidance"),
    ('{"type":"object","properties":{"n":{"type":"number","multipleOf":3}},"required":["n"]}', '{"n":9}',
     "keywords", "llguidance"),
    # Both enforce a pattern, but xgrammar's regex translation is where it was measured to differ.
    ('{"type":"object","properties":{"id":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{4}$"}},"required":["id"]}',
     '{"id":"ABC-1234"}', "keywords", "llguidance"),
]


@pytest.mark.parametrize(("schema", "output", "outcome", "then"), SWITCHES)
def test_auto_replays_the_first_output_on_xgrammar(engine: GrammarEngine, qwen_info: xgr.TokenizerInfo,
                                                   qwen_tokenizer: Any, schema: str, output: str, outcome: str,
                                                   then: str) -> None:
    """llguidance serves the first start; its output, once complete, is replayed on both backends behind the
    step, and the starts after it get the backend the replay chose.  One replay per constraint."""
    spec = parse_constraint("json_schema", schema)
    stop = int(qwen_info.stop_token_ids[0])
    ids = qwen_tokenizer.encode(output, add_special_tokens=False)
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1), llg=engine.llg)
    try:
        eng.start(1, spec)
        assert eng.table.get(1).backend == "llguidance"
        eng.end([1])  # not complete: nothing to replay
        assert eng.auto_switch.drain(HANG_S) and eng.switches() == dict.fromkeys(OUTCOMES, 0)
        for seq_id in (2, 3):  # the second complete output is not replayed again
            eng.start(seq_id, spec)
            _drive(eng, seq_id, ids, stop)
            eng.end([seq_id])
            assert eng.auto_switch.drain(HANG_S)
        assert eng.switches() == {**dict.fromkeys(OUTCOMES, 0), outcome: 1}
        assert eng.backends(spec) == (then,)
        eng.start(4, spec)
        assert eng.table.get(4).backend == then
        _drive(eng, 4, ids, stop)
        eng.end([4])
        snap = GrammarService(eng).metrics_snapshot().values
        assert snap[("grammar_auto_switches_total", (("outcome", outcome),))] == 1.0
    finally:
        eng.close()


def test_a_replay_waits_for_free_compile_workers(engine: GrammarEngine, qwen_info: xgr.TokenizerInfo,
                                                 qwen_tokenizer: Any) -> None:
    """With xgrammar's workers all busy the replay is ``busy`` and the constraint's next output is offered again."""
    spec = parse_constraint("json_schema", SWITCHES[0][0])
    path = [*qwen_tokenizer.encode(SWITCHES[0][1], add_special_tokens=False), int(qwen_info.stop_token_ids[0])]
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1), llg=engine.llg)
    free = [False]
    switched: list[str] = []
    switch = AutoSwitch(QWEN_VOCAB, lambda s, b: (eng.cache if b == "xgrammar" else eng.llg_cache).get_future(
        eng._key(s, b), eng._compile_fn(s, b)), eng._matcher, lambda s: switched.append(s.kind.value), 4, HANG_S,
        lambda: free[0])
    try:
        eng.llg_cache.get(eng._key(spec, "llguidance"), eng._compile_fn(spec, "llguidance"))
        switch.offer("k", spec, path)
        assert switch.drain(HANG_S) and switch.counts()["busy"] == 1 and switch.wants("k")
        assert eng.cache.stats().misses == 0  # no xgrammar compile was queued
        free[0] = True
        switch.offer("k", spec, path)
        assert switch.drain(HANG_S) and switch.counts()["switched"] == 1 and not switch.wants("k")
        switch.offer("k", spec, path)  # replayed once
        assert switch.drain(HANG_S) and sum(switch.counts().values()) == 2 and switched == ["json_schema"]
    finally:
        switch.close()
        eng.close()


def test_a_replay_refuses_what_xgrammar_masks_out(engine: GrammarEngine, qwen_info: xgr.TokenizerInfo,
                                                  qwen_tokenizer: Any) -> None:
    """xgrammar's mask must allow every token of llguidance's output, and end with it, or llguidance keeps it."""
    spec = parse_constraint("json_schema", SWITCHES[0][0])
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1), llg=engine.llg)
    stop = int(qwen_info.stop_token_ids[0])

    def matchers() -> tuple[Any, Any]:
        llguidance = eng.llg_cache.get(eng._key(spec, "llguidance"), eng._compile_fn(spec, "llguidance"))
        return eng._matcher(eng.compile(spec)), eng._matcher(llguidance)

    row = np.zeros((1, (QWEN_VOCAB + 31) // 32), np.int32)
    try:
        good = qwen_tokenizer.encode(SWITCHES[0][1], add_special_tokens=False)
        spent = replay(*matchers(), [*good, stop], row)
        assert spent is not None and min(spent) > 0
        assert replay(*matchers(), good, row) is None  # not ended
        # A name over maxLength: xgrammar's mask refuses the 21st character.
        assert replay(*matchers(), qwen_tokenizer.encode('{"name":"' + "a" * 30 + '"}', add_special_tokens=False),
                      row) is None
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"indent": 2}, r"^grammar_options\.indent: is not supported by the llguidance backend$"),
        ({"any_order": True}, r"^grammar_options\.any_order: is not supported by the llguidance backend$"),
        ({"strict": True}, r"^grammar_options\.strict: is not supported by the llguidance backend$"),
    ],
)
def test_options_llguidance_cannot_honour_are_refused(engine: GrammarEngine, options: dict[str, object],
                                                      match: str) -> None:
    spec = parse_constraint("json_schema", '{"type":"object"}', {**options, "backend": "llguidance"})
    assert re.fullmatch(match, str(refusal(spec)))
    with pytest.raises(CompileError, match=match):
        engine.start(10, spec)


@pytest.mark.parametrize(
    ("whitespace", "expected"),
    [
        ("compact", {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}),
        ("any", {"whitespace_flexible": True}),
        (3, {"whitespace_flexible": True, "whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{0,3}"}),
    ],
)
def test_json_compile_options(whitespace: str | int, expected: dict[str, object]) -> None:
    # Unimplemented keywords and oneOf are approximated, as with xgrammar (post-validation checks them).
    assert json_compile_options(ConstraintOptions(whitespace=whitespace)) == {  # type: ignore[arg-type]
        "coerce_one_of": True, "lenient": True, **expected}


def test_limits_llguidance_meets_at_the_first_token_refuse_the_compile(engine: GrammarEngine) -> None:
    words = json.dumps([f"w{i}" for i in range(2500)])  # more alternatives than its parser's 2,000 items per row
    with pytest.raises(CompileError, match=r"^grammar: llguidance cannot compile this choice: .*max is 2000"):
        engine.start(11, parse_constraint("choice", words, {"backend": "llguidance"}))
    engine.start(11, parse_constraint("choice", words))  # auto: xgrammar first for a choice
    try:
        assert engine.table.get(11).backend == "xgrammar"
    finally:
        engine.end([11])


def test_structural_tags_and_a_missing_backend_are_refused(engine: GrammarEngine, tiny_info: xgr.TokenizerInfo) -> None:
    tag = '{"triggers":["<f"],"tags":[{"begin":"<f>","schema":{"type":"object"},"end":"</f>"}]}'
    with pytest.raises(CompileError, match=r"^grammar_type: structural_tag is not supported by the llguidance backend$"):
        engine.start(7, parse_constraint("structural_tag", tag, {"backend": "llguidance"}))
    bare = GrammarEngine(tiny_info, "tiny", GrammarEngineConfig(max_batch=1))
    try:
        with pytest.raises(CompileError, match=r"^grammar_options\.backend: llguidance is not available on this server$"):
            bare.start(1, parse_constraint("regex", "a", {"backend": "llguidance"}))
        assert bare.backends(parse_constraint("regex", "a")) == ("xgrammar",)
    finally:
        bare.close()


def test_budget_closing_works_on_llguidance_rows(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    """The closer drives an llguidance matcher through the same interface: a model looping inside a
    string is closed within its budget, with the same completion as on xgrammar."""
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                          "tags": {"type": "array", "items": {"type": "string"}}},
                         "required": ["name", "tags"]})
    encode = lambda text: qwen_tokenizer.encode(text, add_special_tokens=False)
    loop = encode('{"name":"') + encode("a") * 100
    stop = int(engine.tokenizer_info.stop_token_ids[0])
    outputs = {}
    for seq_id, backend in ((8, "xgrammar"), (9, "llguidance")):
        engine.start(seq_id, parse_constraint("json_schema", schema, {"backend": backend}), budget=30)
        try:
            ids, tokens = np.array([seq_id], np.uint64), list[int]()
            out = engine.step(ids, np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
            while not out.terminated[0]:
                allowed = set(allowed_tokens(out.bitmask[0], QWEN_VOCAB).tolist())
                want = loop[len(tokens)]
                token = want if want in allowed else min(allowed)  # the model's choice, else what the mask leaves
                tokens.append(token)
                out = engine.step(ids, np.array([[token]], np.int32), np.ones(1, np.int32))
                assert out.errors == (None,)
            assert len(tokens) <= 30 and tokens[-1] == stop
            outputs[backend] = qwen_tokenizer.decode(tokens[:-1])
        finally:
            engine.end([seq_id])
    assert outputs["llguidance"] == outputs["xgrammar"]
    assert json.loads(outputs["llguidance"]) == {"name": "a" * 21, "tags": []}


def _accepts(engine: GrammarEngine, qwen_tokenizer: Any, spec: Any, text: str) -> bool:
    engine.start(12, spec)
    try:
        ids = [*qwen_tokenizer.encode(text, add_special_tokens=False), int(engine.tokenizer_info.stop_token_ids[0])]
        out = engine.step(np.array([12], np.uint64), np.array([ids], np.int32), np.array([len(ids)], np.int32))
        return out.errors == (None,) and bool(out.terminated[0])
    finally:
        engine.end([12])


@pytest.mark.parametrize(
    ("schema", "violation", "unenforced"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]", [("/uniqueItems", "uniqueItems")]),
        ({"type": "object", "properties": {"not": {"not": {"type": "string"}}}}, '{"not":"x"}',
         [("/properties/not/not", "not")]),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", [("/oneOf", "oneOf")]),
        ({"type": "string", "format": "colour"}, None, [("/format", "format")]),
        # Enforced by llguidance (xgrammar 0.2.9 lets "2023-02-30" through): nothing to report.
        ({"type": "string", "format": "date"}, None, []),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, None, []),  # disjoint: exact
    ],
)
def test_the_llguidance_fidelity_report(engine: GrammarEngine, qwen_tokenizer: Any, schema: dict[str, Any],
                                        violation: str | None, unenforced: list[tuple[str, str]]) -> None:
    """Each reported keyword is one llguidance really lets through (the violating output decodes)."""
    spec = parse_constraint("json_schema", json.dumps(schema), {"backend": "llguidance"})
    assert [(u.pointer, u.keyword) for u in llg_unenforced(spec)] == unenforced
    if violation is not None:
        assert _accepts(engine, qwen_tokenizer, spec, violation)


def test_llguidance_enforces_calendar_dates(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    spec = parse_constraint("json_schema", '{"type":"string","format":"date"}', {"backend": "llguidance"})
    assert _accepts(engine, qwen_tokenizer, spec, '"2024-02-29"')
    assert not _accepts(engine, qwen_tokenizer, spec, '"2023-02-30"')


def test_an_llguidance_limit_mid_sequence_fails_that_row_only(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    """Past the first token (which the compile probes), a parser limit ends the row with llguidance's reason."""
    words = " | ".join(f'"w{i}"' for i in range(2500))  # more than its parser's 2,000 items per row
    # The compile probe takes "x" (the first token its mask allows); "y" then opens the wide rule.
    wide = parse_constraint("lark", f'start: ("x" | "z") "y" c\nc: {words}', {"backend": "llguidance"})
    engine.start(13, wide)
    engine.start(14, parse_constraint("regex", "xy[a-z]+", {"backend": "llguidance"}))
    try:
        ids = np.array([13, 14], np.uint64)
        out = engine.step(ids, np.zeros((2, 1), np.int32), np.zeros(2, np.int32))
        feed = np.array([qwen_tokenizer.encode("x", add_special_tokens=False)] * 2, np.int32)
        out = engine.step(ids, feed, np.ones(2, np.int32))
        assert out.errors == (None, None)
        feed = np.array([qwen_tokenizer.encode("y", add_special_tokens=False)] * 2, np.int32)
        out = engine.step(ids, feed, np.ones(2, np.int32))
        assert isinstance(out.errors[0], BackendFailed)
        assert re.fullmatch(r"sequence 13: llguidance stopped: Parser Error: Current row has \d+ items; max is 2000.*",
                            str(out.errors[0]))
        assert out.errors[1] is None
    finally:
        engine.end([13, 14])


def test_when_both_backends_refuse_the_error_is_the_first_ones(engine: GrammarEngine) -> None:
    with pytest.raises(CompileError) as info:
        engine.start(15, parse_constraint("regex", "(a"))  # auto: xgrammar first for a regex
    assert info.value.field == "grammar"
    assert re.fullmatch(r"grammar: xgrammar cannot compile this regex: .+ \(llguidance too: llguidance cannot compile "
                        r"this regex: .+\)", str(info.value), re.DOTALL), str(info.value)
    assert 15 not in engine.table


@pytest.mark.parametrize(
    ("first", "later", "err", "kind", "message"),
    [
        (CompileError("grammar", "llguidance cannot compile this json_schema: too big"), "xgrammar",
         CompileTimeout("grammar: compile did not finish within 20 s (it goes on; retry later)"), CompileTimeout,
         ("grammar: compile did not finish within 20 s (it goes on; retry later) (llguidance: llguidance cannot "
          "compile this json_schema: too big)")),
        (CompileError("grammar", "llguidance cannot compile this json_schema: too big"), "xgrammar",
         CompileQueueFull("grammar: 10 compiles are running or queued (2 workers, queue of 8); retry later"),
         CompileQueueFull, ("grammar: 10 compiles are running or queued (2 workers, queue of 8); retry later "
                            "(llguidance: llguidance cannot compile this json_schema: too big)")),
        (CompileTimeout("grammar: compile did not finish within 5 s (it goes on; retry later)"), "llguidance",
         CompileError("grammar", "llguidance cannot compile this choice: 4097 items"), CompileTimeout,
         ("grammar: compile did not finish within 5 s (it goes on; retry later) (llguidance too: llguidance cannot "
          "compile this choice: 4097 items)")),
        (CompileError("grammar", "xgrammar cannot compile this regex: bad"), "llguidance",
         CompileError("grammar", "llguidance cannot compile this regex: bad too"), CompileError,
         ("grammar: xgrammar cannot compile this regex: bad (llguidance too: llguidance cannot compile this regex: "
          "bad too)")),
    ],
)
def test_a_start_every_backend_failed_is_retriable_when_one_only_ran_out_of_time(
        first: GrammarError, later: str, err: GrammarError, kind: type, message: str) -> None:
    """A final refusal by one backend and a timeout (or full queue) of the other: a retry may still succeed."""
    combined = engine_module._also(first, later, err)
    assert type(combined) is kind
    assert str(combined) == message


_DEEP = "(" * 20_000 + '"a"' + ")" * 20_000


@pytest.mark.parametrize(
    ("kind", "payload", "backend", "message"),
    [
        ("ebnf", 'rule ::= "a"', "llguidance", r"llguidance cannot compile this ebnf: No 'root' rule found$"),
        ("ebnf", 'rule ::= "a"', "xgrammar", r"xgrammar cannot compile this ebnf: .*root rule with name \"root\""),
        ("ebnf", "root ::= foo", "llguidance", r"llguidance cannot compile this ebnf: Rule 'foo' not found$"),
        ("ebnf", "root ::= foo", "xgrammar", r"xgrammar cannot compile this ebnf: .*Rule \"foo\" is not defined$"),
        # llguidance's GBNF translator is recursive Python: 20,000 groups end in a RecursionError.
        ("ebnf", "root ::= " + _DEEP, "llguidance", r"llguidance cannot compile this ebnf: it nests too deeply$"),
        ("ebnf", "root ::= " + _DEEP, "xgrammar", r"xgrammar cannot compile this ebnf: .*Nest layer exceeded"),
        ("lark", 'rule: "a"', "llguidance", r"llguidance cannot compile this lark: no start rule found$"),
        ("lark", "start: foo", "xgrammar", r"xgrammar cannot compile this lark: .*unknown name 'foo'$"),
        ("lark", "start: " + _DEEP, "llguidance", r"llguidance cannot compile this lark: .*too deeply nested"),
        # auto tries both: the error is a client's (INVALID_ARGUMENT), never an internal one.
        ("ebnf", 'rule ::= "a"', "auto", (r"xgrammar cannot compile this ebnf: .*\(llguidance too: llguidance cannot "
                                         r"compile this ebnf: No 'root' rule found\)$")),
        ("ebnf", "root ::= " + _DEEP, "auto", (r"xgrammar .*\(llguidance too: llguidance cannot compile this ebnf: it nests too "
                                              r"deeply\)$")),
    ],
)
def test_a_broken_grammar_is_the_clients_error_on_every_backend(engine: GrammarEngine, kind: str, payload: str,
                                                                backend: str, message: str) -> None:
    with pytest.raises(CompileError, match=r"^grammar: " + message) as info:
        engine.start(16, parse_constraint(kind, payload, {"backend": backend}))
    assert info.value.field == "grammar"
    assert 16 not in engine.table


@pytest.mark.parametrize(
    ("prefix", "tail", "expected"),
    [
        ('{"city":"Paris","unit":"', 'celsius"}', True),  # accepted, and the object is complete
        ('{"city":"Paris","unit":"', 'celsius"', False),  # accepted, still open
        ('{"city":"Paris","unit":"', "kelvin\"}", False),  # not in the enum: rejected at its first token
        ('{"city":"Paris","unit":"celsius"}', "", True),  # nothing more: complete as it is
        ('{"city":"Paris"', "", False),
    ],
)
def test_completes_is_the_closers_token_loop_in_one_call(engine: GrammarEngine, qwen_tokenizer: Any, prefix: str,
                                                          tail: str, expected: bool) -> None:
    """LlgMatcher.completes answers what accepting the tail token by token, then asking is_completed, answers,
    and leaves the matcher where it was (its next mask unchanged)."""
    from grammar_backend.closing import Closer

    with _weather_at(engine, qwen_tokenizer, prefix) as matcher:
        ids = tuple(qwen_tokenizer.encode(tail, add_special_tokens=False))
        before = _mask(matcher)
        slow = Closer.accepts(_TokenByToken(matcher), ids)  # type: ignore[arg-type]  # only what accepts() calls
        assert matcher.completes(ids) is expected and slow is expected
        assert np.array_equal(before, _mask(matcher))


@contextlib.contextmanager
def _weather_at(engine: GrammarEngine, qwen_tokenizer: Any, prefix: str) -> Iterator[Any]:
    """An llguidance sequence of the weather tool's schema, after ``prefix``; ended on the way out."""
    from grammar_backend.llg import LlgMatcher

    spec = parse_constraint("json_schema", json.dumps(load_schema("tool_weather")), {"backend": "llguidance"})
    engine.start(41, spec)
    try:
        matcher = engine.table.get(41).matcher
        assert isinstance(matcher, LlgMatcher)
        for token in qwen_tokenizer.encode(prefix, add_special_tokens=False):
            assert matcher.accept_token(token)
        yield matcher
    finally:
        engine.end([41])


def _mask(matcher: Any) -> np.ndarray:
    row = np.zeros((1, (QWEN_VOCAB + 31) // 32), np.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]


@pytest.mark.parametrize("prefix", ["", '{"city":"Par', '{"city":"Paris","unit":"celsius"', "{"])
def test_allows_is_the_mask_bit_and_moves_nothing(engine: GrammarEngine, qwen_tokenizer: Any, prefix: str) -> None:
    """LlgMatcher.allows answers each token's mask bit (the stop token's too) and leaves the mask as it was."""
    with _weather_at(engine, qwen_tokenizer, prefix) as matcher:
        before = _mask(matcher)
        allowed = set(allowed_tokens(before, QWEN_VOCAB).tolist())
        stop = int(engine.tokenizer_info.stop_token_ids[0])
        for token in [*sorted(allowed)[:20], *range(0, QWEN_VOCAB, 7919), stop]:
            assert matcher.allows(token) is (token in allowed), token
        assert np.array_equal(before, _mask(matcher))


class _TokenByToken:
    """A matcher seen without its ``completes`` (Closer.accepts then accepts and rolls back token by token)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def accept_token(self, token: int) -> bool:
        return bool(self._inner.accept_token(token))

    def rollback(self, steps: int) -> None:
        self._inner.rollback(steps)

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())


def test_a_grammar_gets_further_templates_only_for_sequences_side_by_side(qwen_tokenizer: Any,
                                                                          qwen_info: xgr.TokenizerInfo) -> None:
    """Copies of one llguidance template take turns at its lexer: a start that finds every template copied by
    a live sequence has one more built (up to the fill threads), and each start copies the least copied one."""
    llg = LlgBackend(qwen_tokenizer, QWEN_VOCAB, [int(t) for t in qwen_info.stop_token_ids])
    spread = TemplateSpread(llg)
    compiled = llg.compile(parse_constraint("json_schema", json.dumps(load_schema("tool_weather")),
                                            {"backend": "llguidance"}), 2)
    # One sequence at a time: its one template, its lexer warm, nothing built.
    for _ in range(3):
        alone = spread.matcher(compiled)
        assert (alone.family, compiled.building, len(compiled.templates)) == (0, False, 1)
        del alone  # its copy is given back when it is collected
    first, second = spread.matcher(compiled), spread.matcher(compiled)
    assert (first.family, second.family) == (0, 0)  # the second asked for a template; it is built off its path
    spread.drain(HANG_S)
    assert len(compiled.templates) == 2 and compiled.templates[1] is not compiled.templates[0]
    third, fourth, fifth = (spread.matcher(compiled) for _ in range(3))
    assert (third.family, fourth.family, fifth.family) == (1, 1, 0)  # the least copied; no third template
    assert not compiled.building and len(compiled.templates) == 2
    del first, second, fifth
    assert spread.matcher(compiled).family == 0
    heavy = llg.compile(parse_constraint("regex", "[a-z]+", {"backend": "llguidance"}), 1)
    held = [spread.matcher(heavy) for _ in range(3)]
    assert [m.family for m in held] == [0, 0, 0] and not heavy.building and len(heavy.templates) == 1
    spread.close()


@pytest.mark.parametrize(("heavy_bytes", "families"), [(65_536, [0, 0, 1, 1, 0]), (16, [0, 0, 0, 0, 0])],
                         ids=["side-by-side", "heavy-one-template"])
def test_rows_of_every_template_fill_their_own_masks(qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo,
                                                     heavy_bytes: int, families: list[int]) -> None:
    """On two fill threads, rows copied from two templates (one for a heavy constraint), filled grouped by
    template: each row gets its own mask at its own row."""
    from grammar_backend.llg import LlgMatcher

    stops = [int(t) for t in qwen_info.stop_token_ids]
    llg = LlgBackend(qwen_tokenizer, QWEN_VOCAB, stops)
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=5, fill_threads=2,
                                                               heavy_constraint_bytes=heavy_bytes), llg=llg)
    spec = parse_constraint("json_schema", json.dumps(load_schema("tool_weather")), {"backend": "llguidance"})
    ids = qwen_tokenizer.encode('{"city":"Paris","unit":"celsius"}', add_special_tokens=False)
    seq_ids = np.arange(1, 6, dtype=np.uint64)
    try:
        for seq_id in seq_ids:
            eng.start(int(seq_id), spec)
            if seq_id == 2:  # wait for the template the second start asked for
                eng._spread.drain(HANG_S)  # type: ignore[union-attr]
        matchers = [eng.table.get(int(s)).matcher for s in seq_ids]
        assert [m.family if isinstance(m, LlgMatcher) else None for m in matchers] == families
        # Row r has taken r tokens: every row a state of its own, the templates interleaved.
        for r, seq_id in enumerate(seq_ids):
            if r:
                out = eng.step(np.array([seq_id]), np.array([ids[:r]], np.int32), np.array([r], np.int32))
                assert out.errors == (None,)
        out = eng.step(seq_ids, np.zeros((5, 1), np.int32), np.zeros(5, np.int32))
        assert out.errors == (None,) * 5
        for r in range(5):
            alone = llg.matcher(llg.compile(spec))
            for token in ids[:r]:
                assert alone.accept_token(token)
            row = np.zeros((1, (QWEN_VOCAB + 31) // 32), np.int32)
            alone.fill_next_token_bitmask(row, 0)
            assert np.array_equal(out.bitmask[r], row[0]), f"row {r}"
    finally:
        eng.end([int(s) for s in seq_ids])
        eng.close()


def test_a_compile_for_no_fill_thread_is_refused(qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo) -> None:
    llg = LlgBackend(qwen_tokenizer, QWEN_VOCAB, [int(t) for t in qwen_info.stop_token_ids])
    with pytest.raises(ConfigError, match=r"^llguidance compile: fill_threads must be positive, got 0$"):
        llg.compile(parse_constraint("regex", "[a-z]+", {"backend": "llguidance"}), 0)
