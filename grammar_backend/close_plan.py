"""The closing policy of one sequence: when to let it run, keep it calm, or force its completion.

:class:`ClosePlan` owns the row's closing state (the budget, the runaway
detector, the completion last found and how much of it the output took, the
completion being forced) and decides each step's closing token
(:meth:`ClosePlan.plan`).  Its sequence (:class:`~grammar_backend.sequences.GrammarSequence`)
tells it what the matcher took (:meth:`ClosePlan.followed`) and dropped
(:meth:`ClosePlan.rolled_back`); the searches themselves are the
:class:`~grammar_backend.closing.Closer`'s, shared by every sequence of an engine.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from grammar_backend.bitmask import Matcher
from grammar_backend.closing import UTF8_MAX_OWED, Closer, ClosingConfig, RepeatDetector
from grammar_backend.fidelity import validator_for
from grammar_backend.protocol import CloseState
from grammar_backend.spec import ConstraintKind, ConstraintSpec

__all__ = ["FREE", "ClosePlan"]

#: Node bound of each search of :meth:`ClosePlan.screen` (which does not widen the alphabet either:
#: a token after which nothing is found is left out): a completion that fits near the budget is short.
_SCREEN_NODES = 64
#: :meth:`ClosePlan.plan` result of a row the grammar mask decides alone.
FREE = -1
#: JSON Schema types whose value is one scalar token run (see :meth:`ClosePlan._value_check`).
_SCALARS = frozenset({"string", "number", "integer"})


def _scalar_root(spec: ConstraintSpec) -> bool:
    """Whether every output of ``spec`` is one JSON string or number (its schema's root ``type``)."""
    schema = spec.schema
    if spec.kind is not ConstraintKind.JSON_SCHEMA or not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    return kind in _SCALARS if isinstance(kind, str) else False


class ClosePlan:
    """One sequence's closing state and its per-step plan.

    Parameters
    ----------
    spec : ConstraintSpec
    backend : str
        The backend that serves the sequence (a key of the closer's shared searches).
    budget : int
        The request's ``max_tokens`` (the stop token included); 0 = unknown.
        Budget closing applies when it is positive and ``spec.options.on_budget``
        is ``"close"``; runaway closing when ``on_repeat`` is ``"close"``.
    config : ClosingConfig
    """

    __slots__ = (
        "backend", "budget", "calm_ok", "close_state", "completion", "completion_at", "completion_kept",
        "completion_len", "config", "digit_run", "forced", "forced_at", "growth", "new_tokens", "next_check",
        "next_repeat_check", "openers", "pending_close", "repeats", "scalar_tokens", "segment", "spec", "utf8_need",
    )

    def __init__(self, spec: ConstraintSpec, backend: str, budget: int, config: ClosingConfig) -> None:
        self.spec = spec
        self.backend = backend
        self.config = config
        self.budget = budget if spec.options.on_budget == "close" else 0
        self.repeats = RepeatDetector(config.repeat) if spec.options.on_repeat == "close" else None
        self.close_state = CloseState.OPEN
        #: The completion being forced (None: not forcing) and how much of it is accepted.
        self.forced: tuple[int, ...] | None = None
        self.forced_at = 0
        #: The last completion found (None: none), how many of its tokens the
        #: output took since, and whether it took only those (see :meth:`find`).
        self.completion: tuple[int, ...] | None = None
        self.completion_at = 0
        self.completion_kept = True
        #: The tokens the matcher last took (read by :meth:`plan`) and the
        #: UTF-8 continuation bytes the output still owes (a byte-level token
        #: may stop inside a character, where no completion can start).
        self.new_tokens: Sequence[int] | np.ndarray = ()
        self.utf8_need = 0
        #: The completion's length at the last budget check (-1: none yet) and the most it grew from one
        #: check to the next (:meth:`plan` widens the calm zone by it).
        self.completion_len = -1
        self.growth = 0
        #: What opening one more tagged segment adds to the completion (-1: not measured yet; see
        #: :meth:`Closer.segment`), and the bytes that open one (a calm row takes no token holding one).
        self.openers = spec.segments.openers
        self.segment = -1 if self.openers else 0
        #: Whether calm tokens cannot grow the completion: JSON's structure opens only with the bytes
        #: calm tokens lack (and a structural tag's segments with :attr:`openers`).  A regex, a grammar or a
        #: choice opens its own way (a regex's "(...)+" with a digit, an EBNF's "(", a choice's longer
        #: word), so its calm rows are screened token by token instead (:meth:`screen`; budget_bench's
        #: kinds part: calm rows let "([0-9]{3}-[0-9]{4}\n)+" open a new line past its budget).
        self.calm_ok = spec.kind.is_json or bool(self.openers)
        #: The ASCII digits ending the output (runaway closing only: :meth:`RepeatDetector.repeating`).
        self.digit_run = 0
        #: A top-level scalar's tokens so far (None: the output is not one), so that a completion
        #: is checked as post-validation will check it (:meth:`_value_check`).
        self.scalar_tokens: list[int] | None = [] if self.closes and _scalar_root(spec) else None
        #: Tokens accepted at which the budget (resp. the repetition) is checked next.
        self.next_check = 0 if self.budget else -1
        self.next_repeat_check = config.repeat.min_tokens
        #: Whether the next :meth:`plan` closes the output where it stands: a value policy that dropped a
        #: value past its retries asks for it (:meth:`close_now`).
        self.pending_close = False

    @property
    def closes(self) -> bool:
        """Whether this sequence may be closed early (budget or repetition)."""
        return self.budget > 0 or self.repeats is not None

    @property
    def forcing(self) -> bool:
        """Whether this step's mask is the single token :meth:`plan` returned."""
        return self.forced is not None

    @property
    def open(self) -> bool:
        """Whether the output is the model's own: no completion forced and the row not calm."""
        return self.forced is None and self.close_state == CloseState.OPEN

    def close_now(self) -> None:
        """Close the output where it stands at the next :meth:`plan` (it holds only values that pass)."""
        self.pending_close = True

    def answer_begins(self, thinking_tokens: int) -> None:
        """The thinking section ended after ``thinking_tokens`` of ``max_tokens``: the answer closes within the rest."""
        if self.budget:
            self.budget = max(1, self.budget - thinking_tokens)
            self.next_check = 0

    def followed(self, tokens: Sequence[int] | np.ndarray, accepted: int) -> None:
        """The matcher took ``tokens`` (now ``accepted`` in all): follow the completion and the forced one."""
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
                    self.next_check = accepted if self.budget else -1
                    break

    def fork(self) -> ClosePlan:
        """A copy that goes on apart: a step's draft positions are planned on it (:meth:`GrammarSequence.fork`)."""
        twin = copy.copy(self)
        if self.repeats is not None:
            twin.repeats = self.repeats.fork()
        if self.scalar_tokens is not None:
            twin.scalar_tokens = self.scalar_tokens.copy()
        return twin

    def rolled_back(self, count: int, accepted: int) -> None:
        """The matcher dropped its last ``count`` tokens (``accepted`` are left)."""
        scalar = self.scalar_tokens
        if scalar is not None:
            scalar.extend(int(t) for t in self.new_tokens)  # not yet planned: folded in before the cut
            del scalar[max(0, len(scalar) - count):]
        self.completion = None
        self.new_tokens = ()
        self.utf8_need = 0  # a rolled-back output ends where a value began: on a character boundary
        self.digit_run = 0  # ... so it ends no digit run either
        if self.repeats is not None:
            self.repeats.rollback(count)
        if self.forced is not None:
            self.forced = None
            self.close_state = CloseState.OPEN
        if self.budget:
            self.next_check = min(self.next_check, accepted)

    def plan(self, closer: Closer, matcher: Matcher, accepted: int, stop_token: int) -> int:
        """This step's closing token, or :data:`FREE`; :attr:`close_state` says what it means.

        Called once per step, after the step's tokens were accepted (``accepted``
        in all).  Budget: the sequence may still sample ``left = budget -
        accepted`` tokens, the stop token included; ``spare`` is what a
        completion found now leaves.

        * ``spare > margin + completion``: free; the next check comes a
          quarter of the way to the calm zone, so a 1,000-token budget costs
          about 20 searches, or right after a token that opens an object or
          array, whose required tail may grow the completion past the budget
          before that check (one ``{`` of 30 required properties: +182
          tokens at once).
        * ``1 < spare <= margin + completion``: ``CALM``: the row may take
          only tokens that open no structure (:meth:`Closer.calm_tokens`) or
          the returned token (the completion's next one), so the model can
          still finish on its own while the completion cannot grow: the
          spare shrinks by at most one token per token, and the next check
          comes halfway to ``spare = 1`` (a search at every token costs more
          than the rest of the step: ``bench/budget_bench.py``'s step part).
        * ``0 <= spare <= 1``: ``BUDGET``: the completion is forced token by
          token (the returned token is the only one allowed), then the stop token.
        * ``spare < 0`` (or no completion found at the end): given up; the
          output ends at ``max_tokens`` as it would without closing.

        Repetition: every ``every`` tokens the tail is checked (a repeated
        unit, or ``max_digits`` digits in a run: :class:`RepeatConfig`); a
        runaway forces the completion at once (``REPETITION``), as does a
        :meth:`close_now`.  A top-level string or number's completion is
        checked as post-validation will check it (:meth:`_value_check`).

        Raises
        ------
        MatcherFailed
            The matcher failed during the search.
        """
        if len(self.new_tokens):
            self._took(closer, accepted)
        if self.forced is not None:
            if self.forced_at < len(self.forced):
                return self.forced[self.forced_at]
            return stop_token
        if self.pending_close:
            # A value the schema refuses was dropped past the retries (values.ValuePolicy): ended here,
            # where the output still holds only values that pass.
            self.pending_close = False
            found = self.find(closer, matcher, accepted)
            if found is not None and (not self.budget or len(found) < self.budget - accepted):
                return self._force(found, CloseState.REPETITION, stop_token)
        if self.utf8_need:
            # Inside a character no completion can start (the search would run
            # to its node limit for nothing): every check waits for its end.
            if self.close_state == CloseState.CALM:
                return self._calm_token(stop_token)
            return FREE
        if self.repeats is not None and accepted >= self.next_repeat_check:
            repeat = self.config.repeat
            self.next_repeat_check = accepted + repeat.every
            if self.repeats.repeating(self.digit_run):
                # The kept completion (or a tail of it) where it still ends the output: a new
                # search on a large schema is the expensive part, at every check while it repeats.
                found = self.find(closer, matcher, accepted)
                if found is not None and (not self.budget or len(found) < self.budget - accepted):
                    return self._force(found, CloseState.REPETITION, stop_token)
                # None fits now: the next tries wait a whole run (a search each).
                self.next_repeat_check = accepted + repeat.min_tokens
        if not 0 <= self.next_check <= accepted:
            if self.close_state == CloseState.CALM:
                return self._calm_token(stop_token)
            return FREE
        left = self.budget - accepted
        checked = self.completion_len
        found = self.find(closer, matcher, accepted)
        if found is not None:
            # How much the completion grew between two checks (one opener can add a whole required tail).
            if checked >= 0 and len(found) - checked > self.growth:
                self.growth = len(found) - checked
            self.completion_len = len(found)
        spare = left - 1 - (len(found) if found is not None else 0)
        self.close_state = CloseState.OPEN
        if found is not None and 0 <= spare <= 1:
            return self._force(found, CloseState.BUDGET, stop_token)
        if spare < 0 or (found is None and left <= 1):
            self.next_check = -1  # it cannot fit any more: give up
            return FREE
        # Opening one more sibling (an array item, a key) can grow the completion
        # by about what is still open, so the calm zone widens with it:
        # "},{" opening an item of 3 required fields added 11 tokens at once.  And
        # by the most it grew between two checks so far: in the replay part of
        # budget_bench, '"],"ordered_related_items":["' (a uuid item) took a
        # completion from 3 to 38 tokens with 25 left, after earlier uuid items.
        # And a structural tag's output may open a whole new segment (a tool call) wherever it is complete.
        if self.segment < 0:
            self.segment = (closer.segment((self.backend, self.spec), matcher, self.spec.segments)
                            if accepted == 0 else 0)
        calm_at = self.config.margin + (len(found) + max(self.growth, self.segment) if found is not None else 0)
        if found is not None and spare <= calm_at:
            self.close_state = CloseState.CALM
            # A screened row (see screen) is checked at every token: its screen reads the spare then.
            self.next_check = accepted + (max(1, (spare - 1) // 2) if self.calm_ok else 1)
            return self._calm_token(stop_token)
        self.next_check = accepted + max(1, (spare - calm_at) // 4)
        return FREE

    def find(self, closer: Closer, matcher: Matcher, accepted: int) -> tuple[int, ...] | None:
        """A completion of the current state, as cheaply as it comes.

        The last completion's rest where the output took exactly its first
        tokens; else a tail of it that still completes the grammar
        (:meth:`Closer.resume`); else a new search (:meth:`Closer.complete`),
        which for a new matcher is shared by every sequence of the
        constraint (:meth:`Closer.initial`).  A search at every check costs
        several times a step (``bench/budget_bench.py``'s step part, closing
        on against off).  A reused completion may be longer than a new
        search would find, never one that does not fit: the budget decisions
        stay on the safe side.
        """
        last = self.completion
        check = self._value_check(closer, accepted) if self.scalar_tokens is not None else None
        if last is not None:
            found = last[self.completion_at:] if self.completion_kept else closer.resume(matcher, last)
            if found is not None and check is not None and not check(closer.text(found)):
                found = None  # it ends the output invalid now (a top-level string's format): search again
            if found is None:
                found = closer.complete(matcher, check)
        elif accepted == 0:  # a new matcher's state: the same for every sequence of the constraint
            found = closer.initial((self.backend, self.spec), matcher, check)
        else:
            found = closer.complete(matcher, check)
        self.completion, self.completion_at, self.completion_kept = found, 0, True
        return found

    def _took(self, closer: Closer, accepted: int) -> None:
        """Fold the tokens the matcher last took into the per-output state :meth:`plan` reads."""
        new = self.new_tokens
        self.new_tokens = ()
        self.utf8_need = closer.utf8_need(self.utf8_need, new)
        if (self.budget and self.completion is not None and self.next_check > accepted
                and self.close_state == CloseState.OPEN and closer.opens(new)):
            # A new object or array may need a long required tail: checked now, not at the next
            # spaced check, where it could have outgrown the budget meanwhile (see plan).
            self.next_check = accepted
        if self.repeats is not None:
            self.digit_run = closer.digit_run(self.digit_run, new)
        if self.scalar_tokens is not None:
            self.scalar_tokens.extend(int(t) for t in new)

    def _value_check(self, closer: Closer, accepted: int) -> Callable[[bytes], bool] | None:
        """What post-validation will say of a top-level scalar ended by a given completion (see
        :meth:`Closer.complete`); None where the output's text is not known exactly (tokens accepted
        by two calls without a :meth:`plan` between them, which the engine never does).

        One ``jsonschema`` validation of the whole scalar per candidate, only for outputs that are
        one scalar, only at budget and runaway checks.
        """
        tokens = self.scalar_tokens
        schema = self.spec.schema
        if tokens is None or schema is None or len(tokens) != accepted:
            return None
        validator = validator_for(schema)
        prefix = closer.text(tokens)

        def check(completion: bytes) -> bool:
            return bool(validator.validate_text(prefix + completion).valid)

        return check

    def recheck(self, closer: Closer, matcher: Matcher, accepted: int, stop_token: int) -> int:
        """A calm row whose :meth:`plan` token the grammar does not allow here: find a completion now.

        Returns its first token (valid by construction), or :data:`FREE`
        when none is found (the row is then open, checked again next step).
        """
        if self.utf8_need:
            return FREE  # inside a character: unrestricted for this token, still calm
        self.completion_kept = False  # its next token is not allowed: a tail of it, or a new search
        found = self.find(closer, matcher, accepted)
        if found is None:
            self.close_state = CloseState.OPEN
            self.next_check = accepted + 1
            return FREE
        return found[0] if found else stop_token

    def screen(self, closer: Closer, matcher: Matcher, accepted: int, allowed: Sequence[int],
               stop_token: int) -> list[int]:
        """The tokens of ``allowed`` (the grammar's, at a calm row that is not :attr:`calm_ok`) after which a
        completion still fits the budget.

        Each one is taken, a completion of the state after it searched
        (:meth:`Closer.complete`), and rolled back: kept when that
        completion and the stop token fit in what the budget leaves after
        it.  The stop token, where allowed, always fits.  So near its budget
        a regex may still write its own ending, and a choice its own
        alternative, where either fits.

        Raises
        ------
        MatcherFailed
            The matcher failed during a search.
        """
        room = self.budget - accepted - 2  # after the token: the completion and the stop token
        last = self.completion
        kept: list[int] = []
        for token in allowed:
            if token == stop_token:
                kept.append(token)
                continue
            if not matcher.accept_token(token):
                continue
            try:
                # A tail of the current completion mostly still ends it (a digit more, then the same tail).
                found = closer.resume(matcher, last) if last else None
                if found is None:
                    found = closer.complete(matcher, max_nodes=_SCREEN_NODES, widen=False)
            finally:
                matcher.rollback(1)
            if found is not None and len(found) <= room:
                kept.append(token)
        return kept

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

    def whole_chars_only(self, accepted: int) -> bool:
        """Whether a calm row takes only tokens that end on a character boundary
        (:meth:`Closer.calm_tokens`): a character begun now might not end before the completion must start.

        No check can start a completion inside a character, so a due check
        waits for its end: at most :data:`UTF8_MAX_OWED` tokens.  From a spare
        (budget left after the last completion found and the stop token) of
        ``UTF8_MAX_OWED + 1``, one more byte-level lead could take the spare
        below 0 before the check: the output then ran to ``max_tokens``
        unclosed (``bench/processor_bench.py``, the tiny stand-in: one began
        a 3-byte character at spare 2).
        """
        return self.budget - accepted - 1 - self.completion_len <= UTF8_MAX_OWED + 1

    def _force(self, tokens: tuple[int, ...], state: CloseState, stop_token: int) -> int:
        self.forced = tokens
        self.forced_at = 0
        self.close_state = state
        return tokens[0] if tokens else stop_token
