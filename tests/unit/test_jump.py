"""Jump-forward: canonical tokens for forced text (grammar_backend.jump) and the engine's use of them."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.errors import GrammarError
from grammar_backend.jump import JumpForward, pack_forced
from grammar_backend.protocol import CloseState
from grammar_backend.spec import parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from tests.unit.conftest import TINY_VOCAB, load_schema, tiny_encode

#: A vocabulary with a multi-byte UTF-8 character in pieces, and tokens that extend others.
VOCAB = [b"a", b"b", b"c", b"ab", b"\xc3", b"\xa9", b"\xc3\xa9", b"</s>"]
STOP = 7


def _encode_vocab(text: str) -> list[int]:
    """Longest-match over VOCAB, standing in for a BPE tokenizer."""
    data, out = text.encode(), []
    while data:
        best = max((i for i, p in enumerate(VOCAB[:STOP]) if data.startswith(p)), key=lambda i: len(VOCAB[i]))
        out.append(best)
        data = data[len(VOCAB[best]):]
    return out


@pytest.fixture(scope="module")
def small() -> tuple[xgr.TokenizerInfo, xgr.GrammarCompiler]:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP])
    return info, xgr.GrammarCompiler(info, max_threads=1)


@pytest.mark.parametrize(
    ("regex", "encode", "expected", "skipped"),
    [
        ("b[ab]", _encode_vocab, (1,), 0),
        ("ab[abc]", _encode_vocab, (3,), 0),
        ("ac", _encode_vocab, (0, 2), 0),
        ("a(b|c)", _encode_vocab, (), 0),  # "a" is held back: the grammar allows "ab" to continue it
        ("aa(b|c)", _encode_vocab, (0,), 0),  # the last "a" held back, the first kept
        ("aa(a|c)", _encode_vocab, (0, 0), 0),  # "ab" is not allowed after "aa": nothing to hold back
        ("\u00e9[ab]", _encode_vocab, (6,), 0),
        ("[\u00e9\u00e8]", _encode_vocab, (), 0),  # only a shared first byte is forced: no whole character
        ("ac", lambda text: [STOP], (), 1),  # a stop token: given up
        ("ac", lambda text: [0], (), 1),  # does not spell the run: given up
        ("ac", lambda text: [99], (), 1),  # outside the vocabulary
    ],
)
def test_canonical_tokens(small: tuple[xgr.TokenizerInfo, xgr.GrammarCompiler], regex: str, encode: Any,
                          expected: tuple[int, ...], skipped: int) -> None:
    info, compiler = small
    matcher = xgr.GrammarMatcher(compiler.compile_regex(regex))
    jump = JumpForward(info, encode)
    assert jump.tokens(matcher) == expected
    assert (jump.stats.jumps, jump.stats.tokens, jump.stats.skipped) == (int(bool(expected)), len(expected), skipped)
    # The matcher is as before: the whole forced text is still forced.
    assert jump.tokens(matcher) == expected


def test_pack_forced() -> None:
    tokens, counts = pack_forced([(), (5, 6, 7), (8,)])
    assert tokens.tolist() == [[0, 0, 0], [5, 6, 7], [8, 0, 0]]
    assert counts.tolist() == [0, 3, 1]
    empty_tokens, empty_counts = pack_forced([(), ()])
    assert empty_tokens.shape == (2, 0) and empty_counts.tolist() == [0, 0]


def _first_step(eng: GrammarEngine, ids: list[int], jump: bool = True) -> Any:
    rows = len(ids)
    return eng.step(np.array(ids, np.uint64), np.zeros((rows, 1), np.int32), np.zeros(rows, np.int32),
                    jump_forward=jump)


@pytest.mark.parametrize(
    ("options", "forced"),
    [
        ({}, b'{"city":'),  # '"' held back: '",' (an empty city, then the next key) continues it
        ({"jump_forward": False}, b""),
    ],
)
def test_engine_jumps_only_where_the_option_allows(tiny_info: xgr.TokenizerInfo, options: dict[str, Any],
                                                   forced: bytes) -> None:
    eng = GrammarEngine(tiny_info, "tiny", GrammarEngineConfig(max_batch=2), encode=tiny_encode)
    try:
        eng.start(1, parse_constraint("json_schema", json.dumps(load_schema("tool_weather")), options))
        out = _first_step(eng, [1])
        assert b"".join(TINY_VOCAB[t] for t in out.forced[0]) == forced
    finally:
        eng.close()


def test_a_forcing_row_never_jumps_a_calm_one_does(tiny_info: xgr.TokenizerInfo) -> None:
    """Budget closing: a row whose completion is forced follows it token by token (no jump); a calm
    row (near its budget, no new structure) still appends forced text, which every completion holds."""
    eng = GrammarEngine(tiny_info, "tiny", GrammarEngineConfig(max_batch=2), encode=tiny_encode)
    schema = parse_constraint("json_schema", json.dumps(load_schema("tool_weather")))
    seen: dict[int, set[bool]] = {}
    try:
        for budget in range(1, 40):
            eng.start(budget, schema, budget=budget)
            out = _first_step(eng, [budget])
            seen.setdefault(int(out.closing[0]), set()).add(bool(out.forced[0]))
            eng.end([budget])
    finally:
        eng.close()
    assert seen[CloseState.BUDGET] == {False}
    assert seen[CloseState.CALM] == {True}
    assert seen[CloseState.OPEN] == {True}


def test_jump_forward_needs_an_encoder(tiny_info: xgr.TokenizerInfo) -> None:
    eng = GrammarEngine(tiny_info, "tiny", GrammarEngineConfig(max_batch=2))
    try:
        eng.start(1, parse_constraint("regex", "abc"))
        with pytest.raises(GrammarError, match=r"^step: jump-forward needs the tokenizer's encoder"):
            _first_step(eng, [1])
        assert _first_step(eng, [1], jump=False).errors == (None,)
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("kind", "payload", "output"),
    [
        ("json_schema", json.dumps(load_schema("tool_weather")), '{"city":"Paris","unit":"celsius"}'),
        ("json_schema", json.dumps({"type": "object", "properties": {"naïve café": {"const": "crème brûlée"}},
                                    "required": ["naïve café"]}), '{"naïve café":"crème brûlée"}'),
        ("choice", json.dumps(["internationalization", "internal"]), "internationalization"),
        ("regex", r"order-[0-9]{3}: (shipped|pending)", "order-042: shipped"),
    ],
)
def test_real_bpe_jumps_are_canonical_and_accepted(qwen_tokenizer: Any, qwen_info: xgr.TokenizerInfo, kind: str,
                                                   payload: str, output: str) -> None:
    """Drive one sequence to its end, jumping wherever the grammar forces text (Qwen3 BPE): every
    jump is the tokenizer's own spelling of a whole-character run, the grammar accepts it in order,
    and the output is the one expected."""
    encode = lambda text: qwen_tokenizer.encode(text, add_special_tokens=False)
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1), encode=encode)
    try:
        eng.start(1, parse_constraint(kind, payload))
        text, feed, jumps = "", [0], 0
        count = 0
        while True:
            out = eng.step(np.array([1], np.uint64), np.array([feed], np.int32), np.array([count], np.int32),
                           jump_forward=True)
            assert out.errors == (None,)
            if out.terminated[0]:
                break
            forced = out.forced[0]
            if forced:
                piece = qwen_tokenizer.decode(list(forced))
                assert list(forced) == encode(piece)  # canonical
                assert output.startswith(text + piece)
                jumps += 1
                feed = list(forced)
            else:  # "sample" the expected output's next token, or the stop token at its end
                rest = output[len(text):]
                feed = [encode(rest)[0]] if rest else [qwen_info.stop_token_ids[0]]
                piece = qwen_tokenizer.decode(feed) if rest else ""
            text += piece
            count = len(feed)
        assert text == output
        assert jumps >= 1
    finally:
        eng.close()
