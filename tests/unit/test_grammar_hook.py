"""GrammarRows: the grammar side of TensorRT-LLM's guided decoder, driven in TensorRT-LLM's per-step order.

TensorRT-LLM cannot be installed on these machines.  These tests run the
real tiny torch model and the real grammar engine (xgrammar) behind a
provider that counts its calls, through :class:`Executor`: the per-step
order of TensorRT-LLM 1.2's PyTorch executor as read in its sources
(``py_executor.py`` ``_executor_loop`` and ``_executor_loop_overlap``,
``guided_decoder.py``), with its data (``GuidedRequest``/``GuidedRequests``
as ``guided_decoder.py`` defines them: rows at batch offsets, contexts
first, the matcher initialised at the last context chunk and advanced with
``get_last_tokens(0)`` in generation, a paused request scheduled again as
a context).  ``GuidedDecoder.execute``'s copy and ``logits_bitmask``
kernel are :func:`apply_rows`: rows whose ``token_mask`` is 0 stay unmasked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from grammar_backend.errors import GrammarError
from grammar_backend.protocol import bitmask_width
from grammar_service.engine import GrammarEngine
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import EngineError
from llm_runtime.grammar_hook import GrammarRows, RowOutcome
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest, MaskStep
from standins.tiny_model import TinyModelInfo, tiny_grammar
from tests.support.trtllm_emulation import Guide, GuidedRequest, GuidedRequests, LlmRequestNames, apply_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUMBER = '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}'
CONSTRAINTS = {
    "regex": (ConstraintRequest("regex", "[a-z]{2,6}", ""), r"[a-z]{2,6}"),
    "choice": (ConstraintRequest("choice", '["north", "south"]', ""), r"north|south"),
    "json": (ConstraintRequest("json_schema", NUMBER, ""), r'\{"n":-?[0-9]+\}'),
}
PROMPTS = ["hello world", "yes no", "the quick brown fox", "caf\u00e9"]


class CountingProvider(LocalMaskProvider):
    """The in-process provider over the real grammar engine, counting step calls and their rows."""

    def __init__(self, engine: GrammarEngine) -> None:
        super().__init__(engine)
        self.step_rows: list[int] = []
        self.fail_steps = False
        self.short_masks = False  # answer with bitmask rows one word short (a malformed answer)

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        self.step_rows.append(int(seq_ids.shape[0]))
        if self.fail_steps:
            raise RuntimeError("grammar model unreachable")
        step = super().step(seq_ids, tokens, counts)
        return replace(step, bitmask=step.bitmask[:, :-1]) if self.short_masks else step


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=16, max_seq_len=320))


@pytest.fixture
def grammar(tiny: TinyModelInfo) -> Iterator[GrammarEngine]:
    g = tiny_grammar(tiny, max_batch=16)
    yield g
    assert g.active_count == 0, "a grammar sequence leaked"
    g.close()


@pytest.fixture
def provider(grammar: GrammarEngine) -> CountingProvider:
    return CountingProvider(grammar)


#: TensorRT-LLM pads its vocabulary (vocab_size_padded); the decoder's rows are this much wider.
PAD_WORDS = 2


@dataclass
class Request(LlmRequestNames):
    """What an ``LlmRequest`` shows the guided decoder, and its state in the executor."""

    request_id: int
    prompt: list[int]
    guide: Guide | None
    chunks: int = 1  # context chunks; the matcher starts at the last one
    tokens: list[int] = field(default_factory=list)  # prompt + generated (get_tokens(0))
    chunk: int = 0
    state: str = "context"  # context | generation | paused | aborting | complete
    seq_slot: int | None = None
    max_tokens: int = 48
    listed_after_abort: int = 0  # builds that listed it after the engine ended and aborted it

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def guided_decoding_params(self) -> Guide | None:
        return self.guide

    @property
    def is_last_context_chunk(self) -> bool:
        return self.chunk == self.chunks - 1

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state in ("generation", "aborting")


def allowed_tokens(row: np.ndarray, vocab: int) -> set[int]:
    """The token ids a bitmask row leaves."""
    return {t for t in range(vocab) if row[t // 32] >> (t % 32) & 1}


class Executor:
    """TensorRT-LLM's PyTorch executor loop, in the order its sources give, over the real tiny model.

    ``overlap``: ``_executor_loop_overlap``: the forward of step N is launched
    with step N-1's sampled tokens still on the device; ``_update_requests``
    of the previous batch then lands them on the host (a request that ended
    there leaves the batch's generation state); ``add_batch`` is called again
    and ``execute`` builds and applies the masks; then step N samples.
    Without overlap (``_executor_loop``) the tokens land before the forward.

    ``abort_at``: the engine ends a request when it has this many tokens (a
    stop string in them) and aborts it, calling ``on_abort`` as the token's
    response reaches it.  The executor handles the abort only at a later
    iteration (``_handle_canceled_requests``): the request stays in the
    batch for :data:`ABORT_LAG` more builds, what it samples meanwhile is
    dropped, and then it completes with its final (cancelled) output,
    ``on_final``.  Every build's failed rows go to :attr:`failed`; with
    ``strict`` (the default) any failure stops the run.
    """

    #: Builds that still list an aborted request (the issue's "builds N+1 and N+2").
    ABORT_LAG = 2

    def __init__(self, engine: TorchEngine, rows: GrammarRows, *, overlap: bool, max_slots: int = 16,
                 strict: bool = True) -> None:
        self.engine, self.rows, self.overlap, self.strict = engine, rows, overlap, strict
        width = bitmask_width(engine.vocab_size) + PAD_WORDS
        self.bitmask = np.full((max_slots, width), -1, dtype=np.int32)  # bitmask_host (stale rows on purpose)
        self.token_mask = np.ones(max_slots, dtype=np.int32)  # token_mask_host
        self.free = list(range(max_slots))
        self.builds = 0
        self.failed: list[tuple[int, str]] = []
        self.pause_at: dict[int, tuple[int, int]] = {}  # request id -> (generated count, steps paused)
        self._paused_for: dict[int, int] = {}
        self.abort_at: dict[int, int] = {}  # request id -> generated count at which the engine aborts it
        self.on_abort: Callable[[Request], None] = lambda r: None
        self.on_final: Callable[[Request], None] = lambda r: None
        self.aborted_rows: list[set[int]] = []  # tokens each build left an aborting request

    def _complete(self, r: Request) -> None:
        r.state = "complete"
        self.engine.release(r.request_id)
        if r.seq_slot is not None:
            self.free.append(r.seq_slot)
            r.seq_slot = None

    def _update(self, reqs: list[Request], sampled: dict[int, int]) -> None:
        """``_update_requests``: the sampled tokens land; finished requests complete and free their slot."""
        for r in reqs:
            t = sampled.get(r.request_id)
            if t is None or r.state in ("complete", "aborting"):
                continue
            r.tokens.append(t)
            if t in self.engine.eos_token_ids or len(r.generated) >= r.max_tokens:
                self._complete(r)
            elif self.abort_at.get(r.request_id) == len(r.generated):
                r.state = "aborting"
                self.on_abort(r)
            elif r.request_id in self.pause_at and len(r.generated) == self.pause_at[r.request_id][0]:
                # _pause_requests: the KV cache is freed; the request comes back as a context of all its tokens.
                r.state = "paused"
                self._paused_for[r.request_id] = self.pause_at.pop(r.request_id)[1]
                self.engine.release(r.request_id)

    def run(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.tokens = list(r.prompt)
        pending: dict[int, int] = {}
        previous: list[Request] = []
        while any(r.state != "complete" for r in reqs) or pending:
            if not self.overlap:
                self._update(previous, pending)
                pending = {}
            for rid, left in list(self._paused_for.items()):
                if left == 0:
                    del self._paused_for[rid]
                    r = next(x for x in reqs if x.request_id == rid)
                    r.state, r.chunk, r.chunks = "context", 0, 1
                else:
                    self._paused_for[rid] = left - 1
            batch = ([r for r in reqs if r.state == "context"]
                     + [r for r in reqs if r.state in ("generation", "aborting")])
            if not batch and not pending:
                continue
            for r in batch:
                if r.seq_slot is None:
                    r.seq_slot = self.free.pop(0)
            # The forward (launched before the previous tokens reach the host under overlap).
            logits_rows: dict[int, torch.Tensor] = {}
            gen = [r for r in batch if r.state in ("generation", "aborting")]
            if gen:
                last = [pending.get(r.request_id, r.tokens[-1]) if self.overlap else r.tokens[-1] for r in gen]
                for r, row in zip(gen, self.engine.decode([r.request_id for r in gen], last), strict=True):
                    logits_rows[r.request_id] = row
            for r in batch:
                if r.state == "context" and r.chunk == r.chunks - 1:
                    logits_rows[r.request_id] = self.engine.prefill(r.request_id, r.tokens).reshape(-1)
            if self.overlap:
                self._update(previous, pending)
                pending = {}
            if not batch:
                break
            # add_batch (again, under overlap), then execute: build on the host, mask on the device.
            guided = GuidedRequests([GuidedRequest.from_llm_request(r) for r in batch],
                                    sum(r.state == "context" for r in batch))
            failed = self.rows.build(guided, self.bitmask, self.token_mask)
            self.failed += failed
            assert not (self.strict and failed), failed
            self.builds += 1
            logits = torch.stack([logits_rows.get(r.request_id, torch.zeros(self.engine.vocab_size)) for r in batch])
            apply_rows(logits, self.bitmask, self.token_mask, self.engine.vocab_size)
            for i, r in enumerate(batch):
                if r.state == "context":
                    if r.chunk < r.chunks - 1:
                        r.chunk += 1  # an earlier chunk: no token sampled
                        continue
                    r.state = "generation"
                if r.state == "generation":
                    pending[r.request_id] = int(logits[i].argmax())
                elif r.state == "aborting":
                    r.listed_after_abort += 1
                    self.aborted_rows.append(allowed_tokens(self.bitmask[i], self.engine.vocab_size)
                                             if self.token_mask[i] else set(range(self.engine.vocab_size)))
                    if r.listed_after_abort == self.ABORT_LAG:  # _handle_canceled_requests, then its final output
                        self._complete(r)
                        self.on_final(r)
            previous = [r for r in batch if r.request_id in pending]


def rows_for(engine: TorchEngine, provider: CountingProvider, max_rows: int = 16) -> GrammarRows:
    return GrammarRows(provider, vocab_size=engine.vocab_size, end_token_ids=engine.eos_token_ids, max_rows=max_rows)


def requests_for(engine: TorchEngine, rows: GrammarRows, kinds: Sequence[str | None], *,
                 chunks: Sequence[int] | None = None) -> list[Request]:
    tok = engine.tokenizer
    out = []
    for i, kind in enumerate(kinds):
        guide = None
        if kind is not None:
            seq = 1000 + i
            rows.start(seq, CONSTRAINTS[kind][0])
            guide = Guide(rows.guide(seq))
        out.append(Request(100 + i, tok.encode(PROMPTS[i % len(PROMPTS)]).ids, guide,
                           chunks=1 if chunks is None else chunks[i]))
    return out


def check_outputs(engine: TorchEngine, rows: GrammarRows, reqs: list[Request], kinds: Sequence[str | None]) -> None:
    for r, kind in zip(reqs, kinds, strict=True):
        if kind is None:
            continue
        toks = r.generated
        assert toks[-1] in engine.eos_token_ids, (kind, toks)
        text = engine.tokenizer.decode(toks[:-1])
        assert re.fullmatch(CONSTRAINTS[kind][1], text), (kind, text)
    outcomes = rows.remove([1000 + i for i, k in enumerate(kinds) if k is not None])
    assert all(o is not None and o.error is None for o in outcomes)
    assert rows.row_count == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["executor_loop", "executor_loop_overlap"])
def test_one_grammar_request_per_step_for_16_constrained_rows(engine: TorchEngine, provider: CountingProvider,
                                                              overlap: bool) -> None:
    """16 constrained rows: every step that has one costs exactly one grammar request, with all of them."""
    kinds = [("regex", "choice", "json")[i % 3] for i in range(16)]
    rows = rows_for(engine, provider)
    reqs = requests_for(engine, rows, kinds)
    ex = Executor(engine, rows, overlap=overlap)
    ex.run(reqs)
    assert provider.step_rows[0] == 16
    stats = rows.stats()
    assert (stats.builds, stats.grammar_requests) == (len(provider.step_rows), len(provider.step_rows))
    assert stats.rows == sum(provider.step_rows)
    check_outputs(engine, rows, reqs, kinds)


def test_overlap_gives_what_the_plain_loop_gives(engine: TorchEngine, grammar: GrammarEngine) -> None:
    """Under the overlap scheduler the tokens reach the host one step late; the outputs are the same."""
    kinds: list[str | None] = ["json", "regex", None, "choice"]
    outputs = []
    for overlap in (False, True):
        provider = CountingProvider(grammar)
        rows = rows_for(engine, provider)
        reqs = requests_for(engine, rows, kinds)
        Executor(engine, rows, overlap=overlap).run(reqs)
        outputs.append([r.generated for r in reqs])
        check_outputs(engine, rows, reqs, kinds)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("overlap", [False, True], ids=["executor_loop", "executor_loop_overlap"])
def test_context_chunks_and_a_paused_request(engine: TorchEngine, grammar: GrammarEngine, overlap: bool) -> None:
    """A 3-chunk context gets its first mask at its last chunk; a request paused after 3 tokens and scheduled
    again as a context of all its tokens resumes its grammar where it was (the token sampled before the pause
    is fed then); the outputs equal those of an uninterrupted run."""
    kinds: list[str | None] = ["json", "regex", "choice"]
    provider = CountingProvider(grammar)
    rows = rows_for(engine, provider)
    plain = requests_for(engine, rows, kinds)
    Executor(engine, rows, overlap=overlap).run(plain)
    check_outputs(engine, rows, plain, kinds)
    provider = CountingProvider(grammar)
    rows = rows_for(engine, provider)
    reqs = requests_for(engine, rows, kinds, chunks=[3, 1, 2])
    ex = Executor(engine, rows, overlap=overlap)
    ex.pause_at = {100: (3, 2)}
    ex.run(reqs)
    assert [r.generated for r in reqs] == [r.generated for r in plain]
    assert provider.step_rows[:3] == [1, 2, 3]  # regex from step 1; choice joins at step 2, json at step 3
    check_outputs(engine, rows, reqs, kinds)


def test_rows_past_the_vocabulary_stay_masked(engine: TorchEngine, provider: CountingProvider) -> None:
    """The padded words past the vocabulary are never written: 0, so those ids are never sampled."""
    rows = rows_for(engine, provider)
    reqs = requests_for(engine, rows, ["regex"])
    ex = Executor(engine, rows, overlap=False)
    ex.bitmask[:, bitmask_width(engine.vocab_size):] = 0
    ex.run(reqs)
    assert not ex.bitmask[:, bitmask_width(engine.vocab_size):].any()
    check_outputs(engine, rows, reqs, ["regex"])


@pytest.mark.parametrize("overlap", [False, True], ids=["executor_loop", "executor_loop_overlap"])
def test_a_request_the_engine_ended_is_listed_two_more_builds_without_failing(
        engine: TorchEngine, provider: CountingProvider, grammar: GrammarEngine, overlap: bool) -> None:
    """A stop string at step 3: the engine retires the row and aborts; builds 4 and 5 still list the request
    (TensorRT-LLM drops it at a later iteration): end tokens only, no failure, no grammar step for it; its final
    output removes the row; the other rows decode as without it."""
    kinds: list[str | None] = ["json", "regex", "choice"]
    plain_rows = rows_for(engine, CountingProvider(grammar))
    plain = requests_for(engine, plain_rows, kinds)
    Executor(engine, plain_rows, overlap=overlap).run(plain)
    check_outputs(engine, plain_rows, plain, kinds)
    rows = rows_for(engine, provider)
    reqs = requests_for(engine, rows, kinds)
    ex = Executor(engine, rows, overlap=overlap)
    ex.abort_at = {100: 3}
    retired: list[RowOutcome | None] = []
    stepped_before = [0]

    def abort(r: Request) -> None:  # TrtllmGenerator._deliver_finish(retire=True)
        retired.append(rows.retire(1000))
        stepped_before[0] = len(provider.step_rows)

    def release(r: Request) -> None:  # TrtllmGenerator._release, at TensorRT-LLM's final output
        rows.remove([1000])

    ex.on_abort, ex.on_final = abort, release
    ex.run(reqs)
    assert ex.failed == [] and reqs[0].listed_after_abort == Executor.ABORT_LAG
    assert retired == [RowOutcome(None, 0, False)] and grammar.active_count == 2
    assert ex.aborted_rows == [set(engine.eos_token_ids)] * Executor.ABORT_LAG
    # The retired sequence is never stepped again: only the two others are in the steps after it.
    assert max(provider.step_rows[stepped_before[0]:]) <= 2
    assert [r.generated for r in reqs[1:]] == [r.generated for r in plain[1:]]
    assert (rows.row_count, rows.remove([1000])) == (2, [None])  # its final output removed it
    assert [o is not None and o.error is None for o in rows.remove([1001, 1002])] == [True, True]


@pytest.mark.parametrize("overlap", [False, True], ids=["executor_loop", "executor_loop_overlap"])
def test_removing_the_row_at_the_abort_fails_the_builds_that_still_list_it(
        engine: TorchEngine, provider: CountingProvider, overlap: bool) -> None:
    """What retire() is for: the row removed as the engine ends the request (the old order) makes the next
    build fail the request, which TensorRT-LLM turns into _handle_errors mid-iteration."""
    rows = rows_for(engine, provider)
    reqs = requests_for(engine, rows, ["regex"])
    ex = Executor(engine, rows, overlap=overlap, strict=False)
    ex.abort_at = {100: 2}
    def remove(r: Request) -> None:  # the old order: removed as the engine ends the request
        rows.remove([1000])

    ex.on_abort = remove
    ex.run(reqs)
    assert ex.failed == [(100, "no grammar sequence for this request")] * Executor.ABORT_LAG


def test_a_failed_step_fails_no_retired_row(engine: TorchEngine, provider: CountingProvider) -> None:
    """A step that fails as a whole (here a bitmask too narrow) fails its rows, but not a retired one."""
    rows = rows_for(engine, provider)
    for seq in (5, 6):
        rows.start(seq, CONSTRAINTS["regex"][0])
    width = bitmask_width(engine.vocab_size)

    def both(init: bool) -> GuidedRequests:
        return GuidedRequests([GuidedRequest(Guide(rows.guide(seq)), rid, slot, init, init, not init,
                                             None if init else 100)
                               for seq, rid, slot in ((5, 7, 0), (6, 8, 1))], 2 if init else 0)

    token_mask = np.zeros(2, dtype=np.int32)
    assert rows.build(both(True), np.zeros((2, width), dtype=np.int32), token_mask) == []
    rows.retire(6)
    narrow = np.zeros((2, width - 1), dtype=np.int32)
    message = f"grammar step failed: bitmask_host has {width - 1} words per row, the vocabulary needs {width}"
    assert rows.build(both(False), narrow, token_mask) == [(7, message)]
    assert [o is not None and o.error for o in rows.remove([5, 6])] == [message, None]


def test_retire_is_idempotent_and_remove_after_it_ends_nothing_twice(engine: TorchEngine,
                                                                     provider: CountingProvider,
                                                                     grammar: GrammarEngine) -> None:
    rows = rows_for(engine, provider)
    rows.start(5, CONSTRAINTS["regex"][0])
    assert rows.retire(5) == rows.retire(5) == RowOutcome(None, 0, False)
    assert (grammar.active_count, rows.row_count, rows.retire(6)) == (0, 1, None)
    assert rows.remove([5]) == [RowOutcome(None, 0, False)]
    assert rows.row_count == 0


def view(seq: int | None, *, slot: int = 0, init: bool = True, token: int | None = None) -> GuidedRequests:
    req = GuidedRequest(None if seq is None else Guide(f"constrained-llm-sequence-{seq}"), 7, slot, init, init,
                        not init, token)
    return GuidedRequests([req], int(init))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown sequence", "no grammar sequence for this request"),
        ("step fails", "grammar step failed: grammar model unreachable"),
    ],
)
def test_failed_rows_are_returned_and_left_only_end_tokens(engine: TorchEngine, provider: CountingProvider,
                                                           case: str, message: str) -> None:
    rows = rows_for(engine, provider)
    rows.start(5, CONSTRAINTS["regex"][0])
    bitmask = np.zeros((2, bitmask_width(engine.vocab_size) + PAD_WORDS), dtype=np.int32)
    token_mask = np.zeros(2, dtype=np.int32)
    provider.fail_steps = case == "step fails"
    requests = view(99 if case == "unknown sequence" else 5)
    assert rows.build(requests, bitmask, token_mask) == [(7, message)]
    allowed = allowed_tokens(bitmask[0], engine.vocab_size)
    assert (allowed, token_mask.tolist()) == (set(engine.eos_token_ids), [1, 0])
    outcome = rows.remove([5])[0]
    assert outcome is not None and outcome.error == (None if case == "unknown sequence" else message)


def test_a_malformed_answer_fails_the_steps_rows(engine: TorchEngine, provider: CountingProvider) -> None:
    """The answer is checked before any row reads it (MaskStep.read): a mask of the wrong width fails the rows."""
    rows = rows_for(engine, provider)
    rows.start(5, CONSTRAINTS["regex"][0])
    width = bitmask_width(engine.vocab_size)
    bitmask = np.zeros((1, width), dtype=np.int32)
    token_mask = np.zeros(1, dtype=np.int32)
    provider.short_masks = True
    message = f"bitmask must be int32 [1, {width}], got int32 (1, {width - 1})"
    assert rows.build(view(5), bitmask, token_mask) == [(7, message)]
    allowed = allowed_tokens(bitmask[0], engine.vocab_size)
    assert allowed == set(engine.eos_token_ids)
    outcome = rows.remove([5])[0]
    assert outcome is not None and outcome.error == message


def test_a_terminated_row_keeps_only_end_tokens(engine: TorchEngine, provider: CountingProvider,
                                                tiny: TinyModelInfo) -> None:
    rows = rows_for(engine, provider)
    rows.start(5, CONSTRAINTS["choice"][0])
    bitmask = np.zeros((1, bitmask_width(engine.vocab_size)), dtype=np.int32)
    token_mask = np.zeros(1, dtype=np.int32)
    assert rows.build(view(5), bitmask, token_mask) == []
    for t in [*engine.tokenizer.encode("north").ids, tiny.eos_token_id]:
        assert rows.build(view(5, init=False, token=t), bitmask, token_mask) == []
    assert rows.outcome(5) == RowOutcome(None, 0, True)
    allowed = allowed_tokens(bitmask[0], engine.vocab_size)
    assert allowed == set(engine.eos_token_ids)
    assert [o is not None and o.terminated for o in rows.remove([5, 6])] == [True, False]


def test_start_refuses_a_sequence_twice_without_leaking(engine: TorchEngine, provider: CountingProvider) -> None:
    rows = rows_for(engine, provider)
    rows.start(5, CONSTRAINTS["regex"][0])
    with pytest.raises(GrammarError, match="sequence 5: already started"):
        rows.start(5, CONSTRAINTS["regex"][0])
    assert rows.row_count == 1
    rows.remove([5])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"end_token_ids": []}, "end_token_ids must be non-empty"),
        ({"max_rows": 0}, "max_rows must be positive"),
    ],
)
def test_rows_reject_bad_settings(provider: CountingProvider, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"vocab_size": 100, "end_token_ids": [0], "max_rows": 4, **kwargs}
    with pytest.raises(EngineError, match=message):
        GrammarRows(provider, **args)  # type: ignore[arg-type]


def test_grammar_rows_refuse_to_be_pickled(provider: CountingProvider) -> None:
    """It lives with the executor; TensorRT-LLM carrying it to another process must fail with the reason."""
    import pickle

    with pytest.raises(TypeError, match="lives in the llm model's process"):
        pickle.dumps(GrammarRows(provider, vocab_size=100, end_token_ids=[0], max_rows=1))
