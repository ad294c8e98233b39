"""TorchEngine: batched decoding with per-sequence slot caches equals decoding alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from grammar_backend.errors import ConfigError
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import EngineError, RequestError
from standins.tiny_model import TinyModelInfo
from tests.support import assets

PROMPTS = ("hello world", "yes no maybe true false null, the quick brown fox", "caf\u00e9 \U0001f600")

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def reference(tiny: TinyModelInfo) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(tiny.path), local_files_only=True)
    model.eval()
    return model  # type: ignore[no-any-return]


def greedy_reference(model: torch.nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation: no cache at all, the independent reference."""
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


def run_schedule(engine: TorchEngine, prompts: list[list[int]], n: int, joins: Sequence[int]) -> list[list[int]]:
    """Greedy-decode ``prompts``; prompt i joins at step ``joins[i]`` and leaves after ``n`` tokens.

    Every step is ONE ``decode`` call over all live sequences, then the joiners' prefills.
    """
    outs: list[list[int]] = [[] for _ in prompts]
    live: list[int] = []
    step = 0
    while any(len(o) < n for o in outs):
        for i in [i for i in live if len(outs[i]) >= n]:
            engine.release(i)
            live.remove(i)
        if live:
            # A scrambled order checks that rows come back in the order asked for.
            order = live[::-1]
            logits = engine.decode(order, [outs[i][-1] for i in order])
            assert logits.shape == (len(order), engine.vocab_size)
            for row, i in enumerate(order):
                outs[i].append(int(logits[row].argmax()))
        for i, at in enumerate(joins):
            if at == step:
                outs[i].append(int(engine.prefill(i, prompts[i]).argmax()))
                live.append(i)
        step += 1
    for i in live:
        engine.release(i)
    return [o[:n] for o in outs]


@pytest.mark.parametrize(
    ("joins", "initial_cache_len"),
    [
        ((0, 0, 0), 256),  # all start together
        ((0, 3, 7), 256),  # staggered joins: different lengths in one batch
        ((5, 0, 2), 4),  # tiny initial slots: the buffers grow during decoding
    ],
)
def test_batched_greedy_equals_alone(
    tiny: TinyModelInfo, reference: torch.nn.Module, joins: tuple[int, ...], initial_cache_len: int
) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=4, max_seq_len=256, initial_cache_len=initial_cache_len))
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    n = 12
    expected = [greedy_reference(reference, p, n) for p in prompts]
    alone = [run_schedule(engine, [p], n, [0])[0] for p in prompts]
    assert alone == expected
    assert run_schedule(engine, prompts, n, joins) == expected
    assert engine.live_count == 0


@pytest.mark.parametrize("live_first", [0, 2], ids=["empty-engine", "two-live"])
def test_batched_prefill_equals_prefills_alone(tiny: TinyModelInfo, reference: torch.nn.Module, live_first: int) -> None:
    """Left-padded prompts of different lengths in one forward: the same logits, then the same greedy tokens."""
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=256, initial_cache_len=4))
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    for j in range(live_first):  # sequences already decoding keep their slots and cache
        engine.prefill(100 + j, prompts[j])
    batch = engine.prefill_batch([0, 1, 2], prompts)
    assert batch.shape == (3, engine.vocab_size) and bool(torch.isfinite(batch).all())
    alone = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=256))
    for i, p in enumerate(prompts):
        torch.testing.assert_close(batch[i], alone.prefill(i, p), rtol=1e-4, atol=1e-4)
        assert engine.length(i) == len(p)
    n = 8
    outs = {i: [int(batch[i].argmax())] for i in range(3)}
    live = [100 + j for j in range(live_first)] + [0, 1, 2]
    # The already-live rows decode on alongside (their own first token was greedy too).
    extra = {100 + j: greedy_reference(reference, prompts[j], 1)[0] for j in range(live_first)}
    for _ in range(n - 1):
        logits = engine.decode(live, [outs[s][-1] if s in outs else extra[s] for s in live])
        for row, s in enumerate(live):
            if s in outs:
                outs[s].append(int(logits[row].argmax()))
            else:
                extra[s] = int(logits[row].argmax())
    assert [outs[i] for i in range(3)] == [greedy_reference(reference, p, n) for p in prompts]


@pytest.mark.parametrize(
    ("stops", "release_other_at"),
    [
        ((1, 2, 3, None), None),  # None: the prompt's length; one-token chunks
        ((5, 9, None), 1),  # the live sequence leaves between two chunks (its slot is freed under the chunked one)
        ((None,), None),  # one chunk: the whole prompt
    ],
    ids=["1+1+1+rest", "5+4+rest-other-leaves", "whole"],
)
def test_chunked_prefill_equals_one_forward(tiny: TinyModelInfo, reference: torch.nn.Module,
                                            stops: tuple[int | None, ...], release_other_at: int | None) -> None:
    """A prompt prefilled in chunks, with another sequence decoding between them: the same logits as one
    forward, then the same greedy tokens for both; the cache grows while the chunked prompt waits."""
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=3, max_seq_len=256, initial_cache_len=4))
    other, long = (engine.tokenizer.encode(p).ids for p in PROMPTS[:2])
    assert len(long) > 12
    outs = {7: [int(engine.prefill(7, other).argmax())]}
    for k, stop in enumerate(stops):
        if k == release_other_at:
            engine.release(7)
            del outs[7]
        first = engine.prefill_chunk(3, long, len(long) if stop is None else stop)
        assert (first is None) == (stop is not None)
        assert engine.live_count == len(outs) + (first is not None)
        if 7 in outs and first is None:  # a decode step between two chunks
            outs[7].append(int(engine.decode([7], [outs[7][-1]])[0].argmax()))
    assert first is not None and engine.length(3) == len(long)
    alone = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=1, max_seq_len=256))
    torch.testing.assert_close(first, alone.prefill(0, long), rtol=1e-4, atol=1e-4)
    outs[3] = [int(first.argmax())]
    for _ in range(5):
        live = sorted(outs)
        logits = engine.decode(live, [outs[s][-1] for s in live])
        for row, s in enumerate(live):
            outs[s].append(int(logits[row].argmax()))
    assert outs[3] == greedy_reference(reference, long, 6)
    if 7 in outs:
        assert outs[7] == greedy_reference(reference, other, len(outs[7]))


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [
        ("another", EngineError, "sequence 1 is being prefilled in chunks, not 2"),
        ("same_stop", EngineError, r"sequence 1: chunk end 4 is not in 5\.\.10"),
        ("past_end", EngineError, r"sequence 1: chunk end 11 is not in 1\.\.10"),
        ("changed", EngineError, "sequence 1: its prompt changed between chunks"),
        ("live", EngineError, "sequence 1 is live in the engine"),
        ("full", EngineError, "all 2 cache slots are taken"),
        ("batch_beside", EngineError, "all 2 cache slots are taken"),
        ("batch_same_id", EngineError, "sequence 1 is being prefilled in chunks"),
        ("decode_it", EngineError, r"decode needs every live sequence \(0\), got 1"),
        ("empty", RequestError, "prompt_token_ids: must not be empty"),
        ("bad_id", RequestError, r"prompt_token_ids: ids must be in \[0, 448\)"),
    ],
)
def test_chunked_prefill_misuse(tiny: TinyModelInfo, action: str, error: type[Exception], match: str) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=32))
    p = list(range(5, 15))
    with pytest.raises(error, match=match):
        if action == "another":
            engine.prefill_chunk(1, p, 4)
            engine.prefill_chunk(2, p, 4)
        elif action == "same_stop":
            engine.prefill_chunk(1, p, 4)
            engine.prefill_chunk(1, p, 4)
        elif action == "past_end":
            engine.prefill_chunk(1, p, 11)
        elif action == "changed":
            engine.prefill_chunk(1, p, 4)
            engine.prefill_chunk(1, p[:-1], 6)
        elif action == "live":
            engine.prefill(1, p)
            engine.prefill_chunk(1, p, 4)
        elif action == "full":
            engine.prefill_batch([1, 2], [p, p])
            engine.prefill_chunk(3, p, 4)
        elif action == "batch_beside":  # the chunked prompt holds one of the two slots
            engine.prefill_chunk(1, p, 4)
            engine.prefill_batch([2, 3], [p, p])
        elif action == "batch_same_id":
            engine.prefill_chunk(1, p, 4)
            engine.prefill(1, p)
        elif action == "decode_it":
            engine.prefill_chunk(1, p, 4)
            engine.decode([1], [5])
        elif action == "empty":
            engine.prefill_chunk(1, [], 1)
        elif action == "bad_id":
            engine.prefill_chunk(1, [5, 448], 1)
    assert engine.live_count == (2 if action == "full" else 1 if action == "live" else 0)


@pytest.mark.parametrize("drop", ["release", "release_all"])
def test_a_dropped_chunked_prompt_frees_its_slot(tiny: TinyModelInfo, drop: str) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=32))
    p = list(range(5, 15))
    assert engine.prefill_chunk(1, p, 4) is None
    if drop == "release":
        engine.release(1)
    else:
        engine.release_all()
    with pytest.raises(EngineError, match="sequence 1 is not live"):
        engine.release(1)
    engine.prefill(2, p)  # both slots are free again: a live sequence and a new chunked prompt
    assert engine.prefill_chunk(3, p, 4) is None
    assert engine.prefill_chunk(3, p, 10) is not None
    assert engine.live_count == 2


@pytest.mark.parametrize("chunks", [(1, 4, 2, 5), (6, 6), (12,)], ids=lambda c: "+".join(map(str, c)))
def test_extend_equals_feeding_token_by_token(tiny: TinyModelInfo, reference: torch.nn.Module,
                                              chunks: tuple[int, ...]) -> None:
    """Jump-forward's multi-token forward, in a batch whose other rows feed one token (right padding,
    rows out of slot order): the logits after the last token equal the full recomputation's, and the
    rows that fed one token decode on exactly as alone."""
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=4, max_seq_len=128, initial_cache_len=4))
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    forced = engine.tokenizer.encode(" the quick brown fox jumps over the lazy dog").ids[:12]
    assert sum(chunks) == len(forced) == 12
    first = engine.prefill_batch([0, 1, 2], prompts)
    others = {1: [int(first[1].argmax())], 2: [int(first[2].argmax())]}
    fed = 0
    for k in chunks:
        tokens = np.zeros((3, k), np.int64)
        tokens[0, :k] = forced[fed:fed + k]
        tokens[1, 0], tokens[2, 0] = others[2][-1], others[1][-1]
        logits = engine.extend([0, 2, 1], tokens, np.array([k, 1, 1]))
        fed += k
        others[2].append(int(logits[1].argmax()))
        others[1].append(int(logits[2].argmax()))
    assert engine.length(0) == len(prompts[0]) + 12
    with torch.inference_mode():
        full = reference(torch.tensor([prompts[0] + forced]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(logits[0], full, rtol=1e-4, atol=1e-4)
    for i in (1, 2):
        assert others[i] == greedy_reference(reference, prompts[i], len(chunks) + 1)


def test_truncate_then_feed_equals_never_having_fed(tiny: TinyModelInfo, reference: torch.nn.Module) -> None:
    """A value check's drop: after truncating 3 fed tokens and feeding the last kept one again, the
    logits are the full recomputation's of the kept prefix (the stale positions stay hidden)."""
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=64))
    prompt = engine.tokenizer.encode(PROMPTS[0]).ids
    fed = engine.tokenizer.encode(" the quick brown fox jumps").ids[:5]
    engine.prefill_batch([0], [prompt])
    for token in fed:
        engine.decode([0], [token])
    engine.truncate(0, len(prompt) + 1)  # keeps fed[0]; fed[1] is fed again
    logits = engine.decode([0], [fed[1]])[0]
    assert engine.length(0) == len(prompt) + 2
    with torch.inference_mode():
        full = reference(torch.tensor([prompt + fed[:2]]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    with pytest.raises(EngineError, match=r"^sequence 0: cannot truncate \d+ cached tokens to 99$"):
        engine.truncate(0, 99)


@pytest.mark.parametrize(
    ("counts", "message"),
    [([0, 1], r"counts must be 2 values in 1\.\.3"), ([4, 1], r"counts must be 2 values in 1\.\.3"),
     ([1], r"counts must be 2 values")],
)
def test_extend_refuses_bad_counts(tiny: TinyModelInfo, counts: list[int], message: str) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=64))
    engine.prefill_batch([0, 1], [[5, 6], [7]])
    with pytest.raises(EngineError, match=message):
        engine.extend([0, 1], np.ones((2, 3), np.int64), np.array(counts))
    assert (engine.length(0), engine.length(1)) == (2, 1)  # nothing fed


@pytest.mark.parametrize(
    ("ids", "prompts", "error", "message"),
    [
        ([1, 1], [[1], [2]], EngineError, "a sequence id twice"),
        ([1], [[1], [2]], EngineError, "one prompt per sequence"),
        ([1, 2], [[1], []], RequestError, "must not be empty"),
        ([1, 2], [[1], [10**7]], RequestError, r"ids must be in \[0, "),
    ],
)
def test_batched_prefill_refuses_bad_batches_whole(tiny: TinyModelInfo, ids: list[int], prompts: list[list[int]],
                                                   error: type[Exception], message: str) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=4, max_seq_len=64))
    with pytest.raises(error, match=message):
        engine.prefill_batch(ids, prompts)
    assert engine.live_count == 0  # nothing registered


def test_release_moves_last_slot(tiny: TinyModelInfo, reference: torch.nn.Module) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=3, max_seq_len=128))
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    # Sequence 0 leaves first, so sequence 2 (last slot) moves into slot 0 mid-flight.
    outs = {i: [int(engine.prefill(i, p).argmax())] for i, p in enumerate(prompts)}
    for _ in range(3):
        ids = sorted(outs)
        logits = engine.decode(ids, [outs[i][-1] for i in ids])
        for row, i in enumerate(ids):
            outs[i].append(int(logits[row].argmax()))
    engine.release(0)
    done = {0: outs.pop(0)}
    for _ in range(5):
        ids = sorted(outs)
        logits = engine.decode(ids, [outs[i][-1] for i in ids])
        for row, i in enumerate(ids):
            outs[i].append(int(logits[row].argmax()))
    assert engine.length(2) == len(prompts[2]) + 8
    assert done[0] == greedy_reference(reference, prompts[0], 4)
    for i in (1, 2):
        assert outs[i] == greedy_reference(reference, prompts[i], 9)


def test_properties(tiny: TinyModelInfo) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=64))
    assert engine.vocab_size == tiny.vocab_size == 448
    assert engine.tokenizer.get_vocab_size() == tiny.tokenizer_size
    assert engine.eos_token_ids == frozenset({tiny.eos_token_id})
    assert engine.device == torch.device("cpu")
    logits = engine.prefill(7, [5, 6, 7])
    assert logits.dtype == torch.float32
    assert logits.shape == (448,)
    assert engine.length(7) == 3


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [
        ("dup_prefill", EngineError, "already live"),
        ("full", EngineError, "cache slots are taken"),
        ("subset", EngineError, "every live sequence"),
        ("unknown", EngineError, "not live"),
        ("twice", EngineError, "sequence id twice"),
        ("token_count", EngineError, r"decode got tokens of shape \(2, 1\) for 1 sequences"),
        ("empty_prompt", RequestError, "prompt_token_ids: must not be empty"),
        ("bad_id", RequestError, r"prompt_token_ids: ids must be in \[0, 448\)"),
        ("long_prompt", RequestError, "prompt_token_ids: 33 tokens exceed max_seq_len 32"),
        ("overflow", EngineError, "reached max_seq_len 32"),
    ],
)
def test_engine_misuse(tiny: TinyModelInfo, action: str, error: type[Exception], match: str) -> None:
    engine = TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=32))
    with pytest.raises(error, match=match):
        if action == "dup_prefill":
            engine.prefill(1, [5])
            engine.prefill(1, [5])
        elif action == "full":
            engine.prefill(1, [5])
            engine.prefill(2, [5])
            engine.prefill(3, [5])
        elif action == "subset":
            engine.prefill(1, [5])
            engine.prefill(2, [5])
            engine.decode([1], [5])
        elif action == "unknown":
            engine.prefill(1, [5])
            engine.decode([9], [5])
        elif action == "twice":
            engine.prefill(1, [5])
            engine.prefill(2, [5])
            engine.decode([2, 2], [5, 5])
        elif action == "token_count":
            engine.prefill(1, [5])
            engine.decode([1], [5, 6])
        elif action == "empty_prompt":
            engine.prefill(1, [])
        elif action == "bad_id":
            engine.prefill(1, [5, 448])
        elif action == "long_prompt":
            engine.prefill(1, [5] * 33)
        elif action == "overflow":
            engine.prefill(1, [5] * 31)
            engine.decode([1], [5])
            engine.decode([1], [5])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "tpu"}, "engine.device: must be 'cpu' or 'cuda"),
        ({"dtype": "float64"}, "engine.dtype: must be one of"),
        ({"max_batch_size": 0}, "engine.max_batch_size: must be a positive integer"),
        ({"max_seq_len": True}, "engine.max_seq_len: must be a positive integer"),
        ({"initial_cache_len": -1}, "engine.initial_cache_len: must be a positive integer"),
        ({"num_threads": 0}, "engine.num_threads: must be a positive integer or None"),
    ],
)
def test_engine_config_rejects(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TorchEngineConfig(**{"max_batch_size": 4, "max_seq_len": 256, **kwargs})  # type: ignore[arg-type]


def test_engine_rejects_bad_folders(tiny: TinyModelInfo, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_dir: .* is not a directory"):
        TorchEngine(tmp_path / "missing", TorchEngineConfig(max_batch_size=2, max_seq_len=256))
    with pytest.raises(ConfigError, match="model_dir: .* has no tokenizer.json"):
        TorchEngine(tmp_path, TorchEngineConfig(max_batch_size=2, max_seq_len=256))
    with pytest.raises(ConfigError, match="engine.max_seq_len: 2048 exceeds the model's max_position_embeddings 1024"):
        TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=2, max_seq_len=2048))


def test_smollm2_batched_equals_alone() -> None:
    engine = TorchEngine(assets.smollm2_dir(), TorchEngineConfig(max_batch_size=3, max_seq_len=256, initial_cache_len=32))
    assert engine.vocab_size == 49152
    assert 2 in engine.eos_token_ids
    tok = engine.tokenizer
    prompts = [
        tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
        for q in ("What is 2+2?", "Name a colour of the sky on a clear day.", "Hi")
    ]
    n = 8
    alone = [run_schedule(engine, [p], n, [0])[0] for p in prompts]
    assert run_schedule(engine, prompts, n, [0, 2, 4]) == alone
    # The model is real: the answer to the arithmetic question mentions 4.
    assert "4" in tok.decode(alone[0])
    assert np.all(np.array([len(a) for a in alone]) == n)
