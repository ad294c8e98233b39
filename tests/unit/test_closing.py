"""Budget and runaway closing: the completion search, the repeat detector, a sequence's plan, the engine's masks.

Token alignment matters here (completions are spelled as vocabulary tokens
and forced one by one), so these tests use the real Qwen3 BPE vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.bitmask import BitmaskBuffer, allowed_tokens, few_allowed, pack_tokens
from grammar_backend.closing import (
    Closer,
    CloserConfig,
    ClosingConfig,
    RepeatConfig,
    RepeatDetector,
)
from grammar_backend.compile import compile_spec
from grammar_backend.errors import ConfigError
from grammar_backend.fidelity import validate_output
from grammar_backend.protocol import CloseState
from grammar_backend.sequences import FREE, GrammarSequence
from grammar_backend.spec import parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from tests.support import assets
from tests.unit.conftest import TINY_STOP, TINY_VOCAB, TINY_VOCAB_SIZE, tiny_encode

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "email": {"type": "string"},
    },
    "required": ["name", "age", "tags"],
}
DATE = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]}
EMAIL = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}, "required": ["e"]}
THREE_INTS = {"type": "array", "items": {"type": "integer"}, "minItems": 3}


@pytest.fixture(scope="module")
def compiler(qwen_info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(qwen_info, max_threads=1)


@pytest.fixture(scope="module")
def closer(qwen_info: xgr.TokenizerInfo) -> Closer:
    return Closer(qwen_info)


def _matcher(compiler: xgr.GrammarCompiler, tokenizer: Any, kind: str, payload: str, prefix: str) -> xgr.GrammarMatcher:
    matcher = xgr.GrammarMatcher(compile_spec(compiler, parse_constraint(kind, payload)))
    for token in tokenizer.encode(prefix):
        assert matcher.accept_token(token)
    return matcher


@pytest.mark.parametrize(
    ("kind", "payload", "prefix", "completion"),
    [
        ("json_schema", json.dumps(PERSON), "", '{"name":"","age":0,"tags":[]}'),
        ("json_schema", json.dumps(PERSON), '{"name":"Ann', '","age":0,"tags":[]}'),
        ("json_schema", json.dumps(PERSON), '{"name":"Ann","age":4', ',"tags":[]}'),
        ("json_schema", json.dumps(PERSON), '{"name":"Ann","age":42,"tags":["a","b', '"]}'),
        ("json_schema", json.dumps(DATE), '{"d":"20', '00-01-01"}'),
        ("json_schema", json.dumps(THREE_INTS), "[7", ",0,0]"),
        ("json_schema", json.dumps(EMAIL), '{"e":"jo', '@0"}'),
        ("json_object", "", '{"a":[{"b":"x', '"}]}'),
        ("regex", r"[a-z]+@[a-z]+\.com", "bob@ex", ".com"),
        ("regex", "(ab)+c", "ab", "abc"),  # recently used letters go last: the loop reaches its "c"
        ("choice", '["north","south"]', "so", "uth"),
        ("choice", '["north","south"]', "south", ""),
    ],
)
def test_completion_is_short_and_completes_the_grammar(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, kind: str, payload: str, prefix: str,
    completion: str,
) -> None:
    matcher = _matcher(compiler, qwen_tokenizer, kind, payload, prefix)
    tokens = closer.complete(matcher)
    assert tokens is not None
    assert qwen_tokenizer.decode(list(tokens)) == completion
    if kind in ("json_schema", "json_object"):
        assert validate_output(json.loads(payload or "{}"), prefix + completion).valid


def test_a_completion_the_bounded_search_cannot_find_is_none(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any
) -> None:
    # 1,000 characters at least: longer than the search's 512-character bound.
    schema = json.dumps({"type": "string", "minLength": 1000})
    matcher = _matcher(compiler, qwen_tokenizer, "json_schema", schema, '"abc')
    assert closer.complete(matcher) is None


def test_search_leaves_the_matcher_as_it_was(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo
) -> None:
    matcher = _matcher(compiler, qwen_tokenizer, "json_schema", json.dumps(PERSON), '{"name":"Ann","age":4')
    before = xgr.allocate_token_bitmask(1, qwen_info.vocab_size).numpy()
    after = before.copy()
    matcher.fill_next_token_bitmask(before)
    assert closer.complete(matcher) is not None
    matcher.fill_next_token_bitmask(after)
    np.testing.assert_array_equal(before, after)
    assert matcher.accept_string('2,"tags":[]}') and matcher.is_completed()


@pytest.mark.parametrize("text", ['{"name":"Zoë 🚀"}', "  spaced\tout\n", "x"])
def test_spell_round_trips_through_the_vocabulary(closer: Closer, qwen_tokenizer: Any, text: str) -> None:
    tokens = closer.spell(text.encode("utf-8"))
    assert tokens is not None
    assert qwen_tokenizer.decode(list(tokens)) == text


@pytest.mark.parametrize(
    ("tokens", "repeating"),
    [
        ([7] * 24, True),
        ([7] * 23, False),  # shorter than min_tokens
        ([1, 2, 3] * 8, True),
        ([1, 2, 3] * 7 + [1, 2], False),  # 23 tokens
        ([9] * 10 + [1, 2, 3] * 8, True),
        ([1, 2, 3] * 8 + [4], False),  # the tail breaks the run
        (list(range(16)) * 4, True),  # period 16, 4 repeats
        (list(range(17)) * 4, False),  # period 17 > max_period
        (list(range(40)), False),
    ],
)
def test_repeat_detector(tokens: list[int], repeating: bool) -> None:
    detector = RepeatDetector(RepeatConfig())
    for token in tokens:
        detector.push(token)
    assert detector.repeating() is repeating


def test_repeat_detector_rollback_forgets_tokens() -> None:
    detector = RepeatDetector(RepeatConfig())
    for token in [5] * 70:  # more than the 64-token window
        detector.push(token)
    assert detector.repeating()
    detector.rollback(50)
    assert not detector.repeating()  # 14 tokens held
    for token in [5] * 10:
        detector.push(token)
    assert detector.repeating()


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: CloserConfig(max_nodes=0), "max_nodes and max_chars must be positive"),
        (lambda: RepeatConfig(min_repeats=1), "need max_period >= 1, min_repeats >= 2, every >= 1"),
        (lambda: RepeatConfig(window=32), "window must hold min_tokens and min_repeats periods"),
        (lambda: ClosingConfig(margin=-1), "margin must be >= 0"),
    ],
)
def test_configs_reject_bad_values(factory: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        factory()


def _run(
    seq: GrammarSequence, closer: Closer, stop: int, runaway: list[int], limit: int
) -> tuple[list[int], bool]:
    """Drive ``seq`` like the decode loop: the model emits ``runaway`` forever unless a token is forced
    (or, when calm, the runaway token opens structure: then it takes the completion's next token).

    Returns the tokens taken and whether the stop token was forced.
    """
    calm = set(closer.calm_tokens())
    taken: list[int] = []
    for step in range(limit):
        token = seq.plan(closer, stop)
        if seq.forcing and token == stop:
            return taken, True
        wanted = runaway[step % len(runaway)]
        if token == FREE or (not seq.forcing and wanted in calm):
            token = wanted
        seq.accept([token])
        taken.append(token)
    return taken, False


def _sequence(
    compiler: xgr.GrammarCompiler, payload: dict[str, Any], budget: int, options: dict[str, str]
) -> GrammarSequence:
    spec = parse_constraint("json_schema", json.dumps(payload), options)
    return GrammarSequence(1, spec, xgr.GrammarMatcher(compile_spec(compiler, spec)), "xgrammar", 0.0, budget, ClosingConfig())


@pytest.mark.parametrize("budget", [24, 40, 200])
def test_budget_closing_ends_a_runaway_string_validly_within_the_budget(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo, budget: int
) -> None:
    stop = int(qwen_info.stop_token_ids[0])
    seq = _sequence(compiler, PERSON, budget, {"on_repeat": "continue"})
    prefix = qwen_tokenizer.encode('{"name":"')
    seq.accept(prefix)
    runaway = qwen_tokenizer.encode("bin/")  # "bin/bin/bin/..."
    taken, stopped = _run(seq, closer, stop, runaway, budget)
    assert stopped and seq.close_state == CloseState.BUDGET
    used = len(prefix) + len(taken) + 1  # the stop token counts
    assert budget - ClosingConfig().margin - 1 <= used <= budget
    text = qwen_tokenizer.decode(prefix + taken)
    assert text.startswith('{"name":"bin/') and text.endswith('","age":0,"tags":[]}')
    assert validate_output(PERSON, text).valid
    assert seq.matcher.accept_token(stop) and seq.matcher.is_terminated()


def test_repetition_closes_before_the_budget(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo
) -> None:
    stop = int(qwen_info.stop_token_ids[0])
    seq = _sequence(compiler, PERSON, 1000, {})
    prefix = qwen_tokenizer.encode('{"name":"Ann","age":3,"tags":["')
    seq.accept(prefix)
    runaway = qwen_tokenizer.encode('dog","')  # ["dog","dog","dog",...
    taken, stopped = _run(seq, closer, stop, runaway, 1000)
    assert stopped and seq.close_state == CloseState.REPETITION
    text = qwen_tokenizer.decode(prefix + taken)
    assert text.endswith('"dog","dog"]}')  # closed as soon as it was seen
    assert len(taken) < 40
    assert validate_output(PERSON, text).valid


@pytest.mark.parametrize(
    ("budget", "options"),
    [
        (30, {"on_budget": "truncate", "on_repeat": "continue"}),
        (0, {"on_repeat": "continue"}),  # no budget known
        (4, {"on_repeat": "continue"}),  # the completion never fits: given up, not forced
    ],
)
def test_no_closing_without_the_policy_or_room(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo, budget: int,
    options: dict[str, str],
) -> None:
    stop = int(qwen_info.stop_token_ids[0])
    seq = _sequence(compiler, PERSON, budget, options)
    seq.accept(qwen_tokenizer.encode('{"name":"'))
    taken, stopped = _run(seq, closer, stop, qwen_tokenizer.encode("bin/"), 40)
    assert not stopped and len(taken) == 40 and seq.close_state == CloseState.OPEN


def _first_step(engine: GrammarEngine, tokenizer: Any, budget: int) -> Any:
    """Sequence 1 (``budget``) and sequence 2 (no budget) on PERSON, both after '{"name":"'."""
    spec = parse_constraint("json_schema", json.dumps(PERSON), {"on_repeat": "continue"})
    engine.start(1, spec, budget=budget)
    engine.start(2, spec, budget=0)
    tokens = np.array([tokenizer.encode('{"name":"')] * 2, np.int32)
    return engine.step(np.array([1, 2], np.uint64), tokens, np.array([tokens.shape[1]] * 2, np.int32))


def test_engine_step_forces_one_token_and_reports_closing(
    qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any
) -> None:
    engine = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=2))
    try:
        out = _first_step(engine, qwen_tokenizer, budget=12)
        # Row 0: of its 12 tokens, the prefix, the completion '","age":0,"tags":[]}'
        # and the stop token leave at most one spare: forced from this step on.
        assert out.closing.tolist() == [CloseState.BUDGET, CloseState.OPEN]
        forced = allowed_tokens(out.bitmask[0], qwen_info.vocab_size).tolist()
        assert len(forced) == 1
        assert qwen_tokenizer.decode(forced) == '","'
        assert len(allowed_tokens(out.bitmask[1], qwen_info.vocab_size)) > 1000
    finally:
        engine.close()


def test_a_calm_sequence_may_still_finish_on_its_own(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo
) -> None:
    """{"n":42} fits in 12 tokens: calm from the first token, never forced, not closed early."""
    stop = int(qwen_info.stop_token_ids[0])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    seq = _sequence(compiler, schema, 12, {})
    calm = set(closer.calm_tokens())
    states = []
    for token in qwen_tokenizer.encode('{"n":42}'):
        allowed_next = seq.plan(closer, stop)
        states.append(seq.close_state)
        assert not seq.forcing
        assert token in calm or token == allowed_next
        seq.accept([token])
    assert seq.plan(closer, stop) == stop and not seq.forcing  # complete: the completion is the stop token
    assert set(states) == {CloseState.CALM}


def test_engine_step_restricts_a_calm_row(qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any) -> None:
    engine = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=2))
    try:
        out = _first_step(engine, qwen_tokenizer, budget=20)
        assert out.closing.tolist() == [CloseState.CALM, CloseState.OPEN]
        calm_row = set(allowed_tokens(out.bitmask[0], qwen_info.vocab_size).tolist())
        free_row = set(allowed_tokens(out.bitmask[1], qwen_info.vocab_size).tolist())
        calm = free_row & set(engine.closer.calm_tokens())
        # Calm tokens, and at most one more: the closer's completion token, which the grammar allows.
        extra = calm_row - calm
        assert len(extra) <= 1 and extra <= free_row and calm <= calm_row
        assert qwen_tokenizer.encode('","')[0] not in calm_row - extra
    finally:
        engine.close()


def test_bitmask_force_and_restrict(qwen_info: xgr.TokenizerInfo) -> None:
    vocab = qwen_info.vocab_size
    buffer = BitmaskBuffer(2, vocab)
    buffer.fill([None, None])
    buffer.force(0, 31)
    buffer.restrict(1, pack_tokens([5, 64, vocab - 1], vocab), 100)
    assert allowed_tokens(buffer.buffer[0], vocab).tolist() == [31]
    assert allowed_tokens(buffer.buffer[1], vocab).tolist() == [5, 64, 100, vocab - 1]


@pytest.mark.parametrize(
    ("earlier_at", "now_at", "tail"),
    [
        ('{"name":"Ann', '{"name":"Annabel', '","age":0,"tags":[]}'),  # calm text: the whole of it
        ('{"name":"Ann', '{"name":"Ann","age":4', ',"tags":[]}'),  # the output wrote a field: its tail
        ('{"name":"Ann","age":4', '{"name":"Ann","age":4,"tags":[', "]}"),
    ],
)
def test_resume_finds_the_tail_of_an_earlier_completion(
    compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo,
    earlier_at: str, now_at: str, tail: str,
) -> None:
    earlier = closer.complete(_matcher(compiler, qwen_tokenizer, "json_schema", json.dumps(PERSON), earlier_at))
    assert earlier is not None
    matcher = _matcher(compiler, qwen_tokenizer, "json_schema", json.dumps(PERSON), now_at)
    before = xgr.allocate_token_bitmask(1, qwen_info.vocab_size).numpy()
    matcher.fill_next_token_bitmask(before)
    resumed = closer.resume(matcher, earlier)
    assert resumed is not None and qwen_tokenizer.decode(list(resumed)) == tail
    after = before.copy()
    matcher.fill_next_token_bitmask(after)
    np.testing.assert_array_equal(before, after)  # left as it was
    assert closer.accepts(matcher, resumed)


def test_resume_gives_up_where_no_tail_fits(compiler: xgr.GrammarCompiler, closer: Closer, qwen_tokenizer: Any) -> None:
    earlier = closer.complete(_matcher(compiler, qwen_tokenizer, "json_schema", json.dumps(PERSON), '{"name":"A'))
    assert earlier is not None and qwen_tokenizer.decode(list(earlier)) == '","age":0,"tags":[]}'
    # Inside a tag's string: every tail of the earlier completion closes the wrong value (a new search does).
    matcher = _matcher(compiler, qwen_tokenizer, "json_schema", json.dumps(PERSON), '{"name":"A","age":4,"tags":["x')
    assert closer.resume(matcher, earlier) is None
    found = closer.complete(matcher)
    assert found is not None and qwen_tokenizer.decode(list(found)) == '"]}'


def test_the_first_completion_is_searched_once_per_constraint(
    compiler: xgr.GrammarCompiler, qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closer = Closer(qwen_info)
    searches: list[int] = []
    complete = closer.complete

    def counted(matcher: Any, check: Any = None, *, shortest: bool = False) -> tuple[int, ...] | None:
        searches.append(1)
        return complete(matcher, check, shortest=shortest)

    monkeypatch.setattr(closer, "complete", counted)
    spec = parse_constraint("json_schema", json.dumps(PERSON))
    first = [closer.initial(("xgrammar", spec), xgr.GrammarMatcher(compile_spec(compiler, spec))) for _ in range(3)]
    assert first[0] == first[1] == first[2] and qwen_tokenizer.decode(list(first[0] or ())) == (
        '{"name":"","age":0,"tags":[]}')
    assert len(searches) == 1
    other = parse_constraint("json_schema", json.dumps(THREE_INTS))
    closer.initial(("xgrammar", other), xgr.GrammarMatcher(compile_spec(compiler, other)))
    assert len(searches) == 2


@pytest.mark.parametrize(
    ("text", "cut", "need"),
    [
        ("abc", 3, 0),
        ("é", 1, 1),  # the first of two bytes
        ("日", 1, 2),
        ("日", 2, 1),
        ("🚀", 1, 3),
        ("🚀", 4, 0),
        ("é日", 3, 2),
    ],
)
def test_utf8_need_counts_the_bytes_a_character_still_owes(closer: Closer, qwen_info: xgr.TokenizerInfo,
                                                          text: str, cut: int, need: int) -> None:
    data = text.encode("utf-8")[:cut]
    tokens = [closer.spell(bytes([b])) for b in data]  # one byte-level token per byte
    assert all(t is not None and len(t) == 1 for t in tokens)
    assert closer.utf8_need(0, [t[0] for t in tokens if t]) == need


def test_calm_checks_thin_out_and_stay_cheap(
    compiler: xgr.GrammarCompiler, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A calm string writer: checks halve their distance to the budget, reuse the kept completion, and the
    output still closes validly within the budget."""
    closer = Closer(qwen_info)
    calls = {"complete": 0, "resume": 0}
    complete, resume = closer.complete, closer.resume

    def counted_complete(matcher: Any, check: Any = None) -> tuple[int, ...] | None:
        calls["complete"] += 1
        return complete(matcher, check)

    def counted_resume(matcher: Any, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        calls["resume"] += 1
        return resume(matcher, tokens)

    monkeypatch.setattr(closer, "complete", counted_complete)
    monkeypatch.setattr(closer, "resume", counted_resume)
    stop = int(qwen_info.stop_token_ids[0])
    budget = 120
    seq = _sequence(compiler, PERSON, budget, {"on_repeat": "continue"})
    prefix = qwen_tokenizer.encode('{"name":"')
    seq.accept(prefix)
    taken, stopped = _run(seq, closer, stop, qwen_tokenizer.encode("bin/"), budget)
    assert stopped and seq.close_state == CloseState.BUDGET
    text = qwen_tokenizer.decode(prefix + taken)
    assert validate_output(PERSON, text).valid and len(prefix) + len(taken) + 1 <= budget
    # About 110 tokens written: one search, then resumes at spaced checks only (a search at every
    # token of the calm zone before).
    assert calls["complete"] == 1 and calls["resume"] <= 24, calls


def test_a_check_inside_a_character_waits_for_its_end(
    compiler: xgr.GrammarCompiler, qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closer = Closer(qwen_info)
    searched_at: list[int] = []
    complete = closer.complete
    stop = int(qwen_info.stop_token_ids[0])
    seq = _sequence(compiler, PERSON, 1000, {"on_repeat": "continue"})

    def counted(matcher: Any, check: Any = None) -> tuple[int, ...] | None:
        searched_at.append(seq.tokens_accepted)
        return complete(matcher, check)

    monkeypatch.setattr(closer, "complete", counted)
    seq.accept(qwen_tokenizer.encode('{"name":"'))
    byte_tokens = [closer.spell(bytes([b])) for b in "🚀".encode()]
    seq.accept([byte_tokens[0][0]])  # type: ignore[index]
    seq.close.next_check = seq.tokens_accepted  # a check is due
    assert seq.plan(closer, stop) == FREE
    assert searched_at == [] and seq.close.utf8_need == 3  # inside the character: no search
    seq.accept([t[0] for t in byte_tokens[1:]])  # type: ignore[index]
    seq.plan(closer, stop)
    assert seq.close.utf8_need == 0 and searched_at == [seq.tokens_accepted]


def test_bitmask_allows(qwen_info: xgr.TokenizerInfo) -> None:
    vocab = qwen_info.vocab_size
    buffer = BitmaskBuffer(1, vocab)
    buffer.fill([None])
    buffer.restrict(0, pack_tokens([5, 64], vocab), 100)
    assert [buffer.allows(0, t) for t in (5, 6, 64, 100, vocab - 1)] == [True, False, True, True, False]


@pytest.mark.parametrize(
    ("tokens", "most", "found"),
    [
        ([5, 64, 100], 3, [5, 64, 100]),
        ([5, 64, 100], 2, None),  # more tokens than most
        ([0, 31, 32, 63], 4, [0, 31, 32, 63]),
        (list(range(0, 1000, 10)), 16, None),  # more words than most: decided before unpacking
        ([], 4, []),
    ],
)
def test_few_allowed_lists_a_short_row_only(tokens: list[int], most: int, found: list[int] | None) -> None:
    row = pack_tokens(tokens, 151_936)
    out = few_allowed(row, most)
    assert (None if out is None else out.tolist()) == found


def test_bitmask_keep_allows_exactly_the_tokens_given() -> None:
    buffer = BitmaskBuffer(1, 4096)
    buffer.fill([None])
    buffer.keep(0, [3, 40], 4095)
    assert allowed_tokens(buffer.buffer[0], 4096).tolist() == [3, 40, 4095]


# --------------------------------------------------------------------------- misses where a completion fits
# The four misses (SmolLM2, large schemas, max_tokens 384), replayed through the real matcher with
# SmolLM2's vocabulary: each digit is a token of its own there, and a large schema's required tail is
# longer than the search's old 512-character bound, so no completion was ever found.
@pytest.fixture(scope="module")
def smol() -> Any:
    from grammar_backend.tokenizer import load_tokenizer

    return load_tokenizer(str(assets.smollm2_dir()))


@pytest.fixture(scope="module")
def smol_compiler(smol: Any) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(smol.info, max_threads=1)


@pytest.fixture(scope="module")
def smol_closer(smol: Any) -> Closer:
    return Closer(smol.info)


def _wide(value: dict[str, Any], count: int = 40) -> dict[str, Any]:
    """An object of ``count`` required properties with long names: its shortest instance is over 512 characters."""
    names = [f"required_property_{i:02d}" for i in range(count)]
    return {"type": "object", "properties": {n: value for n in names}, "required": names,
            "additionalProperties": False}


def _wide_text(value: str, count: int = 40) -> str:
    return "{" + ",".join(f'"required_property_{i:02d}":{value}' for i in range(count)) + "}"


@pytest.mark.parametrize(
    ("value", "shortest"),
    [
        ({"type": "string"}, '""'),
        ({"type": "integer"}, "0"),
        ({"type": "string", "minLength": 1}, '"@"'),
        ({"type": "array", "items": {"type": "boolean"}}, "[]"),
    ],
)
def test_a_long_required_tail_is_found(
    smol: Any, smol_compiler: xgr.GrammarCompiler, smol_closer: Closer, value: dict[str, Any], shortest: str
) -> None:
    schema = _wide(value)
    assert len(_wide_text(shortest)) > 1000  # twice the old bound
    matcher = xgr.GrammarMatcher(compile_spec(smol_compiler, parse_constraint("json_schema", json.dumps(schema))))
    tokens = smol_closer.complete(matcher)
    assert tokens is not None
    assert smol.hf.decode(list(tokens)) == _wide_text(shortest)


def _smol_sequence(smol_compiler: xgr.GrammarCompiler, schema: dict[str, Any], budget: int,
                   options: dict[str, str] | None = None) -> GrammarSequence:
    spec = parse_constraint("json_schema", json.dumps(schema), options or {})
    return GrammarSequence(1, spec, xgr.GrammarMatcher(compile_spec(smol_compiler, spec)), "xgrammar", 0.0, budget,
                           ClosingConfig())


def _prose(count: int) -> str:
    """``count`` words in a seeded random order: no short repeating unit."""
    import random

    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "while", "seven", "wizards", "judge", "boxing", "matches", "near", "ancient", "harbors", "filled", "with", "curious", "travelers", "carrying", "maps", "and", "lanterns"]
    rng = random.Random(5)
    return "".join(" " + rng.choice(words) for _ in range(count))


#: 7**400: 339 digits with no period the repeat check sees (a counter's or a hash's digits).
APERIODIC = str(7**400)


@pytest.mark.parametrize(
    ("value", "prefix", "runaway", "budget", "state", "most_runaway"),
    [
        # A digit run in a string: the period-10 one is a repeat (40 tokens, checked every 4), the
        # aperiodic one a digit run (64 digits).  The budget leaves the repeat check time to see them.
        ({"type": "string"}, '{"required_property_00":"', "1234567890", 1000, CloseState.REPETITION, 44),
        ({"type": "string"}, '{"required_property_00":"', APERIODIC, 1000, CloseState.REPETITION, 68),
        # 100000000... in a number.
        ({"type": "integer"}, '{"required_property_00":1', "0", 1000, CloseState.REPETITION, 28),
        ({"type": "number"}, '{"required_property_00":3.', APERIODIC, 1000, CloseState.REPETITION, 68),
        # Within the 384 tokens the 320-token tail leaves no time to see a repeat: the budget closes it.
        ({"type": "string"}, '{"required_property_00":"', APERIODIC, 384, CloseState.BUDGET, 64),
        # A long string with little repetition: not a runaway, closed at the budget.
        ({"type": "string"}, '{"required_property_00":"', _prose(600), 1000, CloseState.BUDGET, 700),
    ],
)
def test_a_runaway_value_in_a_large_schema_closes_validly(
    smol: Any, smol_compiler: xgr.GrammarCompiler, smol_closer: Closer, value: dict[str, Any], prefix: str,
    runaway: str, budget: int, state: CloseState, most_runaway: int,
) -> None:
    schema = _wide(value)
    stop = int(smol.info.stop_token_ids[0])
    seq = _smol_sequence(smol_compiler, schema, budget)
    head = smol.hf.encode(prefix, add_special_tokens=False)
    seq.accept(head)
    taken, stopped = _run(seq, smol_closer, stop, smol.hf.encode(runaway, add_special_tokens=False), budget)
    assert stopped and seq.close_state == state and seq.close.forced is not None
    assert len(head) + len(taken) + 1 <= budget
    assert len(taken) - len(seq.close.forced) <= most_runaway  # the runaway's tokens before the forced completion
    text = smol.hf.decode(head + taken)
    assert validate_output(schema, text).valid, text[-200:]


@pytest.mark.parametrize(
    ("digits", "repeating"),
    [(63, False), (64, True), (0, False)],
)
def test_a_digit_run_is_a_runaway_from_max_digits(digits: int, repeating: bool) -> None:
    detector = RepeatDetector(RepeatConfig())
    for token in range(30):  # 30 distinct tokens: no period
        detector.push(token)
    assert detector.repeating(digits) is repeating


@pytest.mark.parametrize(
    ("pieces", "run"),
    [
        (["abc"], 0),
        (["1", "2", "3"], 3),
        (["x", "1", "2"], 2),
        (["1", "2", "a", "3"], 1),
        (['":"', "7"], 1),
        (["9", '",'], 0),
    ],
)
def test_digit_run_counts_the_digits_ending_the_output(smol: Any, smol_closer: Closer, pieces: list[str],
                                                       run: int) -> None:
    tokens = [smol_closer.spell(p.encode()) for p in pieces]
    assert all(t is not None and len(t) == 1 for t in tokens)
    assert smol_closer.digit_run(0, [t[0] for t in tokens if t]) == run


#: An optional object of 30 required properties: opening it adds 182 SmolLM2 tokens to the completion at once.
INNER = {f"field_{i:02d}": {"type": "string"} for i in range(30)}
LATE = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "object", "properties": INNER,
                                                                         "required": list(INNER)}},
        "required": ["a"]}


@pytest.mark.parametrize("slack", [0, 4, 12, 40])
def test_the_budget_is_checked_right_after_a_container_opens(
    smol: Any, smol_compiler: xgr.GrammarCompiler, smol_closer: Closer, slack: int
) -> None:
    """Checked at its spaced time only, the opened object's tail had outgrown the budget (given up, truncated)."""
    stop = int(smol.info.stop_token_ids[0])
    encode = smol.hf.encode
    opened = encode('{"a":"hello","b":{', add_special_tokens=False)
    probe = xgr.GrammarMatcher(compile_spec(smol_compiler, parse_constraint("json_schema", json.dumps(LATE))))
    assert all(probe.accept_token(t) for t in opened)
    tail = smol_closer.complete(probe)
    assert tail is not None and len(tail) == 182
    budget = len(opened) + len(tail) + 1 + slack  # the shortest completion fits exactly, plus the slack
    seq = _smol_sequence(smol_compiler, LATE, budget)
    head = encode('{"a":"hello"', add_special_tokens=False)
    seq.accept(head)
    runaway = encode(',"b":{"field_00":"' + _prose(300), add_special_tokens=False)
    taken, stopped = _run(seq, smol_closer, stop, runaway, budget)
    assert stopped and seq.close_state == CloseState.BUDGET
    assert len(head) + len(taken) + 1 <= budget
    assert validate_output(LATE, smol.hf.decode(head + taken)).valid


@pytest.mark.parametrize(
    ("schema", "prefix", "ending"),
    [
        # xgrammar leaves idn-email free: the first completion '"' ended the output invalid.
        ({"type": "string", "format": "idn-email"}, '"abc', '@"'),
        ({"type": "string", "format": "email"}, '"abc', '@0"'),  # enforced by the grammar: unchanged
    ],
)
def test_a_budget_closed_top_level_string_passes_post_validation(
    smol: Any, smol_compiler: xgr.GrammarCompiler, smol_closer: Closer, schema: dict[str, Any], prefix: str,
    ending: str,
) -> None:
    stop = int(smol.info.stop_token_ids[0])
    budget = 16
    seq = _smol_sequence(smol_compiler, schema, budget, {"on_repeat": "continue"})
    head = smol.hf.encode(prefix, add_special_tokens=False)
    seq.accept(head)
    taken, stopped = _run(seq, smol_closer, stop, smol.hf.encode("xyz", add_special_tokens=False), budget)
    assert stopped and seq.close_state == CloseState.BUDGET
    text = smol.hf.decode(head + taken)
    assert text.endswith(ending) and validate_output(schema, text).valid, text


def test_a_refused_completion_is_passed_over_within_the_node_bound(
    smol: Any, smol_compiler: xgr.GrammarCompiler, smol_closer: Closer
) -> None:
    matcher = xgr.GrammarMatcher(compile_spec(smol_compiler, parse_constraint("json_schema", json.dumps(
        {"type": "string"}))))
    assert matcher.accept_string('"ab')
    seen: list[bytes] = []

    def check(completion: bytes) -> bool:
        seen.append(completion)
        return completion.endswith(b'.-"')

    found = smol_closer.complete(matcher, check)
    assert found is not None and smol.hf.decode(list(found)) == '@.-"'
    assert seen == [b'"', b'@"', b'@."', b'@.-"']  # depth first: each refusal extends the string
    # Nothing passes: the first complete text stands (it still ends the output parseable).
    fallback = smol_closer.complete(matcher, lambda completion: False)
    assert fallback is not None and smol.hf.decode(list(fallback)) == '"'


@pytest.mark.parametrize("back", [0, 1, 3])
def test_a_rollback_keeps_the_top_level_text_and_ends_the_digit_run(
    smol: Any, smol_compiler: xgr.GrammarCompiler, smol_closer: Closer, back: int
) -> None:
    stop = int(smol.info.stop_token_ids[0])
    seq = _smol_sequence(smol_compiler, {"type": "string", "format": "idn-email"}, 100)
    tokens = smol.hf.encode('"ab12345', add_special_tokens=False)
    for token in tokens:
        seq.accept([token])
        seq.plan(smol_closer, stop)
    assert seq.close.digit_run == 5
    seq.accept(smol.hf.encode("67", add_special_tokens=False))  # not planned yet: folded in by the rollback
    seq.rollback(back)
    seq.plan(smol_closer, stop)
    assert seq.close.scalar_tokens is not None and len(seq.close.scalar_tokens) == seq.tokens_accepted
    assert smol_closer.text(seq.close.scalar_tokens) == (b'"ab1234567'[: len('"ab1234567') - back])
    assert seq.close.digit_run == (7 if back == 0 else 0)



_NAME_SCHEMA = ('{"type":"object","properties":{"name":{"type":"string"}},"required":["name"],'
                '"additionalProperties":false}')
#: A writer that starts a 4-byte character wherever it may (its lead, then continuation bytes).
_LEAD, _CONT = 0xF0, 0x9F


@pytest.fixture(scope="module")
def tiny_engine(tiny_info: xgr.TokenizerInfo) -> Iterator[GrammarEngine]:
    engine = GrammarEngine(tiny_info, "tiny", GrammarEngineConfig(max_batch=1), encode=tiny_encode)
    yield engine
    engine.close()


@pytest.mark.parametrize("budget", range(12, 44))
def test_a_writer_of_multibyte_characters_is_closed_within_its_budget(tiny_engine: GrammarEngine,
                                                                       budget: int) -> None:
    """No check can start a completion inside a character: near the budget a calm row takes only tokens
    that end on a character boundary, so the output still closes (before, a lead byte at spare 2 ran
    the output to max_tokens unclosed)."""
    tiny_engine.start(1, parse_constraint("json_schema", _NAME_SCHEMA, '{"on_budget":"close"}'), budget=budget)
    try:
        out = tiny_engine.step([1], np.zeros((1, 1), np.int32), [0])
        written: list[int] = []
        while True:
            allowed = set(allowed_tokens(out.bitmask[0], TINY_VOCAB_SIZE).tolist())
            token = next((t for t in (_LEAD, _CONT, ord("a")) if t in allowed), min(allowed))
            if token == TINY_STOP:
                break
            written.append(token)
            assert len(written) < budget, written  # room for the stop token stays
            out = tiny_engine.step([1], np.array([[token]], np.int32), [1])
    finally:
        tiny_engine.end([1])
    document = json.loads(b"".join(TINY_VOCAB[t] for t in written).decode("utf-8"))
    assert list(document) == ["name"]
    # 12 tokens hold {"name":""} and the stop token; from 16 on the writer got at least one character in.
    assert any(ord(c) > 0xFFFF for c in document["name"]) == (budget >= 16), document
