"""Prompt-lookup speculation: draft tokens copied from earlier in the sequence, no draft model.

An output that copies from its input (an extraction, a quoted field, code
edited in place, a JSON value repeated from the prompt) repeats runs of tokens
the sequence already holds.  :class:`PromptLookup` proposes, after a
sequence's last tokens, the tokens that followed the most recent earlier
occurrence of its last ``n`` tokens (``n`` from :data:`NGRAM_MAX` down to
:data:`NGRAM_MIN`: the longest match first), as vLLM's and TensorRT-LLM's
n-gram drafters do.  The scheduler (:mod:`llm_runtime.scheduler`) feeds them
after the row's token in the step's one forward, has the grammar mask each
draft position (a draft the grammar forbids is never accepted), and keeps the
drafts the target samples, one position at a time.

The index maps each n-gram to the position after its latest occurrence whose
next token is known, so a proposal is one dictionary lookup per ``n``, and
each new token adds one entry per ``n``.  A sequence whose drafts are all
rejected backs off (:data:`MAX_BACKOFF_STEPS`): on SmolLM2 at 4 streams,
open generation lost 7-10 % of its tokens per second to drafts the model did
not follow without it (docs/benchmarks.md, prompt-lookup speculation).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import numpy as np

__all__ = ["MAX_BACKOFF_STEPS", "NGRAM_MAX", "NGRAM_MIN", "PromptLookup"]

#: The longest n-gram looked up (a longer match predicts its continuation better, and is tried first).
NGRAM_MAX: Final = 4
#: The shortest: a two-token match (one token matches too often to predict anything).
NGRAM_MIN: Final = 2
#: A row whose drafts were all rejected waits 1, 2, 4, ... steps (at most this many) before it drafts again,
#: until one is kept: every row of a step pays for its widest row of drafts, and where the output stops
#: copying its input the lookup keeps finding matches the model does not follow.
MAX_BACKOFF_STEPS: Final = 16
#: The chance a next draft is kept, before a sequence has drafted (and what it drifts back to while it
#: does not draft, so a sequence whose drafts stopped paying tries again).
PRIOR_ACCEPTANCE: Final = 0.5
#: Weight of a proposal's outcome in :attr:`PromptLookup.acceptance`, and of the prior's pull per step
#: without drafts.
_EMA: Final = 0.3
_DRIFT: Final = 0.05


class PromptLookup:
    """One sequence's tokens and the index of its n-grams.

    Parameters
    ----------
    prompt : numpy.ndarray
        The prompt's tokens (int).
    """

    __slots__ = ("_index", "_misses", "_tokens", "_wait", "acceptance")

    def __init__(self, prompt: np.ndarray) -> None:
        #: The chance this sequence's next draft is kept (a moving estimate: :meth:`kept`), for the step's
        #: choice of how many drafts pay (:meth:`llm_runtime.grammar_phase.JumpPolicy.draft_width`).
        self.acceptance = PRIOR_ACCEPTANCE
        self._misses = 0  # proposals in a row whose drafts were all rejected
        self._wait = 0  # steps left before the next proposal
        self._tokens: list[int] = []
        # _index[n - NGRAM_MIN]: n-gram -> the position right after its latest occurrence with a known next token.
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM_MIN, NGRAM_MAX + 1)]
        self.extend(prompt.tolist())

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (sampled, jumped or accepted) to the sequence."""
        toks, index = self._tokens, self._index
        for t in tokens:
            end = len(toks)
            # The n-grams ending here get their next token now: they become proposable.
            for k, table in enumerate(index):
                n = k + NGRAM_MIN
                if end >= n:
                    table[tuple(toks[end - n : end])] = end
            toks.append(t)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a value check dropped the rest); the index is rebuilt."""
        if length >= len(self._tokens):
            return
        kept = self._tokens[:length]
        self._tokens = []
        for table in self._index:
            table.clear()
        self.extend(kept)

    def kept(self, count: int, fed: int) -> None:
        """The target kept ``count`` of the ``fed`` drafts of the last proposal (0: all rejected: back off).

        Each draft is kept with chance :attr:`acceptance` while the ones before it were: ``count`` kept
        and, where one was rejected, that one, measure it as ``count / (count + 1)``.
        """
        seen = count / (count + 1) if count < fed else 1.0
        self.acceptance += _EMA * (seen - self.acceptance)
        if count:
            self._misses = 0
        else:
            self._misses += 1
            self._wait = min(MAX_BACKOFF_STEPS, 1 << (self._misses - 1))

    def idle(self) -> None:
        """A step without drafts from this sequence: :attr:`acceptance` drifts back to the prior."""
        self.acceptance += _DRIFT * (PRIOR_ACCEPTANCE - self.acceptance)

    def propose(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the sequence's last n-gram
        (none while it backs off, :meth:`kept`)."""
        toks = self._tokens
        end = len(toks)
        if self._wait:
            self._wait -= 1
            return ()
        if limit <= 0:
            return ()
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if end <= n:
                continue
            at = self._index[n - NGRAM_MIN].get(tuple(toks[end - n :]))
            if at is not None:
                return tuple(toks[at : at + limit])
        return ()
