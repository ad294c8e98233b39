"""GrammarRows with TensorRT-LLM 1.2.1's draft rows, driven in its per-step order (issue 50 part 2).

TensorRT-LLM cannot be installed on these machines.  :class:`SpecExecutor`
runs the real tiny torch model as the target and the real grammar engine
behind :class:`GrammarRows`, in the order read in TensorRT-LLM's sources (the
versions named in :mod:`llm_runtime.grammar_hook`):

* ``_executor_loop``: ``add_batch`` -> ``rollback_rejected_tokens``
  (:meth:`GrammarRows.accepted`) -> the drafter (a draft model's builds, one
  a draft step, through the same rows; or an n-gram-like drafter that builds
  none) -> pad the drafts with 0 -> ``add_batch`` -> forward -> ``execute``
  (the target's build) -> sample and verify -> ``_update_requests``;
* ``_executor_loop_overlap`` with a draft model (``_handle_speculative_decoding``):
  ``_update_requests`` of the previous batch -> the draft model's builds (no
  ``rollback_rejected_tokens``) -> forward -> ``add_batch`` -> ``execute``; an
  iteration that does not draft lands the previous tokens after its forward.
  1.2.1 turns the overlap scheduler off for drafters without a draft model
  (``support_overlap_scheduler``), so those run only in the plain loop;
* the layout of ``GuidedRequests``: contexts first, each generation row
  followed by ``max_num_draft_tokens`` draft rows, a draft-model batch one row
  a request; verification as TorchSampler's ``_process_draft_tokens_greedy``
  (accept while the draft is the target's pick, stop at an end token or the
  length), ``py_num_accepted_draft_tokens`` set only at a step that had drafts
  and did not stop at its first token.

The drafts come from an oracle: the greedy output of the run without
speculation, corrupted at seeded positions; a draft model's proposals are
that oracle's logits (a seeded random vector, the oracle's token lifted above
it) under the draft row GrammarRows wrote.  Every run is checked against the
run without speculation: the same outputs, the same mask at every position
whose tokens so far are the same (the main row, each draft row, each draft
model's row), and the grammar sequence holding exactly the accepted tokens.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch

from grammar_backend.protocol import bitmask_width
from grammar_service.engine import GrammarEngine
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import EngineError
from llm_runtime.grammar_hook import GrammarRows
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest, MaskStep
from standins.tiny_model import TinyModelInfo, tiny_grammar
from tests.support.trtllm_emulation import Guide, GuidedRequest, GuidedRequests, LlmRequestNames, apply_rows
from tests.unit.test_grammar_hook import PAD_WORDS, PROMPTS, Executor, Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUMBER = '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}'
CONSTRAINTS = {
    "words": (ConstraintRequest("regex", "[a-z]{4,10}( [a-z]{2,8}){2,3}", ""), r"[a-z]{4,10}( [a-z]{2,8}){2,3}"),
    "json": (ConstraintRequest("json_schema", NUMBER, ""), r'\{"n":-?[0-9]+\}'),
    "choice": (ConstraintRequest("choice", '["north", "south"]', ""), r"north|south"),
}
KINDS: tuple[str | None, ...] = ("words", "json", None, "choice")


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


@pytest.fixture
def grammar(tiny: TinyModelInfo) -> Iterator[GrammarEngine]:
    g = tiny_grammar(tiny, max_batch=8)
    yield g
    assert g.active_count == 0, "a grammar sequence leaked"
    g.close()


class DraftProvider(LocalMaskProvider):
    """The in-process provider over the real grammar engine, counting its steps; ``mangle`` rewrites answers."""

    def __init__(self, engine: GrammarEngine) -> None:
        super().__init__(engine)
        self.steps = 0
        self.last_drafts: list[list[int]] | None = None  # the last step's drafts, row by row
        self.mangle: Callable[[MaskStep], MaskStep] = lambda step: step

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        self.steps += 1
        self.last_drafts = (None if drafts is None or draft_counts is None
                            else [row[:n] for row, n in zip(drafts.tolist(), draft_counts.tolist(), strict=True)])
        return self.mangle(super().step(seq_ids, tokens, counts, jump_forward, drafts, draft_counts))


@dataclass
class Profile:
    """How an oracle drafts: ``hit`` the chance a draft is the reference's token (1: drafts accepted in full,
    0: never the target's pick); ``off_every``: every so many iterations speculation is off (no drafts, no
    drafter: ``use_spec_decode`` False)."""

    hit: float
    off_every: int = 0


FULL, PART, NONE = Profile(1.0), Profile(0.5, off_every=4), Profile(0.0)


@dataclass
class SpecRequest(Request):
    """A request of :class:`SpecExecutor`: ``py_draft_tokens`` and the accepted count as TensorRT-LLM keeps them."""

    py_draft_tokens: list[int] | None = field(default_factory=list)
    py_num_accepted_draft_tokens: int = 0
    drafted_seen: bool = False  # the draft model has seen it (its first draft request is a context)
    proposed: int = 0  # drafts the drafter proposed this iteration (the rest of py_draft_tokens is padding)


@dataclass
class DraftRequest(LlmRequestNames):
    """The draft model's request for a target request (``ModelDrafter._create_draft_request``)."""

    request_id: int
    target: SpecRequest
    tokens: list[int]
    state: str
    py_is_draft = True
    is_last_context_chunk = True

    @property
    def guided_decoding_params(self) -> Guide | None:
        return self.target.guide

    @property
    def py_target_seq_slot(self) -> int | None:  # type: ignore[override]
        return self.target.seq_slot

    @property
    def seq_slot(self) -> int | None:  # type: ignore[override]
        return None  # its own slot in the draft engine: never read by the guided decoder

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state == "generation"


@dataclass
class Tally:
    """What a run did: drafts proposed and accepted, rows written by the draft model's builds."""

    drafted: int = 0
    accepted: int = 0
    verifications: list[tuple[int, int, bool]] = field(default_factory=list)  # (drafts, accepted, stopped)
    draft_rows_written: int = 0
    draft_rows_skipped: int = 0
    checked_rows: int = 0


class SpecExecutor:
    """TensorRT-LLM's executor loop with speculative decoding, in the order its sources give (module docstring).

    ``drafts``: TensorRT-LLM's ``max_num_draft_tokens`` (0: no speculation);
    ``drafter``: ``"model"`` (its builds go through the grammar rows) or
    ``"oracle"`` (n-gram-like: no builds); ``reference``: each request's
    output without speculation, and ``ref_masks`` the mask of each
    ``(request, position)`` there: a run without speculation records them.
    """

    def __init__(self, engine: TorchEngine, rows: GrammarRows, grammar: GrammarEngine, *, overlap: bool = False,
                 drafts: int = 0, drafter: str = "oracle", profile: Profile = FULL, seed: int = 0,
                 reference: dict[int, list[int]] | None = None,
                 ref_masks: dict[tuple[int, int], np.ndarray] | None = None, max_slots: int = 8) -> None:
        if overlap and drafter != "model":
            raise ValueError("TensorRT-LLM 1.2.1 runs the overlap scheduler with a draft model only")
        self.engine, self.rows, self.grammar = engine, rows, grammar
        self.overlap, self.drafts, self.drafter, self.profile = overlap, drafts, drafter, profile
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.reference = reference or {}
        self.record = ref_masks is None
        self.masks: dict[tuple[int, int], np.ndarray] = {} if ref_masks is None else ref_masks
        self.vocab = engine.vocab_size
        self.width = bitmask_width(self.vocab)
        rows_n = max_slots * (drafts + 1)
        self.bitmask = np.full((rows_n, self.width + PAD_WORDS), -1, dtype=np.int32)  # stale rows on purpose
        self.token_mask = np.ones(rows_n, dtype=np.int32)
        self.free = list(range(max_slots))
        self.tally = Tally()
        self.iteration = 0
        self.pause_at: dict[int, tuple[int, int]] = {}  # request id -> (generated count, iterations paused)
        self._paused_for: dict[int, int] = {}
        self.seq_of: dict[int, int] = {}  # request id -> grammar sequence

    # -- TensorRT-LLM's request bookkeeping ------------------------------------------------
    def _complete(self, r: SpecRequest) -> None:
        r.state = "complete"
        self.engine.release(r.request_id)
        if r.seq_slot is not None:
            self.free.append(r.seq_slot)
            r.seq_slot = None

    def _land(self, pending: dict[int, tuple[SpecRequest, list[int], int | None, bool]]) -> None:
        """``_update_requests``: the verified tokens land; the accepted count is set only after drafts."""
        for r, tokens, accepted, stopped in pending.values():
            if r.state == "complete":
                continue
            r.tokens += tokens
            if accepted is not None:
                r.py_num_accepted_draft_tokens = accepted
            if stopped:
                self._complete(r)
            elif r.request_id in self.pause_at and len(r.generated) >= self.pause_at[r.request_id][0]:
                # _pause_requests: the KV cache is freed; the request comes back as a context of all its tokens.
                r.state = "paused"
                self._paused_for[r.request_id] = self.pause_at.pop(r.request_id)[1]
                self.engine.release(r.request_id)
                if r.seq_slot is not None:
                    self.free.append(r.seq_slot)
                    r.seq_slot = None
        pending.clear()

    # -- the oracle ------------------------------------------------------------------------
    def _hit(self, r: SpecRequest, position: int) -> bool:
        rng = np.random.default_rng((self.seed, r.request_id, position, self.iteration))
        return bool(rng.random() < self.profile.hit)

    def _oracle_token(self, r: SpecRequest, position: int) -> int:
        ref = self.reference[r.request_id]
        if position < len(ref) and self._hit(r, position):
            return ref[position]
        wrong = int(self.rng.integers(0, self.vocab))
        return wrong if position >= len(ref) or wrong != ref[position] else (wrong + 1) % self.vocab

    def _draft_logits(self, r: SpecRequest, position: int) -> torch.Tensor:
        """The draft model's logits at ``position``: seeded noise, the oracle's token on top (or never taken)."""
        logits = torch.from_numpy(np.random.default_rng((self.seed, r.request_id, position)).random(
            self.vocab, dtype=np.float32))
        ref = self.reference[r.request_id]
        if position < len(ref):
            logits[ref[position]] = 10.0 if self._hit(r, position) else float("-inf")
        return logits

    # -- the drafters ----------------------------------------------------------------------
    def _oracle_drafts(self, gens: list[SpecRequest]) -> None:
        for r in gens:
            n = int(self.rng.integers(0, self.drafts + 1))
            r.py_draft_tokens = [self._oracle_token(r, len(r.generated) + j) for j in range(n)]

    def _model_drafts(self, gens: list[SpecRequest]) -> None:
        """``ModelDrafter.prepare_draft_tokens``: a draft request a target, one build a draft step."""
        live = [DraftRequest(r.request_id, r, list(r.tokens), "generation" if r.drafted_seen else "context")
                for r in gens]
        proposed: dict[int, list[int]] = {r.request_id: [] for r in gens}
        for r in gens:
            r.drafted_seen = True
        for step in range(self.drafts):
            if not live:
                break
            live.sort(key=lambda d: d.state != "context")  # contexts first
            guided = GuidedRequests([GuidedRequest.from_llm_request(d) for d in live],
                                    sum(d.state == "context" for d in live), self.drafts)
            self.token_mask[:] = 1  # whatever the rows held before: the build says what it wrote
            failed = self.rows.build(guided, self.bitmask, self.token_mask)
            assert failed == [], failed  # a draft build's failures wait for the target's build
            self._check_written(len(live))
            nxt = []
            for i, d in enumerate(live):
                r = d.target
                position = len(r.generated) + step
                logits = self._draft_logits(r, position).unsqueeze(0)
                if self.token_mask[i]:
                    self.tally.draft_rows_written += 1
                    if r.guide is not None:
                        self._check_mask(r, position, d.tokens[len(r.prompt):], self.bitmask[i])
                    apply_rows(logits, self.bitmask[i:i + 1], self.token_mask[i:i + 1], self.vocab)
                elif r.guide is not None:
                    self.tally.draft_rows_skipped += 1
                token = int(logits[0].argmax())
                proposed[r.request_id].append(token)
                d.tokens.append(token)
                d.state = "generation"
                if token not in self.engine.eos_token_ids:
                    nxt.append(d)
            live = nxt
        for r in gens:
            r.py_draft_tokens = proposed[r.request_id]

    # -- checks ----------------------------------------------------------------------------
    def _check_written(self, rows: int) -> None:
        for i in range(rows):
            if self.token_mask[i]:
                assert self.bitmask[i, : self.width].any(), f"row {i} was written all-zero"

    def _check_mask(self, r: SpecRequest, position: int, tokens: list[int], row: np.ndarray) -> None:
        """The mask at ``position`` equals the run without speculation's there, if the tokens before it are its."""
        ref = self.reference.get(r.request_id)
        key = (r.request_id, position)
        if self.record:
            self.masks[key] = row[: self.width].copy()
        elif ref is not None and tokens[:position] == ref[:position] and key in self.masks:
            assert (row[: self.width] == self.masks[key]).all(), f"request {r.request_id}, position {position}"
            self.tally.checked_rows += 1

    def _check_grammar_state(self, r: SpecRequest) -> None:
        seq = self.grammar.table.get(self.seq_of[r.request_id])
        assert seq.tokens_accepted == len(r.generated), (r.request_id, seq.tokens_accepted, len(r.generated))

    # -- the loop --------------------------------------------------------------------------
    def run(self, reqs: list[SpecRequest]) -> None:
        for r in reqs:
            r.tokens = list(r.prompt)
        pending: dict[int, tuple[SpecRequest, list[int], int | None, bool]] = {}
        while any(r.state != "complete" for r in reqs) or pending:
            self.iteration += 1
            if not self.overlap:
                self._land(pending)
            for rid, left in list(self._paused_for.items()):
                if left == 0:
                    del self._paused_for[rid]
                    r = next(x for x in reqs if x.request_id == rid)
                    r.state, r.chunk, r.chunks = "context", 0, 1
                else:
                    self._paused_for[rid] = left - 1
            batch = ([r for r in reqs if r.state == "context"] + [r for r in reqs if r.state == "generation"])
            if not batch and not pending:
                continue
            for r in batch:
                if r.seq_slot is None:
                    r.seq_slot = self.free.pop(0)
            spec = self.drafts > 0 and not (self.profile.off_every and self.iteration % self.profile.off_every == 0)
            for r in batch:
                # _prepare_draft_requests: placeholders with speculation on, none with it off.
                if r.state == "generation":
                    r.py_draft_tokens = [0] * self.drafts if spec else []
                    r.proposed = 0
            first = GuidedRequests([GuidedRequest.from_llm_request(r) for r in batch],
                                   sum(r.state == "context" for r in batch), self.drafts)  # add_batch
            landed = not self.overlap
            if spec:
                if self.overlap:
                    if pending:  # _handle_speculative_decoding: the previous batch's tokens land, then drafting
                        self._land(pending)
                        landed = True
                else:
                    self.rows.accepted(first)  # rollback_rejected_tokens
                gens = [r for r in batch if r.state == "generation"]
                # A generation request had a previous batch: under overlap it has landed by now.
                (self._model_drafts if self.drafter == "model" else self._oracle_drafts)(gens)
                for r in gens:
                    # pad_draft_tokens_for_cuda_graph
                    drafted = list(r.py_draft_tokens or [])
                    r.proposed = len(drafted)
                    r.py_draft_tokens = drafted + [0] * (self.drafts - len(drafted))
            if not landed:
                self._land(pending)  # the overlap loop: after the forward, before add_batch and execute
            self._target_step(batch, pending)

    def _target_step(self, batch: list[SpecRequest],
                     pending: dict[int, tuple[SpecRequest, list[int], int | None, bool]]) -> None:
        guided = GuidedRequests([GuidedRequest.from_llm_request(r) for r in batch],
                                sum(r.state == "context" for r in batch), self.drafts)
        offsets: dict[int, int] = {}
        offset = 0
        for req, r in zip(guided.requests, batch, strict=True):
            offsets[r.request_id] = offset
            offset += 1 + (self.drafts if req.is_generation_in_progress_state else 0)
        # The forward: each generation row feeds its last token and its drafts, with the logits after each.
        gens = [r for r in batch if r.state == "generation"]
        logits = torch.zeros(max(1, guided.num_bitmask_tokens), self.vocab)
        if gens:
            fed = [[r.tokens[-1], *(r.py_draft_tokens or [])] for r in gens]
            width = max(len(f) for f in fed)
            tokens = np.zeros((len(gens), width), dtype=np.int64)
            for i, f in enumerate(fed):
                tokens[i, : len(f)] = f
                assert self.engine.length(gens[i].request_id) == len(gens[i].tokens) - 1
            counts = np.array([len(f) for f in fed], dtype=np.int64)
            every = self.engine.extend([r.request_id for r in gens], tokens, counts, every=True)
            for i, r in enumerate(gens):
                logits[offsets[r.request_id]: offsets[r.request_id] + counts[i]] = every[i, : counts[i]]
        for r in batch:
            if r.state == "context":
                logits[offsets[r.request_id]] = self.engine.prefill(r.request_id, r.tokens).reshape(-1)
        # execute: build on the host, mask on the device.
        self.token_mask[:] = 1
        failed = self.rows.build(guided, self.bitmask, self.token_mask)
        assert failed == [], failed
        self._check_written(guided.num_bitmask_tokens)
        apply_rows(logits, self.bitmask, self.token_mask, self.vocab)
        for r in batch:
            if r.state == "complete":  # its last tokens landed after it was scheduled (the overlap loop)
                continue
            at = offsets[r.request_id]
            drafts = list(r.py_draft_tokens or []) if r.state == "generation" else []
            if r.guide is not None:
                self._check_grammar_state(r)
                if self.token_mask[at]:
                    self._check_mask(r, len(r.generated), r.generated, self.bitmask[at])
                for j in range(len(drafts)):
                    if self.token_mask[at + 1 + j]:
                        self._check_mask(r, len(r.generated) + 1 + j, r.generated + drafts, self.bitmask[at + 1 + j])
            # TorchSampler: the pick at each position, the drafts accepted while they are the target's pick;
            # py_num_accepted_draft_tokens only for a step with drafts that did not stop at its first pick.
            picks = [int(logits[at].argmax())]
            stopped = first_stop = self._stops(r, picks)
            accepted = 0
            if not first_stop and drafts:
                for d in drafts:
                    if d != picks[-1]:
                        break
                    accepted += 1
                    picks.append(int(logits[at + accepted].argmax()))
                    if self._stops(r, picks):
                        stopped = True
                        break
                self.tally.drafted += r.proposed
                self.tally.accepted += accepted
                self.tally.verifications.append((r.proposed, accepted, stopped))
            if r.state == "generation":
                # The KV cache keeps the fed token and the accepted drafts: the bonus token is fed next.
                self.engine.truncate(r.request_id, len(r.tokens) + accepted)
            r.state = "generation"
            pending[r.request_id] = (r, picks, accepted if drafts and not first_stop else None, stopped)

    def _stops(self, r: SpecRequest, picks: list[int]) -> bool:
        return picks[-1] in self.engine.eos_token_ids or len(r.generated) + len(picks) >= r.max_tokens


def spec_requests(engine: TorchEngine, rows: GrammarRows, kinds: Sequence[str | None]) -> list[SpecRequest]:
    tok = engine.tokenizer
    out = []
    for i, kind in enumerate(kinds):
        guide = None
        if kind is not None:
            rows.start(1000 + i, CONSTRAINTS[kind][0])
            guide = Guide(rows.guide(1000 + i))
        out.append(SpecRequest(100 + i, tok.encode(PROMPTS[i % len(PROMPTS)]).ids, guide))
    return out


def finish(engine: TorchEngine, rows: GrammarRows, reqs: Sequence[Request], kinds: Sequence[str | None]) -> None:
    """Each constrained output matches its constraint; the rows end cleanly."""
    for r, kind in zip(reqs, kinds, strict=True):
        if kind is not None:
            assert r.generated[-1] in engine.eos_token_ids, (kind, r.generated)
            assert re.fullmatch(CONSTRAINTS[kind][1], engine.tokenizer.decode(r.generated[:-1])), kind
    outcomes = rows.remove([1000 + i for i, k in enumerate(kinds) if k is not None])
    assert [o is not None and o.error for o in outcomes] == [None] * len(outcomes)
    assert rows.row_count == 0


def rows_of(engine: TorchEngine, grammar: GrammarEngine, drafts: int = 0) -> tuple[GrammarRows, DraftProvider]:
    provider = DraftProvider(grammar)
    return GrammarRows(provider, vocab_size=engine.vocab_size, end_token_ids=engine.eos_token_ids, max_rows=8,
                       max_draft_tokens=drafts), provider


@dataclass(frozen=True)
class Reference:
    """The run without speculation: each request's output, and the mask at each (request, position)."""

    outputs: dict[int, list[int]]
    masks: dict[tuple[int, int], np.ndarray]


@pytest.fixture(scope="module")
def reference(tiny: TinyModelInfo, engine: TorchEngine) -> Iterator[Reference]:
    """Run once, twice: by :class:`SpecExecutor` without drafts (recording the masks) and by test_grammar_hook's
    executor (the emulation without speculation): the same outputs."""
    grammar = tiny_grammar(tiny, max_batch=8)
    try:
        rows, _ = rows_of(engine, grammar)
        reqs = spec_requests(engine, rows, KINDS)
        ex = SpecExecutor(engine, rows, grammar)
        ex.seq_of = {r.request_id: 1000 + i for i, r in enumerate(reqs)}
        ex.run(reqs)
        finish(engine, rows, reqs, KINDS)
        plain_rows, _ = rows_of(engine, grammar)
        plain = spec_requests(engine, plain_rows, KINDS)
        Executor(engine, plain_rows, overlap=False).run(list(plain))
        assert [p.generated for p in plain] == [r.generated for r in reqs]
        finish(engine, plain_rows, plain, KINDS)
        assert all(len(r.generated) >= 4 for r in reqs), [r.generated for r in reqs]
        yield Reference({r.request_id: r.generated for r in reqs}, ex.masks)
    finally:
        grammar.close()


def spec_run(engine: TorchEngine, grammar: GrammarEngine, reference: Reference, **settings: Any,
             ) -> tuple[SpecExecutor, list[SpecRequest], DraftProvider]:
    """A run with speculation over the reference's requests, checked against it as it goes (SpecExecutor)."""
    rows, provider = rows_of(engine, grammar, settings.get("drafts", 0))
    reqs = spec_requests(engine, rows, KINDS)
    pause_at = settings.pop("pause_at", {})
    ex = SpecExecutor(engine, rows, grammar, reference=reference.outputs, ref_masks=reference.masks, **settings)
    ex.seq_of = {r.request_id: 1000 + i for i, r in enumerate(reqs)}
    ex.pause_at = dict(pause_at)
    ex.run(reqs)
    assert {r.request_id: r.generated for r in reqs} == reference.outputs
    stats = rows.stats()
    assert (stats.builds, stats.grammar_requests) == (provider.steps, provider.steps)  # one request a build
    finish(engine, rows, reqs, KINDS)
    return ex, reqs, provider


#: (loop, drafter, how drafts are accepted, TensorRT-LLM's max_num_draft_tokens).  1.2.1 runs the overlap
#: scheduler only with a draft model (EAGLE3 two-model, DRAFT_TARGET, MTP_EAGLE); n-gram and user-provided
#: drafts (the "oracle" here: no builds of their own) only in the plain loop.
CASES = [
    pytest.param(False, "oracle", FULL, 3, id="loop-ngram-full"),
    pytest.param(False, "oracle", PART, 3, id="loop-ngram-part"),
    pytest.param(False, "oracle", NONE, 2, id="loop-ngram-none"),
    pytest.param(False, "model", FULL, 3, id="loop-model-full"),
    pytest.param(False, "model", PART, 4, id="loop-model-part"),
    pytest.param(False, "model", NONE, 3, id="loop-model-none"),
    pytest.param(True, "model", FULL, 3, id="overlap-model-full"),
    pytest.param(True, "model", PART, 3, id="overlap-model-part"),
    pytest.param(True, "model", NONE, 2, id="overlap-model-none"),
]


@pytest.mark.parametrize(("overlap", "drafter", "profile", "drafts"), CASES)
def test_greedy_output_with_drafts_is_the_output_without(engine: TorchEngine, grammar: GrammarEngine,
                                                         reference: Reference, overlap: bool, drafter: str,
                                                         profile: Profile, drafts: int) -> None:
    """Drafts accepted in full, in part and not at all, by TensorRT-LLM's plain and overlap loops: the greedy
    outputs are those without speculation, every mask written (target rows, draft rows, the draft model's
    rows) is the one at that position without speculation, and the grammar sequence holds exactly the
    accepted tokens at every target build."""
    ex, _, _ = spec_run(engine, grammar, reference, overlap=overlap, drafter=drafter, profile=profile,
                        drafts=drafts, seed=drafts)
    tally = ex.tally
    assert tally.checked_rows > 0 and tally.drafted > 0
    if profile is FULL:
        # Every proposed draft is accepted, but where the output ended within them.
        assert all(accepted >= proposed or stopped for proposed, accepted, stopped in tally.verifications)
        assert tally.accepted > 0
    elif profile is NONE:
        assert tally.accepted == 0
    else:
        assert 0 < tally.accepted < tally.drafted
    if drafter == "model" and not overlap:
        assert tally.draft_rows_written > 0  # rollback_rejected_tokens said how many drafts were accepted
        if profile is FULL:
            assert tally.draft_rows_skipped == 0
    elif drafter == "model":
        # The overlap loop never calls rollback_rejected_tokens: the draft model's rows stay unmasked.
        assert (tally.draft_rows_written, tally.draft_rows_skipped > 0) == (0, True)


@pytest.mark.parametrize("drafter", ["oracle", "model"])
def test_a_paused_request_with_drafts_resumes_where_it_was(engine: TorchEngine, grammar: GrammarEngine,
                                                           reference: Reference, drafter: str) -> None:
    """A request paused with its last drafts partly accepted comes back as a context of all its tokens: the
    accepted drafts and the new token are committed then, once."""
    ex, _, _ = spec_run(engine, grammar, reference, drafter=drafter, profile=PART, drafts=3, seed=7,
                        pause_at={100: (3, 1), 101: (2, 2)})
    assert ex.tally.accepted > 0 and not ex.pause_at


# -- GrammarRows' draft rows, one build at a time ---------------------------------------------------------

WORDS = CONSTRAINTS["words"][0]
SEQ = 5


def target(*, init: bool = False, token: int | None = None, drafts: Sequence[int] = (),
           accepted: int | None = None) -> GuidedRequest:
    """A target request of grammar sequence :data:`SEQ` at slot 0 (request id 7)."""
    return GuidedRequest(Guide(GrammarRows.guide(SEQ)), 7, 0, init, init, not init, token, False, list(drafts),
                         accepted)


def drafting(token: int) -> GuidedRequest:
    """The draft model's request for :func:`target`'s request (``ModelDrafter``: same id, the target's slot)."""
    return GuidedRequest(Guide(GrammarRows.guide(SEQ)), 7, 0, False, False, True, token, True, [], 0)


def batch(req: GuidedRequest, layout: int) -> GuidedRequests:
    return GuidedRequests([req], int(req.is_context_init_state), layout)


def masks_after(grammar: GrammarEngine, constraint: ConstraintRequest, tokens: Sequence[int]) -> list[np.ndarray]:
    """``[i]``: the mask after ``tokens[:i]``, of a sequence fed one token a step (no drafts anywhere)."""
    provider = LocalMaskProvider(grammar)
    provider.start(99, constraint)
    one = np.array([99], np.uint64)
    try:
        out = [provider.step(one, np.zeros((1, 1), np.int32), np.zeros(1, np.int32)).bitmask[0].copy()]
        for t in tokens:
            out.append(provider.step(one, np.array([[t]], np.int32), np.ones(1, np.int32)).bitmask[0].copy())
    finally:
        provider.end([99])
    return out


@dataclass
class Bench:
    """One row of grammar sequence :data:`SEQ` behind :class:`GrammarRows`, and TensorRT-LLM's host buffers."""

    rows: GrammarRows
    provider: DraftProvider
    grammar: GrammarEngine
    bitmask: np.ndarray
    token_mask: np.ndarray
    words: list[int]  # "hello world again", which the constraint takes
    refused: int  # "7", which it never takes
    masks: list[np.ndarray]  # masks_after(words)

    @property
    def width(self) -> int:
        return self.rows.width

    def build(self, req: GuidedRequest, layout: int) -> list[tuple[int, str]]:
        self.token_mask[:] = 1
        return self.rows.build(batch(req, layout), self.bitmask, self.token_mask)

    def accepted(self) -> int:
        return int(self.grammar.table.get(SEQ).tokens_accepted)

    def row(self, i: int) -> np.ndarray:
        return self.bitmask[i, : self.width]


@pytest.fixture
def bench(engine: TorchEngine, grammar: GrammarEngine) -> Iterator[Bench]:
    rows, provider = rows_of(engine, grammar, 2)
    rows.start(SEQ, WORDS)
    words = engine.tokenizer.encode("hello world again").ids
    refused = engine.tokenizer.encode("7").ids[0]
    b = Bench(rows, provider, grammar, np.zeros((8 * 3, rows.width + PAD_WORDS), np.int32), np.zeros(8 * 3, np.int32),
              words, refused, masks_after(grammar, WORDS, words))
    assert b.build(target(init=True), 2) == [] and b.token_mask[0] == 1
    yield b
    rows.remove([SEQ])


def test_target_rows_end_at_the_first_draft_the_grammar_refuses(bench: Bench) -> None:
    """Row ``offset + 1 + i`` is the mask after draft ``i``; past a refused draft the rows stay token_mask 0 (as
    TensorRT-LLM's own _build leaves them); only the new token is committed, then the accepted drafts with the
    next one."""
    w = bench.words
    assert bench.build(target(token=w[0], drafts=[w[1], bench.refused]), 2) == []
    assert bench.token_mask[:3].tolist() == [1, 1, 0]
    assert (bench.row(0) == bench.masks[1]).all() and (bench.row(1) == bench.masks[2]).all()
    assert bench.accepted() == 1
    # TensorRT-LLM accepted w[1] and picked w[2] after it.
    assert bench.build(target(token=w[2], drafts=[w[3], w[4]], accepted=1), 2) == []
    assert bench.token_mask[:3].tolist() == [1, 1, 1]
    assert [(bench.row(i) == bench.masks[3 + i]).all() for i in range(3)] == [True] * 3
    assert bench.accepted() == 3
    assert bench.provider.last_drafts == [[w[3], w[4]]]


def test_an_older_accepted_count_is_not_read_after_a_step_without_drafts(bench: Bench) -> None:
    """TorchSampler leaves py_num_accepted_draft_tokens as it was at a step without drafts."""
    w = bench.words
    assert bench.build(target(token=w[0]), 2) == []
    assert bench.build(target(token=w[1], accepted=2), 2) == []
    assert (bench.accepted(), (bench.row(0) == bench.masks[2]).all()) == (2, True)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("more than sent", "TensorRT-LLM accepted 3 of the 2 draft tokens sent"),
        ("negative", "TensorRT-LLM accepted -1 of the 2 draft tokens sent"),
        ("none", "TensorRT-LLM accepted None of the 2 draft tokens sent"),
        ("another new token", "the new token {w3} is not the {w2} the draft model's build fed"),
        ("a wider layout", ("grammar step failed: TensorRT-LLM lays out 3 draft rows a request, the grammar rows "
                            "hold 2 (GrammarRows.reserve_drafts)")),
    ],
)
def test_counts_that_do_not_fit_fail_the_row(bench: Bench, engine: TorchEngine, case: str, message: str) -> None:
    w = bench.words
    message = message.format(w2=w[2], w3=w[3])
    assert bench.build(target(token=w[0], drafts=[w[1], w[2]]), 2) == []
    accepted = {"more than sent": 3, "negative": -1, "none": None}.get(case, 1)
    if case == "another new token":
        bench.rows.accepted(batch(target(token=w[2], accepted=1), 2))
        assert bench.build(drafting(w[2]), 2) == [] and bench.token_mask[0] == 1
    failed = bench.build(target(token=w[3], accepted=accepted), 3 if case == "a wider layout" else 2)
    assert failed == [(7, message)]
    assert allowed_set(bench.row(0), engine.vocab_size) == set(engine.eos_token_ids)
    outcome = bench.rows.outcome(SEQ)
    assert outcome is not None and outcome.error == message


def allowed_set(row: np.ndarray, vocab: int) -> set[int]:
    return {t for t in range(vocab) if row[t // 32] >> (t % 32) & 1}


@pytest.mark.parametrize("told", [True, False], ids=["executor_loop", "executor_loop_overlap"])
def test_the_draft_models_rows(bench: Bench, told: bool) -> None:
    """The draft model's builds (``ModelDrafter``): told how many drafts were accepted (rollback_rejected_tokens,
    the plain loop), the first commits them and the new token, the later ones mask after the drafts so far
    without committing them, and the target's build commits nothing more.  Not told (the overlap loop), they
    leave their rows unmasked and the target's build commits."""
    w = bench.words
    assert bench.build(target(token=w[0], drafts=[w[1], bench.refused]), 2) == []
    if told:
        bench.rows.accepted(batch(target(token=w[2], accepted=1, drafts=[0, 0]), 2))
    written = []
    for token, after in ((w[2], 3), (w[3], 4), (bench.refused, None)):
        assert bench.build(drafting(token), 2) == []
        written.append(int(bench.token_mask[0]))
        if bench.token_mask[0]:
            assert after is not None and (bench.row(0) == bench.masks[after]).all()
        assert bench.accepted() == (3 if told else 1)  # nothing past the committed tokens is kept
    assert written == ([1, 1, 0] if told else [0, 0, 0])
    assert bench.build(target(token=w[2], accepted=1, drafts=[w[3], bench.refused]), 2) == []
    assert bench.accepted() == 3
    assert bench.token_mask[:3].tolist() == [1, 1, 0]
    assert (bench.row(0) == bench.masks[3]).all() and (bench.row(1) == bench.masks[4]).all()
    assert bench.provider.steps == (6 if told else 3)  # one grammar request a build with work (init included)


def test_a_draft_builds_failure_is_reported_at_the_target_build_once(bench: Bench, engine: TorchEngine) -> None:
    """A draft the grammar refused, accepted all the same (TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS): the draft
    model's build that commits it fails the row, unmasked and unreported (ModelDrafter drops execute's failures);
    the target's build reports it, once, and leaves only the end tokens."""
    w = bench.words
    assert bench.build(target(token=w[0], drafts=[bench.refused]), 1) == []
    assert bench.token_mask[:2].tolist() == [1, 0]
    bench.rows.accepted(batch(target(token=w[1], accepted=1, drafts=[0]), 1))
    assert bench.build(drafting(w[1]), 1) == [] and bench.token_mask[0] == 0
    message = f"sequence {SEQ}: token {bench.refused} at position 1 is rejected by the grammar"
    assert bench.build(target(token=w[1], accepted=1, drafts=[0]), 1) == [(7, message)]
    assert allowed_set(bench.row(0), engine.vocab_size) == set(engine.eos_token_ids)
    assert bench.build(target(token=w[2], accepted=0), 1) == []  # reported once; still only the end tokens
    assert allowed_set(bench.row(0), engine.vocab_size) == set(engine.eos_token_ids)


def test_a_malformed_draft_answer_fails_the_steps_rows(bench: Bench) -> None:
    bench.provider.mangle = lambda step: replace(
        step, draft_bitmask=None if step.draft_bitmask is None else step.draft_bitmask[:, :, :-1])
    w, width = bench.words, bench.width
    message = f"draft_bitmask must be int32 [2, 1, {width}], got int32 (2, 1, {width - 1})"
    assert bench.build(target(token=w[0], drafts=[w[1], w[2]]), 2) == [(7, message)]
    assert bench.token_mask[:3].tolist() == [1, 0, 0]


def test_drafts_on_a_context_row_are_not_laid_out(engine: TorchEngine, grammar: GrammarEngine) -> None:
    """TensorRT-LLM reserves draft rows after a generation row only: a context row's drafts are not sent."""
    rows, provider = rows_of(engine, grammar, 2)
    rows.start(SEQ, WORDS)
    bitmask, token_mask = np.zeros((6, rows.width), np.int32), np.zeros(6, np.int32)
    guided = batch(target(init=True, drafts=[3]), 2)
    try:
        assert rows.build(guided, bitmask, token_mask) == []
        assert (guided.num_bitmask_tokens, token_mask.tolist(), provider.last_drafts) == (1, [1, 0, 0, 0, 0, 0], None)
        assert not bitmask[1:].any()
    finally:
        rows.remove([SEQ])


@pytest.mark.parametrize("value", [-1, 17])
def test_the_draft_bound_is_the_grammar_steps(grammar: GrammarEngine, value: int) -> None:
    with pytest.raises(EngineError, match=rf"^max_draft_tokens must be within 0\.\.16 \(the most draft tokens a "
                                          rf"grammar step answers\), got {value}$"):
        GrammarRows(DraftProvider(grammar), vocab_size=100, end_token_ids=[0], max_rows=1, max_draft_tokens=value)


# -- the decoder over TensorRT-LLM's emulated modules ------------------------------------------------------


@pytest.fixture
def decoder_module(monkeypatch: pytest.MonkeyPatch, engine: TorchEngine) -> Iterator[types.ModuleType]:
    """``llm_runtime.trtllm_decoder`` imported against the emulated TensorRT-LLM (and forgotten after)."""
    import llm_runtime
    from tests.support.trtllm_emulation import install

    install(monkeypatch, engine)
    monkeypatch.delattr(llm_runtime, "trtllm_decoder", raising=False)
    yield importlib.import_module("llm_runtime.trtllm_decoder")
    sys.modules.pop("llm_runtime.trtllm_decoder", None)
    if hasattr(llm_runtime, "trtllm_decoder"):
        delattr(llm_runtime, "trtllm_decoder")


def executor_with(decoder: object, mode: str | None, drafter_decoder: object | None = None) -> Any:
    """What check_installed reads of ``LLM``: ``_executor.engine`` (the PyExecutor), its model engine's
    ``spec_config.spec_dec_mode`` and its drafter's ``guided_decoder``."""
    spec = None if mode is None else types.SimpleNamespace(spec_dec_mode=types.SimpleNamespace(name=mode))
    engine = types.SimpleNamespace(guided_decoder=decoder, model_engine=types.SimpleNamespace(spec_config=spec),
                                   drafter=types.SimpleNamespace(guided_decoder=drafter_decoder or decoder))
    return types.SimpleNamespace(_executor=types.SimpleNamespace(engine=engine))


def grammar_decoder(module: types.ModuleType, rows: GrammarRows, vocab: int, drafts: int) -> Any:
    return module.GrammarModelDecoder(guided_decoding_config=None, max_num_sequences=4, vocab_size_padded=vocab,
                                      max_num_draft_tokens=drafts, grammar=rows)


#: A one-model mode whose model engine has no grammar decoder (here: the executor has it, as a drafter mode's).
ONE_MODEL = (r"one-model speculative mode {} \(its guided decoder is NoneType\): it must run in this process "
             r"\(TLLM_WORKER_USE_SINGLE_PROCESS=1, tensor_parallel_size 1\)$")


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (None, None), ("NONE", None), ("EAGLE3", None), ("DRAFT_TARGET", None), ("MTP_EAGLE", None),
        ("NGRAM", None), ("USER_PROVIDED", None), ("SAVE_HIDDEN_STATES", None),
        ("MTP", ONE_MODEL.format("MTP")),
        ("MTP_EAGLE_ONE_MODEL", ONE_MODEL.format("MTP_EAGLE_ONE_MODEL")),
        ("EAGLE3_ONE_MODEL", ONE_MODEL.format("EAGLE3_ONE_MODEL")),
        ("PARD", (r"^llm: TensorRT-LLM's speculative decoding mode PARD is not one TensorRT-LLM 1\.2\.1 was read "
                  r"to have \(NONE, EAGLE3, DRAFT_TARGET, MTP_EAGLE, NGRAM, USER_PROVIDED, SAVE_HIDDEN_STATES, MTP, "
                  r"MTP_EAGLE_ONE_MODEL, EAGLE3_ONE_MODEL\); the grammar model's constraints do not serve it$")),
    ],
)
def test_check_installed_serves_the_drafter_modes_and_refuses_the_others(
        decoder_module: types.ModuleType, engine: TorchEngine, grammar: GrammarEngine, mode: str | None,
        message: str | None) -> None:
    from grammar_backend.errors import ConfigError

    rows, _ = rows_of(engine, grammar)
    decoder = grammar_decoder(decoder_module, rows, engine.vocab_size, 3)
    llm = executor_with(decoder, mode)
    if message is None:
        assert decoder_module.check_installed(llm) is decoder
    else:
        with pytest.raises(ConfigError, match=message):
            decoder_module.check_installed(llm)


def test_check_installed_refuses_a_drafter_masking_with_another_decoder(
        decoder_module: types.ModuleType, engine: TorchEngine, grammar: GrammarEngine) -> None:
    from grammar_backend.errors import ConfigError

    rows, _ = rows_of(engine, grammar)
    decoder = grammar_decoder(decoder_module, rows, engine.vocab_size, 3)
    with pytest.raises(ConfigError, match=r"^llm: TensorRT-LLM's drafter masks its drafts with another guided "
                                          r"decoder \(SimpleNamespace\), not the grammar model's$"):
        decoder_module.check_installed(executor_with(decoder, "DRAFT_TARGET", types.SimpleNamespace()))


def test_a_one_model_executor_gets_the_capturable_grammar_decoder(
        decoder_module: types.ModuleType, engine: TorchEngine, grammar: GrammarEngine) -> None:
    """``create_py_executor`` builds ``CapturableGuidedDecoder`` by that name for the one-model modes: while
    ``installed`` runs, that name builds the grammar's; after it, TensorRT-LLM's class again."""
    creator = sys.modules["tensorrt_llm._torch.pyexecutor.py_executor_creator"]
    original = creator.CapturableGuidedDecoder
    rows, _ = rows_of(engine, grammar)
    with decoder_module.installed(rows):
        decoder = creator.CapturableGuidedDecoder(guided_decoding_config=None, max_num_sequences=4,
                                                  vocab_size_padded=engine.vocab_size, max_num_draft_tokens=2)
        assert isinstance(decoder, decoder_module.GrammarCapturableDecoder) and decoder.grammar is rows
        decoder.stream.close()
        assert isinstance(creator.GuidedDecoder(guided_decoding_config=None, max_num_sequences=4,
                                                vocab_size_padded=engine.vocab_size, max_num_draft_tokens=2),
                          decoder_module.GrammarModelDecoder)
    assert creator.CapturableGuidedDecoder is original


def test_the_decoder_refuses_more_drafts_than_a_grammar_step_answers(
        decoder_module: types.ModuleType, engine: TorchEngine, grammar: GrammarEngine) -> None:
    from grammar_backend.errors import ConfigError

    rows, _ = rows_of(engine, grammar)
    with pytest.raises(ConfigError, match=r"^llm: TensorRT-LLM lays out 17 draft tokens a row "
                                          r"\(speculative_config\.max_total_draft_tokens\); the grammar model "
                                          r"answers 0\.\.16$"):
        grammar_decoder(decoder_module, rows, engine.vocab_size, 17)


def test_the_decoder_hands_rollback_rejected_tokens_to_the_rows(
        decoder_module: types.ModuleType, engine: TorchEngine, grammar: GrammarEngine) -> None:
    """The decoder reserves TensorRT-LLM's draft layout in the rows, and its _rollback_rejected_tokens tells them
    how many drafts were accepted: the draft model's first build then commits them and writes its row."""
    rows, _ = rows_of(engine, grammar)
    decoder = grammar_decoder(decoder_module, rows, engine.vocab_size, 2)
    rows.start(SEQ, WORDS)
    w = engine.tokenizer.encode("hello world again").ids
    try:
        for req in (target(init=True), target(token=w[0], drafts=[w[1], w[2]])):
            decoder.requests = batch(req, 2)
            assert decoder.build() == []
        assert decoder.token_mask_host[:3].tolist() == [1, 1, 1]
        decoder.requests = batch(target(token=w[2], accepted=1, drafts=[0, 0]), 2)  # add_batch
        decoder.rollback_rejected_tokens()
        decoder.requests = batch(drafting(w[2]), 2)
        assert decoder.build() == []
        assert (int(decoder.token_mask_host[0]), grammar.table.get(SEQ).tokens_accepted) == (1, 3)
    finally:
        rows.remove([SEQ])
