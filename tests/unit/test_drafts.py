"""Draft positions in a grammar step (issue 50 part 1): the masks after each draft token, on forks of the rows.

The property: greedy decoding with drafts (the target picks its token under each position's mask and
accepts drafts while they match) writes exactly what it writes without them, and a row's state after
every step is that of the tokens accepted.  Real matchers of both backends over the Qwen3 vocabulary;
the "model" is a seeded score per (position, token), so both runs see the same preferences.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from contract.reasoning import Reasoning
from grammar_backend.errors import ConfigError, GrammarError
from grammar_backend.llg import LlgBackend
from grammar_backend.protocol import CloseState
from grammar_backend.sequences import GrammarSequence
from grammar_backend.spec import ConstraintSpec, parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig, StepResult

V = 151_936
BACKENDS = ("xgrammar", "llguidance")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string"},
                                                    "uniqueItems": True}},
          "required": ["name", "age", "tags"], "additionalProperties": False}

#: Every output of these ends without closing: bounded strings, numbers and arrays.
BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                     "maxItems": 3}},
           "required": ["name", "age", "tags"], "additionalProperties": False}
#: The longest a harness run may take (value checks' retries step back and forth).
STEPS = 400
COLOURS = {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan"]}, "uniqueItems": True,
           "minItems": 1, "maxItems": 4}


@pytest.fixture(scope="module")
def engine(qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any) -> Iterator[GrammarEngine]:
    special = [i for i, t in qwen_tokenizer.added_tokens_decoder.items() if t.special]
    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    eng = GrammarEngine(qwen_info, "qwen3", GrammarEngineConfig(max_batch=4, max_draft_tokens=6),
                        encode=lambda text: qwen_tokenizer.encode(text, add_special_tokens=False),
                        llg=LlgBackend(qwen_tokenizer, V, (eos,)), special_ids=special)
    yield eng
    assert eng.active_count == 0, "a sequence leaked"
    eng.close()


def allowed(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:V].astype(bool)


class Target:
    """A greedy model: at output position p it prefers tokens in a seeded random order (the same in every run).

    Random preferences walk a schema's strings and numbers to their limits; the stop token scores lowest,
    so an output ends where the grammar or the closer leaves nothing else.
    """

    def __init__(self, seed: int, stops: list[int]) -> None:
        self.seed = seed
        self.stops = stops

    def pick(self, row: np.ndarray, position: int) -> int:
        scores = np.random.default_rng((self.seed, position)).random(V, dtype=np.float32)
        scores[self.stops] = 0.0
        ok = allowed(row)
        if not ok.any():
            raise AssertionError(f"position {position}: a mask that allows nothing")
        return int(np.where(ok, scores, -1.0).argmax())


@dataclasses.dataclass
class Run:
    output: list[int]
    accepted: int = 0  # drafts the target took
    closes: list[int] = dataclasses.field(default_factory=list)  # the close state where each token was picked
    #: The row's closing state after each step, by the output's length then (see plan_state).
    states: list[tuple[int, tuple[Any, ...]]] = dataclasses.field(default_factory=list)


#: The fields of a row's ClosePlan that a later step reads, but ``new_tokens`` (plan consumes it) and the
#: runaway detector's tail (an object; the cases close at the budget).
PLAN_FIELDS = ("budget", "close_state", "completion", "completion_at", "completion_kept", "completion_len",
               "digit_run", "forced", "forced_at", "growth", "next_check", "next_repeat_check", "pending_close",
               "scalar_tokens", "segment", "utf8_need")


def plan_state(engine: GrammarEngine, seq_id: int) -> tuple[Any, ...]:
    """The row's closing state after its step: with drafts or not, that of the tokens accepted."""
    plan = engine.table.get(seq_id).close
    return tuple(getattr(plan, name) for name in PLAN_FIELDS)


def step(engine: GrammarEngine, seq_id: int, pending: list[int], drafts: list[int] | None = None) -> StepResult:
    tokens = np.array([pending or [0]], np.int32)
    counts = np.array([len(pending)], np.int32)
    if drafts is None:
        return engine.step(np.array([seq_id], np.uint64), tokens, counts)
    return engine.step(np.array([seq_id], np.uint64), tokens, counts,
                       drafts=np.array([drafts or [0]], np.int32), draft_counts=np.array([len(drafts)], np.int32))


def plain_run(engine: GrammarEngine, spec: ConstraintSpec, budget: int, checks: bool, target: Target) -> Run:
    """One token a step, as without speculation (``budget`` 0: no closing)."""
    engine.start(1, spec, budget=budget, value_checks=checks)
    output: list[int] = []
    closes: list[int] = []
    states: list[tuple[int, tuple[Any, ...]]] = []
    pending: list[int] = []
    try:
        for _ in range(STEPS):
            res = step(engine, 1, pending)
            assert res.errors[0] is None, res.errors[0]
            states.append((len(output) - int(res.dropped[0]), plan_state(engine, 1)))
            if res.terminated[0]:
                return Run(output, closes=closes, states=states)
            if res.dropped[0]:
                del output[len(output) - int(res.dropped[0]):]
                del closes[len(output):]
                pending = []  # fed again from before the dropped tokens: this mask is not sampled
                continue
            token = target.pick(res.bitmask[0], len(output))
            output.append(token)
            closes.append(int(res.closing[0]))
            pending = [token]
        raise AssertionError(f"no end in {STEPS} steps")
    finally:
        engine.end([1])


def drafted_run(engine: GrammarEngine, spec: ConstraintSpec, budget: int, checks: bool, target: Target,
                reference: list[int], rng: random.Random, k: int) -> Run:
    """Each step carries up to ``k`` drafts: mostly the reference's next tokens, some wrong; the target
    accepts them while its own pick matches, then adds its own token."""
    engine.start(2, spec, budget=budget, value_checks=checks)
    run = Run([])
    pending: list[int] = []
    try:
        for _ in range(STEPS):
            at = len(run.output)
            drafts = [reference[at + j] if at + j < len(reference) and rng.random() < 0.8 else rng.randrange(V)
                      for j in range(rng.randint(0, k))]
            res = step(engine, 2, pending, drafts)
            assert res.errors[0] is None, res.errors[0]
            run.states.append((len(run.output) - int(res.dropped[0]), plan_state(engine, 2)))
            assert res.draft_bitmask is not None and res.draft_valid is not None
            if res.terminated[0]:
                return run
            if res.dropped[0]:
                assert res.draft_valid[0] == 0
                del run.output[len(run.output) - int(res.dropped[0]):]
                del run.closes[len(run.output):]
                pending = []
                continue
            valid = int(res.draft_valid[0])
            assert valid <= len(drafts)
            assert res.draft_closing is not None and res.draft_closing.shape == res.draft_bitmask.shape[1::-1]
            assert not res.draft_closing[0, valid:].any()
            masks = [res.bitmask[0], *(res.draft_bitmask[j, 0] for j in range(valid))]
            closes = [int(res.closing[0]), *(int(c) for c in res.draft_closing[0, :valid])]
            pending = []
            for j, mask in enumerate(masks):
                token = target.pick(mask, at + j)
                pending.append(token)
                run.closes.append(closes[j])
                if token in target.stops or j >= len(drafts) or token != drafts[j]:
                    break
            run.accepted += len(pending) - 1
            run.output += pending
        raise AssertionError(f"no end in {STEPS} steps")
    finally:
        engine.end([2])


def spec_of(kind: str, payload: str, backend: str, reasoning: Reasoning | None = None) -> ConstraintSpec:
    spec = parse_constraint(kind, payload, {"backend": backend})
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, reasoning=reasoning))


# (constraint, budget, value checks): closing at the budget (calm and forced rows), value checks and
# their retries (budget 0: no closing), a thinking section whose end is forced, a regex.
CASES = [
    pytest.param(("json_schema", json.dumps(PERSON), None), 40, False, id="person-budget"),
    pytest.param(("json_schema", json.dumps(BOUNDED), None), 0, True, id="person-checks"),
    pytest.param(("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 6}), None),
                 24, False, id="array-budget"),
    pytest.param(("json_schema", json.dumps(PERSON), Reasoning(end="</think>", start="<think>", max_reasoning_tokens=12)),
                 60, False, id="person-thinking"),
    pytest.param(("regex", r"[a-z]{2,8}(-[0-9]{1,3}){1,3}", None), 20, False, id="regex-budget"),
    # Neither backend enforces uniqueItems: repeated colours are dropped and banned by the value checks.
    pytest.param(("json_schema", json.dumps(COLOURS), None), 0, True, id="unique-checks"),
    pytest.param(("json_schema", json.dumps(COLOURS), None), 30, True, id="unique-checks-budget"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("constraint", "budget", "checks"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_output_with_drafts_is_the_output_without(engine: GrammarEngine, qwen_info: xgr.TokenizerInfo,
                                                         backend: str, constraint: tuple[str, str, Any],
                                                         budget: int, checks: bool, seed: int) -> None:
    kind, payload, reasoning = constraint
    spec = spec_of(kind, payload, backend, reasoning)
    target = Target(seed, [int(t) for t in qwen_info.stop_token_ids])
    plain = plain_run(engine, spec, budget, checks, target)
    assert plain.output
    accepted = 0
    for k, draft_seed in ((1, seed), (3, seed + 10), (6, seed + 20)):
        drafted = drafted_run(engine, spec, budget, checks, target, plain.output, random.Random(draft_seed), k)
        assert drafted.output == plain.output, f"{k} drafts a step"
        # Each draft position reports the close state a step of its own would have (draft_closing).
        assert drafted.closes == plain.closes, f"{k} drafts a step"
        # ... and after the tokens the target accepted, all of the row's closing state is one token a
        # step's there (with value checks, one of the states it had there: a retry comes back to a length).
        for at, state in drafted.states:
            assert state in [s for p, s in plain.states if p == at], f"{k} drafts a step, at {at}"
        accepted += drafted.accepted
    assert accepted > 0 or len(plain.output) < 4  # drafts were taken, not only proposed


# -- the step's draft inputs ------------------------------------------------------------------------


def _started(engine: GrammarEngine, seq_ids: tuple[int, ...], **options: Any) -> None:
    for seq_id in seq_ids:
        engine.start(seq_id, parse_constraint("json_schema", json.dumps(COLOURS), options))


@pytest.mark.parametrize(
    ("drafts", "draft_counts", "match"),
    [
        (np.zeros((2, 2), np.int32), None, r"^step: DRAFT_TOKENS and DRAFT_COUNT come together$"),
        (None, np.zeros(2, np.int32), r"^step: DRAFT_TOKENS and DRAFT_COUNT come together$"),
        (np.zeros((1, 2), np.int32), np.zeros(2, np.int32),
         r"^step: SEQUENCE_ID has 2 rows, DRAFT_COUNT 2, DRAFT_TOKENS shape \(1, 2\)$"),
        (np.zeros((2, 7), np.int32), np.zeros(2, np.int32),
         r"^step: DRAFT_TOKENS has 7 columns, more than max_draft_tokens 6$"),
    ],
    ids=["no-counts", "no-tokens", "rows", "too-wide"],
)
def test_a_malformed_draft_batch_fails_whole(engine: GrammarEngine, drafts: np.ndarray | None,
                                             draft_counts: np.ndarray | None, match: str) -> None:
    _started(engine, (11, 12))
    try:
        with pytest.raises(GrammarError, match=match):
            engine.step(np.array([11, 12], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                        drafts=drafts, draft_counts=draft_counts)
        # Nothing was accepted: the rows step on from where they were.
        res = engine.step(np.array([11, 12], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32))
        assert res.errors == (None, None)
    finally:
        engine.end([11, 12])


def test_a_bad_draft_count_fails_its_row_only(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    _started(engine, (11, 12))
    bracket = qwen_tokenizer.convert_tokens_to_ids("[")
    try:
        res = engine.step(np.array([11, 12], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                          drafts=np.full((2, 2), bracket, np.int32), draft_counts=np.array([3, 1], np.int32))
        assert str(res.errors[0]) == "sequence 11: DRAFT_COUNT 3 outside 0..2" and res.errors[1] is None
        assert res.draft_valid is not None and res.draft_valid.tolist() == [0, 1]
    finally:
        engine.end([11, 12])


def test_a_draft_mask_buffer_of_another_shape_is_refused(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    _started(engine, (11,))
    bracket = qwen_tokenizer.convert_tokens_to_ids("[")
    try:
        with pytest.raises(GrammarError, match=r"^step: a draft mask buffer must be C-contiguous int32 of shape "
                                               r"\(2, 1, 4748\), not int32 \(1, 1, 4748\)$"):
            engine.step(np.array([11], np.uint64), np.array([[bracket]], np.int32), np.ones(1, np.int32),
                        drafts=np.zeros((1, 2), np.int32), draft_counts=np.array([2], np.int32),
                        draft_out=np.zeros((1, 1, 4748), np.int32))
        # Refused before the row's token was accepted: "[" is still its first.
        res = engine.step(np.array([11], np.uint64), np.array([[bracket]], np.int32), np.ones(1, np.int32))
        assert res.errors == (None,)
    finally:
        engine.end([11])


def test_draft_rows_no_draft_reaches_are_all_ones(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    # A buffer full of zeros (a new mask buffer): an all-zero row would leave the target nothing to sample.
    _started(engine, (11, 12))
    out = np.zeros((3, 2, 4748), np.int32)
    bracket = qwen_tokenizer.convert_tokens_to_ids("[")
    try:
        res = engine.step(np.array([11, 12], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                          drafts=np.array([[bracket, bracket, 0], [0, 0, 0]], np.int32),
                          draft_counts=np.array([2, 0], np.int32), draft_out=out)
        assert res.draft_valid is not None and res.draft_valid.tolist() == [1, 0]  # "[[" is not a colour list
        assert res.draft_bitmask is out
        assert not (out[0, 0] == -1).all() and (out[1:, 0] == -1).all() and (out[:, 1] == -1).all()
    finally:
        engine.end([11, 12])


def test_a_row_with_drafts_jumps_too(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    # '{"' is forced at the start of an object with required keys: jump-forward offers it, drafts or not (the
    # caller jumps and drops the drafts, as its output without them would have).
    spec = parse_constraint("json_schema", json.dumps(PERSON), {})
    for seq_id in (11, 12):
        engine.start(seq_id, spec)
    try:
        res = engine.step(np.array([11, 12], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                          jump_forward=True, drafts=np.zeros((2, 1), np.int32), draft_counts=np.array([0, 1]))
        assert res.forced[0] and res.forced[1] == res.forced[0]
    finally:
        engine.end([11, 12])


def test_a_fork_goes_on_apart(engine: GrammarEngine, qwen_tokenizer: Any) -> None:
    spec = parse_constraint("json_schema", json.dumps(COLOURS), {})
    engine.start(11, spec, budget=20)
    try:
        seq = engine.table.get(11)
        assert isinstance(seq, GrammarSequence) and seq.close.repeats is not None
        fork = seq.fork()
        tokens = qwen_tokenizer.encode('["red",', add_special_tokens=False)
        fork.accept(tokens)
        fork.plan(engine.closer, int(qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")))
        assert (fork.tokens_accepted, seq.tokens_accepted) == (len(tokens), 0)
        assert fork.close.repeats is not None and len(fork.close.repeats._tail) == len(tokens)
        assert len(seq.close.repeats._tail) == 0 and seq.close.close_state == CloseState.OPEN
        assert fork.matcher is seq.matcher  # shared: the engine rolls it back
        seq.matcher.rollback(len(tokens))
    finally:
        engine.end([11])


@pytest.mark.parametrize("value", [-1, 17])
def test_the_draft_bound_is_checked(value: int) -> None:
    with pytest.raises(ConfigError, match=rf"^engine: max_draft_tokens must be within 0\.\.16, got {value}$"):
        GrammarEngineConfig(max_draft_tokens=value)
