"""Grammar engine: batched steps, per-row errors, bitmask layout, real-vocabulary token alignment."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.bitmask import BitmaskBuffer, allowed_tokens
from grammar_backend.errors import (
    CompileError,
    CompileQueueFull,
    CompileTimeout,
    ConfigError,
    DuplicateSequence,
    GrammarError,
)
from grammar_backend.protocol import bitmask_width
from grammar_backend.spec import parse_constraint
from grammar_service.cache import CacheConfig
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from tests.unit.conftest import (
    TINY_STOP,
    TINY_VOCAB,
    TINY_VOCAB_SIZE,
    load_schema,
    tiny_encode,
)


@pytest.fixture()
def engine(tiny_info: xgr.TokenizerInfo) -> Iterator[GrammarEngine]:
    eng = GrammarEngine(tiny_info, "tiny-fp", GrammarEngineConfig(max_batch=8), encode=tiny_encode)
    yield eng
    eng.close()


def _step(engine: GrammarEngine, rows: list[tuple[int, list[int]]]) -> Any:
    k = max([len(t) for _, t in rows] + [1])
    tokens = np.zeros((len(rows), k), dtype=np.int32)
    for i, (_, toks) in enumerate(rows):
        tokens[i, : len(toks)] = toks
    ids = np.array([sid for sid, _ in rows], dtype=np.uint64)
    counts = np.array([len(t) for _, t in rows], dtype=np.int32)
    return engine.step(ids, tokens, counts)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 151936])
def test_bitmask_width(vocab: int) -> None:
    assert bitmask_width(vocab) == -(-vocab // 32) == xgr.get_bitmask_shape(1, vocab)[1]


def test_bitmask_buffer_is_reused_and_rows_are_exact(tiny_info: xgr.TokenizerInfo) -> None:
    compiler = xgr.GrammarCompiler(tiny_info, cache_enabled=False)
    matcher = xgr.GrammarMatcher(compiler.compile_regex("[xy]z"))
    buf = BitmaskBuffer(4, TINY_VOCAB_SIZE)
    first = buf.fill([None, matcher, None])
    assert first.shape == (3, bitmask_width(TINY_VOCAB_SIZE)) and first.base is buf.buffer
    assert allowed_tokens(first[1], TINY_VOCAB_SIZE).tolist() == [ord("x"), ord("y")]
    assert len(allowed_tokens(first[0], TINY_VOCAB_SIZE)) == TINY_VOCAB_SIZE
    second = buf.fill([matcher])
    assert second.base is buf.buffer
    with pytest.raises(GrammarError, match=r"^bitmask: batch of 5 rows exceeds max_batch 4$"):
        buf.fill([None] * 5)


def test_bitmask_buffer_fills_the_callers_rows(tiny_info: xgr.TokenizerInfo) -> None:
    """``out``: the caller's rows are filled in place of the buffer, and force/keep/restrict edit them."""
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(tiny_info, cache_enabled=False).compile_regex("[xy]z"))
    buf = BitmaskBuffer(4, TINY_VOCAB_SIZE)
    width = bitmask_width(TINY_VOCAB_SIZE)
    out = np.zeros((2, width), np.int32)
    assert buf.fill([matcher, None], out).base is out
    assert allowed_tokens(out[0], TINY_VOCAB_SIZE).tolist() == [ord("x"), ord("y")]
    assert len(allowed_tokens(out[1], TINY_VOCAB_SIZE)) == TINY_VOCAB_SIZE
    buf.force(1, ord("q"))
    assert allowed_tokens(out[1], TINY_VOCAB_SIZE).tolist() == [ord("q")] and buf.allows(1, ord("q"))
    assert (buf.buffer == -1).all()  # untouched
    for bad in (np.zeros((3, width), np.int32), np.zeros((2, width), np.int64), np.zeros((width, 2), np.int32).T):
        with pytest.raises(GrammarError, match=r"^bitmask: an out buffer must be C-contiguous int32 of shape"):
            buf.fill([matcher, None], bad)


@pytest.mark.parametrize(("threads", "spread_min_s", "taken"), [
    (1, 0.0, [1, 1, 1]),  # one thread: nothing to spread over
    (2, 0.0, [2, 2, 2]),  # every fill takes both
    (2, 1e-12, [1, 2, 2]),  # the first fill has no cost to go by: one thread; then any fill costs enough
    (2, float("inf"), [1, 1, 1]),  # no fill costs enough to start threads for
])
def test_xgrammar_rows_take_the_fill_threads_where_their_last_fill_was_costly(
        tiny_info: xgr.TokenizerInfo, threads: int, spread_min_s: float, taken: list[int]) -> None:
    """BatchGrammarMatcher(n) starts n threads at every call: a fill goes to them only where the rows' last
    fill cost ``spread_min_s`` or more, and fills the same rows either way."""
    grammar = xgr.GrammarCompiler(tiny_info, cache_enabled=False).compile_regex("[xy]z|zz[xy]")
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(6)]
    one = BitmaskBuffer(8, TINY_VOCAB_SIZE)
    buf = BitmaskBuffer(8, TINY_VOCAB_SIZE, threads, spread_min_s=spread_min_s)
    seen = []
    for token in (None, ord("z"), ord("z")):
        if token is not None:
            for matcher in matchers[::2]:  # half the rows move on: rows in two states
                assert matcher.accept_token(token)
        rows: list[xgr.GrammarMatcher | None] = [*matchers, None]
        np.testing.assert_array_equal(buf.fill(rows), one.fill(rows))
        seen.append(buf.xgrammar_threads)
    assert seen == taken


@pytest.mark.parametrize("spread_min_s", [-1e-3, float("nan")])
def test_a_spread_threshold_below_zero_or_nan_is_refused(spread_min_s: float) -> None:
    with pytest.raises(ConfigError, match=r"^bitmask: spread_min_s must be >= 0, not "):
        BitmaskBuffer(4, TINY_VOCAB_SIZE, 2, spread_min_s=spread_min_s)


def test_a_step_into_the_callers_rows_equals_a_step_into_the_engines(engine: GrammarEngine) -> None:
    engine.start(20, parse_constraint("json_schema", json.dumps(load_schema("person"))))
    engine.start(21, parse_constraint("choice", '["yes", "no"]'))
    ids = np.array([20, 21], np.uint64)
    out = np.zeros((2, bitmask_width(TINY_VOCAB_SIZE)), np.int32)
    try:
        for tokens in ([0, 0], [ord("{"), ord("y")]):
            counts = np.array([0, 0] if tokens == [0, 0] else [1, 1], np.int32)
            step = engine.step(ids, np.array([[t] for t in tokens], np.int32), counts, out=out)
            assert step.bitmask.base is out or step.bitmask is out
            mine = out.copy()
            engine.rollback([20, 21], counts.tolist())
            again = engine.step(ids, np.array([[t] for t in tokens], np.int32), counts)
            assert np.array_equal(again.bitmask, mine)
    finally:
        engine.end([20, 21])


def test_mixed_batch_step(engine: GrammarEngine) -> None:
    engine.start(10, parse_constraint("json_schema", json.dumps(load_schema("person"))))
    engine.start(11, parse_constraint("choice", '["yes", "no"]'))
    out = _step(engine, [(10, []), (99, []), (11, tiny_encode("ye")), (12, [])])
    assert out.bitmask.shape == (4, bitmask_width(TINY_VOCAB_SIZE))
    assert allowed_tokens(out.bitmask[0], TINY_VOCAB_SIZE).tolist() == [ord("{"), 256]  # '{' and '{"'
    assert allowed_tokens(out.bitmask[2], TINY_VOCAB_SIZE).tolist() == [ord("s")]
    assert [str(e) if e else None for e in out.errors] == [
        None, "sequence 99: not active (never started, ended or evicted)", None,
        "sequence 12: not active (never started, ended or evicted)",
    ]
    assert out.terminated.tolist() == [False, False, False, False]
    out = _step(engine, [(11, tiny_encode("s"))])
    assert allowed_tokens(out.bitmask[0], TINY_VOCAB_SIZE).tolist() == [TINY_STOP]  # stop only where accepted
    out = _step(engine, [(11, [TINY_STOP]), (10, tiny_encode('{"name":"A"'))])
    assert out.terminated.tolist() == [True, False] and out.errors == (None, None)
    assert allowed_tokens(out.bitmask[1], TINY_VOCAB_SIZE).tolist() == [ord(",")]
    assert engine.end([10, 11, 12]) == 2 and engine.active_count == 0


def test_rejected_token_fails_only_its_row(engine: GrammarEngine) -> None:
    engine.start(1, parse_constraint("regex", "[0-9]+"))
    engine.start(2, parse_constraint("regex", "[0-9]+"))
    out = _step(engine, [(1, tiny_encode("1a")), (2, tiny_encode("12"))])
    assert str(out.errors[0]) == "sequence 1: token 97 at position 1 is rejected by the grammar"
    assert out.errors[1] is None
    assert allowed_tokens(out.bitmask[1], TINY_VOCAB_SIZE).tolist() == [*range(ord("0"), ord("9") + 1), TINY_STOP]


def test_jump_forward_tokens(engine: GrammarEngine) -> None:
    engine.start(1, parse_constraint("json_schema", json.dumps(load_schema("tool_weather"))))
    out = engine.step(np.array([1], dtype=np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32),
                      jump_forward=True)
    forced = b"".join(TINY_VOCAB[t] for t in out.forced[0])
    # The final '"' is held back: it is a strict prefix of longer tokens (xgrammar's documented rule).
    assert forced == b'{"city":'


def test_start_errors(engine: GrammarEngine) -> None:
    engine.start(1, parse_constraint("regex", "a"))
    with pytest.raises(DuplicateSequence, match=r"^sequence 1: already started$"):
        engine.start(1, parse_constraint("regex", "b"))
    with pytest.raises(CompileError, match=r"^grammar: xgrammar cannot compile this ebnf: EBNF parser error"):
        engine.start(2, parse_constraint("ebnf", "root ::= missing_rule"))
    assert engine.active_count == 1
    assert engine.cache.stats().compile_failures == 1


def _slow(n: int) -> Any:
    # About 6 s to compile with the tiny vocabulary and xgrammar's cache on
    # (8k items: 0.2 s); the description only makes the keys distinct.
    return parse_constraint(
        "json_schema", json.dumps({"description": str(n), "enum": [f"value-{i}" for i in range(10_000)]})
    )


class _Outcomes:
    """Collects start_async callbacks (each must come exactly once)."""

    def __init__(self) -> None:
        self.by_seq: dict[int, GrammarError | None] = {}
        self.calls = 0
        self.cond = threading.Condition()

    def for_seq(self, seq_id: int) -> Any:
        def done(err: GrammarError | None) -> None:
            with self.cond:
                self.calls += 1
                self.by_seq[seq_id] = err
                self.cond.notify_all()
        return done

    def wait(self, count: int, timeout: float = 120) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.calls >= count, timeout)


def test_a_start_past_its_deadline_answers_and_never_creates_its_matcher(tiny_info: xgr.TokenizerInfo) -> None:
    eng = GrammarEngine(tiny_info, "fp", GrammarEngineConfig(cache=CacheConfig(workers=1, timeout_s=0.3)))
    try:
        eng.warm_up()
        out = _Outcomes()
        eng.start_async(1, _slow(1), out.for_seq(1))
        out.wait(1)
        assert isinstance(out.by_seq[1], CompileTimeout)
        assert str(out.by_seq[1]) == "grammar: compile did not finish within 0.3 s (it goes on; retry later)"
        assert out.by_seq[1].status == "DEADLINE_EXCEEDED"
        # The compile goes on and is cached; the timed-out start stays without a matcher.
        eng.compile(_slow(1), timeout_s=120)
        assert (out.calls, eng.active_count, 1 in eng.table) == (1, 0, False)
        eng.start(2, _slow(1))  # a retry is a cache hit
        assert eng.active_count == 1
        stats = eng.cache.stats()
        assert (stats.compiles, stats.timeouts) == (1, 1)
    finally:
        eng.close()


def test_a_full_compile_queue_refuses_new_keys_but_not_cached_or_joining_ones(tiny_info: xgr.TokenizerInfo) -> None:
    eng = GrammarEngine(tiny_info, "fp", GrammarEngineConfig(cache=CacheConfig(workers=1, max_queued=1, timeout_s=120)))
    try:
        eng.warm_up()
        eng.start(9, parse_constraint("regex", "[a-z]+"))
        out = _Outcomes()
        eng.start_async(1, _slow(1), out.for_seq(1))  # compiling
        eng.start_async(2, _slow(2), out.for_seq(2))  # queued
        with pytest.raises(CompileQueueFull, match=r"^grammar: 2 compiles are running or queued \(1 workers, "
                                                   r"queue of 1\); retry later$") as caught:
            eng.start_async(3, _slow(3), out.for_seq(3))
        assert caught.value.status == "RESOURCE_EXHAUSTED"
        eng.start_async(4, _slow(1), out.for_seq(4))  # joins the running compile of the same key
        eng.start(5, parse_constraint("regex", "[a-z]+"))  # a cache hit never waits behind the slow ones
        assert eng.active_count == 2 and out.calls == 0
        out.wait(3)
        assert out.by_seq == {1: None, 2: None, 4: None}
        assert eng.active_count == 5
        stats = eng.cache.stats()
        assert (stats.refused, stats.compiles, stats.in_flight) == (1, 3, 0)
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("rows", "counts", "tokens_shape", "match"),
    [
        (9, 9, (9, 1), r"^step: batch of 9 rows exceeds max_batch 8$"),
        (2, 3, (2, 1), r"^step: SEQUENCE_ID has 2 rows, TOKEN_COUNT 3, TOKENS shape \(2, 1\)$"),
        (2, 2, (3, 1), r"^step: SEQUENCE_ID has 2 rows, TOKEN_COUNT 2, TOKENS shape \(3, 1\)$"),
    ],
)
def test_malformed_batches(engine: GrammarEngine, rows: int, counts: int, tokens_shape: tuple[int, int],
                           match: str) -> None:
    with pytest.raises(GrammarError, match=match):
        engine.step(np.arange(rows, dtype=np.uint64), np.zeros(tokens_shape, np.int32), np.zeros(counts, np.int32))


def test_token_count_out_of_range_is_a_row_error(engine: GrammarEngine) -> None:
    engine.start(1, parse_constraint("regex", "a"))
    out = engine.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.array([2], np.int32))
    assert str(out.errors[0]) == "sequence 1: TOKEN_COUNT 2 outside 0..1"


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match=r"^engine: max_batch"):
        GrammarEngineConfig(max_batch=0)


# --------------------------------------------------------- real large vocabulary
@pytest.mark.parametrize(
    ("kind", "payload", "options", "output"),
    [
        ("json_schema", json.dumps(load_schema("order")), None,
         '{"id":"ABC-1234","items":[{"sku":"é-ü 東京","qty":2}],"status":"paid","express":true}'),
        ("json_schema", json.dumps(load_schema("tree")), None,
         '{"value":1,"children":[{"value":2},{"value":-3,"children":[]}]}'),
        ("json_schema", json.dumps(load_schema("person")), '{"indent": 2}',
         '{\n  "name": "Zoë",\n  "age": 41\n}'),
        ("json_object", "", None, '{"k":[1,2.5,"\\u00e9",null]}'),
        ("regex", r"\d{3}-[a-z]+@example\.com", None, "123-john@example.com"),
        ("choice", '["north", "north-east", "南"]', None, "north-east"),
        ("ebnf", 'root ::= "SELECT " col (", " col)* " FROM t"\ncol ::= [a-z]+', None, "SELECT a, bc FROM t"),
        ("lark", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/', None, "(12+7+100)"),
        ("structural_tag",
         json.dumps({"triggers": ["<tool_call>"], "tags": [
             {"begin": "<tool_call>", "schema": load_schema("tool_weather"), "end": "</tool_call>"}]}), None,
         'Let me check. <tool_call>{"city": "Paris", "unit": "celsius"}</tool_call>'),
    ],
)
def test_real_bpe_tokens_are_accepted_and_masks_allow_them(
    qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo, kind: str, payload: str, options: str | None, output: str
) -> None:
    """Tokenize a valid output with Qwen3's BPE and force it token by token through the engine:
    every token must be allowed by the mask of its step, and the stop token only at the end."""
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=2))
    try:
        eng.start(1, parse_constraint(kind, payload, options))
        ids = qwen_tokenizer.encode(output, add_special_tokens=False)
        stop = qwen_info.stop_token_ids[0]
        previous: list[int] = []
        for token in [*ids, stop]:
            out = eng.step(np.array([1], np.uint64), np.array([previous or [0]], np.int32),
                           np.array([len(previous)], np.int32))
            assert out.errors == (None,)
            row = out.bitmask[0]
            assert (row[token // 32] >> (token % 32)) & 1, f"token {token} {qwen_tokenizer.decode([token])!r} masked"
            if kind.startswith("json"):  # a JSON document is never complete before its last token
                assert bool((row[stop // 32] >> (stop % 32)) & 1) is (token == stop)
            previous = [token]
        out = eng.step(np.array([1], np.uint64), np.array([[stop]], np.int32), np.array([1], np.int32))
        assert out.terminated.tolist() == [True]
    finally:
        eng.close()


def test_real_vocab_bitmask_padding_is_masked(qwen_info: xgr.TokenizerInfo) -> None:
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1))
    try:
        eng.start(1, parse_constraint("json_object", ""))
        out = eng.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
        allowed = allowed_tokens(out.bitmask[0], 151936)
        assert out.bitmask.shape == (1, 4748)
        assert allowed.max() < 151669  # the 267 padding ids are never allowed
    finally:
        eng.close()


@pytest.mark.parametrize("options", [None, '{"strict": true}', '{"whitespace": "any"}'])
def test_json_object_means_an_object(engine: GrammarEngine, options: str | None) -> None:
    """The contract's json_object: an object, never a bare string, number, array or literal."""
    spec = parse_constraint("json_object", "", options)
    engine.start(1, spec)
    out = engine.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
    allowed = {TINY_VOCAB[t] for t in allowed_tokens(out.bitmask[0], TINY_VOCAB_SIZE)}
    assert {b"{", b'{"'} <= allowed and not allowed & {b"[", b'"', b"1", b"t", b"n"}
    assert allowed <= {b"{", b'{"', b" ", b"\t", b"\n", b"\r"}
    assert spec.schema == {"type": "object"}
    engine.end([1])
