"""Prompt-lookup speculation in the torch engine's scheduler (issue 50 part 3).

The property that matters: a request decodes the same tokens with speculation on and off, greedy and
seeded, constrained or not, whatever drafts it is given.  The drafts here come from an oracle (the
output without speculation, with wrong tokens mixed in) so that drafts are kept in full, in part and
not at all; a last case uses the real n-gram lookup.  The grammar side is the real engine over the
tiny model's tokenizer (``standins.tiny_model.tiny_grammar``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import contract
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import RequestError
from llm_runtime.grammar_phase import JumpPolicy
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest
from llm_runtime.scheduler import GenerationRequest, Scheduler, SchedulerConfig
from llm_runtime.speculation import PromptLookup
from standins.tiny_model import TinyModelInfo, tiny_grammar
from tests.unit.test_runtime_scheduler import PriorJumps, Result

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the n-gram lookup ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "limit", "drafts"),
    [
        ([1, 2, 3, 4, 1, 2], 2, (3, 4)),  # the two-token match "1 2" -> what followed it
        ([1, 2, 3, 4, 1, 2], 9, (3, 4, 1, 2)),  # up to the end of the sequence
        ([5, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 1, (8,)),  # the latest occurrence
        ([9, 1, 2, 6, 3, 1, 2, 7, 4, 1, 2, 7, 4, 1, 2], 2, (7, 4)),  # the longest match: "4 1 2" beats "1 2"
        ([1, 2, 3, 4, 5], 3, ()),  # nothing repeats
        ([1, 1], 3, ()),  # a one-token match is no match
        ([1, 2, 3, 1, 2], 0, ()),
    ],
    ids=["two", "to-the-end", "latest", "longest", "none", "one-token", "no-room"],
)
def test_prompt_lookup_proposes_what_followed_the_last_ngram(tokens: list[int], limit: int,
                                                              drafts: tuple[int, ...]) -> None:
    whole = PromptLookup(np.array(tokens))
    assert whole.propose(limit) == drafts
    grown = PromptLookup(np.array(tokens[:1]))  # the same sequence, one token at a time
    grown.extend(tokens[1:])
    assert grown.propose(limit) == drafts and len(grown) == len(tokens)


def test_prompt_lookup_forgets_truncated_tokens() -> None:
    lookup = PromptLookup(np.array([1, 2, 3, 1, 2]))
    assert lookup.propose(1) == (3,)
    lookup.truncate(3)  # a value check dropped "1 2"
    lookup.extend([4, 1, 2])
    assert lookup.propose(2) == (3, 4)
    lookup.truncate(2)
    assert lookup.propose(2) == () and len(lookup) == 2


def test_prompt_lookup_backs_off_after_rejected_drafts() -> None:
    lookup = PromptLookup(np.array([1, 2, 3, 1, 2]))
    waits = []
    for _ in range(6):  # all rejected: 1, 2, 4, 8, 16, 16 steps without a proposal
        lookup.kept(0, 2)
        skipped = 0
        while lookup.propose(2) == ():
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 2, 4, 8, 16, 16]
    lookup.kept(1, 2)  # one kept: proposals at once again, and the next miss waits one step
    assert lookup.propose(2) == (3, 1)
    lookup.kept(0, 2)
    assert lookup.propose(2) == () and lookup.propose(2) == (3, 1)


def test_prompt_lookup_acceptance_follows_what_is_kept() -> None:
    lookup = PromptLookup(np.array([1, 2]))
    assert lookup.acceptance == 0.5  # the prior
    lookup.kept(3, 3)  # all kept: each next draft was, seen once
    assert lookup.acceptance == pytest.approx(0.5 + 0.3 * 0.5)
    lookup.kept(1, 4)  # one kept, the next rejected: 1/2
    assert lookup.acceptance == pytest.approx(0.65 + 0.3 * (0.5 - 0.65))
    for _ in range(100):  # no drafts for a while: back to the prior
        lookup.idle()
    assert lookup.acceptance == pytest.approx(0.5, abs=1e-2)


@pytest.mark.parametrize(
    ("rows", "floor", "drafts", "measured", "width"),
    [
        (1, 1, [(6, 1.0)], {}, 7),  # every draft kept: the widest (prior cost 1 + 0.25 per token)
        (1, 1, [(6, 0.5)], {}, 2),  # half: one draft pays (1.5 / 1.25), six do not (1.98 / 2.25)
        (4, 1, [(6, 0.5)], {}, 1),  # four rows pay for one row's drafts: a plain step does better
        (4, 1, [(6, 0.9)] * 4, {}, 7),
        (4, 1, [(6, 0.9)] * 4, {7: 4.0, 4: 1.5}, 4),  # measured: seven wide costs 4x, four wide 1.5x
        (2, 3, [(6, 0.1)], {}, 3),  # a jump makes the step 3 wide: two drafts ride free, no more pay
    ],
    ids=["all-kept", "half", "half-of-four-rows", "likely", "measured", "under-a-jump"],
)
def test_draft_width_weighs_expected_kept_drafts_against_cost(rows: int, floor: int,
                                                              drafts: list[tuple[int, float]],
                                                              measured: dict[int, float], width: int) -> None:
    policy = JumpPolicy(0.25)
    for w, ratio in measured.items():
        policy.record(rows, 1, 1.0)
        policy.record(rows, w, ratio)
    assert policy.draft_width(rows, floor, float(rows), drafts) == width


# -- the scheduler -------------------------------------------------------------------------------


class Oracle:
    """Drafts from the output each request had without speculation, ``right`` of them correct."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], right: float, seed: int, vocab: int) -> None:
        self.references = references
        self.right = right
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, lookup: PromptLookup, limit: int) -> tuple[int, ...]:
        seq = lookup._tokens
        for prompt, ref in self.references.items():
            whole = [*prompt, *ref]
            if len(seq) >= len(prompt) and whole[: len(seq)] == seq:
                at = len(seq)
                n = self.rng.randint(0, limit)
                return tuple(whole[at + j] if at + j < len(whole) and self.rng.random() < self.right
                             else self.rng.randrange(self.vocab) for j in range(n))
        return ()  # on its way to tokens a value check drops: the reference never had them


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "n": {"type": "integer"}},
                     "required": ["name", "n"], "additionalProperties": False})
COLOURS = json.dumps({"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True,
                      "minItems": 2, "maxItems": 3})
# backend auto moves a JSON constraint to xgrammar once a replay of its first output finishes, off the
# step's path (grammar_service.auto_switch): when, depends on the host, so the two runs compared pin one.
PINNED = json.dumps({"backend": "xgrammar"})
# (prompt, constraint, max_tokens, stop): free text, closing at the budget, value checks that retry,
# a regex, a choice, a stop string.
REQUESTS: list[tuple[str, ConstraintRequest | None, int, tuple[str, ...]]] = [
    ("the quick brown fox the quick brown", None, 40, ()),
    ("name: Alice", ConstraintRequest("json_schema", SCHEMA, PINNED), 24, ()),
    ("colours", ConstraintRequest("json_schema", COLOURS, json.dumps({"on_repeat": "continue", "backend": "xgrammar"})),
     40, ()),
    ("code", ConstraintRequest("regex", r"[a-z]{2,6}(-[0-9]{1,3}){1,4}", ""), 30, ()),
    ("pick", ConstraintRequest("choice", json.dumps(["north-east", "south-west"]), ""), 20, ()),
    ("hello world hello", None, 40, ("o", " st")),
]


Request = tuple[str, ConstraintRequest | None, int, tuple[str, ...]]


def run(engine: TorchEngine, tiny: TinyModelInfo, *, temperature: float, drafts: int | None,
        server: int = 0, fill: float = 0.25, requests: list[Request] = REQUESTS,
        alone: bool = False) -> tuple[list[tuple[Any, ...]], dict[str, float | int]]:
    """The requests in one batch, jump-forward off; or ``alone`` (one after the other), jump-forward on.

    A step's jump width depends on its batch (:meth:`JumpPolicy.width`), and speculation changes which
    rows share a step, so the jumps, and so the tokens, are the same with and without it only where the
    batch is: a request alone, or no jumps.
    """
    grammar = tiny_grammar(tiny)
    config = SchedulerConfig(max_batch_size=8, draft_tokens=server, jump_min_fill=fill,
                             max_jump_tokens=16 if alone else 0)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), config) as s:
            results = []
            for i, (text, constraint, max_tokens, stop) in enumerate(requests):
                r = Result()
                s.submit(GenerationRequest(engine.tokenizer.encode(text).ids, max_tokens=max_tokens,
                                           temperature=temperature, seed=i, constraint=constraint, stop=stop,
                                           draft_tokens=drafts), r)
                results.append(r)
                if alone:
                    r.wait()
            finals = [r.wait() for r in results]
            summary = s.summary()
        assert grammar.active_count == 0 and engine.live_count == 0
        return ([(f.finish_reason, f.text, tuple(r.token_ids), f.completion_tokens, f.close_reason,
                  f.value_retries, f.stop_string) for f, r in zip(finals, results, strict=True)], summary)
    finally:
        grammar.close()


@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone-with-jumps"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("right", "k"), [(1.0, 4), (0.8, 3), (0.5, 6), (0.0, 2)],
                         ids=["all-right", "mostly-right", "half-right", "all-wrong"])
def test_speculation_gives_the_tokens_without_it(engine: TorchEngine, tiny: TinyModelInfo,
                                                 monkeypatch: pytest.MonkeyPatch, temperature: float,
                                                 right: float, k: int, alone: bool) -> None:
    """Drafts kept in full, in part and not at all: every request's tokens, text, finish (budget closing,
    stop strings, the end token) and value retries are those of the run without speculation, in fewer
    steps when drafts are right."""
    monkeypatch.setattr("llm_runtime.scheduler.JumpPolicy", PriorJumps)
    plain, base = run(engine, tiny, temperature=temperature, drafts=0, alone=alone)
    prompts = [tuple(engine.tokenizer.encode(text).ids) for text, *_ in REQUESTS]
    assert len(set(prompts)) == len(prompts)
    oracle = Oracle({p: list(r[2]) for p, r in zip(prompts, plain, strict=True)}, right, seed=k, vocab=tiny.vocab_size)
    monkeypatch.setattr(PromptLookup, "propose", lambda self, limit: oracle.propose(self, limit))
    drafted, summary = run(engine, tiny, temperature=temperature, drafts=k, alone=alone)
    assert drafted == plain
    assert base["draft_tokens"] == 0 and summary["draft_tokens"] > 0
    kept = int(summary["kept_drafts"])
    assert (kept > 0) is (right > 0)
    assert summary["output_tokens"] == base["output_tokens"]
    if right == 1.0:
        assert summary["steps"] < base["steps"]  # kept drafts are tokens without a forward of their own
    assert {r[0] for r in plain} >= {"stop", "length"}
    # Closing at the budget and a stop string ran (and, greedy, a value check's retry).
    assert any(r[4] == "budget" for r in plain) and any(r[6] for r in plain)
    assert temperature or any(r[5] for r in plain)


def test_prompt_lookup_speculation_gives_the_tokens_without_it(engine: TorchEngine, tiny: TinyModelInfo,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The real n-gram lookup, from the server's default: same tokens, drafts fed.  Wider forwards are
    taken to cost nothing (jump_min_fill 0, never measured): every proposal is fed, at its full length."""
    monkeypatch.setattr("llm_runtime.scheduler.JumpPolicy", PriorJumps)
    plain, _ = run(engine, tiny, temperature=0.0, drafts=None)
    drafted, summary = run(engine, tiny, temperature=0.0, drafts=None, server=5, fill=0.0)
    assert drafted == plain
    assert summary["draft_tokens"] > 0


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"draft_tokens": contract.MAX_DRAFT_TOKENS + 1},
         (rf"^draft_tokens: must be null \(the server's default\) or an integer in 0\.\.{contract.MAX_DRAFT_TOKENS}, "
          rf"got {contract.MAX_DRAFT_TOKENS + 1}$")),
        ({"draft_tokens": -1}, r"^draft_tokens: must be null .* got -1$"),
        ({"draft_tokens": True}, r"^draft_tokens: must be null .* got True$"),
        ({"draft_tokens": 2, "frequency_penalty": 0.5},
         (r"^draft_tokens: prompt-lookup speculation cannot be combined with a repetition, frequency or presence "
          r"penalty$")),
        ({"draft_tokens": 2, "logprobs": 1},
         r"^draft_tokens: prompt-lookup speculation cannot be combined with logprobs$"),
    ],
    ids=["too-many", "negative", "bool", "penalty", "logprobs"],
)
def test_bad_draft_tokens_are_refused_by_name(engine: TorchEngine, tiny: TinyModelInfo, fields: dict[str, Any],
                                              match: str) -> None:
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            with pytest.raises(RequestError, match=match):
                s.submit(GenerationRequest([1, 2, 3], max_tokens=4, **fields), Result())
            ok = Result()  # the scheduler serves on
            s.submit(GenerationRequest([1, 2, 3], max_tokens=4, temperature=0.0, draft_tokens=0,
                                       frequency_penalty=0.5), ok)
            assert ok.wait().finish_reason in ("stop", "length")
    finally:
        grammar.close()


def test_a_penalized_request_does_not_take_the_servers_drafts(engine: TorchEngine, tiny: TinyModelInfo) -> None:
    """The server's default applies to the requests that can draft; a penalty's logits depend on the drafts
    before each position, so such a request decodes one token a step."""
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8, draft_tokens=4)) as s:
            r = Result()
            s.submit(GenerationRequest(engine.tokenizer.encode("hello world hello world hello").ids, max_tokens=30,
                                       temperature=0.0, repetition_penalty=1.3), r)
            r.wait()
            assert s.summary()["draft_tokens"] == 0
    finally:
        grammar.close()


@pytest.mark.parametrize("value", [-1, contract.MAX_DRAFT_TOKENS + 1, True])
def test_the_server_default_is_bounded(value: object) -> None:
    from grammar_backend.errors import ConfigError

    with pytest.raises(ConfigError, match=r"scheduler\.draft_tokens: must be an integer in 0\.\.16"):
        SchedulerConfig(draft_tokens=value)  # type: ignore[arg-type]



MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench-dev"


def _maskbench_sample(count: int, seed: int) -> list[Request]:
    """A seeded sample of maskbench-dev's smaller schemas (under 2 KB), as JSON-schema requests."""
    files = sorted(p for p in MASKBENCH.glob("*.json") if p.stat().st_size < 2048)
    picked = random.Random(seed).sample(files, count)
    return [(f"Write {p.stem} as JSON.", ConstraintRequest("json_schema", json.dumps(json.loads(p.read_text())["schema"]),
                                                          PINNED), 40, ()) for p in picked]


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason=f"{MASKBENCH} is absent (the shared test data)")
def test_speculation_gives_the_tokens_without_it_on_a_maskbench_sample(engine: TorchEngine, tiny: TinyModelInfo,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight held-in MaskBench schemas (real tool and extraction schemas), greedy, drafts mostly right:
    every outcome (errors included) is the one without speculation."""
    monkeypatch.setattr("llm_runtime.scheduler.JumpPolicy", PriorJumps)
    sample = _maskbench_sample(8, seed=59)
    plain, _ = run(engine, tiny, temperature=0.0, drafts=0, requests=sample)
    prompts = [tuple(engine.tokenizer.encode(text).ids) for text, *_ in sample]
    oracle = Oracle({p: list(r[2]) for p, r in zip(prompts, plain, strict=True)}, 0.8, seed=1, vocab=tiny.vocab_size)
    monkeypatch.setattr(PromptLookup, "propose", lambda self, limit: oracle.propose(self, limit))
    drafted, summary = run(engine, tiny, temperature=0.0, drafts=4, requests=sample)
    assert drafted == plain
    assert summary["kept_drafts"] > 0
