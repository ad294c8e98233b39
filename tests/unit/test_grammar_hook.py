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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from contract import bitmask_width
from grammar_backend.engine import GrammarEngine, GrammarEngineConfig
from grammar_backend.errors import GrammarError
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import EngineError
from llm_runtime.grammar_hook import GrammarRows, RowOutcome
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest, MaskStep
from tests.support.tiny_model import TinyModelInfo

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

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
             jump_forward: bool = False) -> MaskStep:
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
    hf = AutoTokenizer.from_pretrained(str(tiny.path), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tiny.vocab_size, stop_token_ids=[tiny.eos_token_id])
    g = GrammarEngine(info, "tiny", GrammarEngineConfig(max_batch=16))
    yield g
    assert g.active_count == 0, "a grammar sequence leaked"
    g.close()


@pytest.fixture
def provider(grammar: GrammarEngine) -> CountingProvider:
    return CountingProvider(grammar)


#: TensorRT-LLM pads its vocabulary (vocab_size_padded); the decoder's rows are this much wider.
PAD_WORDS = 2


@dataclass
class Guide:
    """``tllm.GuidedDecodingParams``: ``guide`` is the string the request was given."""

    guide: str


@dataclass
class Request:
    """What an ``LlmRequest`` shows the guided decoder, and its state in the executor."""

    request_id: int
    prompt: list[int]
    guide: Guide | None
    chunks: int = 1  # context chunks; the matcher starts at the last one
    tokens: list[int] = field(default_factory=list)  # prompt + generated (get_tokens(0))
    chunk: int = 0
    state: str = "context"  # context | generation | paused | complete
    seq_slot: int | None = None
    max_tokens: int = 48

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclass(slots=True)
class GuidedRequest:
    """TensorRT-LLM's ``GuidedRequest`` (the fields GrammarRows reads, the two predicates verbatim)."""

    guided_decoding_params: Guide | None
    request_id: int
    seq_slot: int | None
    is_context_init_state: bool
    is_last_context_chunk: bool
    is_generation_in_progress_state: bool
    new_token: int | None
    is_draft: bool = False
    draft_tokens: list[int] = field(default_factory=list)

    @classmethod
    def from_llm_request(cls, r: Request) -> GuidedRequest:
        ctx = r.state == "context"
        return cls(r.guide, r.request_id, r.seq_slot, ctx, ctx and r.chunk == r.chunks - 1,
                   r.state == "generation", r.tokens[-1])

    def require_matcher_init(self) -> bool:
        if self.guided_decoding_params is None or self.is_draft:
            return False
        return self.is_context_init_state and self.is_last_context_chunk

    def require_matcher_advance(self) -> bool:
        if self.guided_decoding_params is None or self.is_draft:
            return False
        return self.is_generation_in_progress_state


@dataclass
class GuidedRequests:
    """TensorRT-LLM's ``GuidedRequests`` (no draft tokens: one row per request)."""

    requests: list[GuidedRequest]
    num_contexts: int

    @property
    def num_bitmask_tokens(self) -> int:
        return len(self.requests)

    def valid_requests_with_offsets(self) -> Iterator[tuple[GuidedRequest, int]]:
        for offset, req in enumerate(self.requests):
            if req.guided_decoding_params is not None and req.seq_slot is not None:
                yield req, offset


def apply_rows(logits: torch.Tensor, bitmask: np.ndarray, token_mask: np.ndarray, vocab: int) -> None:
    """``GuidedDecoder.execute`` after the build: the ``logits_bitmask`` kernel, rows with token_mask 1 only."""
    rows = [i for i in range(logits.shape[0]) if token_mask[i]]
    if rows:
        xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask[: logits.shape[0]]), vocab_size=vocab,
                                        indices=rows)


class Executor:
    """TensorRT-LLM's PyTorch executor loop, in the order its sources give, over the real tiny model.

    ``overlap``: ``_executor_loop_overlap``: the forward of step N is launched
    with step N-1's sampled tokens still on the device; ``_update_requests``
    of the previous batch then lands them on the host (a request that ended
    there leaves the batch's generation state); ``add_batch`` is called again
    and ``execute`` builds and applies the masks; then step N samples.
    Without overlap (``_executor_loop``) the tokens land before the forward.
    """

    def __init__(self, engine: TorchEngine, rows: GrammarRows, *, overlap: bool, max_slots: int = 16) -> None:
        self.engine, self.rows, self.overlap = engine, rows, overlap
        width = bitmask_width(engine.vocab_size) + PAD_WORDS
        self.bitmask = np.full((max_slots, width), -1, dtype=np.int32)  # bitmask_host (stale rows on purpose)
        self.token_mask = np.ones(max_slots, dtype=np.int32)  # token_mask_host
        self.free = list(range(max_slots))
        self.builds = 0
        self.pause_at: dict[int, tuple[int, int]] = {}  # request id -> (generated count, steps paused)
        self._paused_for: dict[int, int] = {}

    def _update(self, reqs: list[Request], sampled: dict[int, int]) -> None:
        """``_update_requests``: the sampled tokens land; finished requests complete and free their slot."""
        for r in reqs:
            t = sampled.get(r.request_id)
            if t is None or r.state == "complete":
                continue
            r.tokens.append(t)
            if t in self.engine.eos_token_ids or len(r.generated) >= r.max_tokens:
                r.state = "complete"
                self.engine.release(r.request_id)
                if r.seq_slot is not None:
                    self.free.append(r.seq_slot)
                    r.seq_slot = None
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
            batch = [r for r in reqs if r.state == "context"] + [r for r in reqs if r.state == "generation"]
            if not batch and not pending:
                continue
            for r in batch:
                if r.seq_slot is None:
                    r.seq_slot = self.free.pop(0)
            # The forward (launched before the previous tokens reach the host under overlap).
            logits_rows: dict[int, torch.Tensor] = {}
            gen = [r for r in batch if r.state == "generation"]
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
            assert failed == []
            self.builds += 1
            logits = torch.stack([logits_rows.get(r.request_id, torch.zeros(self.engine.vocab_size)) for r in batch])
            apply_rows(logits, self.bitmask, self.token_mask, self.engine.vocab_size)
            for r in batch:
                if r.state == "context":
                    if r.chunk < r.chunks - 1:
                        r.chunk += 1  # an earlier chunk: no token sampled
                        continue
                    r.state = "generation"
                if r.state == "generation":
                    pending[r.request_id] = int(logits[batch.index(r)].argmax())
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


def view(seq: int | None, *, slot: int = 0, init: bool = True, token: int | None = None,
         draft: list[int] | None = None) -> GuidedRequests:
    req = GuidedRequest(None if seq is None else Guide(f"constrained-llm-sequence-{seq}"), 7, slot, init, init,
                        not init, token, draft_tokens=draft or [])
    return GuidedRequests([req], int(init))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown sequence", "no grammar sequence for this request"),
        ("draft tokens", "speculative decoding is not supported with the grammar model's constraints"),
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
    requests = view(99 if case == "unknown sequence" else 5, draft=[1] if case == "draft tokens" else None)
    assert rows.build(requests, bitmask, token_mask) == [(7, message)]
    allowed = {t for t in range(engine.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1}
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
    allowed = {t for t in range(engine.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1}
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
    allowed = {t for t in range(engine.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1}
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
