"""The grammar decoder in TensorRT-LLM 1.2.1's one-model speculative modes (EAGLE3_ONE_MODEL, MTP), emulated.

``tests.support.trtllm_emulation.install(spec_mode=...)`` builds the emulated
``LLM`` with ``py_executor_creator.CapturableGuidedDecoder`` (the grammar's,
while :func:`llm_runtime.trtllm_decoder.installed` runs) and runs the one-model
worker's order: ``add_batch`` -> target forward -> ``execute`` (the target
build, a host function on the decoder's stream thread) -> greedy verification
-> per draft step ``add_draft_batch`` -> ``execute_draft_batch``; with and
without the overlap scheduler (the host request's accepted count an
iteration old), and with CUDA graph warmup re-running host functions.  Every
run is checked against the run without speculation: the same greedy outputs,
and the grammar sequence holding exactly the accepted tokens after every
target build.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from grammar_service.engine import GrammarEngine
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.grammar_hook import GrammarRows
from llm_runtime.mask import MaskStep
from standins.tiny_model import TinyModelInfo, tiny_grammar
from tests.support.trtllm_emulation import Trtllm, install
from tests.unit.test_grammar_hook import PROMPTS
from tests.unit.test_grammar_hook_drafts import CONSTRAINTS, DraftProvider

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ("words", "json", "choice")
SEQ0 = 2000


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


@pytest.fixture
def grammar(tiny: TinyModelInfo) -> Iterator[GrammarEngine]:
    g = tiny_grammar(tiny, max_batch=8)
    yield g
    assert g.active_count == 0, "a grammar sequence leaked"
    g.close()


@dataclass
class Run:
    outputs: dict[int, list[int]]  # request index -> tokens
    finish: dict[int, str | None]
    llm: Any
    made: Trtllm
    rows: GrammarRows
    errors: dict[int, str | None]


def _decoder_module() -> types.ModuleType:
    import llm_runtime

    sys.modules.pop("llm_runtime.trtllm_decoder", None)
    if hasattr(llm_runtime, "trtllm_decoder"):
        delattr(llm_runtime, "trtllm_decoder")
    return importlib.import_module("llm_runtime.trtllm_decoder")


def run(monkeypatch: pytest.MonkeyPatch, engine: TorchEngine, grammar: GrammarEngine, *,
        spec_mode: str | None = None, drafter: Callable[[int, int, int], int] | None = None, overlap: bool = False,
        warmup: bool = False, drafts: int = 3, provider: DraftProvider | None = None,
        before: Callable[[Run], None] | None = None, check_state: bool = True) -> Run:
    """Generate one request per constraint of :data:`KINDS` through the emulated LLM; checks the grammar state
    after every target build (one-model) and that the host functions raised nothing of the grammar's."""
    with monkeypatch.context() as mp:
        made = install(mp, engine, spec_mode=spec_mode, drafter=drafter, overlap=overlap, warmup=warmup,
                       drafts=drafts)
        module = _decoder_module()
        try:
            rows = GrammarRows(provider or DraftProvider(grammar), vocab_size=engine.vocab_size,
                               end_token_ids=engine.eos_token_ids, max_rows=8)
            assert made.module is not None
            with module.installed(rows):
                llm = made.module.LLM(guided_decoding_backend="xgrammar", max_batch_size=4, speculative_config=None)
            decoder = module.check_installed(llm)
            assert decoder is (llm._executor.engine.model_engine.guided_decoder if spec_mode
                               else llm._executor.engine.guided_decoder)
            ex: Any = made.executor
            assert ex is not None
            seq_of: dict[int, int] = {}
            if spec_mode is not None and check_state:
                def check(r: Any, generated: int) -> None:
                    seq = grammar.table.get(seq_of[r.request_id])
                    if seq is not None and not any(t in engine.eos_token_ids for t in ex._generated[r.request_id]):
                        assert seq.tokens_accepted == generated, (r.request_id, seq.tokens_accepted, generated)
                ex.check = check  # type: ignore[attr-defined]
            sampling = sys.modules["tensorrt_llm.sampling_params"]
            out = Run({}, {}, llm, made, rows, {})
            for i, kind in enumerate(KINDS):
                rows.start(SEQ0 + i, CONSTRAINTS[kind][0])
            if before is not None:
                before(out)

            async def main() -> None:
                async def one(i: int) -> None:
                    params = sampling.SamplingParams(  # type: ignore[attr-defined]
                        max_tokens=40, end_id=min(engine.eos_token_ids),
                        guided_decoding=sampling.GuidedDecodingParams(regex=rows.guide(SEQ0 + i)))  # type: ignore[attr-defined]
                    prompt = engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids
                    result = llm.generate_async({"prompt_token_ids": prompt}, params, streaming=True)
                    seq_of[result.request_id] = SEQ0 + i
                    tokens: list[int] = []
                    reason = None
                    async for o in result:
                        tokens += o.outputs[0].token_ids_diff
                        reason = o.outputs[0].finish_reason
                    out.outputs[i], out.finish[i] = tokens, reason

                await asyncio.gather(*(one(i) for i in range(len(KINDS))))

            asyncio.run(main())
            llm.shutdown()
            for i, o in enumerate(rows.remove([SEQ0 + i for i in range(len(KINDS))])):
                out.errors[i] = None if o is None else o.error
            assert rows.row_count == 0
            if spec_mode is not None:
                # Only TensorRT-LLM's own assert of a warmup's second draft step 0 (requests cast already).
                stream_errors = decoder.stream.errors
                assert all(isinstance(e, AssertionError) for e in stream_errors), stream_errors
                assert bool(stream_errors) == warmup
            return out
        finally:
            sys.modules.pop("llm_runtime.trtllm_decoder", None)


@pytest.fixture(scope="module")
def reference(tiny: TinyModelInfo, engine: TorchEngine) -> dict[int, list[int]]:
    """The greedy outputs without speculation (GrammarModelDecoder, the plain loop)."""
    g = tiny_grammar(tiny, max_batch=8)
    mp = pytest.MonkeyPatch()
    try:
        out = run(mp, engine, g)
        for i, kind in enumerate(KINDS):
            assert out.finish[i] == "stop" and out.errors[i] is None, (kind, out.outputs[i])
            assert len(out.outputs[i]) >= 3
        return out.outputs
    finally:
        mp.undo()
        g.close()


def drafter_of(kind: str, reference: dict[int, list[int]], engine: TorchEngine) -> Callable[[int, int, int], int]:
    """The one-model draft model: the reference's token (``right``), never it (``wrong``), a token no constraint
    takes (``forbidden``), or the end token at draft step 1 (``end``); request ids are 1, 2, 3 in order."""
    eos = min(engine.eos_token_ids)
    forbidden = engine.tokenizer.encode("#").ids[0]

    def right(rid: int, position: int) -> int:
        ref = reference[rid - 1]
        return ref[position] if position < len(ref) else eos

    def draft(rid: int, position: int, step: int) -> int:
        if kind == "right":
            return right(rid, position)
        if kind == "wrong":
            return (right(rid, position) + 1) % engine.vocab_size
        if kind == "forbidden":
            return forbidden
        return eos if step == 1 else right(rid, position)

    return draft


CASES = [pytest.param(mode, kind, overlap, id=f"{mode}-{kind}-{'overlap' if overlap else 'loop'}")
         for mode, kind in [("EAGLE3_ONE_MODEL", "right"), ("EAGLE3_ONE_MODEL", "wrong"), ("MTP", "forbidden"),
                            ("MTP_EAGLE_ONE_MODEL", "end")]
         for overlap in (False, True)]


@pytest.mark.parametrize(("mode", "kind", "overlap"), CASES)
def test_greedy_outputs_with_one_model_speculation_are_those_without(
        monkeypatch: pytest.MonkeyPatch, engine: TorchEngine, grammar: GrammarEngine, reference: dict[int, list[int]],
        mode: str, kind: str, overlap: bool) -> None:
    """Drafts right, wrong, forbidden by the grammar, or an end token among them; the plain and the overlap
    loop: the outputs are those without speculation, no row failed, and the grammar holds exactly the
    accepted tokens after every target build (checked in :func:`run`)."""
    out = run(monkeypatch, engine, grammar, spec_mode=mode, drafter=drafter_of(kind, reference, engine),
              overlap=overlap)
    assert out.outputs == reference
    assert out.errors == {0: None, 1: None, 2: None}
    assert out.finish == {0: "stop", 1: "stop", 2: "stop"}
    ex = out.made.executor
    tally = ex.tally  # type: ignore[union-attr]
    if kind == "right":
        assert tally.accepted > 0 and tally.end_in_drafts > 0
    elif kind in ("wrong", "forbidden"):
        assert tally.accepted == 0 and tally.drafted > 0
    if overlap and tally.accepted:
        assert tally.stale_counts > 0  # the request's own count was an iteration old: the recorded one was used


@pytest.mark.parametrize("overlap", [False, True], ids=["loop", "overlap"])
def test_host_functions_run_again_on_one_batch_commit_once(
        monkeypatch: pytest.MonkeyPatch, engine: TorchEngine, grammar: GrammarEngine, reference: dict[int, list[int]],
        overlap: bool) -> None:
    """CUDA graph warmup: the target build and draft step 0 run twice on one batch; nothing is committed twice
    (the grammar state check in :func:`run`) and the masks are the same (the outputs)."""
    out = run(monkeypatch, engine, grammar, spec_mode="EAGLE3_ONE_MODEL",
              drafter=drafter_of("right", reference, engine), overlap=overlap, warmup=True)
    assert out.outputs == reference and out.errors == {0: None, 1: None, 2: None}


def test_a_failing_grammar_ends_the_request_without_raising(
        monkeypatch: pytest.MonkeyPatch, engine: TorchEngine, grammar: GrammarEngine,
        reference: dict[int, list[int]]) -> None:
    """A grammar sequence evicted under it: the host function raises nothing, the row allows only the end
    tokens (the request ends with ``stop`` at this step), and the row's outcome carries the error the engine
    reports; the other requests are untouched."""
    provider = DraftProvider(grammar)
    original = provider.step

    evicted: list[int] = []

    def step(seq_ids: np.ndarray, *args: Any, **kwargs: Any) -> MaskStep:
        if not evicted and provider.steps >= 2 and SEQ0 + 1 in seq_ids.tolist():
            grammar.end([SEQ0 + 1])  # evicted
            evicted.append(provider.steps)
        return original(seq_ids, *args, **kwargs)

    provider.step = step  # type: ignore[method-assign]
    out = run(monkeypatch, engine, grammar, spec_mode="EAGLE3_ONE_MODEL",
              drafter=drafter_of("wrong", reference, engine), provider=provider, check_state=False)
    assert evicted == [2]
    assert out.outputs[0] == reference[0] and out.outputs[2] == reference[2]
    assert out.finish[1] == "stop" and out.outputs[1][-1] in engine.eos_token_ids
    assert out.errors[0] is None and out.errors[2] is None
    assert out.errors[1] is not None and str(SEQ0 + 1) in out.errors[1]


class NoChannel(DraftProvider):
    """A remote provider whose grammar channel is closed: a step could only go over BLS."""

    channel_open = False

    def send_step(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_a_one_model_build_never_goes_over_bls(monkeypatch: pytest.MonkeyPatch, engine: TorchEngine,
                                              grammar: GrammarEngine) -> None:
    """The channel closed (and not opened at the start): every row fails with the reason, no BLS step is
    made in the host function, and every request ends."""
    provider = NoChannel(grammar)
    out = run(monkeypatch, engine, grammar, spec_mode="EAGLE3_ONE_MODEL", provider=provider, check_state=False)
    message = ("grammar step failed: the grammar channel is not open, and a build in a CUDA host function "
               "(one-model speculative decoding) never goes over BLS")
    assert out.errors == {0: message, 1: message, 2: message}
    assert out.finish == {0: "stop", 1: "stop", 2: "stop"}
    assert provider.steps == 2 * len(KINDS)  # the starts' attempts to open the channel, on their own thread


class _Sent:
    """A step sent over the (emulated) channel: answered when asked."""

    def __init__(self, answer: MaskStep) -> None:
        self.answer = answer

    def result(self) -> tuple[MaskStep, float]:
        return self.answer, 0.0


class LateChannel(DraftProvider):
    """A remote provider as ``RemoteMaskProvider`` opens itself: its channel opens at its second step (the first
    goes over BLS and opens the mask buffer); from then on steps are sent over the channel."""

    def __init__(self, engine: GrammarEngine) -> None:
        super().__init__(engine)
        self.first_steps: list[tuple[list[int], list[int]]] = []  # (sequence ids, counts) of the steps before
        self.sent = 0

    @property
    def channel_open(self) -> bool:
        return self.steps >= 2

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        if not self.channel_open:
            self.first_steps.append((seq_ids.tolist(), counts.tolist()))
        return super().step(seq_ids, tokens, counts, jump_forward, drafts, draft_counts)

    def send_step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
                  drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> _Sent | None:
        if not self.channel_open:
            return None
        self.sent += 1
        return _Sent(super().step(seq_ids, tokens, counts, jump_forward, drafts, draft_counts))


@pytest.mark.parametrize("overlap", [False, True], ids=["loop", "overlap"])
def test_the_channel_opened_at_the_first_start_changes_nothing(
        monkeypatch: pytest.MonkeyPatch, engine: TorchEngine, grammar: GrammarEngine, reference: dict[int, list[int]],
        overlap: bool) -> None:
    """A remote provider's first steps (which open its channel) are made by the first start, on its own thread,
    as steps of no token on the new sequence; the later starts make none; every build goes over the channel;
    and the outputs are those without speculation (asking the first mask twice commits nothing)."""
    provider = LateChannel(grammar)
    out = run(monkeypatch, engine, grammar, spec_mode="EAGLE3_ONE_MODEL",
              drafter=drafter_of("right", reference, engine), overlap=overlap, provider=provider)
    assert provider.first_steps == [([SEQ0], [0]), ([SEQ0], [0])]
    assert out.outputs == reference and out.errors == {0: None, 1: None, 2: None}
    assert provider.sent == provider.steps - 2 > 0
