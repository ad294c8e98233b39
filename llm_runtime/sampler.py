"""Token sampling: grammar mask -> penalties -> temperature -> top-k -> min-p -> top-p -> seeded draw.

Log probabilities (request field ``logprobs``, :meth:`Sampler.logprobs`) are
read between the penalties and the temperature: from the distribution the
grammar allows, not from the narrowed one a draw uses.

Masking touches the rows that carry a constraint only: float32 logits on the
CPU through :func:`mask_logits_cpu` (numpy, vectorized), others through
``xgrammar.apply_token_bitmask_inplace`` (its CUDA kernel on a GPU).  Masked
tokens get ``-inf`` logits, hence probability exactly
0, and the inverse-CDF draw below can never land on a zero-probability token
(see :meth:`Sampler._draw`), so a masked token is never sampled.  The
penalties come after the mask and move finite logits by finite amounts only:
a masked token stays at ``-inf``, and an allowed one stays possible (the only
allowed token is still drawn however much it repeats).

Every request draws from its own ``torch.Generator``, one uniform per output
token (a forced token a jump appends skips its uniform: the draws stay aligned
with the output's positions), so a seeded request reproduces its tokens
whatever else shares the batch.  One exception: jump widths follow measured
step costs, and a row whose jump was cut short samples the rest of its forced
text under the mask, where another tokenization may win.
"""

from __future__ import annotations

import math
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .mask import bitmask_width

__all__ = ["Sampler", "SamplingParams", "TokenCounts", "mask_logits_cpu"]

_U64 = 2**64


def mask_logits_cpu(logits: np.ndarray, bitmask: np.ndarray, vocab_size: int) -> None:
    """Set ``logits[i, j]`` to ``-inf`` where bit ``j`` of ``bitmask[i]`` is clear, in place.

    Parameters
    ----------
    logits : np.ndarray
        float32 ``[R, >= vocab_size]``; columns from ``vocab_size`` on are left alone.
    bitmask : np.ndarray
        int32 ``[R, ceil(vocab_size / 32)]`` in xgrammar's packing (bit ``j % 32``
        of word ``j // 32``), on a little-endian host: its bytes then unpack,
        least significant bit first, in token order.

    Notes
    -----
    xgrammar's CPU kernel tests one bit per token and writes the ``-inf``s one
    by one, skipping only words whose 32 tokens are all allowed.  Unpacking the
    inverted mask into a bool array and one ``np.copyto(where=...)`` costs the
    same whatever the mask holds: 16 rows of 49,152 tokens 0.55-0.70 ms against
    xgrammar's 0.25-2.5 ms (timed alone, no bench; docs/benchmarks.md, the
    serving path's third round).  It also stays inside the vocabulary, which
    xgrammar 0.2.9's kernel does not where the vocabulary is not a multiple
    of 32 and a row allows every token: it sets logit ``vocab_size`` of that
    row to ``-inf`` (33, 70 and 50,257 tokens, one stray write per such
    row), which in logits exactly ``vocab_size`` wide is the next row's first
    logit, or past the end of the last row.
    """
    rows = bitmask.shape[0]
    words = np.invert(np.ascontiguousarray(bitmask))
    disallowed = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    np.copyto(logits[:rows, :vocab_size], -np.inf, where=disallowed.view(np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes
    ----------
    temperature : float
        0 = greedy (argmax of the masked logits); otherwise logits are divided by it.
    top_k : int
        Keep the ``top_k`` most likely tokens (0 = all).
    top_p : float
        Keep the smallest set of most likely tokens whose mass reaches ``top_p``
        (1.0 = all); in ``(0, 1]``.
    seed : int or None
        Seed of the request's generator (uint64); ``None`` draws a random seed.
    repetition_penalty, frequency_penalty, presence_penalty, min_p : float
        See :data:`contract.PENALTY_FIELDS` (their neutral values turn them off;
        the penalties apply at temperature 0 too, before the argmax).
    logprobs : int or None
        Report each output token's log probability and this many alternatives
        (:meth:`Sampler.logprobs`); None: off.

    Trusted: the scheduler checked them against the request contract
    (:func:`contract.check_sampling`) before they got here.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies (the request then keeps :class:`TokenCounts`)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class TokenCounts:
    """How often each token occurs in one request's output, and which occur in its prompt.

    Kept only for a request with a penalty (:attr:`SamplingParams.penalized`):
    two dense rows of the vocabulary's width (float32 counts and a bool mask
    of the prompt: 0.25 MB for 49,152 tokens), so a step's penalty is a few
    vector operations on the logits row however long the output (the
    repetition penalty's two ``where`` over the whole row dominate; timings in
    docs/benchmarks.md), and adding a token is one indexed increment.

    Parameters
    ----------
    vocab_size : int
        The logits width.
    prompt : np.ndarray
        The prompt's token ids (the repetition penalty counts them; the
        frequency and presence penalties count the output only).
    device : torch.device
        Where the logits live.
    """

    __slots__ = ("counts", "in_prompt")

    def __init__(self, vocab_size: int, prompt: np.ndarray, device: torch.device) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[torch.as_tensor(prompt, dtype=torch.int64, device=device)] = True

    def add(self, tokens: Sequence[int], sign: float = 1.0) -> None:
        """Count ``tokens`` once more each (``sign=-1``: forget them, after a value check dropped them)."""
        if len(tokens) == 1:
            self.counts[tokens[0]] += sign
            return
        ids = torch.as_tensor(tokens, dtype=torch.int64, device=self.counts.device)
        self.counts.index_put_((ids,), torch.full(ids.shape, sign, device=self.counts.device), accumulate=True)

    def apply(self, row: torch.Tensor, p: SamplingParams) -> None:
        """Penalize ``row`` (one request's logits, masked) in place by ``p``'s penalties."""
        seen = self.counts > 0
        if p.repetition_penalty != 1.0:
            hit = seen | self.in_prompt
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(hit, scaled, row))
        if p.frequency_penalty != 0.0:
            row.sub_(self.counts * p.frequency_penalty)
        if p.presence_penalty != 0.0:
            row.sub_(seen.to(row.dtype) * p.presence_penalty)


class Sampler:
    """Batched masking and per-row sampling over a logits tensor.

    Parameters
    ----------
    vocab_size : int
        Logits width.
    token_limit : int or None
        Ids ``>= token_limit`` (padding rows of the output projection the tokenizer
        does not know) are never sampled; ``None`` = ``vocab_size``.
    device : torch.device or str
        Where the logits live (the generators are created there).
    """

    def __init__(self, vocab_size: int, *, token_limit: int | None = None, device: torch.device | str = "cpu") -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        limit = vocab_size if token_limit is None else token_limit
        if not 0 < limit <= vocab_size:
            raise ValueError(f"token_limit: must be in [1, {vocab_size}], got {limit}")
        self.vocab_size = vocab_size
        self.token_limit = limit
        self.width = bitmask_width(vocab_size)
        self.device = torch.device(device)
        # Imported here, not at module level: the llm model's TensorRT-LLM path
        # imports this module (through the scheduler's request checks) inside
        # TensorRT-LLM's environment, which keeps its own xgrammar pin and never masks here.
        import xgrammar

        self._apply_bitmask = xgrammar.apply_token_bitmask_inplace
        # float32 logits on the CPU are masked by mask_logits_cpu, which reads the packed words byte by byte.
        self._mask_on_host = self.device.type == "cpu" and sys.byteorder == "little"

    def generator(self, seed: int | None) -> torch.Generator:
        """A generator on :attr:`device`, seeded with ``seed`` (random when ``None``)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(secrets.randbits(63) if seed is None else seed)
        return gen

    def apply_mask(self, logits: torch.Tensor, bitmask: torch.Tensor | np.ndarray, rows: Sequence[int]) -> None:
        """Set the logits of disallowed tokens to ``-inf`` in place, for ``rows`` only.

        Parameters
        ----------
        logits : torch.Tensor
            float32 ``[B, vocab_size]``.
        bitmask : torch.Tensor or np.ndarray
            int32 ``[B, ceil(vocab_size / 32)]`` on the logits' device, aligned with
            the logits rows; rows not listed in ``rows`` are ignored.  A NumPy
            array where the logits are on the host: the grammar's answer as it
            came, with no copy into a tensor first.
        rows : sequence of int
            Batch rows that carry a constraint.
        """
        if not rows:
            return
        host = isinstance(bitmask, np.ndarray)
        if bitmask.dtype != (np.int32 if host else torch.int32) or bitmask.shape[-1] != self.width:
            raise ValueError(
                f"bitmask: expected int32 [B, {self.width}], got {bitmask.dtype} {tuple(bitmask.shape)}"
            )
        if host and self.device.type != "cpu":
            raise ValueError(f"bitmask: a NumPy array, for logits on {self.device}")
        if self._mask_on_host and logits.dtype == torch.float32:
            words = bitmask if isinstance(bitmask, np.ndarray) else bitmask.numpy()
            if _is_prefix(rows):
                mask_logits_cpu(logits.numpy(), words[: len(rows)], self.vocab_size)
            else:
                idx = torch.as_tensor(rows, dtype=torch.int64)
                sub = logits.index_select(0, idx)
                mask_logits_cpu(sub.numpy(), words[list(rows)], self.vocab_size)
                logits.index_copy_(0, idx, sub)
            return
        tensor = torch.from_numpy(bitmask) if isinstance(bitmask, np.ndarray) else bitmask
        self._apply_bitmask(logits, tensor, vocab_size=self.vocab_size, indices=list(rows))

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        taken: Sequence[int] | None = None,
        counts: Sequence[TokenCounts | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Draw one token per row (after :meth:`apply_mask`).

        Parameters
        ----------
        logits : torch.Tensor
            float32 ``[B, vocab_size]``; modified in place (ids past ``token_limit``
            are set to ``-inf``).
        params : sequence of SamplingParams
            One per row.
        generators : sequence of torch.Generator
            One per row (from :meth:`generator`).
        taken : sequence of int, optional
            Per row, how many forced tokens it appends instead of a drawn one
            (a jump; 0: it draws).  Such a row is not drawn (its token in the
            result is meaningless); its generator skips one uniform per token,
            as if each had been drawn in a step of its own where the mask
            allows that token only.
        counts : sequence of TokenCounts or None, optional
            Per row, the request's token counts (``None``: it has no penalty);
            applied to the row's logits (already masked) before anything else.

        Returns
        -------
        tokens : np.ndarray
            int64 ``[B]``.
        dead : np.ndarray
            bool ``[B]``: rows where no token is allowed (every logit ``-inf``);
            their token is meaningless.
        """
        b = logits.shape[0]
        if (len(params) != b or len(generators) != b or (taken is not None and len(taken) != b)
                or (counts is not None and len(counts) != b)):
            raise ValueError(f"sample: {b} logits rows, {len(params)} params, {len(generators)} generators"
                             + ("" if taken is None else f", {len(taken)} taken")
                             + ("" if counts is None else f", {len(counts)} counts"))
        if self.token_limit < self.vocab_size:
            logits[:, self.token_limit :] = -math.inf
        if counts is not None:
            for i, tc in enumerate(counts):
                if tc is not None and not (taken is not None and taken[i]):
                    tc.apply(logits[i], params[i])
        best = logits.max(dim=-1)
        tokens = best.indices.cpu().numpy().astype(np.int64, copy=True)
        dead = torch.isneginf(best.values).cpu().numpy()
        for i, p in enumerate(params):
            if p.temperature == 0 or dead[i]:
                continue
            skip = taken[i] if taken is not None else 0
            if skip:
                gen = generators[i]
                for _ in range(skip):  # a scalar draw each: far cheaper than drawing a whole row
                    torch.rand((), generator=gen, device=logits.device)
                continue
            tokens[i] = self._draw(logits[i], p, generators[i])
        return tokens, dead

    def logprobs(self, logits: torch.Tensor, rows: Sequence[int], tokens: np.ndarray,
                 k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log probabilities of the drawn tokens and the ``k`` most likely ones, for ``rows`` (after :meth:`sample`).

        The log-softmax of ``logits`` as :meth:`sample` left them: masked
        (:meth:`apply_mask`), ids past ``token_limit`` at ``-inf``, penalized;
        temperature, top-k, top-p and min-p only narrow the draw and are not
        applied (:func:`contract.check_logprobs`).  One batched computation
        for all the rows that asked; nothing for a step where none did (the
        caller does not call it).

        Parameters
        ----------
        logits : torch.Tensor
            float32 ``[B, vocab_size]``, as :meth:`sample` left them.
        rows : sequence of int
            The batch rows that report log probabilities (ascending).
        tokens : np.ndarray
            int64 ``[B]``: the tokens :meth:`sample` returned.
        k : int
            Alternatives per row (the largest any of the rows asked for; 0: none).

        Returns
        -------
        chosen : np.ndarray
            float32 ``[R]``: each row's drawn token's log probability.
        top_ids, top_logprobs : np.ndarray
            int64 and float32 ``[R, k]``: the ``k`` most likely tokens, most likely
            first; where the mask allows fewer than ``k`` tokens the rest have
            ``-inf`` log probabilities (disallowed tokens: never report them).
        """
        idx = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
        drawn = torch.as_tensor(tokens[list(rows)], dtype=torch.int64, device=logits.device)
        chosen = lp.gather(1, drawn.unsqueeze(1)).squeeze(1)
        if k:
            vals, ids = torch.topk(lp, min(k, lp.shape[1]), dim=-1)  # sorted, descending
            return chosen.cpu().numpy(), ids.cpu().numpy(), vals.cpu().numpy()
        empty = np.empty((len(rows), 0))
        return chosen.cpu().numpy(), empty.astype(np.int64), empty.astype(np.float32)

    def _draw(self, row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        x = row / p.temperature
        n = x.shape[0]
        idx: torch.Tensor | None = None
        if 0 < p.top_k < n:
            x, idx = torch.topk(x, p.top_k)  # sorted, descending
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            # The most likely token always stays (its probability is the bound's reference).
            probs = torch.where(probs >= probs.max() * p.min_p, probs, torch.zeros((), device=probs.device))
            probs = probs / probs.sum()  # top_p then measures the mass of what min_p kept
        if p.top_p < 1.0:
            if idx is None:
                probs, idx = self._nucleus_candidates(probs, p.top_p)
            cum = probs.cumsum(0)
            # Keep tokens up to and including the first one where the mass reaches top_p.
            keep = min(int(torch.searchsorted(cum, torch.tensor(p.top_p, device=cum.device))) + 1, probs.shape[0])
            probs = probs[:keep]
            idx = idx[:keep]
        cum = probs.cumsum(0)
        u = torch.rand((), generator=gen, device=probs.device) * cum[-1]
        # right=True returns the first j with cum[j] > u.  A zero-probability token
        # has cum[j] == cum[j-1] (or 0 for j == 0), so it is never that first j.
        j = int(torch.searchsorted(cum, u, right=True))
        if j >= probs.shape[0]:  # u rounded up to cum[-1]: take the last positive token
            j = int(torch.nonzero(probs).max())
        return int(idx[j]) if idx is not None else j

    @staticmethod
    def _nucleus_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Top tokens (descending) whose mass reaches ``top_p``, without a full sort.

        A full sort of a 49,152-wide row costs about fifty times a ``topk`` of
        64 on one CPU thread (timed alone: docs/benchmarks.md); nuclei of a
        trained model are usually small, so grow ``k`` by 8x until the mass is
        reached (exact: the last round may be the full row).
        """
        n = probs.shape[0]
        k = min(64, n)
        while True:
            vals, idx = torch.topk(probs, k)
            if k == n or float(vals.sum()) >= top_p:
                return vals, idx
            k = min(8 * k, n)


def _is_prefix(rows: Sequence[int]) -> bool:
    """Whether ``rows`` are ``0, 1, ..., len(rows) - 1`` (every row of a step is constrained: the usual case)."""
    return rows[-1] == len(rows) - 1 and rows[0] == 0 and all(r == i for i, r in enumerate(rows))
