"""The preallocated token bitmask, filled for a whole batch in one call per backend."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final, Protocol

import llguidance
import llguidance.numpy
import numpy as np
import xgrammar as xgr

from grammar_backend.errors import ConfigError, GrammarError
from grammar_backend.llg import LlgMatcher
from grammar_backend.protocol import bitmask_width


class Matcher(Protocol):
    """One sequence's matcher: the part of xgrammar's ``GrammarMatcher`` the engine,
    the closer and jump-forward use (:class:`grammar_backend.llg.LlgMatcher` has it too).

    ``rollback(n)`` undoes the last ``n`` accepted tokens or strings.
    """

    def accept_token(self, token: int, /) -> bool: ...
    def accept_string(self, text: str, /) -> bool: ...
    def rollback(self, steps: int, /) -> object: ...
    def is_terminated(self) -> bool: ...
    def is_completed(self) -> bool: ...
    def find_jump_forward_string(self) -> str: ...
    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0, /) -> object: ...

#: All 32 bits set: every token of the word allowed.
ALL_ALLOWED = np.int32(-1)
#: xgrammar's rows go to its ``threads`` only where their last fill took this long or longer; below it, to one.
#: ``BatchGrammarMatcher(n)`` starts ``n`` threads at every call (its pool "cannot be reused after Join()",
#: ``cpp/grammar_matcher.cc``): 64 Qwen3 rows after 2 tokens of their paths filled in 0.06-0.09 ms on one
#: thread and 0.17-0.22 ms on two, while states costing 0.7-1.7 ms filled in 0.53-0.87x the time on two
#: (``bench/grammar_step_bench.py --fill-states --threads 2``, 2-CPU host).  The crossover, ``F = F / 2 +
#: 0.14 ms``, is near 0.3 ms.
XGRAMMAR_SPREAD_MIN_S: Final = 0.3e-3





class BitmaskBuffer:
    """One int32 ``[max_batch, ceil(V/32)]`` buffer reused at every step.

    Bit ``t % 32`` of word ``t // 32`` of a row is set when token ``t`` is
    allowed (xgrammar's packing; ``apply_token_bitmask_inplace`` reads it).

    Parameters
    ----------
    max_batch : int
        Most rows a step can have.
    vocab_size : int
        The model's padded vocabulary size (logits width).
    threads : int
        Threads of ``xgrammar.BatchGrammarMatcher`` and of llguidance's
        ``LLExecutor`` for the batch fill.  xgrammar's rows take them only
        where their last fill took ``spread_min_s`` or longer.
    spread_min_s : float
        :data:`XGRAMMAR_SPREAD_MIN_S` (0: xgrammar's rows always take every
        thread).  The first fill, with no cost to go by, is on one thread
        unless this is 0.
    """

    def __init__(self, max_batch: int, vocab_size: int, threads: int = 1, *,
                 spread_min_s: float = XGRAMMAR_SPREAD_MIN_S) -> None:
        if max_batch <= 0 or vocab_size <= 0 or threads <= 0:
            raise ConfigError("bitmask: max_batch, vocab_size and threads must be positive")
        if not spread_min_s >= 0:
            raise ConfigError(f"bitmask: spread_min_s must be >= 0, not {spread_min_s}")
        self.max_batch = max_batch
        self.threads = threads
        self.width = bitmask_width(vocab_size)
        self.buffer = np.full((max_batch, self.width), ALL_ALLOWED, dtype=np.int32)
        self._batch = xgr.BatchGrammarMatcher(1)
        self._spread = xgr.BatchGrammarMatcher(threads) if threads > 1 else None
        self._spread_min_s = spread_min_s
        self._xgrammar_row_s = 0.0  # seconds a row at the last fill of xgrammar rows: the next one's estimate
        #: Threads xgrammar's rows of the last fill were given (1 or ``threads``).
        self.xgrammar_threads = 1
        # One thread: llguidance's rows are filled in a plain loop, faster than
        # a one-thread LLExecutor at 16 rows of the tiny vocabulary and equal at
        # 64 of Qwen3's (no bench compares the two; figures: docs/benchmarks.md).
        self._executor = llguidance.LLExecutor(threads) if threads > 1 else None
        self._one: Any = None  # a one-thread LLExecutor, made on the first fill_rows(one_call=True)
        #: The rows the last :meth:`fill` wrote: this buffer, or the caller's; :meth:`force` and the others edit them.
        self.filled: np.ndarray = self.buffer
        # Reused per step so the step path allocates only the backends' own lists.
        self._active: list[xgr.GrammarMatcher] = []
        self._rows: list[int] = []
        self._llg_rows: list[tuple[Any, int]] = []
        # llguidance rows by template (LlgMatcher.family), handed to the executor one family after the other:
        # its threads take the list in contiguous runs (rayon halves it), and copies of one template take turns
        # at its lexer (grammar_backend.llg.LlgCompiled).
        self._llg_families: list[list[tuple[Any, int]]] = [[] for _ in range(threads)]

    def fill(self, matchers: Sequence[Matcher | None], out: np.ndarray | None = None) -> np.ndarray:
        """Fill rows ``0..len(matchers)`` and return that view of the buffer (or ``out``).

        Row ``i`` holds the mask of ``matchers[i]``; a None row (no
        constraint, a terminated matcher, or a row in error) is all ones.
        Terminated matchers must be passed as None: xgrammar raises when
        asked to fill a matcher that has accepted its stop token.  xgrammar
        rows are filled in one batched call (on ``threads`` where their last
        fill was costly), llguidance's in another.
        ``out`` (int32, C-contiguous, ``[len(matchers), width]``) is filled
        in place of this buffer: the caller's shared-memory mask buffer,
        which a copy would cost a pass over (``bench/grammar_step_bench.py``
        measures the served step).

        Raises
        ------
        GrammarError
            More rows than ``max_batch``, or an ``out`` of another shape or layout.
        """
        target = self.prepare(len(matchers), out)
        self.fill_rows(matchers, 0)
        return target

    def prepare(self, rows: int, out: np.ndarray | None = None) -> np.ndarray:
        """Make ``out`` (or this buffer) the rows :meth:`fill_rows` and the row edits write; its first ``rows`` rows.

        Raises
        ------
        GrammarError
            As :meth:`fill`.
        """
        if rows > self.max_batch:
            raise GrammarError(f"bitmask: batch of {rows} rows exceeds max_batch {self.max_batch}")
        if out is None:
            target = self.buffer
        elif out.shape == (rows, self.width) and out.dtype == np.int32 and out.flags.c_contiguous:
            target = out
        else:
            raise GrammarError(f"bitmask: an out buffer must be C-contiguous int32 of shape {(rows, self.width)}, "
                               f"not {out.dtype} {out.shape}")
        self.filled = target
        return target[:rows]

    def fill_rows(self, matchers: Sequence[Matcher | None], start: int, *, one_call: bool = False) -> None:
        """Fill rows ``start..start + len(matchers)`` of the rows :meth:`prepare` chose, as :meth:`fill` does.

        One call at a time (the lists it reuses are this buffer's).  ``one_call``: llguidance's rows in one
        call to its executor, which holds no GIL throughout, even on one thread (the fill of a thread beside
        the step thread, :class:`grammar_service.fill_pipeline.FillPipeline`, would otherwise wait for the GIL
        between rows).
        """
        target = self.filled
        active, indices, llg_rows, families = self._active, self._rows, self._llg_rows, self._llg_families
        active.clear()
        indices.clear()
        llg_rows.clear()
        for family in families:
            family.clear()
        threads = len(families)
        for i, matcher in enumerate(matchers, start):
            if matcher is None:
                target[i].fill(ALL_ALLOWED)
            elif isinstance(matcher, xgr.GrammarMatcher):
                active.append(matcher)
                indices.append(i)
            elif isinstance(matcher, LlgMatcher):
                families[matcher.family % threads].append((matcher.inner, i))
            else:
                matcher.fill_next_token_bitmask(target, i)
        if active:
            # Priced at the last fill's seconds a row: a pipelined step fills its rows in two calls.
            spread = self._spread if len(active) * self._xgrammar_row_s >= self._spread_min_s else None
            self.xgrammar_threads = 1 if spread is None else self.threads
            t0 = time.perf_counter()
            (spread or self._batch).batch_fill_next_token_bitmask(active, target, indices)
            self._xgrammar_row_s = (time.perf_counter() - t0) / len(active)
        if threads == 1:
            llg_rows = families[0]  # one thread: nothing to group
        else:
            for family in families:
                llg_rows.extend(family)
        if not llg_rows:
            return
        if self._executor is not None:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, llg_rows, target)
        elif one_call:
            if self._one is None:
                self._one = llguidance.LLExecutor(1)
            llguidance.numpy.fill_next_token_bitmask_par(self._one, llg_rows, target)
        else:
            for inner, i in llg_rows:
                llguidance.numpy.fill_next_token_bitmask(inner, target, i)

    def force(self, row: int, token: int) -> None:
        """Make ``token`` the only allowed token of ``row`` (of the rows the last :meth:`fill` wrote)."""
        words = self.filled[row]
        words.fill(0)
        words[token >> 5] = _bit(token)

    def allows(self, row: int, token: int) -> bool:
        """Whether ``row`` allows ``token``."""
        return bool(self.filled[row, token >> 5] & _bit(token))

    def keep(self, row: int, tokens: Sequence[int], token: int) -> None:
        """Make ``tokens`` and ``token`` the only allowed tokens of ``row``."""
        words = self.filled[row]
        words.fill(0)
        for t in (*tokens, token):
            words[t >> 5] |= _bit(t)

    def restrict(self, row: int, allowed: np.ndarray, token: int) -> None:
        """Keep only the tokens of ``row`` that ``allowed`` (a packed row) also allows, plus ``token``."""
        words = self.filled[row]
        np.bitwise_and(words, allowed, out=words)
        words[token >> 5] |= _bit(token)


#: The word of a packed row holding only bit ``i``, for each ``i`` of 0..31: looked up, not built as a
#: NumPy scalar each time, since the grammar step forces or checks a token in most rows.
_BITS: Final = [np.int32(w) for w in np.array([1 << i for i in range(32)], np.uint32).view(np.int32).tolist()]


def _bit(token: int) -> np.int32:
    """The word of a packed row in which only ``token``'s bit is set."""
    return _BITS[token & 31]


def pack_tokens(tokens: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """A packed int32 row (``[ceil(V/32)]``) with the bits of ``tokens`` set."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, dtype=bool)
    bits[np.asarray(tokens, dtype=np.int64)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


def few_allowed(row: np.ndarray, most: int) -> np.ndarray | None:
    """The token ids one packed row allows where they are at most ``most``, else None.

    Reads only the row's nonzero words, where :func:`allowed_tokens` unpacks
    the whole row (a calm row near its budget has few).
    """
    words = np.flatnonzero(row)
    if len(words) > most:
        return None
    bits = np.unpackbits(row[words].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").astype(bool)
    ids = (words[:, None] * 32 + np.arange(32))[bits]
    return ids if len(ids) <= most else None


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids allowed by one bitmask row (for tests and diagnostics, not the hot path)."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])
