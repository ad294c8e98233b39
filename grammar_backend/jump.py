"""Jump-forward: the text a grammar forces, as the tokens the model's tokenizer would use.

When a grammar admits only one continuation (``{"name":`` after the start
of an object with a required ``name``), the decode loop can append it
without sampling and feed all of it in one forward.  xgrammar finds the
forced text (``GrammarMatcher.find_jump_forward_string``: whole UTF-8
characters only, so a jump never splits one).  :class:`JumpForward` spells
it with the model's own tokenizer, since xgrammar's own
``find_jump_forward_tokens`` is a greedy longest match the model never saw
in training, and decides where the jump must stop:

* The last token is held back when the grammar lets a longer token continue
  it (``":`` when the value may start with ``"``, so ``":"`` stays
  possible): the model then chooses how to cross that boundary, as it would
  have without the jump.  It is kept when no longer token is allowed there
  (``":`` before an integer value), which xgrammar's vocabulary-only rule
  (hold back whenever a longer token exists at all) does not see: it cut
  the forwards per request on each of ``bench/jump_bench.py``'s four schemas
  (206 -> 194 for the order; the others in docs/benchmarks.md).  The check
  accepts the other tokens into the matcher, fills one mask row and rolls
  back (only on steps that jump).
* The tokens must spell exactly the forced bytes and hold no special or
  stop token, or there is no jump (counted in ``JumpStats.skipped``):
  tokenizers that normalise text (a SentencePiece prefix space) do not
  round-trip, and a forced ``<|im_end|>`` must stay text.

The tokens are not accepted here: the decode loop feeds them back as the
row's next tokens and the next step accepts them into the matcher in order,
exactly like sampled tokens.  The encoding is of the forced run on its own,
from the current token boundary: tokens already generated are never
re-spelled.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xgrammar as xgr

from grammar_backend.bitmask import Matcher, pack_tokens
from grammar_backend.closing import UTF8_MAX_OWED, utf8_owed
from grammar_backend.lru import Lru
from grammar_backend.protocol import bitmask_width

__all__ = ["JumpForward", "JumpStats", "pack_forced"]

#: Most pieces whose packed "longer tokens" mask is kept (19 KB each with Qwen3's vocabulary).
_LONGER_CACHE = 256

#: Most forced runs whose spelling is kept.
_SPELLED_CACHE = 4096

#: Encodes text with the model's tokenizer, without special tokens.
Encoder = Callable[[str], Sequence[int]]


@dataclass
class JumpStats:
    """Counters of :meth:`JumpForward.tokens` (since the engine started).

    Attributes
    ----------
    jumps : int
        Calls that returned tokens.
    tokens : int
        Tokens returned.
    skipped : int
        Forced runs given up: the tokenizer's spelling did not round-trip,
        or held a special token.
    """

    jumps: int = 0
    tokens: int = 0
    skipped: int = 0


class PrefixIndex:
    """The tokenizer's ordinary tokens sorted by spelling: the ones that start with a piece are a contiguous run.

    Built once per engine (a sort of the whole vocabulary) and shared by
    jump-forward and the value checks.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self.vocab: list[bytes] = [bytes(p) for p in tokenizer_info.decoded_vocab]
        self.special = frozenset(int(t) for t in (*tokenizer_info.special_token_ids, *tokenizer_info.stop_token_ids))
        ordinary = sorted((p, t) for t, p in enumerate(self.vocab) if p and t not in self.special)
        self._sorted = [p for p, _ in ordinary]
        self._sorted_ids = np.array([t for _, t in ordinary], dtype=np.int64)
        self._char_rows: dict[int, tuple[np.ndarray, ...]] = {}  # vocab_size -> char_rows

    def char_rows(self, vocab_size: int) -> tuple[np.ndarray, ...]:
        """Packed masks ``k = 0..UTF8_MAX_OWED``: the tokens that, after a text owing ``k`` UTF-8
        continuation bytes, leave it on a character boundary or closer to one (built once).

        Row ``k`` holds the tokens of continuation bytes only, at most ``k``
        of them (they go on with the character begun), and the tokens of
        exactly ``k`` continuation bytes followed by text that ends on a
        boundary; row 0 the tokens that end on one.  None begins a character
        it does not end, so at most ``k`` tokens of these rows reach a
        boundary and row 0 keeps the text there.
        """
        rows_of = self._char_rows.get(vocab_size)
        if rows_of is None:
            rows: list[list[int]] = [[] for _ in range(UTF8_MAX_OWED + 1)]
            for token, piece in enumerate(self.vocab):
                if not piece:  # spells nothing (special tokens, whose masks are decided elsewhere)
                    rows[0].append(token)
                    continue
                lead = 0
                while lead < len(piece) and 0x80 <= piece[lead] < 0xC0:
                    lead += 1
                if lead == len(piece):
                    for k in range(lead, UTF8_MAX_OWED + 1):
                        rows[k].append(token)
                elif lead <= UTF8_MAX_OWED and utf8_owed(0, piece[lead:]) == 0:
                    rows[lead].append(token)
            rows_of = self._char_rows[vocab_size] = tuple(pack_tokens(r, vocab_size) for r in rows)
        return rows_of

    def starting(self, piece: bytes, *, longer: bool = False) -> np.ndarray:
        """Ids of the ordinary tokens that start with ``piece`` (``longer``: other than ``piece`` itself)."""
        lo = (bisect.bisect_right if longer else bisect.bisect_left)(self._sorted, piece)
        hi = lo
        while hi < len(self._sorted) and self._sorted[hi].startswith(piece):
            hi += 1
        return self._sorted_ids[lo:hi]


class JumpForward:
    """Canonical jump-forward tokens for a matcher's current state.

    Parameters
    ----------
    tokenizer_info : xgrammar.TokenizerInfo
        The vocabulary the matchers use.
    encode : callable
        ``text -> token ids`` with the model's tokenizer, no special tokens
        added (``tokenizer.encode(text, add_special_tokens=False)``).
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, encode: Encoder, index: PrefixIndex | None = None) -> None:
        self._index = index if index is not None else PrefixIndex(tokenizer_info)
        self._vocab = self._index.vocab
        self._special = self._index.special
        self._encode = encode
        self._vocab_size = int(tokenizer_info.vocab_size)
        self._longer: Lru[int, np.ndarray] = Lru(_LONGER_CACHE)
        # Forced runs repeat (the same keys in every object of a schema): a lookup
        # costs a small part of spelling one with the tokenizer.
        self._spelled: Lru[str, tuple[int, ...]] = Lru(_SPELLED_CACHE)
        # numpy, which both backends' matchers fill.
        self._row = np.zeros((1, bitmask_width(self._vocab_size)), dtype=np.int32)
        self._row_words = self._row[0]
        self.stats = JumpStats()

    def tokens(self, matcher: Matcher) -> tuple[int, ...]:
        """The forced continuation of ``matcher``, canonically tokenized (``()``: none).

        The matcher is left as it was.
        """
        text = matcher.find_jump_forward_string()
        if not text:
            return ()
        ids = self._spelled.get(text)
        if ids is None:
            ids = self._spelled.put(text, self._spell(text))
        if not ids:
            self.stats.skipped += 1
            return ()
        if self._continued(matcher, ids):
            ids = ids[:-1]
        if ids:
            self.stats.jumps += 1
            self.stats.tokens += len(ids)
        return ids

    def _spell(self, text: str) -> tuple[int, ...]:
        """The tokenizer's spelling of ``text``, or ``()`` when it does not round-trip or holds a special token."""
        ids = tuple(int(t) for t in self._encode(text))
        vocab = self._vocab
        if any(t in self._special or t >= len(vocab) for t in ids) or b"".join(vocab[t] for t in ids) != text.encode():
            return ()
        return ids

    def _continued(self, matcher: Matcher, ids: tuple[int, ...]) -> bool:
        """Whether, after ``ids[:-1]``, the grammar allows a token longer than ``ids[-1]`` that starts with it."""
        longer = self._longer_than(ids[-1])
        if not longer.size:
            return False
        accepted = 0
        try:
            for t in ids[:-1]:
                if not matcher.accept_token(t):
                    return True  # cannot tell (never seen: the text is forced): hold back, the safe side
                accepted += 1
            matcher.fill_next_token_bitmask(self._row, 0)
        finally:
            if accepted:
                matcher.rollback(accepted)
        return bool(np.bitwise_and(self._row_words, longer).any())

    def _longer_than(self, token: int) -> np.ndarray:
        """The packed mask of the ordinary tokens longer than ``token`` that start with it (empty: none).

        Packed, because a piece like ``" "`` starts 53,020 of Qwen3's tokens:
        gathering their bits cost 136 us a call, the packed AND 6-8 us (timed
        alone; ``bench/grammar_step_bench.py --jump-forward`` times the whole step).  Kept
        for the last tokens of forced runs seen (a few dozen pieces: ``":``,
        ``",``, ``"``...), bounded by :data:`_LONGER_CACHE`.
        """
        cached = self._longer.get(token)
        if cached is None:
            ids = self._index.starting(self._vocab[token], longer=True)
            cached = self._longer.put(token, pack_tokens(ids, self._vocab_size) if ids.size else np.zeros(0, np.int32))
        return cached


def pack_forced(forced: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row forced tokens as the wire arrays: int32 ``[B, F]`` (right-padded with 0) and counts ``[B]``."""
    rows = len(forced)
    lengths = [len(f) for f in forced]
    counts = np.array(lengths, np.int32)
    tokens = np.zeros((rows, max(lengths, default=0)), np.int32)
    for i, toks in enumerate(forced):
        if toks:
            tokens[i, : len(toks)] = toks
    return tokens, counts
