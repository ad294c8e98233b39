"""Per-sequence matcher state: the request-level object and the table of them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from grammar_backend.bitmask import Matcher
from grammar_backend.closing import Closer, CloseState, ClosingConfig, RepeatDetector
from grammar_backend.errors import (
    CapacityExceeded,
    ConfigError,
    DuplicateSequence,
    SequenceError,
    TokenRejected,
    UnknownSequence,
)
from grammar_backend.spec import ConstraintSpec
from grammar_backend.values import ValueChecks, ValueRules, ValueScanner


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


#: :meth:`GrammarSequence.plan` result of a row the grammar mask decides alone.
FREE = -1


class GrammarSequence:
    """One sequence's matcher and counters (the request-level object).

    Parameters
    ----------
    seq_id : int
    spec : ConstraintSpec
    matcher : Matcher
        A new matcher of the compiled constraint (xgrammar's or llguidance's).
    backend : str
        Which backend compiled it (``"xgrammar"`` or ``"llguidance"``).
    now : float
        Creation time on the table's clock.
    budget : int
        The request's ``max_tokens`` (the stop token included); 0 = unknown.
        Budget closing applies when it is positive and ``spec.options.on_budget``
        is ``"close"``; runaway closing when ``on_repeat`` is ``"close"``.
    closing : ClosingConfig
    """

    __slots__ = (
        "backend", "budget", "checks", "close_state", "closing", "completion", "completion_at", "completion_kept",
        "created", "dropped", "forced", "forced_at", "last_used", "matcher", "new_tokens", "next_check",
        "next_repeat_check", "repeats", "retries_left", "seq_id", "spec", "steps", "tokens_accepted", "utf8_need",
        "values",
    )

    def __init__(
        self,
        seq_id: int,
        spec: ConstraintSpec,
        matcher: Matcher,
        backend: str,
        now: float,
        budget: int = 0,
        closing: ClosingConfig | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.spec = spec
        self.matcher = matcher
        self.backend = backend
        self.tokens_accepted = 0
        self.steps = 0
        self.created = now
        self.last_used = now
        self.closing = closing if closing is not None else ClosingConfig()
        self.budget = budget if spec.options.on_budget == "close" else 0
        self.repeats = RepeatDetector(self.closing.repeat) if spec.options.on_repeat == "close" else None
        self.close_state = CloseState.OPEN
        #: The completion being forced (None: not forcing) and how much of it is accepted.
        self.forced: tuple[int, ...] | None = None
        self.forced_at = 0
        #: The last completion found (None: none), how many of its tokens the
        #: output took since, and whether it took only those (see :meth:`_completion`).
        self.completion: tuple[int, ...] | None = None
        self.completion_at = 0
        self.completion_kept = True
        #: The tokens of the last :meth:`accept` (read by :meth:`plan`) and the
        #: UTF-8 continuation bytes the output still owes (a byte-level token
        #: may stop inside a character, where no completion can start).
        self.new_tokens: Sequence[int] | np.ndarray = ()
        self.utf8_need = 0
        #: ``tokens_accepted`` at which the budget (resp. the repetition) is checked next.
        self.next_check = 0 if self.budget else -1
        self.next_repeat_check = self.closing.repeat.min_tokens
        #: Value checks (:mod:`grammar_backend.values`): off unless :meth:`check_values` turns them on.
        self.values: ValueScanner | None = None
        self.checks: ValueChecks | None = None
        self.retries_left = 0
        #: Tokens the last :meth:`accept` dropped to retry a value that broke the schema (0: none).
        self.dropped = 0

    def check_values(self, checks: ValueChecks, rules: ValueRules, retries: int) -> None:
        """Check each value as it completes, dropping tokens to retry one that breaks the schema (``retries`` times)."""
        if retries > 0:
            self.checks, self.values, self.retries_left = checks, ValueScanner(rules, checks.index.vocab), retries

    @property
    def terminated(self) -> bool:
        """Whether the matcher accepted a stop token (no further token is legal)."""
        return bool(self.matcher.is_terminated())

    def accept(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Accept ``tokens`` atomically: on a rejected token, roll back the ones accepted before it.

        With value checks on, a value they complete that breaks the schema is
        backtracked (:meth:`ValueChecks.backtrack`): :attr:`dropped` says how
        many tokens went.

        Raises
        ------
        TokenRejected
            The grammar rejects ``tokens[i]``; the matcher is as before the call.
        MatcherFailed
            The matcher cannot go on (llguidance past a limit).
        """
        matcher = self.matcher
        for i, token in enumerate(tokens):
            if not matcher.accept_token(int(token)):
                if i:
                    matcher.rollback(i)
                raise TokenRejected(self.seq_id, int(token), self.tokens_accepted + i)
        self.tokens_accepted += len(tokens)
        self.new_tokens = tokens
        if self.repeats is not None:
            for token in tokens:
                self.repeats.push(int(token))
        completion = self.completion
        if completion is not None and self.completion_kept:
            for token in tokens:
                if self.completion_at < len(completion) and int(token) == completion[self.completion_at]:
                    self.completion_at += 1
                else:
                    self.completion_kept = False
                    break
        if self.forced is not None:
            for token in tokens:
                if self.forced_at < len(self.forced) and int(token) == self.forced[self.forced_at]:
                    self.forced_at += 1
                else:  # the engine did not take the forced token (never with our mask): plan again
                    self.forced = None
                    self.close_state = CloseState.OPEN
                    self.next_check = self.tokens_accepted if self.budget else -1
                    break
        self.dropped = 0
        values = self.values
        if values is not None:
            # A completion being forced (or kept calm) is the closer's plan: not second-guessed.
            try:
                found = values.push([int(t) for t in tokens],
                                    check=self.forced is None and self.close_state == CloseState.OPEN)
            except (LookupError, TypeError, ValueError, AttributeError) as err:
                # A scanner bug fails this row only (engine.step reports it), never the batch.
                raise SequenceError(self.seq_id, f"value check failed: {err!r}") from err
            if found is not None and self.checks is not None:
                dropped = self.checks.backtrack(self.matcher, values, found)
                if dropped:
                    self._rolled_back(dropped)
                    self.dropped = dropped
                    self.retries_left -= 1
                    if not self.retries_left:  # the budget is spent: what completes now stands
                        self.values = None

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
            if self.values is not None:
                self.values.rollback(count)
            self._rolled_back(count)

    def _rolled_back(self, count: int) -> None:
        """Counters after the matcher (and the scanner) dropped ``count`` tokens."""
        self.tokens_accepted -= count
        self.completion = None
        self.new_tokens = ()
        self.utf8_need = 0  # a rolled-back output ends where a value began: on a character boundary
        if self.repeats is not None:
            self.repeats.rollback(count)
        if self.forced is not None:
            self.forced = None
            self.close_state = CloseState.OPEN
        if self.budget:
            self.next_check = min(self.next_check, self.tokens_accepted)

    def plan(self, closer: Closer, stop_token: int) -> int:
        """This step's closing token, or :data:`FREE`; :attr:`close_state` says what it means.

        Called once per step, after :meth:`accept`.  Budget: the sequence may
        still sample ``left = budget - tokens_accepted`` tokens, the stop
        token included; ``spare`` is what a completion found now leaves.

        * ``spare > margin + completion``: free; the next check comes a
          quarter of the way to the calm zone, so a 1,000-token budget costs
          about 20 searches (p50 0.09 ms, p99 2 ms on maskbench-dev).
        * ``1 < spare <= margin + completion``: ``CALM``: the row may take
          only tokens that open no structure (:meth:`Closer.calm_tokens`) or
          the returned token (the completion's next one), so the model can
          still finish on its own while the completion cannot grow: the
          spare shrinks by at most one token per token, and the next check
          comes halfway to ``spare = 1`` (checking every token cost 2.2 ms
          of a 16-row step with llguidance, four times the rest of the step).
        * ``0 <= spare <= 1``: ``BUDGET``: the completion is forced token by
          token (the returned token is the only one allowed), then the stop token.
        * ``spare < 0`` (or no completion found at the end): given up; the
          output ends at ``max_tokens`` as it would without closing.

        Repetition: every ``every`` tokens the tail is checked; a runaway
        forces the completion at once (``REPETITION``).

        Raises
        ------
        MatcherFailed
            The matcher failed during the search.
        """
        if self.forced is not None:
            if self.forced_at < len(self.forced):
                return self.forced[self.forced_at]
            return stop_token
        accepted = self.tokens_accepted
        if len(self.new_tokens):
            self.utf8_need = closer.utf8_need(self.utf8_need, self.new_tokens)
            self.new_tokens = ()
        if self.utf8_need:
            # Inside a character no completion can start (the search would run
            # to its node limit for nothing): every check waits for its end.
            if self.close_state == CloseState.CALM:
                return self._calm_token(stop_token)
            return FREE
        if self.repeats is not None and accepted >= self.next_repeat_check:
            self.next_repeat_check = accepted + self.closing.repeat.every
            if self.repeats.repeating():
                found = closer.complete(self.matcher)
                if found is not None and (not self.budget or len(found) < self.budget - accepted):
                    return self._force(found, CloseState.REPETITION, stop_token)
        if not 0 <= self.next_check <= accepted:
            if self.close_state == CloseState.CALM:
                return self._calm_token(stop_token)
            return FREE
        left = self.budget - accepted
        found = self._completion(closer)
        spare = left - 1 - (len(found) if found is not None else 0)
        self.close_state = CloseState.OPEN
        if found is not None and 0 <= spare <= 1:
            return self._force(found, CloseState.BUDGET, stop_token)
        if spare < 0 or (found is None and left <= 1):
            self.next_check = -1  # it cannot fit any more: give up
            return FREE
        # Opening one more sibling (an array item, a key) can grow the completion
        # by about what is still open, so the calm zone widens with it: measured,
        # "},{" opening an item of 3 required fields added 11 tokens at once.
        calm_at = self.closing.margin + (len(found) if found is not None else 0)
        if found is not None and spare <= calm_at:
            self.close_state = CloseState.CALM
            self.next_check = accepted + max(1, (spare - 1) // 2)
            return self._calm_token(stop_token)
        self.next_check = accepted + max(1, (spare - calm_at) // 4)
        return FREE

    def _completion(self, closer: Closer) -> tuple[int, ...] | None:
        """A completion of the current state, as cheaply as it comes.

        The last completion's rest where the output took exactly its first
        tokens; else a tail of it that still completes the grammar
        (:meth:`Closer.resume`: 0.1-0.2 ms); else a new search (0.4-1.5 ms,
        :meth:`Closer.complete`), which for a new matcher is shared by every
        sequence of the constraint (:meth:`Closer.initial`).  Measured on the tiny stand-in's served
        outputs (16 rows, budget 128, llguidance), searching at every check
        cost 2.2 ms of a 0.5 ms step.  A reused completion may be longer
        than a new search would find, never one that does not fit: the
        budget decisions stay on the safe side.
        """
        last = self.completion
        if last is not None:
            found = last[self.completion_at:] if self.completion_kept else closer.resume(self.matcher, last)
            if found is None:
                found = closer.complete(self.matcher)
        elif self.tokens_accepted == 0:  # a new matcher's state: the same for every sequence of the constraint
            found = closer.initial((self.backend, self.spec), self.matcher)
        else:
            found = closer.complete(self.matcher)
        self.completion, self.completion_at, self.completion_kept = found, 0, True
        return found

    def recheck(self, closer: Closer, stop_token: int) -> int:
        """A calm row whose :meth:`plan` token the grammar does not allow here: find a completion now.

        Returns its first token (valid by construction), or :data:`FREE`
        when none is found (the row is then open, checked again next step).
        """
        if self.utf8_need:
            return FREE  # inside a character: unrestricted for this token, still calm
        self.completion_kept = False  # its next token is not allowed: a tail of it, or a new search
        found = self._completion(closer)
        if found is None:
            self.close_state = CloseState.OPEN
            self.next_check = self.tokens_accepted + 1
            return FREE
        return found[0] if found else stop_token

    def _calm_token(self, stop_token: int) -> int:
        """The token a calm row may take besides calm ones: the completion's next one (the stop token once
        it is all taken).  After the output left it (calm text inside a string, say), its first token,
        which usually still closes what is open; where the grammar does not allow it, the engine asks
        :meth:`recheck` for a new one."""
        completion = self.completion
        if completion is None:
            return stop_token
        at = self.completion_at if self.completion_kept else 0
        return completion[at] if at < len(completion) else stop_token

    @property
    def forcing(self) -> bool:
        """Whether this step's mask is the single token :meth:`plan` returned."""
        return self.forced is not None

    def _force(self, tokens: tuple[int, ...], state: CloseState, stop_token: int) -> int:
        self.forced = tokens
        self.forced_at = 0
        self.close_state = state
        return tokens[0] if tokens else stop_token

    @property
    def closes(self) -> bool:
        """Whether this sequence may be closed early (budget or repetition)."""
        return self.budget > 0 or self.repeats is not None


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
