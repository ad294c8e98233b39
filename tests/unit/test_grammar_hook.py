"""GrammarLogitsProcessor: the grammar hook of the TensorRT-LLM engine, driven by a real model here.

TensorRT-LLM cannot be installed on these machines, so these tests drive the
processor the way TensorRT-LLM's executor does (its documented batched
logits-processor call: after the forward, before sampling, every request's
token history with the prompt first, logits modified in place), with the
logits of the real tiny torch model and the real grammar engine (xgrammar)
behind a provider that counts its calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from grammar_backend.engine import GrammarEngine, GrammarEngineConfig
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import EngineError
from llm_runtime.grammar_hook import GrammarLogitsProcessor, RowOutcome
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest, MaskStep
from llm_runtime.tiny_model import TinyModelInfo, build_tiny_llama

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

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
             jump_forward: bool = False) -> MaskStep:
        self.step_rows.append(int(seq_ids.shape[0]))
        if self.fail_steps:
            raise RuntimeError("grammar model unreachable")
        return super().step(seq_ids, tokens, counts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModelInfo:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


@pytest.fixture
def grammar(tiny: TinyModelInfo) -> Iterator[GrammarEngine]:
    hf = AutoTokenizer.from_pretrained(str(tiny.path), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tiny.vocab_size, stop_token_ids=[tiny.eos_token_id])
    g = GrammarEngine(info, "tiny", GrammarEngineConfig(max_batch=8))
    yield g
    assert g.active_count == 0, "a grammar sequence leaked"
    g.close()


@pytest.fixture
def provider(grammar: GrammarEngine) -> CountingProvider:
    return CountingProvider(grammar)


def processor_for(engine: TorchEngine, provider: CountingProvider) -> GrammarLogitsProcessor:
    return GrammarLogitsProcessor(provider, vocab_size=engine.vocab_size, end_token_ids=engine.eos_token_ids,
                                  max_rows=8)


def drive_like_trtllm(
    engine: TorchEngine,
    processor: GrammarLogitsProcessor,
    prompts: Sequence[list[int]],
    constraints: Sequence[ConstraintRequest | None],
    max_tokens: int,
    *,
    list_form: bool = False,
    stream_ptr: int | None = None,
) -> tuple[list[list[int]], list[RowOutcome | None], int]:
    """Greedy in-flight decoding in TensorRT-LLM's order: forward -> processor(all rows) -> sample.

    Returns each request's generated tokens, its row outcome at finish, and the
    number of steps that had a constrained row.
    """
    keys = list(range(100, 100 + len(prompts)))  # the engine's request ids (not the grammar's)
    for key, prompt, c in zip(keys, prompts, constraints, strict=True):
        if c is not None:
            processor.start(key, key * 7 + 1, c, len(prompt))
    histories = {k: list(p) for k, p in zip(keys, prompts, strict=True)}
    live = list(keys)
    outcomes: dict[int, RowOutcome | None] = {}
    logits = torch.stack([engine.prefill(k, p) for k, p in zip(keys, prompts, strict=True)])
    constrained_steps = 0
    for _ in range(max_tokens):
        constrained_steps += any(k in processor for k in live)
        rows = [logits[i].view(1, 1, -1) for i in range(len(live))] if list_form else logits
        processor(live, rows, [[histories[k]] for k in live], stream_ptr, [None] * len(live))
        tokens = logits.argmax(dim=-1).tolist()
        done = []
        for k, t in zip(live, tokens, strict=True):
            histories[k].append(t)
            if t in engine.eos_token_ids or len(histories[k]) - len(prompts[keys.index(k)]) >= max_tokens:
                done.append(k)
        for k, out in zip(done, processor.remove(done), strict=True):
            outcomes[k] = out
            engine.release(k)
        live = [k for k in live if k not in done]
        if not live:
            break
        logits = engine.decode(live, [histories[k][-1] for k in live])
    for k, out in zip(live, processor.remove(live), strict=True):
        outcomes[k] = out
        engine.release(k)
    generated = [histories[k][len(p):] for k, p in zip(keys, prompts, strict=True)]
    return generated, [outcomes[k] for k in keys], constrained_steps


@pytest.mark.parametrize("list_form", [False, True], ids=["tensor", "per-request-tensors"])
def test_one_batched_grammar_request_per_step(engine: TorchEngine, provider: CountingProvider, list_form: bool) -> None:
    """Four rows (three constrained, one free) cost exactly one grammar request per step."""
    tok = engine.tokenizer
    prompts = [tok.encode(p).ids for p in PROMPTS]
    kinds = ["regex", "choice", "json", None]
    constraints = [None if k is None else CONSTRAINTS[k][0] for k in kinds]
    processor = processor_for(engine, provider)
    generated, outcomes, steps = drive_like_trtllm(engine, processor, prompts, constraints, 24, list_form=list_form)
    assert len(provider.step_rows) == steps
    assert provider.step_rows[0] == 3  # every constrained row in the first (context) call
    stats = processor.stats()
    assert (stats.calls, stats.grammar_requests, stats.rows) == (steps, steps, sum(provider.step_rows))
    for kind, out, toks in zip(kinds, outcomes, generated, strict=True):
        if kind is None:
            assert out is None
            continue
        assert out is not None and out == RowOutcome(None, out.close_state, False)
        assert toks[-1] in engine.eos_token_ids, "a constrained row must end with its end token"
        text = tok.decode(toks[:-1])
        assert re.fullmatch(CONSTRAINTS[kind][1], text), (kind, text)
    assert processor.row_count == 0


def test_row_error_and_termination_leave_only_end_tokens(engine: TorchEngine, provider: CountingProvider,
                                                          tiny: TinyModelInfo) -> None:
    """A row the grammar side ends gets a mask that allows only the end tokens; its outcome says why."""
    processor = processor_for(engine, provider)
    prompt = engine.tokenizer.encode("hello").ids
    processor.start(1, 11, CONSTRAINTS["choice"][0], len(prompt))
    processor.start(2, 22, CONSTRAINTS["choice"][0], len(prompt))
    logits = torch.zeros((2, engine.vocab_size))
    north = engine.tokenizer.encode("north").ids
    # Row 1 feeds a full choice then its end token... row 2 a token the grammar refuses.
    bad = engine.tokenizer.encode("zzz").ids[:1]
    processor([1, 2], logits, [[prompt], [prompt]])  # the context step: nothing fed yet
    logits.zero_()
    processor([1, 2], logits, [[prompt + north], [prompt + bad]])
    allowed = [set(torch.nonzero(torch.isfinite(logits[i])).view(-1).tolist()) for i in range(2)]
    assert allowed[1] == set(engine.eos_token_ids)
    out = processor.outcome(2)
    assert out is not None and out.error is not None and "reject" in out.error.lower()
    assert tiny.eos_token_id in allowed[0]  # "north" is complete: the end token is allowed
    logits.zero_()
    processor([1], logits[:1], [[prompt + north + [tiny.eos_token_id]]])
    assert processor.outcome(1) == RowOutcome(None, 0, True)
    assert set(torch.nonzero(torch.isfinite(logits[0])).view(-1).tolist()) == set(engine.eos_token_ids)
    assert [o is not None and o.terminated for o in processor.remove([1, 2, 3])] == [True, False, False]


@pytest.mark.parametrize(
    ("case", "token_ids", "message"),
    [
        ("beams", lambda p: [p, p], "beam width 2 is not supported"),
        ("shrunk", lambda p: [p[:-1]], "token history shrank"),
    ],
)
def test_unsupported_rows_fail_alone(engine: TorchEngine, provider: CountingProvider, case: str,
                                     token_ids: object, message: str) -> None:
    processor = processor_for(engine, provider)
    prompt = engine.tokenizer.encode("hello world").ids
    processor.start(1, 11, CONSTRAINTS["regex"][0], len(prompt))
    processor.start(2, 22, CONSTRAINTS["regex"][0], len(prompt))
    logits = torch.zeros((2, engine.vocab_size))
    processor([1, 2], logits, [token_ids(prompt), [prompt]])  # type: ignore[operator]
    out = processor.outcome(1)
    assert out is not None and out.error is not None and message in out.error
    assert processor.outcome(2) == RowOutcome(None, 0, False)
    assert int(torch.isfinite(logits[1]).sum()) > len(engine.eos_token_ids)
    processor.remove([1, 2])


def test_multi_token_steps_are_fed_in_order(engine: TorchEngine, provider: CountingProvider) -> None:
    """Several tokens sampled since the last call (speculative or multi-token steps) are accepted in order."""
    processor = processor_for(engine, provider)
    prompt = engine.tokenizer.encode("x").ids
    processor.start(5, 55, CONSTRAINTS["json"][0], len(prompt))
    text = engine.tokenizer.encode('{"n":12').ids
    logits = torch.zeros((1, engine.vocab_size))
    processor([5], logits, [[prompt]])
    processor([5], logits, [[prompt + text]])
    assert provider.step_rows == [1, 1]
    assert processor.outcome(5) == RowOutcome(None, 0, False)
    logits.zero_()
    processor([5], logits, [[prompt + text]])  # nothing new: the same mask again
    allowed = torch.isfinite(logits[0])
    close = engine.tokenizer.encode("}").ids
    assert len(close) == 1 and bool(allowed[close[0]])
    assert not bool(allowed[engine.tokenizer.encode("a").ids[0]])
    processor.remove([5])


def test_a_failed_grammar_step_ends_every_constrained_row(engine: TorchEngine, provider: CountingProvider) -> None:
    processor = processor_for(engine, provider)
    prompt = engine.tokenizer.encode("hi").ids
    processor.start(1, 11, CONSTRAINTS["regex"][0], len(prompt))
    processor.start(2, 22, CONSTRAINTS["json"][0], len(prompt))
    provider.fail_steps = True
    logits = torch.zeros((3, engine.vocab_size))
    processor([1, 2, 3], logits, [[prompt], [prompt], [prompt]])
    for key in (1, 2):
        out = processor.outcome(key)
        assert out is not None and out.error == "grammar step failed: grammar model unreachable"
        assert set(torch.nonzero(torch.isfinite(logits[key - 1])).view(-1).tolist()) == set(engine.eos_token_ids)
    assert bool(torch.isfinite(logits[2]).all()), "the unconstrained row is untouched"
    processor.remove([1, 2])


def test_start_refuses_a_key_twice_without_leaking(engine: TorchEngine, provider: CountingProvider) -> None:
    processor = processor_for(engine, provider)
    processor.start(1, 11, CONSTRAINTS["regex"][0], 1)
    with pytest.raises(EngineError, match="request 1 already has a grammar row"):
        processor.start(1, 12, CONSTRAINTS["regex"][0], 1)
    processor.remove([1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"end_token_ids": []}, "end_token_ids must be non-empty"),
        ({"end_token_ids": [10**6]}, "end_token_ids must be non-empty ids in"),
        ({"max_rows": 0}, "max_rows must be positive"),
    ],
)
def test_processor_rejects_bad_settings(provider: CountingProvider, kwargs: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"vocab_size": 320, "end_token_ids": [1], "max_rows": 4}
    settings.update(kwargs)
    with pytest.raises(EngineError, match=message):
        GrammarLogitsProcessor(provider, **settings)  # type: ignore[arg-type]


def test_budget_closing_through_the_processor(engine: TorchEngine, provider: CountingProvider) -> None:
    """Closing states reach the row outcome, and the forced completion is valid JSON."""
    tok = engine.tokenizer
    schema = '{"type":"object","properties":{"s":{"type":"string"}},"required":["s"],"additionalProperties":false}'
    c = ConstraintRequest("json_schema", schema, json.dumps({"on_budget": "close", "on_repeat": "continue"}), budget=12)
    processor = processor_for(engine, provider)
    prompts = [tok.encode("x").ids] * 2
    generated, outcomes, _ = drive_like_trtllm(engine, processor, prompts, [c, c], 12)
    for toks, out in zip(generated, outcomes, strict=True):
        assert out is not None and out.error is None
        assert out.close_state == 1  # CloseState.BUDGET
        assert toks[-1] in engine.eos_token_ids and len(toks) <= 12
        assert set(json.loads(tok.decode(toks[:-1]))) == {"s"}


@pytest.mark.gpu
def test_processor_masks_cuda_logits_on_the_engines_stream(tiny: TinyModelInfo, grammar: GrammarEngine) -> None:
    """The CUDA path: pinned host rows copied on the engine's stream, the kernel applied there (per-request tensors)."""
    engine = TorchEngine(tiny.path, TorchEngineConfig(device="cuda", max_batch_size=4, max_seq_len=320))
    provider = CountingProvider(grammar)
    processor = GrammarLogitsProcessor(provider, vocab_size=engine.vocab_size, end_token_ids=engine.eos_token_ids,
                                       max_rows=4, device="cuda")
    tok = engine.tokenizer
    kinds = ["regex", "choice", "json"]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        generated, outcomes, steps = drive_like_trtllm(
            engine, processor, [tok.encode(p).ids for p in PROMPTS[:3]], [CONSTRAINTS[k][0] for k in kinds], 24,
            list_form=True, stream_ptr=stream.cuda_stream)
    assert len(provider.step_rows) == steps
    for kind, out, toks in zip(kinds, outcomes, generated, strict=True):
        assert out is not None and out.error is None
        assert toks[-1] in engine.eos_token_ids
        assert re.fullmatch(CONSTRAINTS[kind][1], tok.decode(toks[:-1]))


def test_a_processor_failure_never_reaches_the_engine(engine: TorchEngine, provider: CountingProvider) -> None:
    """More rows than the processor was sized for: the call returns, the rows fail (inside TensorRT-LLM's
    forward an exception would fail the whole batch or its executor loop)."""
    processor = GrammarLogitsProcessor(provider, vocab_size=engine.vocab_size, end_token_ids=engine.eos_token_ids,
                                       max_rows=1)
    prompt = engine.tokenizer.encode("hi").ids
    processor.start(1, 11, CONSTRAINTS["regex"][0], len(prompt))
    processor.start(2, 22, CONSTRAINTS["regex"][0], len(prompt))
    processor([1, 2], torch.zeros((2, engine.vocab_size)), [[prompt], [prompt]])
    for key in (1, 2):
        out = processor.outcome(key)
        assert out is not None and out.error == "grammar processor failed: 2 rows exceed the processor's 1"
    processor.remove([1, 2])
