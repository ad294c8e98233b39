"""Sampler: bitmask application, greedy, temperature / top-k / top-p, seeded draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xgrammar

from llm_runtime.mask import bitmask_width
from llm_runtime.sampler import Sampler, SamplingParams, TokenCounts, mask_logits_cpu

V = 70  # not a multiple of 32: the last bitmask word is partly padding

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [B, V] -> packed int32 [B, ceil(V/32)], bit j of word w = token 32*w + j."""
    b, v = allowed.shape
    w = bitmask_width(v)
    bits = np.zeros((b, w * 32), dtype=np.uint64)
    bits[:, :v] = allowed
    words = (bits.reshape(b, w, 32) << np.arange(32, dtype=np.uint64)).sum(axis=2)
    return words.astype(np.uint32).view(np.int32)


def random_case(seed: int, b: int = 4, density: float = 0.3) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(0, 3, size=(b, V)).astype(np.float32))
    allowed = rng.random((b, V)) < density
    allowed[:, 0] = True  # never empty
    return logits, allowed


def test_pack_matches_xgrammar_layout() -> None:
    """Our test packing agrees with xgrammar's own bitmask (filled by a real matcher)."""
    allowed = np.zeros((1, V), dtype=bool)
    allowed[0, [0, 31, 32, 33, 69]] = True
    logits = torch.zeros((1, V))
    xgrammar.apply_token_bitmask_inplace(logits, torch.from_numpy(pack(allowed)), vocab_size=V)
    assert torch.isneginf(logits[0]).numpy().tolist() == (~allowed[0]).tolist()


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 448, 49152])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 0.98, 1.0])
def test_host_masking_equals_xgrammars_kernel(vocab: int, density: float) -> None:
    """mask_logits_cpu sets exactly the -inf that xgrammar's kernel sets in the vocabulary, and leaves the
    columns past it alone (xgrammar 0.2.9's kernel may write one past it: compared on a padded copy)."""
    rng = np.random.default_rng(vocab)
    allowed = rng.random((3, vocab)) < density
    logits = torch.from_numpy(rng.normal(0, 3, size=(3, vocab + 5)).astype(np.float32))
    before, padded = logits.clone(), logits.clone()
    xgrammar.apply_token_bitmask_inplace(padded, torch.from_numpy(pack(allowed)), vocab_size=vocab)
    want = padded[:, :vocab]
    mask_logits_cpu(logits.numpy(), pack(allowed), vocab)
    assert torch.equal(logits[:, :vocab], want)
    assert torch.equal(logits[:, vocab:], before[:, vocab:])


def test_host_masking_of_rows_that_allow_everything_touches_nothing() -> None:
    """Every token allowed, a vocabulary not a multiple of 32, logits exactly as wide: no logit changes
    (xgrammar 0.2.9's CPU kernel sets the next row's first logit to -inf here)."""
    logits = torch.arange(3 * 33, dtype=torch.float32).reshape(3, 33)
    mask_logits_cpu(logits.numpy(), pack(np.ones((3, 33), bool)), 33)
    assert torch.equal(logits, torch.arange(3 * 33, dtype=torch.float32).reshape(3, 33))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=5.0, top_k=20),
        SamplingParams(temperature=3.0, top_p=0.99),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    ],
)
def test_masked_token_never_sampled(params: SamplingParams) -> None:
    sampler = Sampler(V)
    gens = [sampler.generator(i) for i in range(4)]
    for trial in range(150):
        logits, allowed = random_case(trial)
        sampler.apply_mask(logits, torch.from_numpy(pack(allowed)), [0, 1, 2, 3])
        tokens, dead = sampler.sample(logits, [params] * 4, gens)
        assert not dead.any()
        assert all(allowed[i, t] for i, t in enumerate(tokens)), (trial, tokens)


def test_greedy_picks_best_allowed_and_unconstrained_rows_are_untouched() -> None:
    sampler = Sampler(V)
    logits, allowed = random_case(7)
    original = logits.clone()
    allowed[2] = False  # an all-zero row that must be ignored (row 2 carries no constraint)
    sampler.apply_mask(logits, torch.from_numpy(pack(allowed)), [0, 1, 3])
    assert torch.equal(logits[2], original[2])
    tokens, dead = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 4, [sampler.generator(0)] * 4)
    best_allowed = np.where(allowed, original.numpy(), -np.inf).argmax(axis=1)
    assert tokens.tolist() == [best_allowed[0], best_allowed[1], int(original[2].argmax()), best_allowed[3]]
    assert not dead.any()


def test_dead_row_reported() -> None:
    sampler = Sampler(V)
    logits, allowed = random_case(3, b=2)
    allowed[1] = False
    sampler.apply_mask(logits, torch.from_numpy(pack(allowed)), [0, 1])
    _, dead = sampler.sample(logits, [SamplingParams(temperature=1.0)] * 2, [sampler.generator(1)] * 2)
    assert dead.tolist() == [False, True]


def test_seed_reproduces_and_differs() -> None:
    sampler = Sampler(V)
    logits, _ = random_case(11, b=1)

    def draw(seed: int) -> list[int]:
        gen = sampler.generator(seed)
        p = SamplingParams(temperature=3.0, seed=seed)
        return [int(sampler.sample(logits.clone(), [p], [gen])[0][0]) for _ in range(40)]

    assert draw(123) == draw(123)
    assert draw(123) != draw(124)


def test_seeded_row_independent_of_batch() -> None:
    """A request's draws depend on its own generator only, not on its batch neighbours."""
    sampler = Sampler(V)
    logits, _ = random_case(5, b=3)
    p = SamplingParams(temperature=2.0)
    alone_gen = sampler.generator(99)
    alone = [int(sampler.sample(logits[1:2].clone(), [p], [alone_gen])[0][0]) for _ in range(30)]
    gens = [sampler.generator(1), sampler.generator(99), sampler.generator(2)]
    batched = [int(sampler.sample(logits.clone(), [p] * 3, gens)[0][1]) for _ in range(30)]
    assert batched == alone


@pytest.mark.parametrize("jump", [1, 2, 5, 16])
def test_jumped_tokens_use_their_draws(jump: int) -> None:
    """Forced tokens appended by one jump skip the uniforms they would have drawn one step each (the mask
    allowing that token only), so the draws after them are the same whatever the jump width."""
    sampler = Sampler(V)
    logits, _ = random_case(7, b=1)
    p = SamplingParams(temperature=2.0, seed=5)
    one = np.zeros((1, V), dtype=bool)
    one[0, 3] = True
    stepwise = sampler.generator(5)
    for _ in range(jump):
        forced = logits.clone()
        sampler.apply_mask(forced, torch.from_numpy(pack(one)), [0])
        assert int(sampler.sample(forced, [p], [stepwise])[0][0]) == 3
    after_steps = [int(sampler.sample(logits.clone(), [p], [stepwise])[0][0]) for _ in range(20)]
    jumped = sampler.generator(5)
    sampler.sample(logits.clone(), [p], [jumped], [jump])
    after_jump = [int(sampler.sample(logits.clone(), [p], [jumped])[0][0]) for _ in range(20)]
    assert after_jump == after_steps
    if jump > 1:  # one draw for the whole jump (the old way) shifts every later token
        unskipped = sampler.generator(5)
        sampler.sample(logits.clone(), [p], [unskipped])
        assert [int(sampler.sample(logits.clone(), [p], [unskipped])[0][0]) for _ in range(20)] != after_steps


def test_taken_length_checked() -> None:
    sampler = Sampler(V)
    logits, _ = random_case(1, b=2)
    with pytest.raises(ValueError, match="sample: 2 logits rows, 2 params, 2 generators, 1 taken"):
        sampler.sample(logits, [SamplingParams()] * 2, [sampler.generator(0)] * 2, [0])


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_support(k: int) -> None:
    sampler = Sampler(V)
    logits, _ = random_case(21, b=1)
    top = set(torch.topk(logits[0], k).indices.tolist())
    gen = sampler.generator(0)
    seen = {int(sampler.sample(logits.clone(), [SamplingParams(temperature=10.0, top_k=k)], [gen])[0][0])
            for _ in range(400)}
    assert seen <= top
    assert len(seen) == k  # at temperature 10 every kept token shows up in 400 draws


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.95])
def test_top_p_support(top_p: float) -> None:
    sampler = Sampler(V)
    logits, _ = random_case(31, b=1)
    probs = torch.softmax(logits[0], -1).double().numpy()
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, top_p)) + 1].tolist())
    gen = sampler.generator(0)
    seen = {int(sampler.sample(logits.clone(), [SamplingParams(top_p=top_p)], [gen])[0][0]) for _ in range(600)}
    assert seen <= nucleus
    # Tokens in the nucleus with probability >= 2% are all drawn in 600 tries (fixed seed).
    assert {t for t in nucleus if probs[t] >= 0.02} <= seen


def test_token_limit_excludes_padding_ids() -> None:
    sampler = Sampler(V, token_limit=40)
    logits = torch.zeros((2, V))
    logits[:, 50] = 100.0  # best token is a padding id
    tokens, _ = sampler.sample(
        logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
        [sampler.generator(0), sampler.generator(1)],
    )
    assert all(t < 40 for t in tokens)


def test_draw_frequencies_follow_softmax() -> None:
    sampler = Sampler(4)
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), -math.inf]])
    gen = sampler.generator(2024)
    counts = np.zeros(4)
    for _ in range(6000):
        counts[int(sampler.sample(logits.clone(), [SamplingParams(temperature=1.0)], [gen])[0][0])] += 1
    assert counts[3] == 0
    assert np.allclose(counts[:3] / 6000, [1 / 6, 2 / 6, 3 / 6], atol=0.02)


@pytest.mark.parametrize(("rows", "dtype"), [([0, 1, 2, 3], torch.float32), ([0, 1, 3], torch.float32),
                                           ([1, 2], torch.float32), ([0, 1, 2, 3], torch.bfloat16)],
                         ids=["every-row", "some-rows", "later-rows", "bfloat16-logits"])
def test_a_numpy_bitmask_masks_as_its_tensor_does(rows: list[int], dtype: torch.dtype) -> None:
    """The decode loop hands the grammar's answer to the sampler as it came (a NumPy view), on the host."""
    sampler = Sampler(V)
    logits, allowed = random_case(11)
    logits = logits.to(dtype)
    through_tensor = logits.clone()
    sampler.apply_mask(through_tensor, torch.from_numpy(pack(allowed)), rows)
    sampler.apply_mask(logits, pack(allowed), rows)
    assert torch.equal(logits, through_tensor)
    masked = torch.isinf(logits.float()).numpy()
    assert (masked[rows] == ~allowed[rows]).all()  # exactly the disallowed tokens of the listed rows
    assert not masked[[r for r in range(4) if r not in rows]].any()


@pytest.mark.parametrize(
    "bitmask",
    [torch.zeros((1, 2), dtype=torch.int32), np.zeros((1, 2), np.int32), np.zeros((1, 3), np.int64)],
    ids=["tensor-width", "numpy-width", "numpy-dtype"],
)
def test_apply_mask_rejects_wrong_bitmask(bitmask: torch.Tensor | np.ndarray) -> None:
    sampler = Sampler(V)
    with pytest.raises(ValueError, match=r"bitmask: expected int32 \[B, 3\]"):
        sampler.apply_mask(torch.zeros((1, V)), bitmask, [0])


# --------------------------------------------------------------------------- penalties and min_p
def _counts(prompt: list[int], output: list[int]) -> TokenCounts:
    tc = TokenCounts(V, np.asarray(prompt, dtype=np.int64), torch.device("cpu"))
    if output:
        tc.add(output)
    return tc


# (params, prompt, output, token: its expected logit from 2.0 (positive) / -2.0 (negative))
PENALTY_TABLE = [
    pytest.param(SamplingParams(temperature=0.0, repetition_penalty=2.0), [5], [], 5, (1.0, -4.0), id="rep-prompt"),
    pytest.param(SamplingParams(temperature=0.0, repetition_penalty=2.0), [], [5, 5], 5, (1.0, -4.0), id="rep-output"),
    pytest.param(SamplingParams(temperature=0.0, repetition_penalty=0.5), [], [5], 5, (4.0, -1.0), id="rep-below-1"),
    pytest.param(SamplingParams(temperature=0.0, repetition_penalty=2.0), [6], [7], 5, (2.0, -2.0), id="rep-unseen"),
    pytest.param(SamplingParams(temperature=0.0, frequency_penalty=0.5), [5, 5], [5, 5, 5], 5, (0.5, -3.5),
                 id="freq-output-only"),
    pytest.param(SamplingParams(temperature=0.0, presence_penalty=1.5), [5], [5, 5, 5], 5, (0.5, -3.5),
                 id="presence-once"),
    pytest.param(SamplingParams(temperature=0.0, presence_penalty=1.5), [5], [], 5, (2.0, -2.0),
                 id="presence-not-prompt"),
    pytest.param(SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=0.5), [], [5, 5], 5,
                 (3.5, -0.5), id="negative-frequency"),
]


@pytest.mark.parametrize(("params", "prompt", "output", "token", "expected"), PENALTY_TABLE)
def test_penalty_moves_the_logit_by_the_rule(params: SamplingParams, prompt: list[int], output: list[int],
                                             token: int, expected: tuple[float, float]) -> None:
    for start, want in zip((2.0, -2.0), expected, strict=True):
        row = torch.zeros(V)
        row[token] = start
        before = row.clone()
        _counts(prompt, output).apply(row, params)
        assert float(row[token]) == want
        others = torch.ones(V, dtype=torch.bool)
        others[token] = False
        moved = {*prompt, *output} - {token}
        for t in moved:
            others[t] = False
        assert torch.equal(row[others], before[others])


def test_penalties_keep_masked_tokens_masked_and_the_only_allowed_token_possible() -> None:
    """After the mask: -inf stays -inf whatever the counts, and a token allowed alone is drawn however often it repeats."""
    sampler = Sampler(V)
    allowed = np.zeros((2, V), dtype=bool)
    allowed[:, 9] = True
    hot = [9] * 500 + list(range(V))  # every token seen, token 9 500 times
    strong = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0,
                             min_p=1.0, seed=3)]
    for _ in range(20):
        logits = torch.randn(2, V) * 5
        sampler.apply_mask(logits, torch.from_numpy(pack(allowed)), [0, 1])
        counts = [_counts(hot, hot), _counts(hot, hot)]
        tokens, dead = sampler.sample(logits, strong, [sampler.generator(0), sampler.generator(1)], None, counts)
        assert tokens.tolist() == [9, 9] and not dead.any()
        assert torch.isneginf(logits[:, :9]).all() and torch.isneginf(logits[:, 10:]).all()


def test_greedy_with_a_penalty_takes_the_penalized_argmax_and_unpenalized_rows_stay() -> None:
    sampler = Sampler(V)
    logits = torch.zeros(2, V)
    logits[:, 3], logits[:, 4] = 5.0, 4.0
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    tokens, _ = sampler.sample(logits, [p, p], [sampler.generator(0)] * 2, None, [_counts([], [3]), None])
    assert tokens.tolist() == [4, 3]  # 5 - 2 < 4 on row 0; row 1 has no counts


def test_counts_forget_dropped_tokens() -> None:
    tc = _counts([], [3, 3, 4])
    tc.add([3, 4], -1.0)
    assert tc.counts[3].item() == 1.0 and tc.counts[4].item() == 0.0
    tc.add((4,))
    assert tc.counts[4].item() == 1.0


def test_counts_length_checked() -> None:
    sampler = Sampler(V)
    with pytest.raises(ValueError, match=r"^sample: 2 logits rows, 2 params, 2 generators, 1 counts$"):
        sampler.sample(torch.zeros(2, V), [SamplingParams()] * 2, [sampler.generator(0)] * 2, None, [None])


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_samples_only_tokens_near_the_best(min_p: float) -> None:
    sampler = Sampler(V)
    logits = torch.from_numpy(np.random.default_rng(1).normal(0, 2, size=(1, V)).astype(np.float32))
    probs = torch.softmax(logits[0], -1)
    keep = set(torch.nonzero(probs >= probs.max() * min_p).reshape(-1).tolist())
    gen = sampler.generator(5)
    p = SamplingParams(temperature=1.0, min_p=min_p)
    seen = {int(sampler.sample(logits.clone(), [p], [gen])[0][0]) for _ in range(400)}
    assert seen <= keep
    assert len(seen) >= min(len(keep), 2)


# -- log probabilities (request field logprobs) -----------------------------------------------------------------
LOGPROB_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.3, top_k=2),
    SamplingParams(temperature=1.0, top_p=0.5, min_p=0.2),
    SamplingParams(temperature=2.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logprobs_are_the_masked_distribution_before_temperature(seed: int) -> None:
    """Over the tokens the mask allows they sum to one, masked tokens are never among them, the drawn
    token's is its own, and they are the same whatever the temperature, top-k, top-p and min-p."""
    sampler = Sampler(V)
    logits, allowed = random_case(seed)
    sampler.apply_mask(logits, torch.from_numpy(pack(allowed)), range(4))
    expected = torch.log_softmax(logits, dim=-1)  # masked, untempered, untruncated
    gens = [sampler.generator(i) for i in range(4)]
    tokens, dead = sampler.sample(logits, LOGPROB_PARAMS, gens)
    assert not dead.any()
    chosen, ids, lps = sampler.logprobs(logits, [0, 1, 2, 3], tokens, V)
    assert ids.shape == lps.shape == (4, V)
    for r in range(4):
        finite = np.isfinite(lps[r])
        assert set(ids[r][finite].tolist()) == set(np.flatnonzero(allowed[r]).tolist())  # masked: never there
        assert math.isclose(float(np.exp(lps[r][finite].astype(np.float64)).sum()), 1.0, rel_tol=1e-5)
        assert (np.diff(lps[r][finite]) <= 0).all()  # most likely first
        assert np.allclose(lps[r], expected[r, torch.from_numpy(ids[r])].numpy(), atol=1e-6)
        assert chosen[r] == pytest.approx(float(expected[r, tokens[r]]), abs=1e-6)
        assert chosen[r] <= 0.0
    assert chosen[0] == pytest.approx(float(lps[0, 0]), abs=1e-6)  # greedy draws the most likely


@pytest.mark.parametrize("k", [0, 1, 3])
def test_logprobs_top_k_and_rows(k: int) -> None:
    """Only the rows that ask are computed (one batched pass), k alternatives each; k=0: none."""
    sampler = Sampler(V)
    logits, _ = random_case(7, b=3, density=1.0)
    tokens, _ = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, [sampler.generator(0)] * 3)
    chosen, ids, lps = sampler.logprobs(logits, [0, 2], tokens, k)
    assert chosen.shape == (2,) and ids.shape == lps.shape == (2, k)
    assert (ids.dtype, lps.dtype) == (np.int64, np.float32)
    best = torch.topk(torch.log_softmax(logits[[0, 2]], -1), k)
    assert ids.tolist() == best.indices.tolist()
    assert np.allclose(lps, best.values.numpy())


def test_logprobs_follow_the_penalties_and_padding() -> None:
    """Read after the penalties (and with ids past token_limit at -inf): the logits a draw starts from."""
    sampler = Sampler(V, token_limit=V - 6)
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4] = 5.0, 4.0
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    tokens, _ = sampler.sample(logits, [p], [sampler.generator(0)], None, [_counts([], [3])])
    chosen, _, lps = sampler.logprobs(logits, [0], tokens, V)
    penalized = torch.zeros(V - 6)
    penalized[3], penalized[4] = 3.0, 4.0
    assert tokens.tolist() == [4]
    assert chosen[0] == pytest.approx(float(torch.log_softmax(penalized, -1)[4]), abs=1e-6)
    assert int(np.isfinite(lps[0]).sum()) == V - 6  # padding ids are never alternatives
