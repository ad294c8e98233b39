"""Scheduler: in-flight batching, constrained decoding through a real xgrammar MaskProvider.

The provider below is a real one (xgrammar compiler + one GrammarMatcher per
sequence over the tiny model's vocabulary), written directly on xgrammar so
these tests do not depend on grammar_backend.  It records every start and end,
so each test can check that no grammar state leaks.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from grammar_backend.errors import (
    CompileError,
    ConstraintError,
    DuplicateSequence,
    UnknownSequence,
)
from grammar_service.engine import GrammarEngine
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import Overloaded, RequestError, SchedulerClosed
from llm_runtime.grammar_phase import JumpPolicy
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.logprobs import TokenLogprobs, TokenText, forced
from llm_runtime.mask import ConstraintRequest, MaskStep
from llm_runtime.model_config import LlmModelConfig
from llm_runtime.scheduler import (
    FinishEvent,
    GenerationRequest,
    Scheduler,
    SchedulerConfig,
    TokenEvent,
)
from pipeline.finish import finish_json, read_finish
from standins.tiny_model import TinyModelInfo, build_tiny_llama, tiny_grammar
from tests.support.poll import poll
from triton_support.params import from_parameters

TIMEOUT = 60.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")



class XGrammarMaskProvider:
    """A MaskProvider on xgrammar: ``regex``, ``choice`` and ``json_schema`` constraints."""

    def __init__(self, compiler: xgr.GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.lock = threading.Lock()
        self.matchers: dict[int, xgr.GrammarMatcher] = {}
        self.started: list[int] = []
        self.ended: list[int] = []
        self.step_calls = 0
        self.start_gate: threading.Event | None = None  # when set by a test, start() waits for it

    def _compile(self, c: ConstraintRequest) -> xgr.CompiledGrammar:
        try:
            if c.kind == "regex":
                return self.compiler.compile_regex(c.payload)
            if c.kind == "choice":
                options = json.loads(c.payload)
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
            if c.kind == "json_schema":
                return self.compiler.compile_json_schema(c.payload, any_whitespace=False, separators=(",", ":"))
        except RuntimeError as err:
            raise CompileError("grammar", str(err).splitlines()[-1]) from err
        raise ConstraintError("grammar_type", f"unsupported kind {c.kind!r}")

    def start(self, seq_id: int, constraint: ConstraintRequest) -> str:
        if self.start_gate is not None and not self.start_gate.wait(TIMEOUT):
            raise TimeoutError("start gate never opened")
        matcher = xgr.GrammarMatcher(self._compile(constraint))
        with self.lock:
            if seq_id in self.matchers:
                raise DuplicateSequence(seq_id, "already active")
            self.matchers[seq_id] = matcher
            self.started.append(seq_id)
        return "xgrammar"

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        b = seq_ids.shape[0]
        bitmask = xgr.allocate_token_bitmask(b, self.vocab_size)
        terminated = np.zeros(b, dtype=bool)
        errors: list[str | None] = [None] * b
        with self.lock:
            self.step_calls += 1
            rows = [self.matchers.get(int(s)) for s in seq_ids]
        for i, m in enumerate(rows):
            if m is None:
                errors[i] = f"sequence {int(seq_ids[i])} is not active"
                continue
            for t in tokens[i, : counts[i]]:
                if not m.accept_token(int(t)):
                    errors[i] = f"token {int(t)} rejected"
                    break
            if errors[i] is not None:
                continue
            if m.is_terminated():
                terminated[i] = True
            else:
                m.fill_next_token_bitmask(bitmask, i)
        return MaskStep(bitmask.numpy(), terminated, tuple(errors))

    def end(self, seq_ids: Sequence[int]) -> None:
        with self.lock:
            for s in seq_ids:
                if s not in self.matchers:
                    raise UnknownSequence(s, "not active")
                del self.matchers[s]
                self.ended.append(s)

    def assert_no_leak(self) -> None:
        with self.lock:
            assert self.matchers == {}
            assert len(self.ended) == len(set(self.ended))  # end exactly once
            assert sorted(self.ended) == sorted(self.started)


class FaultyRowProvider(XGrammarMaskProvider):
    """The real provider, except that one sequence's row reports an error on its n-th step."""

    def __init__(self, compiler: xgr.GrammarCompiler, vocab_size: int, fail_payload: str, fail_at_step: int) -> None:
        super().__init__(compiler, vocab_size)
        self.fail_payload = fail_payload
        self.fail_seq: int | None = None
        self.fail_at_step = fail_at_step
        self.seen = 0

    def start(self, seq_id: int, constraint: ConstraintRequest) -> str:
        backend = super().start(seq_id, constraint)
        if constraint.payload == self.fail_payload:
            self.fail_seq = seq_id
        return backend

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        out = super().step(seq_ids, tokens, counts)
        errors = list(out.errors)
        for i, s in enumerate(seq_ids):
            if int(s) == self.fail_seq:
                self.seen += 1
                if self.seen == self.fail_at_step:
                    errors[i] = "injected row failure"
        return MaskStep(out.bitmask, out.terminated, tuple(errors))


@dataclass
class Result:
    events: list[TokenEvent | FinishEvent] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    first_token: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event: TokenEvent | FinishEvent) -> None:
        assert not self.done.is_set(), "event after FinishEvent"
        self.events.append(event)
        if isinstance(event, FinishEvent):
            self.done.set()
        elif event.token_ids:
            self.first_token.set()

    def wait(self) -> FinishEvent:
        assert self.done.wait(TIMEOUT), "request did not finish"
        fin = self.events[-1]
        assert isinstance(fin, FinishEvent)
        deltas = [e for e in self.events[:-1] if isinstance(e, TokenEvent)]
        assert len(deltas) == len(self.events) - 1
        assert "".join(e.text_delta for e in deltas) == fin.text
        return fin

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenEvent) for t in e.token_ids]


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


@pytest.fixture(scope="module")
def compiler(tiny: TinyModelInfo) -> xgr.GrammarCompiler:
    hf = AutoTokenizer.from_pretrained(str(tiny.path), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tiny.vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1)


@pytest.fixture
def provider(compiler: xgr.GrammarCompiler, tiny: TinyModelInfo) -> Iterator[XGrammarMaskProvider]:
    p = XGrammarMaskProvider(compiler, tiny.vocab_size)
    yield p
    p.assert_no_leak()


@pytest.fixture
def sched(engine: TorchEngine, provider: XGrammarMaskProvider) -> Iterator[Scheduler]:
    s = Scheduler(engine, provider, SchedulerConfig())
    yield s
    s.close()
    assert engine.live_count == 0


def prompt(engine: TorchEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text).ids


def submit(s: Scheduler, req: GenerationRequest) -> Result:
    r = Result()
    s.submit(req, r)
    return r


PROMPTS = [
    "hello world", "yes no", "the quick brown fox", "caf\u00e9", "0123", "{\"name\": 1}", "Stop here.", "emoji \U0001f600",
]


def test_eight_concurrent_requests_decode_in_one_batch(engine: TorchEngine, sched: Scheduler) -> None:
    reqs = [GenerationRequest(prompt(engine, p), max_tokens=12, temperature=0.0) for p in PROMPTS]
    alone = []
    for req in reqs:  # one at a time: the reference
        r = submit(sched, req)
        fin = r.wait()
        assert (fin.finish_reason, fin.completion_tokens) == ("length", 12)
        alone.append(r.token_ids)
    assert sched.stats().max_batch_size_seen == 1
    sched.reset_stats()
    results = [submit(sched, req) for req in reqs]
    fins = [r.wait() for r in results]
    assert sched.stats().max_batch_size_seen == 8
    assert [f.finish_reason for f in fins] == ["length"] * 8
    assert [r.token_ids for r in results] == alone
    assert [f.prompt_tokens for f in fins] == [len(r.prompt_token_ids) for r in reqs]


@pytest.mark.parametrize(
    ("lengths", "budget", "calls"),
    [
        ([8] * 7, 24, [[8, 8, 8], [8, 8, 8], [8]]),
        ([8, 16, 8, 8], 24, [[8], [16], [8, 8]]),  # two rows of 16 (the left-padded width) pass 24: the 16 alone
        ([40, 8, 8], 24, [("chunk to", 24), ("chunk to", 40), [8, 8]]),  # longer than the budget: alone, in chunks
        ([8] * 7, 1024, [[8] * 7]),
    ],
)
def test_prefill_budget_groups_the_joining_prompts(engine: TorchEngine, provider: XGrammarMaskProvider,
                                                   monkeypatch: pytest.MonkeyPatch, lengths: list[int],
                                                   budget: int, calls: list[Any]) -> None:
    """Ready requests join oldest first while rows x the longest prompt stays within max_prefill_tokens."""
    real_batch, real_chunk = engine.prefill_batch, engine.prefill_chunk
    gate = threading.Event()
    seen: list[Any] = []

    def prefill_batch(seq_ids: Sequence[int], prompts: Sequence[Any]) -> Any:
        seen.append([len(p) for p in prompts])
        if not gate.wait(TIMEOUT):  # the first request holds the loop until the others are queued
            raise TimeoutError("gate never opened")
        return real_batch(seq_ids, prompts)

    def prefill_chunk(seq_id: int, prompt_ids: Any, stop: int) -> Any:
        seen.append(("chunk to", stop))
        return real_chunk(seq_id, prompt_ids, stop)

    monkeypatch.setattr(engine, "prefill_batch", prefill_batch)
    monkeypatch.setattr(engine, "prefill_chunk", prefill_chunk)
    with Scheduler(engine, provider, SchedulerConfig(max_prefill_tokens=budget)) as s:
        first = submit(s, GenerationRequest([5] * 8, max_tokens=len(lengths) + 3, temperature=0.0))
        poll(lambda: len(seen), bool, TIMEOUT)
        results = [submit(s, GenerationRequest([7] * n, max_tokens=2, temperature=0.0)) for n in lengths]
        gate.set()
        assert [r.wait().finish_reason for r in (first, *results)] == ["length"] * (len(lengths) + 1)
    assert seen == [[8], *calls]
    assert engine.live_count == 0


def run_long_prompt(engine: TorchEngine, provider: XGrammarMaskProvider, budget: int,
                    cancel_first: bool = False) -> tuple[list[FinishEvent], list[list[int]], list[tuple[int, int]]]:
    """A short request decodes; then a short one and a 20-token constrained prompt arrive.

    Returns each request's finish and tokens, and (batch size, prefill rows) of the steps that prefilled.
    With ``cancel_first`` a first long request is cancelled while its first chunk runs.
    """
    long = [(3 * i) % 40 + 5 for i in range(20)]
    regex = ConstraintRequest("regex", "[ab]{40}", "")
    with Scheduler(engine, provider, SchedulerConfig(max_prefill_tokens=budget)) as s:
        running = submit(s, GenerationRequest(prompt(engine, "hello"), max_tokens=30, temperature=0.0))
        assert running.first_token.wait(TIMEOUT)
        if cancel_first:
            real = engine.prefill_chunk
            entered, gate = threading.Event(), threading.Event()

            def held(seq_id: int, prompt_ids: Any, stop: int) -> Any:
                entered.set()
                if not gate.wait(TIMEOUT):
                    raise TimeoutError("gate never opened")
                return real(seq_id, prompt_ids, stop)

            engine.prefill_chunk = held  # type: ignore[method-assign]
            try:
                victim = Result()
                rid = s.submit(GenerationRequest(long, constraint=regex, max_tokens=5), victim)
                assert entered.wait(TIMEOUT)
                assert s.cancel(rid)
                gate.set()
                assert victim.wait().status == "CANCELLED"
            finally:
                del engine.prefill_chunk
        before = s.stats().steps
        # The short one first: it joins at once, and whenever the long one's grammar start returns,
        # its prompt (20 tokens, past the bound) joins alone after it.
        results = [submit(s, GenerationRequest(prompt(engine, "yes no"), max_tokens=4, temperature=0.0)),
                   submit(s, GenerationRequest(long, constraint=regex, max_tokens=5, temperature=0.0))]
        fins = [r.wait() for r in (running, *results)]
        stats = s.stats()
    joins = stats.prefill_rows[before:] > 0
    return fins, [r.token_ids for r in (running, *results)], list(zip(
        stats.batch_size[before:][joins].tolist(), stats.prefill_rows[before:][joins].tolist(), strict=True))


@pytest.mark.parametrize("cancel_first", [False, True], ids=["plain", "first-cancelled-mid-chunk"])
def test_a_long_prompt_prefills_in_chunks_between_decode_steps(engine: TorchEngine, provider: XGrammarMaskProvider,
                                                               cancel_first: bool) -> None:
    """A prompt longer than max_prefill_tokens runs 8 + 8 + 4 tokens over three steps, each beside the
    decoding rows' forward, and samples (its grammar joins) at the third.  The tokens are those of one
    whole-prompt forward; a request cancelled mid-chunk frees its slot."""
    fins, tokens, joins = run_long_prompt(engine, provider, 8, cancel_first)
    ref_fins, ref_tokens, ref_joins = run_long_prompt(engine, provider, 1024)
    assert [f.finish_reason for f in fins] == ["length"] * 3
    assert tokens == ref_tokens and [f.text for f in fins] == [f.text for f in ref_fins]
    assert re.fullmatch("[ab]{5}", fins[2].text)
    # (rows sampled, prompts run): the short one joins; the two decoding rows beside each chunk; the last
    # chunk's row samples with them.
    assert joins == [(2, 1), (2, 1), (2, 1), (3, 1)]
    assert sum(rows for _, rows in ref_joins) == 2
    assert engine.live_count == 0


def test_a_failed_chunk_fails_only_its_request(engine: TorchEngine, provider: XGrammarMaskProvider,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward of a long prompt's second chunk fails: that request ends with the error, the decoding
    one goes on, and the next long prompt runs in chunks again (the failed one left no slot behind)."""
    real = engine._forward
    chunks = [0]

    def forward(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if tuple(input_ids.shape) == (1, 8):
            chunks[0] += 1
            if chunks[0] == 2:
                raise RuntimeError("device lost")
        return real(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", forward)
    long = [(3 * i) % 40 + 5 for i in range(20)]
    with Scheduler(engine, provider, SchedulerConfig(max_prefill_tokens=8)) as s:
        running = submit(s, GenerationRequest(prompt(engine, "hello"), max_tokens=30, temperature=0.0))
        assert running.first_token.wait(TIMEOUT)
        failed = submit(s, GenerationRequest(long, max_tokens=5, temperature=0.0))
        fin = failed.wait()
        assert (fin.finish_reason, fin.status, fin.error) == ("error", "INTERNAL", "prefill failed: device lost")
        again = submit(s, GenerationRequest(long, max_tokens=5, temperature=0.0))
        assert again.wait().completion_tokens == 5
        assert running.wait().finish_reason == "length"
    assert chunks[0] == 4 and engine.live_count == 0  # 8 + 8 (failed), then 8 + 8 (+ 4)


@pytest.mark.parametrize(("value", "budget"), [("", 256), ("512", 512)])  # unset: the CPU default
def test_the_llm_model_sets_the_prefill_budget(tiny: TinyModelInfo, provider: XGrammarMaskProvider, value: str,
                                               budget: int) -> None:
    config = from_parameters(LlmModelConfig, {"model_dir": str(tiny.path), "max_batch": "2", "max_seq_len": "320",
                                              "max_prefill_tokens": value}, "llm")
    gen = config.build(provider)
    try:
        assert isinstance(gen, Scheduler) and gen.config.max_prefill_tokens == budget
    finally:
        gen.close()

@pytest.mark.parametrize(
    ("kind", "payload", "temperature"),
    [
        ("regex", r"(yes|no|maybe), [0-9]{2}\.", 0.0),
        ("regex", r"(yes|no|maybe), [0-9]{2}\.", 1.0),
        ("regex", r"[a-c]{3}-[xyz]{1,2}!", 0.7),
        ("regex", r"\{\"n\": [1-9][0-9]?\}", 0.0),
        ("regex", "caf\u00e9 [\U0001f600\U0001f680]", 1.0),
        ("choice", json.dumps(["red", "green", "blue sky"]), 0.0),
        ("choice", json.dumps(["red", "green", "blue sky"]), 2.0),
    ],
)
def test_mixed_constrained_and_free_requests_share_a_batch(
    engine: TorchEngine, sched: Scheduler, provider: XGrammarMaskProvider, kind: str, payload: str, temperature: float
) -> None:
    constraint = ConstraintRequest(kind, payload, "")
    constrained = [
        submit(sched, GenerationRequest(prompt(engine, p), constraint=constraint, max_tokens=64,
                                        temperature=temperature, seed=i))
        for i, p in enumerate(PROMPTS[:4])
    ]
    free = [submit(sched, GenerationRequest(prompt(engine, p), max_tokens=20, temperature=temperature, seed=9))
            for p in PROMPTS[4:]]
    for r in constrained:
        fin = r.wait()
        assert fin.finish_reason == "stop", fin
        if kind == "regex":
            assert re.fullmatch(payload, fin.text), fin.text
        else:
            assert fin.text in json.loads(payload)
        # The end token was sampled (forced by the grammar) and counted, not streamed.
        assert fin.completion_tokens == len(r.token_ids) + 1
        assert engine.tokenizer.decode(r.token_ids) == fin.text
    for r in free:
        assert r.wait().finish_reason == "length"
    stats = sched.stats()
    assert stats.max_batch_size_seen == 8
    with_grammar = stats.constrained_rows > 0
    assert with_grammar.any()
    assert np.all(stats.grammar_s[with_grammar] > 0)
    assert np.all(stats.mask_wait_s[with_grammar] >= 0)
    # The loop's own grammar time holds the wait for the answer, and more (the request, masking).
    assert np.all(stats.grammar_loop_s[with_grammar] > stats.mask_wait_s[with_grammar])
    assert np.all(np.isnan(stats.grammar_s[~with_grammar]))
    assert np.all(np.isnan(stats.grammar_loop_s[~with_grammar]))
    assert np.all(stats.forward_s > 0)
    assert len(provider.started) == 4


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
@pytest.mark.parametrize("constrained", [False, True])
def test_max_tokens_gives_length(engine: TorchEngine, sched: Scheduler, max_tokens: int, constrained: bool) -> None:
    c = ConstraintRequest("regex", "[a-z]+", "") if constrained else None
    r = submit(sched, GenerationRequest(prompt(engine, "hello"), constraint=c, max_tokens=max_tokens, temperature=0.0))
    fin = r.wait()
    assert (fin.finish_reason, fin.completion_tokens, len(r.token_ids)) == ("length", max_tokens, max_tokens)
    if constrained:
        assert re.fullmatch("[a-z]+", fin.text)


@pytest.mark.parametrize(("start", "length"), [(0, 1), (3, 2), (6, 4)])
def test_stop_string_cuts_the_output(engine: TorchEngine, sched: Scheduler, start: int, length: int) -> None:
    base = GenerationRequest(prompt(engine, "the quick brown fox"), max_tokens=24, temperature=0.0)
    full = submit(sched, base).wait().text
    stop = full[start : start + length]
    assert len(stop) == length
    cut = full.find(stop)
    r = submit(sched, GenerationRequest(base.prompt_token_ids, max_tokens=24, temperature=0.0, stop=(stop, "\x00")))
    fin = r.wait()
    assert (fin.finish_reason, fin.text, fin.stop_string) == ("stop", full[:cut], True)
    assert fin.completion_tokens == len(r.token_ids) < 24


def test_finish_event_reaches_postprocessing_unchanged(engine: TorchEngine, sched: Scheduler) -> None:
    # The scheduler's FinishEvent, serialized as the llm model does, is what postprocessing reads back.
    constraint = {"kind": "regex", "payload": "[a-z]+", "options": ""}
    c = ConstraintRequest(constraint["kind"], constraint["payload"], constraint["options"])
    fin = submit(sched, GenerationRequest(prompt(engine, "hello"), constraint=c, max_tokens=3, temperature=0.0)).wait()
    assert (fin.finish_reason, fin.completion_tokens) == ("length", 3)
    assert read_finish(finish_json(fin, constraint).encode()) == (fin, constraint)


def test_start_error_only_affects_its_request(
    engine: TorchEngine, sched: Scheduler, provider: XGrammarMaskProvider
) -> None:
    bad = submit(sched, GenerationRequest(prompt(engine, "a"), constraint=ConstraintRequest("regex", "(ab", ""),
                                          max_tokens=8))
    unsupported = submit(sched, GenerationRequest(prompt(engine, "a"), constraint=ConstraintRequest("lark", "x", ""),
                                                  max_tokens=8))
    good = submit(sched, GenerationRequest(prompt(engine, "b"), constraint=ConstraintRequest("regex", "ok|fine", ""),
                                           max_tokens=8))
    free = submit(sched, GenerationRequest(prompt(engine, "c"), max_tokens=8, temperature=0.0))
    fin = bad.wait()
    assert (fin.finish_reason, fin.status, fin.completion_tokens, fin.text) == ("error", "INVALID_ARGUMENT", 0, "")
    assert fin.error is not None and fin.error.startswith("grammar: ")
    assert fin.error.endswith("Regex parsing error at position 4: The parenthesis is not closed.")
    fin = unsupported.wait()
    assert (fin.finish_reason, fin.status, fin.error) == (
        "error", "INVALID_ARGUMENT", "grammar_type: unsupported kind 'lark'")
    assert good.wait().finish_reason == "stop"
    assert free.wait().finish_reason == "length"
    assert len(provider.started) == 1  # end is called for started sequences only (checked on teardown)


def test_row_error_only_affects_its_sequence(engine: TorchEngine, compiler: xgr.GrammarCompiler,
                                             tiny: TinyModelInfo) -> None:
    provider = FaultyRowProvider(compiler, tiny.vocab_size, fail_payload="[a-y]{30}", fail_at_step=3)
    with Scheduler(engine, provider) as s:
        c = ConstraintRequest("regex", "[a-z]{30}", "")
        victim = submit(s, GenerationRequest(prompt(engine, "x"), constraint=ConstraintRequest("regex", "[a-y]{30}", ""),
                                             max_tokens=40))
        other = submit(s, GenerationRequest(prompt(engine, "y"), constraint=c, max_tokens=40))
        free = submit(s, GenerationRequest(prompt(engine, "z"), max_tokens=10, temperature=0.0))
        fin = victim.wait()
        assert (fin.finish_reason, fin.error, fin.status) == ("error", "injected row failure", "INTERNAL")
        assert fin.completion_tokens == 2  # two tokens were accepted before its third step failed
        fin = other.wait()
        assert fin.finish_reason == "stop" and re.fullmatch("[a-z]{30}", fin.text)
        assert free.wait().finish_reason == "length"
    provider.assert_no_leak()


@pytest.mark.parametrize("stage", ["compiling", "waiting", "decoding"])
def test_cancel_frees_the_grammar_sequence(
    engine: TorchEngine, compiler: xgr.GrammarCompiler, tiny: TinyModelInfo, stage: str
) -> None:
    provider = XGrammarMaskProvider(compiler, tiny.vocab_size)
    # Waiting: a quick compile (the victim never decodes); else long enough not to finish before the cancel.
    c = ConstraintRequest("regex", "[a-z]+" if stage == "waiting" else "[a-z]{250}", "")
    with Scheduler(engine, provider, SchedulerConfig(max_batch_size=1)) as s:
        # Once the victim is compiled, the blocker's next event holds the loop
        # until the victim is cancelled: it really waits outside the busy batch.
        gate = threading.Event()
        blocker = Result()

        def held(event: TokenEvent | FinishEvent) -> None:
            blocker(event)
            if provider.started and not gate.is_set():
                assert gate.wait(TIMEOUT)

        blocker_rid = ""
        if stage == "compiling":
            provider.start_gate = threading.Event()
        elif stage == "waiting":  # the batch (size 1) is busy: the compiled request waits outside it
            blocker_rid = s.submit(GenerationRequest(prompt(engine, "b"), max_tokens=250), held)
            assert blocker.first_token.wait(TIMEOUT)
        victim = Result()
        rid = s.submit(GenerationRequest(prompt(engine, "a"), constraint=c, max_tokens=250), victim)
        if stage == "decoding":
            assert victim.first_token.wait(TIMEOUT)
        elif stage == "waiting":
            poll(lambda: provider.started, bool, TIMEOUT, interval_s=0.005)
            assert provider.started and s.active_count == 1
        assert s.cancel(rid)
        gate.set()
        fin = victim.wait()
        assert (fin.finish_reason, fin.status, fin.error) == ("error", "CANCELLED", "request cancelled")
        assert fin.completion_tokens < 250
        assert not s.cancel(rid)  # no longer in flight
        if provider.start_gate is not None:
            provider.start_gate.set()  # the compile finishes after the cancel: its state is freed then
        if blocker_rid:
            assert s.cancel(blocker_rid)
            assert blocker.wait().status == "CANCELLED"
        poll(lambda: provider.ended, bool, TIMEOUT, interval_s=0.005)
        assert len(provider.started) == 1
        provider.assert_no_leak()
        assert s.live_count == 0


def test_compile_never_stalls_the_batch(engine: TorchEngine, sched: Scheduler, provider: XGrammarMaskProvider) -> None:
    provider.start_gate = threading.Event()
    slow = submit(sched, GenerationRequest(prompt(engine, "a"), constraint=ConstraintRequest("regex", "ok", ""),
                                           max_tokens=8))
    fast = submit(sched, GenerationRequest(prompt(engine, "b"), max_tokens=10, temperature=0.0))
    assert fast.wait().finish_reason == "length"
    assert not slow.done.is_set() and provider.started == []
    provider.start_gate.set()
    fin = slow.wait()
    assert (fin.finish_reason, fin.text) == ("stop", "ok")


#: How long the held step lasts at least: twice start_wait_s's most (1 s), so the start wait after it
#: (at most half the last step) is the full second, many times what a cached start takes.
HELD_STEP_S = 2.0


class HeldStep(XGrammarMaskProvider):
    """The real provider, whose next step, once armed, is held until the test releases it.

    Requests submitted while the step is held all arrive at its end, one
    boundary, whatever the machine's speed; the step lasts at least
    :data:`HELD_STEP_S`, the step time the scheduler's start wait is half of.
    """

    def __init__(self, compiler: xgr.GrammarCompiler, vocab_size: int) -> None:
        super().__init__(compiler, vocab_size)
        self.armed = False
        self.held = threading.Event()  # set once the armed step has begun
        self.release = threading.Event()

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        if self.armed:
            self.armed = False
            began = time.monotonic()
            self.held.set()
            assert self.release.wait(TIMEOUT), "the held step was never released"
            time.sleep(max(0.0, HELD_STEP_S - (time.monotonic() - began)))
        return super().step(seq_ids, tokens, counts)


@pytest.mark.parametrize(("start_wait_s", "gated", "joins"), [
    (1.0, False, [1, 2]),  # the cached start ends within the wait: both requests join the same step
    (0.0, False, [1, 1, 1]),  # no wait: the constrained one joins a step later
    (1.0, True, [1, 1, 1]),  # a start still running does not hold the step past the wait
], ids=["waited", "no-wait", "compiling"])
def test_a_fast_start_joins_the_step_its_request_arrived_for(engine: TorchEngine, compiler: xgr.GrammarCompiler,
                                                             tiny: TinyModelInfo, start_wait_s: float, gated: bool,
                                                             joins: list[int]) -> None:
    provider = HeldStep(compiler, tiny.vocab_size)
    regex = ConstraintRequest("regex", "[ab]{40}", "")
    with Scheduler(engine, provider, SchedulerConfig(start_wait_s=start_wait_s)) as s:
        submit(s, GenerationRequest(prompt(engine, "warm"), constraint=regex, max_tokens=2)).wait()  # compiled once
        before = s.stats().steps
        provider.armed = True  # the next step (the running request's first, its prefill row the first 1) is held
        running = submit(s, GenerationRequest(prompt(engine, "x"), constraint=regex, max_tokens=12))
        assert provider.held.wait(TIMEOUT)
        provider.start_gate = threading.Event() if gated else None
        # Both arrive while the step is held, so at the same boundary.
        late = submit(s, GenerationRequest(prompt(engine, "y"), constraint=regex, max_tokens=3))
        free = submit(s, GenerationRequest(prompt(engine, "z"), max_tokens=3, temperature=0.0))
        provider.release.set()
        assert free.wait().finish_reason == "length"
        if provider.start_gate is not None:
            provider.start_gate.set()
        assert late.wait().completion_tokens == 3
        running.wait()
        stats = s.stats()
    prefill = stats.prefill_rows[before:]
    assert prefill[prefill > 0].tolist() == joins
    provider.assert_no_leak()


def test_seed_reproduces_whatever_the_batch(engine: TorchEngine, sched: Scheduler) -> None:
    req = GenerationRequest(prompt(engine, "hello world"), max_tokens=16, temperature=1.0, seed=1234)
    alone = submit(sched, req)
    alone.wait()
    crowd = [submit(sched, GenerationRequest(prompt(engine, p), max_tokens=16, temperature=1.0))
             for p in PROMPTS[:3]]
    again = submit(sched, req)
    again.wait()
    for r in crowd:
        r.wait()
    assert again.token_ids == alone.token_ids
    other = submit(sched, GenerationRequest(req.prompt_token_ids, max_tokens=16, temperature=1.0, seed=1235))
    other.wait()
    assert other.token_ids != alone.token_ids


def test_callback_error_cancels_only_that_request(engine: TorchEngine, sched: Scheduler,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    calls: list[TokenEvent | FinishEvent] = []

    def broken(event: TokenEvent | FinishEvent) -> None:
        calls.append(event)
        if len(calls) == 1:  # the first event is a TokenEvent
            raise ConnectionError("client went away")

    c = ConstraintRequest("regex", "[a-z]{40}", "")
    sched.submit(GenerationRequest(prompt(engine, "a"), constraint=c, max_tokens=40), broken)
    # Greedy: the end token's logit is 0 against tops near +5, so only sampling could end it early.
    ok = submit(sched, GenerationRequest(prompt(engine, "b"), max_tokens=30, temperature=0.0))
    assert ok.wait().finish_reason == "length"
    poll(lambda: sched.live_count, lambda live: live == 0, TIMEOUT, interval_s=0.005)
    fin = calls[-1]
    assert isinstance(fin, FinishEvent) and fin.status == "CANCELLED"
    assert len(calls) <= 3
    assert "event callback of request" in caplog.text


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"max_tokens": 0}, RequestError, r"max_tokens: must be a positive integer, got 0"),
        ({"max_tokens": True}, RequestError, r"max_tokens: must be a positive integer, got True"),
        # No cap of its own (preprocessing's max_tokens_limit is the bound): only the context limits it.
        ({"max_tokens": 319}, RequestError,
         r"max_tokens: prompt \(2 tokens\) \+ max_tokens \(319\) exceed the context length 320"),
        ({"max_tokens": 250, "prompt_token_ids": [5] * 100}, RequestError,
         r"max_tokens: prompt \(100 tokens\) \+ max_tokens \(250\) exceed the context length 320"),
        ({"prompt_token_ids": []}, RequestError, "prompt_token_ids: must not be empty"),
        ({"prompt_token_ids": [5, 448]}, RequestError, r"prompt_token_ids: ids must be in \[0, 448\), got \[5, 448\]"),
        ({"prompt_token_ids": ["a"]}, RequestError, "prompt_token_ids: must be a sequence of integers"),
        # The request contract's ranges (contract.check_sampling), as preprocessing applies them.
        ({"temperature": -1.0}, RequestError, r"temperature: must be a number in 0\.\.2, got -1\.0"),
        ({"temperature": 2.5}, RequestError, r"temperature: must be a number in 0\.\.2, got 2\.5"),
        ({"temperature": math.nan}, RequestError, r"temperature: must be a number in 0\.\.2, got nan"),
        ({"top_p": 0.0}, RequestError, r"top_p: must be a number in \(0, 1\], got 0\.0"),
        ({"top_k": -2}, RequestError, r"top_k: must be an integer in 0\.\.\d+ \(0 = off\), got -2"),
        ({"seed": -5}, RequestError, r"seed: must be an integer in \[0, 2\*\*64\), got -5"),
        ({"stop": ("",)}, RequestError, r"stop\[0\]: must be a non-empty string"),
        ({"stop": ("x" * 300,)}, RequestError, r"stop\[0\]: is 300 characters; at most 256"),
        ({"stop": tuple("abcdefghi")}, RequestError, "stop: at most 8 stop strings, got 9"),
        ({"constraint": "regex"}, RequestError, "constraint: must be a ConstraintRequest or None, got str"),
        ({"request_id": ""}, RequestError, "request_id: must be a non-empty string or None"),
    ],
)
def test_submit_rejects_bad_requests(
    engine: TorchEngine, sched: Scheduler, changes: dict[str, object], error: type[Exception], match: str
) -> None:
    fields: dict[str, object] = {"prompt_token_ids": [5, 6], "max_tokens": 4}
    fields.update(changes)
    with pytest.raises(error, match=match):
        sched.submit(GenerationRequest(**fields), Result())  # type: ignore[arg-type]
    assert sched.live_count == 0


def test_duplicate_request_id_and_overload(engine: TorchEngine, provider: XGrammarMaskProvider) -> None:
    provider.start_gate = threading.Event()
    c = ConstraintRequest("regex", "ok", "")
    with Scheduler(engine, provider, SchedulerConfig(max_queued=2)) as s:
        a = Result()
        assert s.submit(GenerationRequest([5], request_id="r1", constraint=c, max_tokens=4), a) == "r1"
        with pytest.raises(RequestError, match="request_id: 'r1' is already in flight"):
            s.submit(GenerationRequest([5], request_id="r1", max_tokens=4), Result())
        b = Result()
        assert s.submit(GenerationRequest([5], constraint=c, max_tokens=4), b).startswith("req-")
        with pytest.raises(Overloaded, match=r"2 requests are queued \(max_queued 2\)"):
            s.submit(GenerationRequest([5], max_tokens=4), Result())
        provider.start_gate.set()
        assert a.wait().text == b.wait().text == "ok"


def test_close_fails_what_is_left(engine: TorchEngine, provider: XGrammarMaskProvider) -> None:
    provider.start_gate = threading.Event()
    s = Scheduler(engine, provider)
    compiling = submit(s, GenerationRequest([5], constraint=ConstraintRequest("regex", "[a-z]{200}", ""),
                                            max_tokens=200))
    running = submit(s, GenerationRequest([6], max_tokens=250))
    assert running.first_token.wait(TIMEOUT)
    threading.Timer(0.2, provider.start_gate.set).start()  # the compile completes while closing
    s.close()
    for r in (compiling, running):
        fin = r.wait()
        assert (fin.finish_reason, fin.status) == ("error", "UNAVAILABLE")
    with pytest.raises(SchedulerClosed, match="the scheduler is closed"):
        s.submit(GenerationRequest([5], max_tokens=4), Result())
    assert engine.live_count == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch_size": 9}, "scheduler.max_batch_size: 9 exceeds the engine's 8 cache slots"),
        ({"max_batch_size": 0}, "scheduler.max_batch_size: must be a positive integer"),
        ({"idle_wait_s": 0}, r"scheduler.idle_wait_s: must be in \(0, 10\] seconds"),
        ({"start_threads": 0}, "scheduler.start_threads: must be a positive integer"),
        ({"max_prefill_tokens": 0}, "scheduler.max_prefill_tokens: must be a positive integer"),
        ({"max_jump_tokens": -1}, r"scheduler.max_jump_tokens: must be an integer in 0\.\.256, got -1"),
        ({"max_jump_tokens": 257}, r"scheduler.max_jump_tokens: must be an integer in 0\.\.256, got 257"),
    ],
)
def test_scheduler_config_rejects(engine: TorchEngine, provider: XGrammarMaskProvider,
                                  kwargs: dict[str, object], match: str) -> None:
    from grammar_backend.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        Scheduler(engine, provider, SchedulerConfig(**kwargs))  # type: ignore[arg-type]


def test_ids_are_unguessable(engine: TorchEngine, provider: XGrammarMaskProvider) -> None:
    """Request and grammar sequence ids are random, not counters (no client can name another's)."""
    with Scheduler(engine, provider) as s:
        results = [submit(s, GenerationRequest([5], constraint=ConstraintRequest("regex", "ok", ""), max_tokens=4))
                   for _ in range(4)]
        rids = [s.submit(GenerationRequest([5], max_tokens=1), Result()) for _ in range(2)]
        for r in results:
            r.wait()
    ids = provider.started
    assert len(set(ids)) == 4 and all(0 < sid < 2**64 for sid in ids)
    assert max(ids) - min(ids) > 2**32  # a counter would give neighbours
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", rid) for rid in rids) and rids[0] != rids[1]


def test_tiny_checkpoint_is_a_plain_folder(tmp_path: Path) -> None:
    """The tiny checkpoint loads from a plain folder (nothing is downloaded)."""
    info = build_tiny_llama(tmp_path / "m", num_layers=1)
    assert sorted(p.name for p in info.path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tiny_model.json",
        "tokenizer.json", "tokenizer_config.json",
    ]


@pytest.mark.parametrize(
    ("kind", "payload", "pattern"),
    [
        ("regex", "[a-z]{2,6}", r"[a-z]{2,6}"),
        ("choice", '["north", "south"]', r"north|south"),
        ("json_schema", ('{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],'
                        '"additionalProperties":false}'), r'\{"n":-?[0-9]+\}'),
    ],
)
def test_scheduler_over_the_real_grammar_engine(engine: TorchEngine, tiny: TinyModelInfo, kind: str, payload: str,
                                                pattern: str) -> None:
    """The in-process composition the Triton models split across BLS: Scheduler + LocalMaskProvider(GrammarEngine)."""
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            results = [submit(s, GenerationRequest(prompt(engine, p), constraint=ConstraintRequest(kind, payload, ""),
                                                   max_tokens=40, temperature=0.8, seed=i))
                       for i, p in enumerate(PROMPTS[:4])]
            finals = [r.wait() for r in results]
        for fin in finals:
            # Budget closing (the default): an output that would run out of tokens
            # is closed with a valid ending, reported as "length" + "budget".
            assert re.fullmatch(pattern, fin.text), fin.text
            if fin.finish_reason == "length":
                assert fin.close_reason == "budget" and fin.completion_tokens <= 40
            else:
                assert (fin.finish_reason, fin.close_reason) == ("stop", None)
        assert any(f.finish_reason == "stop" for f in finals)
        assert grammar.active_count == 0
    finally:
        grammar.close()


@pytest.mark.parametrize("on_budget", ["close", "truncate"])
def test_budget_closing_through_the_scheduler(engine: TorchEngine, tiny: TinyModelInfo, on_budget: str) -> None:
    """A random model never closes its string in 12 tokens: "close" ends every output validly, "truncate" none."""
    grammar = tiny_grammar(tiny)
    schema = '{"type":"object","properties":{"s":{"type":"string"}},"required":["s"],"additionalProperties":false}'
    # No jump-forward: it would spell '{"s":"' in fewer tokens than the random model does.
    options = json.dumps({"on_budget": on_budget, "on_repeat": "continue", "jump_forward": False})
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            results = [submit(s, GenerationRequest(prompt(engine, "x"), max_tokens=12, temperature=1.0, seed=i,
                                                   constraint=ConstraintRequest("json_schema", schema, options)))
                       for i in range(4)]
            finals = [r.wait() for r in results]
        assert all(f.finish_reason == "length" for f in finals)
        if on_budget == "close":
            for fin in finals:
                assert fin.close_reason == "budget" and fin.completion_tokens <= 12
                assert set(json.loads(fin.text)) == {"s"}
        else:
            assert [(f.close_reason, f.completion_tokens) for f in finals] == [(None, 12)] * 4
        assert grammar.active_count == 0
    finally:
        grammar.close()


#: Four distinct items of four values: a random model repeats one almost always.
PERMUTATION = json.dumps({"type": "array", "items": {"enum": [0, 1, 2, 3]}, "minItems": 4, "maxItems": 4,
                          "uniqueItems": True})


@pytest.mark.parametrize("retries", [0, 8])
def test_value_checks_retry_repeated_items(engine: TorchEngine, tiny: TinyModelInfo, retries: int) -> None:
    """uniqueItems is in no grammar: without retries most outputs repeat an item; with them every output is a
    permutation, the dropped tokens never reach the stream (Result.wait: the deltas add up to the text), and
    the cache and the grammar side are left clean."""
    grammar = tiny_grammar(tiny)
    options = json.dumps({"value_retries": retries})
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            results = [submit(s, GenerationRequest(prompt(engine, "x"), max_tokens=40, temperature=1.0, seed=i,
                                                   constraint=ConstraintRequest("json_schema", PERMUTATION, options)))
                       for i in range(8)]
            finals = [r.wait() for r in results]
        items = [json.loads(f.text) for f in finals]
        assert all(f.finish_reason == "stop" and len(i) == 4 for f, i in zip(finals, items, strict=True))
        unique = [len(set(i)) == 4 for i in items]
        if retries:
            # (retries + 1: past the budget, one more drop closes the output, on_repeat: close.)
            assert all(unique) and all(0 < f.value_retries <= retries + 1 for f in finals)
            assert all(f.value_dropped_tokens >= 2 * f.value_retries for f in finals)  # an item and its comma
            assert all(f.completion_tokens == len(r.token_ids) + 1 for f, r in zip(finals, results, strict=True))
        else:
            assert sum(unique) < 4 and all(f.value_retries == 0 for f in finals)
        assert grammar.active_count == 0 and engine.live_count == 0
    finally:
        grammar.close()


#: A schema whose keys are long forced runs: jump-forward spells them without sampling.
JUMP_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"identification_number": {"type": "integer"}, "classification_label": {"enum": ["A", "B"]}},
    "required": ["identification_number", "classification_label"], "additionalProperties": False,
})
JUMP_PATTERN = r'\{"identification_number":-?[0-9]+,"classification_label":"[AB]"\}'


@pytest.mark.parametrize(
    ("jump_option", "max_jump", "jumps"),
    [(True, 16, True), (False, 16, False), (True, 0, False), (True, 3, True)],
    ids=["on", "option-off", "server-off", "capped"],
)
def test_jump_forward_appends_forced_text_in_fewer_forwards(
    engine: TorchEngine, tiny: TinyModelInfo, jump_option: bool, max_jump: int, jumps: bool
) -> None:
    """Forced runs come as multi-token events without sampling; the grammar accepts them (the
    output matches), every token is counted, and the steps run are fewer than the tokens."""
    grammar = tiny_grammar(tiny)
    # No value checks: they hold a key's tokens back until it is whole, so events would be wide without jumps.
    options = json.dumps({"jump_forward": jump_option, "on_repeat": "continue", "value_retries": 0})
    try:
        with Scheduler(engine, LocalMaskProvider(grammar),
                       SchedulerConfig(max_batch_size=8, max_jump_tokens=max_jump)) as s:
            results = [submit(s, GenerationRequest(prompt(engine, p), max_tokens=120, temperature=0.7, seed=i,
                                                   constraint=ConstraintRequest("json_schema", JUMP_SCHEMA, options)))
                       for i, p in enumerate(PROMPTS[:3])]
            finals = [r.wait() for r in results]
            stats = s.stats()
        for r, fin in zip(results, finals, strict=True):
            assert re.fullmatch(JUMP_PATTERN, fin.text), fin.text
            assert fin.completion_tokens == len(r.token_ids) + 1  # + the end token, never streamed
            widest = max(len(e.token_ids) for e in r.events if isinstance(e, TokenEvent))
            assert (widest > 1) is jumps
            assert widest <= max(1, max_jump)
        assert int(stats.output_tokens.sum()) == sum(f.completion_tokens for f in finals)
        jumped = sum(len(e.token_ids) for r in results for e in r.events
                     if isinstance(e, TokenEvent) and len(e.token_ids) > 1)
        assert int(stats.jump_tokens.sum()) == jumped
        assert grammar.active_count == 0 and grammar.jump is not None
        assert (grammar.jump.stats.jumps > 0) is jumps
    finally:
        grammar.close()


def test_the_first_forced_run_streams_in_its_own_step(engine: TorchEngine, tiny: TinyModelInfo) -> None:
    """Value checks hold what they may drop, but not the output's opening `{"identification_number":`:
    the grammar says it is safe, so it streams in the step that forced it (time to first token)."""
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            seen: list[tuple[int, tuple[int, ...], str]] = []
            r = Result()

            def on_event(event: TokenEvent | FinishEvent) -> None:
                if isinstance(event, TokenEvent) and not seen:
                    seen.append((s.stats().steps, event.token_ids, event.text_delta))
                r(event)

            s.submit(GenerationRequest(prompt(engine, "x"), max_tokens=60, temperature=0.0,
                                       constraint=ConstraintRequest("json_schema", JUMP_SCHEMA, "")), on_event)
            fin = r.wait()
        assert fin.finish_reason in ("stop", "length") and re.fullmatch(JUMP_PATTERN, fin.text)
        (steps_before, tokens, text), = seen
        # At most max_jump_tokens (16) of the 20 forced tokens are taken in a step.
        assert steps_before == 0 and len(tokens) == 16 and '{"identification_number":'.startswith(text)
        assert text.startswith('{"identif')
    finally:
        grammar.close()


@pytest.mark.parametrize(("schema", "first"), [
    ({"type": "array", "items": {"type": "integer"}}, "["),  # a one-token forced run: sampled, not jumped
    ({"type": "array", "items": {"type": "string", "format": "date"}}, "["),  # items checked, `[` is not
])
def test_a_one_token_forced_run_streams_in_the_step_that_samples_it(engine: TorchEngine, tiny: TinyModelInfo,
                                                                    schema: dict[str, Any], first: str) -> None:
    """The output's first forced run is safe from value checks however long it is: a single forced token
    (not worth a jump) streams in the step that samples it, not a step later.  (Where the model samples a
    longer token than the forced run, `{"` for a forced `{`, it is held a step, as any sampled token.)"""
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            seen: list[tuple[int, str]] = []
            r = Result()

            def on_event(event: TokenEvent | FinishEvent) -> None:
                if isinstance(event, TokenEvent) and not seen:
                    seen.append((s.stats().steps, event.text_delta))
                r(event)

            s.submit(GenerationRequest(prompt(engine, "x"), max_tokens=40, temperature=0.0,
                                       constraint=ConstraintRequest("json_schema", json.dumps(schema), "")), on_event)
            fin = r.wait()
        assert fin.text.startswith(first)
        assert seen == [(0, first)]  # streamed before the stats counted the step that sampled it
    finally:
        grammar.close()


def test_a_stop_string_inside_a_jump_cuts_it(engine: TorchEngine, tiny: TinyModelInfo) -> None:
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            r = submit(s, GenerationRequest(prompt(engine, "x"), max_tokens=60, temperature=0.0, stop=("cation_n",),
                                            constraint=ConstraintRequest("json_schema", JUMP_SCHEMA, "")))
            fin = r.wait()
        assert (fin.finish_reason, fin.stop_string, fin.text) == ("stop", True, '{"identifi')
        assert fin.completion_tokens == len(r.token_ids)
        assert grammar.active_count == 0
    finally:
        grammar.close()


@pytest.mark.parametrize(
    ("lengths", "rows", "fill", "measured", "width"),
    [
        ([8], 1, 0.25, {}, 8),  # alone: any jump pays
        ([8], 4, 0.25, {}, 8),  # 7 forced of 28 padded positions: exactly break-even (the wider on a tie)
        ([8], 8, 0.25, {}, 0),  # 7 of 56: dropped
        ([8, 8], 8, 0.25, {}, 8),  # two rows: 14 of 56
        ([8, 3], 6, 0.25, {}, 3),  # width 3: 10 tokens for 1.5 (6.7 a unit); 5: 12 for 2 (6.0); 8: 15 for 2.75
        ([2, 2, 2], 16, 0.25, {}, 0),
        ([5], 16, 0.0, {}, 5),  # 0: free until measured
        ([4] * 8, 16, 0.25, {}, 4),  # the prior: 40 tokens for 1.75
        ([4] * 8, 16, 0.25, {4: 3.0}, 3),  # measured at width 4: 40 for 3.0; width 3 keeps the prior: 32 for 1.5
        ([8], 8, 0.25, {8: 1.05}, 8),  # a GPU-like engine: a wide forward costs about one narrow one
        ([2] * 4, 16, 0.25, {}, 2),  # the prior: 20 tokens for 1.25, break-even
        ([2] * 4, 16, 0.25, {2: 1.42}, 0),  # the tiny stand-in on the CPU: 20 tokens for 1.42 < 16 for 1
    ],
)
def test_jump_policy(lengths: list[int], rows: int, fill: float, measured: dict[int, float], width: int) -> None:
    policy = JumpPolicy(fill)
    policy.record(rows, 2, 0.005)  # no one-token base yet: nothing to compare with, ignored
    assert policy.cost(rows, 2) == 1 + fill
    if measured:
        policy.record(rows, 1, 0.002)
    for k, ratio in measured.items():
        policy.record(rows, k, 0.002 * ratio)
        assert policy.cost(rows, k) == pytest.approx(ratio)
    assert policy.width(lengths, rows) == width


def test_jump_policy_averages_what_it_measures() -> None:
    policy = JumpPolicy(0.25)
    policy.record(4, 1, 0.010)
    policy.record(4, 1, 0.020)  # moving average: 0.010 + 0.1 * 0.010
    policy.record(4, 3, 0.022)
    assert policy.cost(4, 3) == pytest.approx(2.0)
    policy.record(4, 3, 0.033)  # ratio 3.0 -> 2.0 + 0.1 * 1.0
    assert policy.cost(4, 3) == pytest.approx(2.1)
    assert (policy.cost(4, 1), policy.cost(8, 3)) == (1.0, 1.5)  # other batch sizes keep the prior


class CountingProvider(LocalMaskProvider):
    """The in-process provider over the real grammar engine, counting its step calls."""

    def __init__(self, engine: GrammarEngine) -> None:
        super().__init__(engine)
        self.step_calls = 0

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        self.step_calls += 1
        return super().step(seq_ids, tokens, counts, jump_forward)


class PriorJumps(JumpPolicy):
    """Jump widths from the prior only: measured step costs (timing) would make two runs' widths differ, and
    with them the tokens (a row cut short samples the rest of its forced text under the mask)."""

    def record(self, rows: int, width: int, seconds: float) -> None:
        pass


def test_processor_mode_gives_what_overlap_gives(engine: TorchEngine, tiny: TinyModelInfo,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar step after the forward (processor) or beside it (overlap): the same request and the same
    reading of its answer, so the same tokens -- jumps, value checks and closing included -- and one grammar
    request per step with a constrained row."""
    monkeypatch.setattr("llm_runtime.scheduler.JumpPolicy", PriorJumps)
    kinds = [("regex", "[a-z]{2,6}"), ("choice", '["north", "south"]'), ("json_schema", JUMP_SCHEMA),
             ("json_schema", PERMUTATION)]

    def run(mode: str) -> tuple[list[tuple[str, str, tuple[int, ...], int]], int]:
        grammar = tiny_grammar(tiny)
        provider = CountingProvider(grammar)
        try:
            with Scheduler(engine, provider, SchedulerConfig(max_batch_size=8, grammar_mode=mode)) as s:
                results = [submit(s, GenerationRequest(prompt(engine, p), max_tokens=30, temperature=0.7, seed=i,
                                                       constraint=ConstraintRequest(kind, payload, "")))
                           for i, (p, (kind, payload)) in enumerate(zip(PROMPTS, kinds, strict=False))]
                finals = [r.wait() for r in results]
                summary = s.summary()
            assert summary["grammar_requests"] == summary["steps_constrained"] == provider.step_calls
            assert grammar.active_count == 0
            return ([(f.finish_reason, f.text, tuple(r.token_ids), f.value_retries)
                     for f, r in zip(finals, results, strict=True)], int(summary["jump_tokens"]))
        finally:
            grammar.close()

    overlap, jumped = run("overlap")
    processor, jumped_after = run("processor")
    assert processor == overlap
    assert all(reason in ("stop", "length") for reason, _, _, _ in overlap)
    assert jumped > 0 and jumped_after > 0  # the long keys were jumped over


def _penalized_greedy(engine: TorchEngine, ids: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """The rule, written out on the engine's own logits (batch of one, as the scheduler runs a lone request)."""
    seq = 987654
    known = engine.tokenizer.get_vocab_size(with_added_tokens=True)  # the ids past it pad the output projection
    row = engine.prefill_batch([seq], [np.asarray(ids)])[0].numpy().astype(np.float64)
    out: list[int] = []
    try:
        for _ in range(n):
            row[known:] = -np.inf
            counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=row.shape[0])[: row.shape[0]]
            hit = (counts > 0) | np.isin(np.arange(row.shape[0]), ids)
            row = np.where(hit, np.where(row > 0, row / rep, row * rep), row)
            row = row - counts * freq - (counts > 0) * pres
            tok = int(np.argmax(row))
            if tok in engine.eos_token_ids:
                break
            out.append(tok)
            row = engine.decode([seq], np.asarray([tok]))[0].numpy().astype(np.float64)
    finally:
        engine.release(seq)
    return out


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.0, 0.0, 1.5), (1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.2, 0.4, 0.3)])
def test_greedy_penalties_follow_the_rule(engine: TorchEngine, sched: Scheduler, rep: float, freq: float,
                                          pres: float) -> None:
    """Greedy with penalties gives exactly the tokens of the rule applied by hand (frequency and presence count
    the output, repetition the prompt too), and fewer repeats than plain greedy on the looping tiny model."""
    ids = prompt(engine, "the quick brown fox")
    plain = submit(sched, GenerationRequest(ids, max_tokens=40, temperature=0.0))
    plain.wait()
    r = submit(sched, GenerationRequest(ids, max_tokens=40, temperature=0.0, repetition_penalty=rep,
                                        frequency_penalty=freq, presence_penalty=pres))
    r.wait()
    assert r.token_ids == _penalized_greedy(engine, ids, 40, rep, freq, pres)
    repeats = [len(t) - len(set(t)) for t in (plain.token_ids, r.token_ids)]
    assert repeats[1] < repeats[0], repeats


@pytest.mark.parametrize("fields", [{"presence_penalty": 2.0}, {"repetition_penalty": 2.0, "frequency_penalty": 2.0},
                                    {"min_p": 0.9, "temperature": 1.0, "seed": 4}])
def test_penalties_never_break_the_constraint(engine: TorchEngine, sched: Scheduler, fields: dict[str, Any]) -> None:
    """Two allowed characters, twenty of them: penalties push against both, the mask still holds."""
    c = ConstraintRequest("regex", "[ab]{20}", "")
    r = submit(sched, GenerationRequest(prompt(engine, "hello"), constraint=c, max_tokens=40,
                                        **{"temperature": 0.0, **fields}))
    fin = r.wait()
    assert fin.finish_reason == "stop" and re.fullmatch("[ab]{20}", fin.text), fin


def test_penalties_ride_through_value_retries(engine: TorchEngine, tiny: TinyModelInfo) -> None:
    """Dropped tokens are forgotten by the counts: with a frequency penalty every output is still a permutation."""
    grammar = tiny_grammar(tiny)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            results = [submit(s, GenerationRequest(prompt(engine, "x"), max_tokens=40, temperature=1.0, seed=i,
                                                   frequency_penalty=1.0, repetition_penalty=1.3,
                                                   constraint=ConstraintRequest("json_schema", PERMUTATION, "")))
                       for i in range(4)]
            finals = [r.wait() for r in results]
        assert all(f.finish_reason == "stop" and sorted(json.loads(f.text)) == [0, 1, 2, 3] for f in finals), finals
        assert grammar.active_count == 0 and engine.live_count == 0
    finally:
        grammar.close()


# -- seeds and log probabilities ---------------------------------------------------------------------------------
def test_unseeded_requests_report_their_seed_and_replay(engine: TorchEngine, sched: Scheduler) -> None:
    """No seed: one is drawn per request (so outputs differ) and reported; sent back, it replays the output."""
    req = GenerationRequest(prompt(engine, "hello world"), max_tokens=16, temperature=1.0)
    first, second = submit(sched, req), submit(sched, req)
    fins = [first.wait(), second.wait()]
    seeds = [f.seed for f in fins]
    assert seeds[0] != seeds[1] and all(s is not None and 0 <= s < 2**64 for s in seeds)
    assert first.token_ids != second.token_ids
    replay = submit(sched, GenerationRequest(req.prompt_token_ids, max_tokens=16, temperature=1.0, seed=seeds[0]))
    assert replay.wait().seed == seeds[0]
    assert replay.token_ids == first.token_ids


def _entries(r: Result) -> list[TokenLogprobs]:
    return [lp for e in r.events if isinstance(e, TokenEvent) for lp in (e.logprobs or ())]


@pytest.mark.parametrize("retries", [0, 8], ids=["streamed", "value-checked"])
@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_one_entry_per_output_token(engine: TorchEngine, tiny: TinyModelInfo, retries: int, k: int) -> None:
    """Constrained rows with logprobs: one entry per streamed token (the end token has none), aligned with
    the events' tokens, their bytes joined are the text; forced (jumped) tokens are certain; a free row in
    the same batch without logprobs gets none and draws exactly what it draws alone."""
    grammar = tiny_grammar(tiny)
    options = json.dumps({"on_repeat": "continue", "value_retries": retries})
    free = GenerationRequest(prompt(engine, "hello world"), max_tokens=24, temperature=1.0, seed=99)
    try:
        with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
            alone = submit(s, free)
            alone.wait()
            asked = [submit(s, GenerationRequest(prompt(engine, p), max_tokens=120, temperature=1.0, seed=i,
                                                 logprobs=k, constraint=ConstraintRequest("json_schema", JUMP_SCHEMA,
                                                                                          options)))
                     for i, p in enumerate(PROMPTS[:3])]
            beside = submit(s, free)
            finals = [r.wait() for r in asked]
            beside.wait()
        assert beside.token_ids == alone.token_ids
        assert all(e.logprobs is None for e in beside.events if isinstance(e, TokenEvent))
        text = TokenText(engine.tokenizer)
        for r, fin in zip(asked, finals, strict=True):
            assert re.fullmatch(JUMP_PATTERN, fin.text), fin.text
            entries = _entries(r)
            assert [e.token for e in entries] == r.token_ids
            assert fin.completion_tokens == len(entries) + 1  # + the end token: not part of the output
            assert b"".join(bytes(text.piece(e.token)[1]) for e in entries) == fin.text.encode()
            for e in entries:
                values = [v for _, v in e.top]
                assert e.logprob <= 0.0 and (1 <= len(e.top) <= k if k else not e.top)
                assert all(math.isfinite(v) and v <= 0.0 for v in values) and values == sorted(values, reverse=True)
                if e.token in dict(e.top):
                    assert dict(e.top)[e.token] == pytest.approx(e.logprob, abs=1e-6)
            assert any(e.logprob < 0.0 for e in entries)  # sampled at temperature 1 somewhere
            if retries == 0:  # events of several tokens are jumps (value checks hold tokens back otherwise)
                jumped = [lp for ev in r.events if isinstance(ev, TokenEvent) and len(ev.token_ids) > 1
                          for lp in ev.logprobs or ()]
                assert jumped and all(lp == forced(lp.token, k) for lp in jumped)
        assert grammar.active_count == 0 and engine.live_count == 0
    finally:
        grammar.close()


def test_logprobs_refused_out_of_range(engine: TorchEngine, sched: Scheduler) -> None:
    with pytest.raises(RequestError, match=r"^logprobs: must be null \(off\) or an integer in 0\.\.20 "):
        sched.submit(GenerationRequest(prompt(engine, "x"), logprobs=21), Result())
