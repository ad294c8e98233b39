"""The table of active sequences: one :class:`GrammarSequence` per id, shared by the grammar service's threads."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from grammar_backend.bitmask import Matcher
from grammar_backend.closing import ClosingConfig
from grammar_backend.errors import CapacityExceeded, ConfigError, DuplicateSequence, SequenceError, UnknownSequence
from grammar_backend.sequences import GrammarSequence
from grammar_backend.spec import ConstraintSpec

__all__ = ["SequenceTable", "TableConfig"]


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

    def start(
        self,
        seq_id: int,
        spec: ConstraintSpec,
        matcher: Matcher,
        backend: str = "xgrammar",
        budget: int = 0,
        closing: ClosingConfig | None = None,
    ) -> GrammarSequence:
        """Add a new sequence with its matcher (``backend``, ``budget``, ``closing``: see :class:`GrammarSequence`).

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
            seq = GrammarSequence(seq_id, spec, matcher, backend, now, budget, closing)
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

    def get_rows(self, seq_ids: Sequence[int]) -> list[GrammarSequence | SequenceError]:
        """:meth:`get` of every row of a step under one lock and one clock read: each row's sequence, or the
        error of a row whose sequence is not active, or that an earlier row named (that row's alone: one
        matcher cannot take two rows' tokens, nor be filled for two rows at once; llguidance's executor
        refuses a matcher it already holds, which failed the whole fill)."""
        found: list[GrammarSequence | SequenceError] = []
        with self._lock:
            seqs, now = self._seqs, self._clock()
            for seq_id in seq_ids:
                seq = seqs.get(seq_id)
                if seq is None:
                    found.append(UnknownSequence(seq_id, "not active (never started, ended or evicted)"))
                    continue
                seq.last_used = now
                seqs.move_to_end(seq_id)
                found.append(seq)
        if len(set(seq_ids)) != len(seq_ids):
            seen: set[int] = set()
            for i, seq_id in enumerate(seq_ids):
                if seq_id in seen:
                    found[i] = SequenceError(seq_id, "named by more than one row of this step")
                seen.add(seq_id)
        return found

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
        return self.pop(seq_id) is not None

    def pop(self, seq_id: int) -> GrammarSequence | None:
        """Free a sequence and return it; None when it was not active."""
        with self._lock:
            return self._seqs.pop(seq_id, None)

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
