"""The thinking section on the grammar side, at engine level, on Qwen3's vocabulary.

Qwen3's ``<think>`` and ``</think>`` are single tokens (151667, 151668), and
its vocabulary also spells them in pieces (``</`` ``think`` ``>``), so both
ways of writing the end marker are driven here, with forced token sequences:
a scripted "model" writes its thinking and its answer, and takes whatever the
engine forces (a single allowed token) instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from contract.reasoning import Reasoning, split_reasoning
from grammar_backend.bitmask import allowed_tokens
from grammar_backend.errors import SequenceError
from grammar_backend.jump import PrefixIndex
from grammar_backend.protocol import REASONING_STATES, CloseState
from grammar_backend.reasoning import MarkerTable, ReasoningConfig
from grammar_backend.spec import ConstraintSpec, parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig

V = 151936
THINK = Reasoning(end="</think>", start="<think>")
OPEN_TOKEN, END_TOKEN = 151667, 151668
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
BACKENDS = ("xgrammar", "llguidance")


@pytest.fixture(scope="module")
def encode(qwen_tokenizer: Any) -> Any:
    return lambda text: qwen_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def engine(qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any, encode: Any) -> Iterator[GrammarEngine]:
    from grammar_backend.llg import LlgBackend

    special = [i for i, t in qwen_tokenizer.added_tokens_decoder.items() if t.special]
    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    eng = GrammarEngine(qwen_info, "qwen3", GrammarEngineConfig(max_batch=4), encode=encode,
                        llg=LlgBackend(qwen_tokenizer, V, (eos,)), special_ids=special)
    yield eng
    assert eng.active_count == 0, "a sequence leaked"
    eng.close()


def spec_of(kind: str, payload: str, reasoning: Reasoning | None = THINK, **options: Any) -> ConstraintSpec:
    spec = parse_constraint(kind, payload, options)
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, reasoning=reasoning))


def person(**options: Any) -> ConstraintSpec:
    return spec_of("json_schema", json.dumps(PERSON), **options)


def allows(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@dataclass
class Run:
    """What a scripted model wrote, and what the engine said at each step."""

    tokens: list[int] = field(default_factory=list)
    states: list[int] = field(default_factory=list)
    terminated: bool = False

    @property
    def reasoning_tokens(self) -> int:
        return sum(1 for s in self.states if s in REASONING_STATES)

    @property
    def forced(self) -> list[int]:
        return [t for t, s in zip(self.tokens, self.states, strict=True) if s == CloseState.REASONING_END]


class Model:
    """Drives one sequence through ``engine.step`` like the decode loop does, one token a step."""

    def __init__(self, engine: GrammarEngine, seq_id: int) -> None:
        self.engine = engine
        self.seq_id = seq_id
        self.ids = np.array([seq_id], np.uint64)
        self.pending: list[int] = []
        vocab = engine.values.index.vocab
        special = engine.values.index.special
        self.spelling = {piece: t for t, piece in reversed(list(enumerate(vocab))) if piece and t not in special}

    def step(self) -> Any:
        tokens = np.array([self.pending], np.int32).reshape(1, len(self.pending))
        out = self.engine.step(self.ids, tokens, np.array([len(self.pending)], np.int32))
        self.pending = []
        return out

    def spell(self, row: np.ndarray, text: bytes) -> int | None:
        """The longest allowed token that begins ``text`` (llguidance allows only its own spelling of forced text)."""
        for size in range(min(len(text), 48), 0, -1):
            token = self.spelling.get(text[:size])
            if token is not None and allows(row, token):
                return token
        return None

    def run(self, thinking: Sequence[int] | Callable[[np.ndarray], int], answer: str, max_tokens: int,
            filler: int) -> Run:
        """Think ``thinking`` (then ``filler`` for ever; or the token a writer picks from the step's mask),
        answer ``answer``, within ``max_tokens``.

        A token the mask forbids is replaced: by the forced token, else (in the
        answer) by the closer's completion of the matcher's state.
        """
        run = Run()
        think_at = 0
        rest = answer.encode()
        eos = self.engine._stop_token
        vocab = self.engine.values.index.vocab
        while len(run.tokens) < max_tokens:
            out = self.step()
            assert out.errors[0] is None, out.errors[0]
            if out.terminated[0]:
                run.terminated = True
                break
            row, state = out.bitmask[0], int(out.closing[0])
            only = allowed_tokens(row, V)
            token: int | None
            if state in REASONING_STATES:
                if state == CloseState.REASONING_END:
                    assert len(only) == 1
                    token = int(only[0])
                else:
                    if callable(thinking):
                        token = thinking(row)
                    else:
                        token = thinking[think_at] if think_at < len(thinking) else filler
                        think_at += 1
                    assert allows(row, token), token
            elif len(only) == 1:
                token = int(only[0])
            else:
                token = self.spell(row, rest) if rest else None
                if token is None:
                    rest = b""  # the script went off the grammar: finish as the closer would
                    found = self.engine.closer.complete(self.engine.table.get(self.seq_id).matcher)
                    token = found[0] if found else eos
                    assert allows(row, token)
            if state not in REASONING_STATES and rest:
                piece = vocab[token]
                rest = rest[len(piece):] if rest.startswith(piece) else b""
            run.tokens.append(token)
            run.states.append(state)
            self.pending = [token]
        return run


def text_of(tokenizer: Any, tokens: Sequence[int]) -> str:
    return str(tokenizer.decode(list(tokens), skip_special_tokens=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reasoning_thinks_freely_then_answers_under_the_constraint(engine: GrammarEngine, encode: Any,
                                                                   qwen_tokenizer: Any, backend: str) -> None:
    thinking = [OPEN_TOKEN, *encode("\nThe user wants a person. {not json} Let me think.\n"), END_TOKEN]
    answer = '{"name":"Ada","age":36}'
    engine.start(1, person(backend=backend), budget=256)
    try:
        model = Model(engine, 1)
        run = model.run(thinking, answer, 256, filler=encode(" hmm")[0])
    finally:
        engine.end([1])
    assert run.terminated
    n = len(thinking)
    assert run.states[:n] == [CloseState.REASONING] * n and CloseState.REASONING not in run.states[n:]
    assert run.tokens[:n] == thinking and run.tokens[-1] == engine._stop_token
    reasoning, text, ended = split_reasoning(text_of(qwen_tokenizer, run.tokens), THINK)
    assert (reasoning, text, ended) == ("\nThe user wants a person. {not json} Let me think.\n",
                                        '{"name":"Ada","age":36}', True)
    assert 1 not in engine.table


def test_reasoning_thinking_mask_refuses_only_stop_special_and_overrunning_tokens(engine: GrammarEngine,
                                                                                 encode: Any,
                                                                                 qwen_tokenizer: Any) -> None:
    engine.start(2, person(), budget=256)
    try:
        model = Model(engine, 2)
        row = model.step().bitmask[0].copy()
        refused = set(range(V)) - set(allowed_tokens(row, V).tolist())
        special = {i for i, t in qwen_tokenizer.added_tokens_decoder.items() if t.special}
        eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert eos in special and qwen_tokenizer.convert_tokens_to_ids("<|im_start|>") in special
        # And the padding past the tokenizer (151,669 of 151,936 logits: xgrammar's special ids), no token.
        assert refused == special | set(range(len(qwen_tokenizer), V))
        assert allows(row, OPEN_TOKEN) and allows(row, END_TOKEN)
        assert allows(row, encode("Hello")[0]) and allows(row, encode("}")[0])
        # "</think" written: a token that completes the marker and goes on is refused, ">" is not.
        model.pending = encode("</") + encode("think")
        assert [len(encode(p)) for p in ("</", "think")] == [1, 1]
        row = model.step().bitmask[0]
        overrun = encode(">\n\n")
        assert len(overrun) == 1
        assert not allows(row, overrun[0]) and allows(row, encode(">")[0]) and allows(row, END_TOKEN)
        assert {qwen_tokenizer.decode([t]) for t in engine.marker_table("</think>").overrunning(7)} >= {
            ">\n", ">\n\n", "></", ">("}
    finally:
        engine.end([2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pieces", [["</", "think", ">"], ["<", "/", "think", ">"], ["</", "th", "ink", ">"]])
def test_reasoning_end_marker_split_across_tokens(engine: GrammarEngine, encode: Any, qwen_tokenizer: Any,
                                                  backend: str, pieces: list[str]) -> None:
    marker = [t for p in pieces for t in encode(p)]
    assert len(marker) == len(pieces) and END_TOKEN not in marker
    thinking = [*encode("Thinking </ not yet </thin no"), *marker]
    answer = '{"name":"Bo","age":7}'
    engine.start(3, person(backend=backend), budget=256)
    try:
        run = Model(engine, 3).run(thinking, answer, 256, filler=encode(" hmm")[0])
    finally:
        engine.end([3])
    assert run.tokens[: len(thinking)] == thinking and run.terminated
    assert run.reasoning_tokens == len(thinking)
    assert split_reasoning(text_of(qwen_tokenizer, run.tokens), THINK) == (
        "Thinking </ not yet </thin no", '{"name":"Bo","age":7}', True)


def test_reasoning_a_token_past_the_marker_fails_its_row_only(engine: GrammarEngine, encode: Any) -> None:
    """The thinking mask never allows it; a caller that feeds it anyway gets a row error, not a bad answer."""
    engine.start(4, person(), budget=64)
    engine.start(5, person(), budget=64)
    try:
        overrun = encode("</think") + encode(">\n\n")
        ids = np.array([4, 5], np.uint64)
        tokens = np.zeros((2, len(overrun)), np.int32)
        tokens[0] = overrun
        tokens[1, 0] = encode("ok")[0]
        engine.step(ids, tokens[:, :0], np.zeros(2, np.int32))
        out = engine.step(ids, tokens, np.array([len(overrun), 1], np.int32))
        assert isinstance(out.errors[0], SequenceError)
        assert "runs 2 bytes past the reasoning end marker" in str(out.errors[0])
        assert out.errors[1] is None and int(out.closing[1]) == CloseState.REASONING
        with pytest.raises(SequenceError, match="cannot roll back 1 tokens inside the thinking section"):
            engine.table.rollback(5, 1)
    finally:
        engine.end([4, 5])


def shortest_answer(engine: GrammarEngine, spec: ConstraintSpec) -> int:
    found = engine.closer.complete(xgr.GrammarMatcher(engine.compile(spec)))
    assert found is not None
    return len(found)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reasoning_never_ends_so_the_budget_forces_the_marker(engine: GrammarEngine, encode: Any,
                                                              qwen_tokenizer: Any, backend: str) -> None:
    """A model that never writes the end marker: at every budget from the shortest answer's up, the
    marker is forced where the answer's reserve begins, and the answer parses and validates."""
    spec = person(backend=backend)
    shortest = shortest_answer(engine, spec)  # {"name":"","age":0} spelled in tokens
    config = ReasoningConfig()
    worst = engine.marker_table("</think>").worst
    answer = '{"name":"Alexandra Wonderland of the Looking Glass","age":36}'
    seq = 10
    for budget in range(shortest + 2, 96, 3):
        engine.start(seq, spec, budget=budget)
        try:
            run = Model(engine, seq).run([], answer, budget, filler=encode(" hmm")[0])
        finally:
            engine.end([seq])
        seq += 1
        assert len(run.tokens) <= budget
        reasoning, text, ended = split_reasoning(text_of(qwen_tokenizer, run.tokens), THINK)
        assert ended and run.forced == [END_TOKEN], budget
        jsonschema.validate(json.loads(text), PERSON)
        # Cut where what is left falls to the reserve: the longest rest, the answer, its margin, the stop token.
        assert run.reasoning_tokens == max(0, budget - config.reserve(worst, shortest)) + 1, budget
        assert reasoning == " hmm" * (run.reasoning_tokens - 1)


def test_reasoning_too_small_a_budget_still_cuts_at_once(engine: GrammarEngine, encode: Any) -> None:
    """Below the shortest answer nothing valid fits: the marker is forced first, and the answer is truncated
    as without closing (never a thinking that eats the whole budget)."""
    spec = person()
    budget = shortest_answer(engine, spec)
    engine.start(40, spec, budget=budget)
    try:
        run = Model(engine, 40).run([], "", budget, filler=encode(" hmm")[0])
    finally:
        engine.end([40])
    assert run.tokens[0] == END_TOKEN and run.states[0] == CloseState.REASONING_END
    assert len(run.tokens) == budget and not run.terminated


@pytest.mark.parametrize("limit", [1, 2, 5, 17])
@pytest.mark.parametrize("marker", ["</think>", "[[done]]"])
def test_reasoning_max_reasoning_tokens_is_met_exactly(engine: GrammarEngine, encode: Any, qwen_tokenizer: Any,
                                                       limit: int, marker: str) -> None:
    """A thinking that would go on ends at the bound, its end marker included (one Qwen3 token for
    ``</think>``, three for ``[[done]]``), with room to spare in ``max_tokens``."""
    reasoning = Reasoning(end=marker, max_reasoning_tokens=limit)
    spec = spec_of("json_schema", json.dumps(PERSON), reasoning)
    rest = engine.marker_table(marker).rest(0)
    assert rest is not None and len(rest) == (1 if marker == "</think>" else 3)
    engine.start(50, spec, budget=512)
    try:
        run = Model(engine, 50).run([], '{"name":"A","age":1}', 512, filler=encode(" hmm")[0])
    finally:
        engine.end([50])
    assert run.terminated
    assert run.reasoning_tokens == max(limit, len(rest))
    assert run.forced == list(rest)
    thinking, text, ended = split_reasoning(text_of(qwen_tokenizer, run.tokens), reasoning)
    assert ended and text == '{"name":"A","age":1}' and thinking == " hmm" * (run.reasoning_tokens - len(rest))


def test_reasoning_a_marker_begun_at_the_bound_is_finished_within_it(engine: GrammarEngine, encode: Any,
                                                                    qwen_tokenizer: Any) -> None:
    """``</`` written where ``think`` ``>`` would pass the bound: its rest is forced at once (the bound holds),
    and in the last tokens before the bound no token that begins the marker is allowed."""
    limit = 8
    reasoning = Reasoning(end="</think>", max_reasoning_tokens=limit)
    table = engine.marker_table("</think>")
    assert table.worst == 3 and table.rest(2) == tuple(encode("think>"))
    thinking = [*encode(" a b c d"), *encode("</")]  # "</" is the 5th token: after it 5 + 1 + 3 > 8
    spec = spec_of("json_schema", json.dumps(PERSON), reasoning)
    engine.start(60, spec, budget=128)
    try:
        run = Model(engine, 60).run(thinking, '{"name":"A","age":1}', 128, filler=encode(" hmm")[0])
    finally:
        engine.end([60])
    assert run.tokens[: len(thinking)] == thinking
    assert run.forced == list(table.rest(2) or ())
    assert run.reasoning_tokens == len(thinking) + 2 <= limit
    assert split_reasoning(text_of(qwen_tokenizer, run.tokens), reasoning)[:2] == (" a b c d", '{"name":"A","age":1}')
    # Near the bound, at state 0: "<" and "</" (they begin the marker) are out, the whole marker is in.
    calm = table.calm_row()
    assert not allows(calm, encode("<")[0]) and not allows(calm, encode("</")[0])
    assert allows(calm, END_TOKEN) and allows(calm, encode(" hmm")[0])


def test_reasoning_cut_in_the_middle_of_a_written_marker(engine: GrammarEngine, encode: Any,
                                                         qwen_tokenizer: Any) -> None:
    """The budget runs out after the model wrote ``</thi``: the forced rest is ``nk>``, and the thinking
    ends exactly at the marker (nothing of it reaches the answer)."""
    spec = person()
    shortest = shortest_answer(engine, spec)
    worst = engine.marker_table("</think>").worst
    head = encode("</thi")
    budget = ReasoningConfig().reserve(worst, shortest) + len(head)
    engine.start(70, spec, budget=budget)
    try:
        run = Model(engine, 70).run(head, '{"name":"A","age":1}', budget, filler=encode(" hmm")[0])
    finally:
        engine.end([70])
    rest = engine.marker_table("</think>").rest(5)
    assert rest is not None and b"".join(engine.values.index.vocab[t] for t in rest) == b"nk>"
    assert run.tokens[: len(head)] == head and run.forced == list(rest)
    thinking, text, ended = split_reasoning(text_of(qwen_tokenizer, run.tokens), THINK)
    assert ended and thinking == "" and text == '{"name":"A","age":1}'


def test_reasoning_truncate_keeps_only_the_explicit_bound(engine: GrammarEngine, encode: Any) -> None:
    """``on_budget: truncate`` turns the answer's reserve off with the rest of budget closing: the thinking
    runs to max_tokens (as on servers that apply the grammar after thinking, and no more)."""
    engine.start(80, person(on_budget="truncate"), budget=24)
    try:
        run = Model(engine, 80).run([], "", 24, filler=encode(" hmm")[0])
    finally:
        engine.end([80])
    assert run.states == [CloseState.REASONING] * 24 and run.forced == []


@pytest.mark.parametrize(
    ("kind", "payload", "answer", "options"),
    [
        ("regex", r"[0-9]{3}-[0-9]{4}", "555-0199", {}),
        ("choice", '["yes", "no"]', "no", {}),
        ("ebnf", 'root ::= "(" [a-z]+ ")"', "(ok)", {}),
        ("json_object", "", '{"k":[1,2]}', {}),
        ("lark", 'start: "ab" "c"+', "abccc", {"backend": "llguidance"}),
    ],
)
def test_reasoning_applies_to_every_kind(engine: GrammarEngine, encode: Any, qwen_tokenizer: Any, kind: str,
                                         payload: str, answer: str, options: dict[str, Any]) -> None:
    spec = spec_of(kind, payload, **options)
    thinking = [*encode("<think>free {[( text"), END_TOKEN]
    engine.start(90, spec, budget=128)
    try:
        run = Model(engine, 90).run(thinking, answer, 128, filler=encode(" hmm")[0])
    finally:
        engine.end([90])
    assert run.terminated
    assert split_reasoning(text_of(qwen_tokenizer, run.tokens), THINK) == ("free {[( text", answer, True)


def test_reasoning_then_a_structural_tag_tool_call(engine: GrammarEngine, encode: Any, qwen_tokenizer: Any) -> None:
    """The model thinks, then writes free text and a tool call whose arguments the schema constrains."""
    tag = {"triggers": ["<tool_call>"],
           "tags": [{"begin": '<tool_call>{"name": "weather", "arguments": ', "end": "}</tool_call>",
                     "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                "additionalProperties": False}}]}
    spec = spec_of("structural_tag", json.dumps(tag))
    thinking = [*encode("I should call the weather tool."), END_TOKEN]
    answer = 'Sure. <tool_call>{"name": "weather", "arguments": {"city":"Paris"}}</tool_call>'
    engine.start(91, spec, budget=256)
    try:
        run = Model(engine, 91).run(thinking, answer, 256, filler=encode(" hmm")[0])
    finally:
        engine.end([91])
    assert split_reasoning(text_of(qwen_tokenizer, run.tokens), THINK) == (
        "I should call the weather tool.", answer, True)
    assert run.reasoning_tokens == len(thinking)


def test_reasoning_marker_table_follows_overlaps() -> None:
    """The automaton finds the marker across pieces, a self-overlapping one included, and a token overruns
    only where it completes the marker before its last byte."""
    vocab = [b"a", b"b", b"aa", b"ab", b"aab", b"xaaby", b"bz", b"</s>"]
    index = PrefixIndex(xgr.TokenizerInfo([p.decode() for p in vocab], stop_token_ids=[7]))

    def spell(data: bytes) -> tuple[int, ...]:
        return tuple(vocab.index(bytes([b])) for b in data)

    table = MarkerTable(b"aab", index, 8, [7], spell)
    assert table.advance(0, b"aaab") == (3, 4)  # "aa" then "ab": the overlap is followed
    assert table.advance(2, b"b") == (3, 1)
    assert table.advance(1, b"ab") == (3, 2)
    assert table.advance(0, b"aba") == (1, -1)
    assert [table.overrunning(k) for k in range(3)] == [[5], [5], [5, 6]]
    assert [table.rest(k) for k in range(3)] == [(0, 0, 1), (0, 1), (1,)]
    assert table.worst == 3
    assert allowed_tokens(table.row(2), 8).tolist() == [0, 1, 2, 3, 4]
    assert allowed_tokens(table.calm_row(), 8).tolist() == [1, 3, 4, 6]  # nothing that ends with "a" or "aa"


def _byte_token(engine: GrammarEngine, byte: int) -> int:
    return engine.values.index.vocab.index(bytes([byte]))


class FourByteWriter:
    """A thinking that writes 4-byte characters a byte at a token wherever the mask lets it begin one."""

    def __init__(self, engine: GrammarEngine) -> None:
        vocab = engine.values.index.vocab
        self.lead, self.cont, self.space = (vocab.index(bytes([b])) for b in (0xF0, 0x9F, ord(" ")))
        self.owed = 0

    def __call__(self, row: np.ndarray) -> int:
        token = self.cont if self.owed else (self.lead if allows(row, self.lead) else self.space)
        self.owed = 3 if token == self.lead else self.owed - 1 if token == self.cont else 0
        return token


def _thinking_bytes(engine: GrammarEngine, run: Run) -> bytes:
    vocab = engine.values.index.vocab
    return b"".join(vocab[t] for t, s in zip(run.tokens, run.states, strict=True) if s == CloseState.REASONING)


@pytest.mark.parametrize("limit", range(6, 18))
def test_reasoning_cut_at_its_bound_never_splits_a_character(engine: GrammarEngine, limit: int) -> None:
    """Near ``max_reasoning_tokens`` a thinking row takes only tokens that keep its text on character
    boundaries, so the forced marker ends whole characters (a writer of 4-byte characters, one byte a
    token, every bound; without the rule 9 of these 12 bounds split one)."""
    spec = spec_of("json_schema", json.dumps(PERSON), Reasoning(end="</think>", max_reasoning_tokens=limit))
    engine.start(70, spec, budget=256)
    try:
        run = Model(engine, 70).run(FourByteWriter(engine), "", 256, filler=-1)
    finally:
        engine.end([70])
    thinking, written = _thinking_bytes(engine, run), run.tokens
    text = thinking.decode("utf-8")  # strict: a split character raises
    # The characters begun before the last WHOLE_CHARS_AHEAD + worst tokens (one byte a token), then spaces.
    whole = (limit - 4) // 4
    assert written.index(END_TOKEN) == len(thinking) == limit - 1
    assert text == "\U0001f7df" * whole + " " * (limit - 1 - 4 * whole)


@pytest.mark.parametrize("budget", range(40, 52))
def test_reasoning_cut_for_the_answers_reserve_never_splits_a_character(engine: GrammarEngine, budget: int) -> None:
    """The same where the answer's reserve forces the marker (``on_budget: close``): the thinking ends on a
    character boundary, at the same token, and the answer still validates (9 of these 12 budgets split one
    without the rule)."""
    spec = person()
    engine.start(71, spec, budget=budget)
    try:
        run = Model(engine, 71).run(FourByteWriter(engine), "", budget, filler=-1)
    finally:
        engine.end([71])
    thinking, written = _thinking_bytes(engine, run), run.tokens
    text = thinking.decode("utf-8")
    # Cut where the reserve begins, as for any thinking.
    reserve = ReasoningConfig().reserve(engine.marker_table("</think>").worst, shortest_answer(engine, spec))
    assert written.index(END_TOKEN) == len(thinking) == budget - reserve
    assert text == "\U0001f7df" * text.count("\U0001f7df") + " " * text.count(" ") and "\U0001f7df" in text
    answer = written[written.index(END_TOKEN) + 1:]
    assert answer[-1] == engine._stop_token
    jsonschema.validate(json.loads(b"".join(engine.values.index.vocab[t] for t in answer[:-1])), PERSON)


@pytest.mark.parametrize(("owed", "expected"), [
    (0, [b"a", "\u20ac".encode(), b"</s>"]),
    (1, [b"\x9f", b"\x9fa"]),
    (2, [b"\x9f", b"\x9f\x9f"]),
    (3, [b"\x9f", b"\x9f\x9f", b"\x9f\x9f\x9f"]),
])
def test_char_rows_keep_a_text_on_character_boundaries(owed: int, expected: list[bytes]) -> None:
    """Owing ``owed`` continuation bytes, a token may go on with the character (no further than its end)
    or finish it and end on a boundary; none begins a character it does not end."""
    vocab = [b"a", b"\xf0", b"\x9f", b"\x9f\x9f", b"\x9f\x9f\x9f", b"\x9fa", b"\x9f\xf0", b"a\xf0", "\u20ac".encode(),
             b"</s>"]
    index = PrefixIndex(xgr.TokenizerInfo(vocab, stop_token_ids=[9]))
    assert [vocab[t] for t in allowed_tokens(index.char_rows(len(vocab))[owed], len(vocab))] == expected
