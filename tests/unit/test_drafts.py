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
from grammar_backend.closing import ClosingConfig, RepeatConfig
from grammar_backend.errors import GrammarError
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

    Half the tokens of the Qwen3 vocabulary score high at random, which walks a schema's strings and
    numbers to their limits; the stop token scores low, so an output ends where the grammar or the
    closer leaves nothing else.
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
    steps: int
    drafted: int = 0
    accepted: int = 0


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
    pending: list[int] = []
    try:
        for n in range(STEPS):
            res = step(engine, 1, pending)
            assert res.errors[0] is None, res.errors[0]
            if res.terminated[0]:
                return Run(output, n)
            if res.dropped[0]:
                del output[len(output) - int(res.dropped[0]):]
                pending = []  # fed again from before the dropped tokens: this mask is not sampled
                continue
            token = target.pick(res.bitmask[0], len(output))
            output.append(token)
            pending = [token]
        raise AssertionError(f"no end in {STEPS} steps")
    finally:
        engine.end([1])


def drafted_run(engine: GrammarEngine, spec: ConstraintSpec, budget: int, checks: bool, target: Target,
                reference: list[int], rng: random.Random, k: int) -> Run:
    """Each step carries up to ``k`` drafts: mostly the reference's next tokens, some wrong; the target
    accepts them while its own pick matches, then adds its own token."""
    engine.start(2, spec, budget=budget, value_checks=checks)
    run = Run([], 0)
    pending: list[int] = []
    try:
        for n in range(STEPS):
            at = len(run.output)
            drafts = [reference[at + j] if at + j < len(reference) and rng.random() < 0.8 else rng.randrange(V)
                      for j in range(rng.randint(0, k))]
            res = step(engine, 2, pending, drafts)
            assert res.errors[0] is None, res.errors[0]
            assert res.draft_bitmask is not None and res.draft_valid is not None
            if res.terminated[0]:
                run.steps = n
                return run
            if res.dropped[0]:
                assert res.draft_valid[0] == 0
                del run.output[len(run.output) - int(res.dropped[0]):]
                pending = []
                continue
            valid = int(res.draft_valid[0])
            assert valid <= len(drafts)
            masks = [res.bitmask[0], *(res.draft_bitmask[j, 0] for j in range(valid))]
            pending = []
            for j, mask in enumerate(masks):
                token = target.pick(mask, at + j)
                pending.append(token)
                if token in target.stops or j >= len(drafts) or token != drafts[j]:
                    break
            run.drafted += len(drafts)
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
        accepted += drafted.accepted
    assert accepted > 0 or len(plain.output) < 4  # drafts were taken, not only proposed
