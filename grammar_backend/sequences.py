"""Per-sequence matcher state: the request-level object and the table of them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xgrammar as xgr

from grammar_backend.errors import (
    CapacityExceeded,
    ConfigError,
    DuplicateSequence,
    SequenceError,
    TokenRejected,
    UnknownSequence,
)
from grammar_backend.spec import ConstraintSpec


@dataclass(frozen=True)
class TableConfig:
    """Sequence-table settings.

    Parameters
    ----------
    capacity : int
        Most concurrently active sequences.
    idle_ttl_s : float
        A sequence untouched this long is evicted (a client or engine that
        never sent ``end``); 0 disables eviction.

    xgrammar 0.2.9 always keeps the full rollback history of a matcher
    (``max_rollback_tokens`` is deprecated there), so any accepted token can
    be rolled back.
    """

    capacity: int = 1024
    idle_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.capacity <= 0 or self.idle_ttl_s < 0:
            raise ConfigError("sequences: capacity must be positive and idle_ttl_s >= 0")


class GrammarSequence:
    """One sequence's matcher and counters (the request-level object).

    Parameters
    ----------
    seq_id : int
    spec : ConstraintSpec
    compiled : xgrammar.CompiledGrammar
    now : float
        Creation time on the table's clock.
    """

    __slots__ = ("created", "last_used", "matcher", "seq_id", "spec", "steps", "tokens_accepted")

    def __init__(self, seq_id: int, spec: ConstraintSpec, compiled: xgr.CompiledGrammar, now: float) -> None:
        self.seq_id = seq_id
        self.spec = spec
        self.matcher = xgr.GrammarMatcher(compiled)
        self.tokens_accepted = 0
        self.steps = 0
        self.created = now
        self.last_used = now

    @property
    def terminated(self) -> bool:
        """Whether the matcher accepted a stop token (no further token is legal)."""
        return bool(self.matcher.is_terminated())

    def accept(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Accept ``tokens`` atomically: on a rejected token, roll back the ones accepted before it.

        Raises
        ------
        TokenRejected
            The grammar rejects ``tokens[i]``; the matcher is as before the call.
        """
        matcher = self.matcher
        for i, token in enumerate(tokens):
            if not matcher.accept_token(int(token)):
                if i:
                    matcher.rollback(i)
                raise TokenRejected(self.seq_id, int(token), self.tokens_accepted + i)
        self.tokens_accepted += len(tokens)

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens.

        Raises
        ------
        SequenceError
            ``count`` is negative or exceeds what can be rolled back.
        """
        limit = self.tokens_accepted
        if not 0 <= count <= limit:
            raise SequenceError(self.seq_id, f"cannot roll back {count} tokens (at most {limit})")
        if count:
            self.matcher.rollback(count)
            self.tokens_accepted -= count


class SequenceTable:
    """Active sequences by id, with a capacity limit and idle eviction.

    Thread-safe: the grammar model's step path and its start path (compiles
    finish on other threads) share it.

    Parameters
    ----------
    config : TableConfig
    clock : callable
        Monotonic clock, injectable for tests.
    """

    def __init__(self, config: TableConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        # Ordered by last use, so idle eviction pops from the front.
        self._seqs: OrderedDict[int, GrammarSequence] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def start(self, seq_id: int, spec: ConstraintSpec, compiled: xgr.CompiledGrammar) -> GrammarSequence:
        """Create the matcher of a new sequence.

        Raises
        ------
        DuplicateSequence
            ``seq_id`` is active.
        CapacityExceeded
            The table is full (after evicting idle sequences).
        """
        now = self._clock()
        with self._lock:
            if seq_id in self._seqs:
                raise DuplicateSequence(seq_id, "already started")
            self._evict_idle_locked(now)
            if len(self._seqs) >= self.config.capacity:
                raise CapacityExceeded(f"sequence {seq_id}: {self.config.capacity} sequences are active")
            seq = GrammarSequence(seq_id, spec, compiled, now)
            self._seqs[seq_id] = seq
            return seq

    def get(self, seq_id: int) -> GrammarSequence:
        """The active sequence ``seq_id``, marked as used now.

        Raises
        ------
        UnknownSequence
        """
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise UnknownSequence(seq_id, "not active (never started, ended or evicted)")
            seq.last_used = self._clock()
            self._seqs.move_to_end(seq_id)
            return seq

    def accept(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> bool:
        """Accept tokens for one sequence; returns whether it is now terminated."""
        seq = self.get(seq_id)
        seq.accept(tokens)
        return seq.terminated

    def rollback(self, seq_id: int, count: int) -> None:
        """Roll one sequence back by ``count`` tokens."""
        self.get(seq_id).rollback(count)

    def end(self, seq_id: int) -> bool:
        """Free a sequence; returns False when it was not active (ending twice is harmless)."""
        with self._lock:
            return self._seqs.pop(seq_id, None) is not None

    def evict_idle(self) -> list[int]:
        """Evict sequences idle longer than the TTL; returns their ids."""
        with self._lock:
            return self._evict_idle_locked(self._clock())

    def _evict_idle_locked(self, now: float) -> list[int]:
        ttl = self.config.idle_ttl_s
        if ttl <= 0:
            return []
        gone = []
        while self._seqs:
            seq_id, seq = next(iter(self._seqs.items()))
            if now - seq.last_used < ttl:
                break
            del self._seqs[seq_id]
            gone.append(seq_id)
        self.evicted += len(gone)
        return gone
