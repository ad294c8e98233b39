"""The llguidance backend behind the engine's matcher interface, and ``backend: auto`` (Qwen3 BPE)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.bitmask import allowed_tokens
from grammar_backend.engine import GrammarEngine, GrammarEngineConfig
from grammar_backend.errors import CompileError, TokenRejected
from grammar_backend.llg import LlgBackend, json_compile_options
from grammar_backend.spec import ConstraintOptions, parse_constraint
from tests.unit.conftest import load_schema

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
    """Past ``auto_timeout_s`` the start is served by llguidance; xgrammar's compile goes on and is cached."""
    words = [f"item-{i:05d}-{i * 7919 % 100_003}" for i in range(3000)]  # xgrammar: about a second
    schema = json.dumps({"type": "object", "properties": {"pick": {"enum": words}}, "required": ["pick"]})
    eng = GrammarEngine(qwen_info, "qwen", GrammarEngineConfig(max_batch=1, auto_timeout_s=0.05), llg=engine.llg)
    try:
        eng.start(1, parse_constraint("json_schema", schema))
        assert eng.table.get(1).backend == "llguidance"
        ids = qwen_tokenizer.encode(json.dumps({"pick": words[1234]}, separators=(",", ":")), add_special_tokens=False)
        _drive(eng, 1, ids, int(qwen_info.stop_token_ids[0]))
        eng.compile(parse_constraint("json_schema", schema))  # still compiling, then cached for xgrammar requests
        assert eng.cache.stats().entries == 1 and eng.cache.stats().timeouts == 1
    finally:
        eng.close()


def test_auto_keeps_xgrammar_where_it_compiles(engine: GrammarEngine) -> None:
    engine.start(6, parse_constraint("regex", "[0-9]+"))
    try:
        assert engine.table.get(6).backend == "xgrammar"
    finally:
        engine.end([6])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"indent": 2}, r"^grammar_options\.indent: is not supported by the llguidance backend$"),
        ({"any_order": True}, r"^grammar_options\.any_order: is not supported by the llguidance backend$"),
        ({"strict": True}, r"^grammar_options\.strict: is not supported by the llguidance backend$"),
    ],
)
def test_options_llguidance_cannot_honour_are_refused(options: dict[str, object], match: str) -> None:
    with pytest.raises(CompileError, match=match):
        json_compile_options(ConstraintOptions(**options))  # type: ignore[arg-type]


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
