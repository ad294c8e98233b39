"""Per-sequence matcher state: the request-level object and the table of them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from grammar_backend.bitmask import Matcher
from grammar_backend.closing import UTF8_MAX_OWED, Closer, CloseState, ClosingConfig, RepeatDetector
from grammar_backend.errors import (
    CapacityExceeded,
    ConfigError,
    DuplicateSequence,
    SequenceError,
    TokenRejected,
    UnknownSequence,
)
from grammar_backend.fidelity import validator_for
from grammar_backend.reasoning import MarkerTable, ReasoningConfig, Thinking
from grammar_backend.spec import ConstraintKind, ConstraintSpec
from grammar_backend.values import ValueChecks, ValueRules, ValueScanner, Violation


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


#: Node bound of each search of :meth:`GrammarSequence.screen` (which does not widen the alphabet either:
#: a token after which nothing is found is left out): a completion that fits near the budget is short.
_SCREEN_NODES = 64
#: :meth:`GrammarSequence.plan` result of a row the grammar mask decides alone.
FREE = -1
#: JSON Schema types whose value is one scalar token run (see :meth:`GrammarSequence._value_check`).
_SCALARS = frozenset({"string", "number", "integer"})


def _scalar_root(spec: ConstraintSpec) -> bool:
    """Whether every output of ``spec`` is one JSON string or number (its schema's root ``type``)."""
    schema = spec.schema
    if spec.kind is not ConstraintKind.JSON_SCHEMA or not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    return kind in _SCALARS if isinstance(kind, str) else False


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
        "backend", "budget", "calm_ok", "checks", "close_state", "closing", "completion", "completion_at", "completion_kept",
        "completion_len", "created", "digit_run", "dropped", "forced", "forced_at", "growth", "last_used", "matcher",
        "new_tokens", "next_check", "next_repeat_check", "openers", "reasoning", "repeats", "retries_left",
        "scalar_tokens", "segment", "seq_id", "spec", "spent", "steps", "thinking", "tokens_accepted", "utf8_need",
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
        #: ``tokens_accepted`` at which the budget (resp. the repetition) is checked next.
        self.next_check = 0 if self.budget else -1
        self.next_repeat_check = self.closing.repeat.min_tokens
        #: Value checks (:mod:`grammar_backend.values`): off unless :meth:`check_values` turns them on.
        self.values: ValueScanner | None = None
        self.checks: ValueChecks | None = None
        self.retries_left = 0
        #: Whether a value broke the schema once more with the retries spent (runaway closing only):
        #: :meth:`plan` closes the output before it.
        self.spent = False
        #: Tokens the last :meth:`accept` dropped to retry a value that broke the schema (0: none).
        self.dropped = 0
        #: The thinking section in front of the matcher (None: none, or over; :meth:`think`).
        self.thinking: Thinking | None = None
        self.reasoning = ReasoningConfig()

    def think(self, table: MarkerTable, limit: int, config: ReasoningConfig) -> None:
        """Begin with a thinking section ended by ``table``'s marker (``limit``: ``max_reasoning_tokens``, 0: none).

        Until the marker is written the matcher takes no token and the row's
        mask is :meth:`thinking_row`'s (:mod:`grammar_backend.reasoning`).
        """
        self.thinking = Thinking(table, limit)
        self.reasoning = config

    @property
    def reasoning_state(self) -> CloseState:
        """A thinking row's CLOSING: forcing its end marker, or free."""
        thinking = self.thinking
        return CloseState.REASONING_END if thinking is not None and thinking.forcing else CloseState.REASONING

    def thinking_row(self) -> np.ndarray:
        """The packed mask of a thinking row that forces nothing (see :meth:`MarkerTable.row`)."""
        assert self.thinking is not None
        return self.thinking.row(self.budget, self.reasoning)

    def reason(self, closer: Closer) -> int:
        """A thinking row's plan: the end marker's next token when it is forced (:data:`FREE`: think on).

        Raises
        ------
        MatcherFailed
            The matcher failed during the search for the shortest answer.
        """
        thinking = self.thinking
        assert thinking is not None
        forced = thinking.forced
        if forced is not None and thinking.forced_at < len(forced):
            return forced[thinking.forced_at]
        if thinking.answer < 0 and self.budget and self.reasoning.reserve_answer:
            thinking.answer = self._answer_length(closer)  # once: the start state's, cached per constraint
        rest = thinking.due(self.budget, self.reasoning)
        if rest is None:
            return FREE
        thinking.forced, thinking.forced_at, thinking.cut = rest, 0, True
        return rest[0]

    def _answer_length(self, closer: Closer) -> int:
        """The shortest answer, in tokens: the completion of the matcher's start state (0: none found)."""
        found = self._completion(closer)
        return 0 if found is None else len(found)

    def _think(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Take thinking tokens; returns how many were the thinking's (the rest are the answer's).

        Raises
        ------
        SequenceError
            A token runs past the end marker (never under the thinking mask).
        """
        thinking = self.thinking
        assert thinking is not None
        for i, token in enumerate(tokens):
            after = thinking.take(int(token))
            if after < 0:
                continue
            if after:
                raise SequenceError(self.seq_id, f"token {int(token)} runs {after} bytes past the reasoning end "
                                                 "marker (the thinking mask does not allow it)")
            self.thinking = None
            if self.budget:
                # The thinking spent its tokens out of max_tokens: the answer closes within what is left.
                self.budget = max(1, self.budget - thinking.tokens)
                self.next_check = 0
            return i + 1
        return len(tokens)

    def check_values(self, checks: ValueChecks, rules: ValueRules, retries: int) -> None:
        """Check each value as it completes, dropping tokens to retry one that breaks the schema (``retries`` times)."""
        if retries > 0:
            self.checks, self.retries_left = checks, retries
            self.values = ValueScanner(rules, checks.index.vocab, checks.stops)

    @property
    def terminated(self) -> bool:
        """Whether the matcher accepted a stop token (no further token is legal)."""
        return bool(self.matcher.is_terminated())

    def accept(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Accept ``tokens`` atomically: on a rejected token, roll back the ones accepted before it.

        With value checks on, a value they complete that breaks the schema is
        backtracked (:meth:`ValueChecks.backtrack`): :attr:`dropped` says how
        many tokens went.  A top-level number, which only the end of the
        output completes, is checked after each token as if the output ended
        there (:meth:`ValueChecks.refuse_end`), and a stop token where that
        end is refused is dropped, with what follows it, instead of accepted.

        Raises
        ------
        TokenRejected
            The grammar rejects ``tokens[i]``; the matcher is as before the call.
        MatcherFailed
            The matcher cannot go on (llguidance past a limit).
        """
        if self.thinking is not None:
            taken = self._think(tokens)
            if taken == len(tokens):
                self.dropped = 0
                return
            tokens = tokens[taken:]  # the answer's first tokens came in the same call
        if self.values is not None and self.checks is not None:
            stops = self.checks.stops
            for i, token in enumerate(tokens):
                if int(token) in stops:
                    self._accept_end(tokens, i)
                    return
        self._accept(tokens)

    def _accept_end(self, tokens: Sequence[int] | np.ndarray, i: int) -> None:
        """:meth:`accept` of ``tokens`` whose ``i``-th is a stop token.

        The stop is checked before the matcher takes it: llguidance keeps no
        stop token in its history once only the stop was left (``1`` under
        ``maximum: 9``), so a rollback over one would undo the token before it.
        """
        if i:
            self._accept(tokens[:i])
        else:
            self.dropped = 0
        values, checks = self.values, self.checks
        if self.dropped or (self.forced is None and values is not None and checks is not None
                            and checks.ends_refused(values, int(tokens[i]))):
            self.dropped += len(tokens) - i  # the caller drops the stop (and what follows it) too
            return
        try:
            self._accept(tokens[i:])
        except TokenRejected:  # a token after the stop: the call stays atomic (its position counts from the start)
            self.rollback(i)
            raise

    def _accept(self, tokens: Sequence[int] | np.ndarray) -> None:
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
            checking = self.forced is None and self.close_state == CloseState.OPEN
            try:
                found = values.push([int(t) for t in tokens], check=checking)
            except (LookupError, TypeError, ValueError, AttributeError) as err:
                # A scanner bug fails this row only (engine.step reports it), never the batch.
                raise SequenceError(self.seq_id, f"value check failed: {err!r}") from err
            if found is not None:
                self._retry(values, found, at_end=False)
            elif checking and self.retries_left > 0:
                self._retry(values, self._pending(values), at_end=True)

    def _retry(self, values: ValueScanner, found: Violation | None, *, at_end: bool) -> None:
        """Retry the value ``found`` says breaks the schema (``at_end``: the top-level number, were the output to
        end here), while the budget lasts.  A backtrack may leave a top-level number that breaks the schema in
        turn (``19`` back to ``1`` under ``not: {enum: [1, 19]}``): its end is refused too.

        With the budget spent, a value that breaks the schema once more stands, unless runaway closing is
        on: a model that keeps writing values the schema refuses is a runaway no period shows (budget_bench's
        served part: invented keys in an open object, each new one refused as a duplicate of an earlier one).
        That value is dropped whole, with the separator before it (:meth:`ValueChecks.drop_value`), and
        :meth:`plan` closes the output there (:attr:`spent`).
        """
        checks = self.checks
        while found is not None and checks is not None:
            spent = not self.retries_left
            if spent and (at_end or self.repeats is None):
                return  # the value stands
            if spent:
                dropped = checks.drop_value(self.matcher, values, found) or None
            else:
                dropped = (checks.refuse_end(self.matcher, values, found) if at_end
                           else checks.backtrack(self.matcher, values, found) or None)
            if dropped is None:  # no choice point in reach: the value stands
                return
            if not spent:
                self.retries_left -= 1
            if not dropped:  # (never once spent: only an end's refusal drops nothing)
                # The end is banned here: the number must grow.  The scanner stays, even with the budget
                # spent, so that the ban holds.
                return
            self._rolled_back(dropped)
            self.dropped += dropped
            if spent:
                self.values, self.spent = None, True
                return
            if not self.retries_left and self.repeats is None:  # the budget is spent: what completes now stands
                self.values = None
                return
            found, at_end = self._pending(values), True

    def _pending(self, values: ValueScanner) -> Violation | None:
        """:meth:`ValueScanner.pending`, its failures as this row's error (like the scan's)."""
        try:
            return values.pending()
        except (LookupError, TypeError, ValueError, AttributeError) as err:
            raise SequenceError(self.seq_id, f"value check failed: {err!r}") from err

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens.

        Raises
        ------
        SequenceError
            ``count`` is negative or exceeds what can be rolled back.
        """
        limit = self.tokens_accepted
        if self.thinking is not None and count:
            raise SequenceError(self.seq_id, f"cannot roll back {count} tokens inside the thinking section")
        if not 0 <= count <= limit:
            raise SequenceError(self.seq_id, f"cannot roll back {count} tokens (at most {limit})")
        if count:
            self.matcher.rollback(count)
            if self.values is not None:
                self.values.rollback(count)
            self._rolled_back(count)

    def _rolled_back(self, count: int) -> None:
        """Counters after the matcher (and the scanner) dropped ``count`` tokens."""
        scalar = self.scalar_tokens
        if scalar is not None:
            scalar.extend(int(t) for t in self.new_tokens)  # not yet planned: folded in before the cut
            del scalar[max(0, len(scalar) - count):]
        self.tokens_accepted -= count
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
            self.next_check = min(self.next_check, self.tokens_accepted)

    def plan(self, closer: Closer, stop_token: int) -> int:
        """This step's closing token, or :data:`FREE`; :attr:`close_state` says what it means.

        Called once per step, after :meth:`accept`.  Budget: the sequence may
        still sample ``left = budget - tokens_accepted`` tokens, the stop
        token included; ``spare`` is what a completion found now leaves.

        * ``spare > margin + completion``: free; the next check comes a
          quarter of the way to the calm zone, so a 1,000-token budget costs
          about 20 searches (p50 0.09 ms, p99 2 ms on maskbench-dev), or
          right after a token that opens an object or array, whose required
          tail may grow the completion past the budget before that check
          (one ``{`` of 30 required properties: +182 tokens at once).
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

        Repetition: every ``every`` tokens the tail is checked (a repeated
        unit, or ``max_digits`` digits in a run: :class:`RepeatConfig`); a
        runaway forces the completion at once (``REPETITION``).  A top-level
        string or number's completion is checked as post-validation will
        check it (:meth:`_value_check`).

        Raises
        ------
        MatcherFailed
            The matcher failed during the search.
        """
        if len(self.new_tokens):
            self._took(closer)
        if self.forced is not None:
            if self.forced_at < len(self.forced):
                return self.forced[self.forced_at]
            return stop_token
        accepted = self.tokens_accepted
        if self.spent:
            # The value retries are spent and the model wrote one more value the schema refuses, now
            # dropped (:meth:`_retry`): ended here, where the output still holds only values that pass.
            self.spent = False
            found = self._completion(closer)
            if found is not None and (not self.budget or len(found) < self.budget - accepted):
                return self._force(found, CloseState.REPETITION, stop_token)
        if self.utf8_need:
            # Inside a character no completion can start (the search would run
            # to its node limit for nothing): every check waits for its end.
            if self.close_state == CloseState.CALM:
                return self._calm_token(stop_token)
            return FREE
        if self.repeats is not None and accepted >= self.next_repeat_check:
            repeat = self.closing.repeat
            self.next_repeat_check = accepted + repeat.every
            if self.repeats.repeating(self.digit_run):
                # The kept completion (or a tail of it) where it still ends the output: a new
                # search on a large schema costs up to 20 ms, at every check while it repeats.
                found = self._completion(closer)
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
        found = self._completion(closer)
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
        # by about what is still open, so the calm zone widens with it: measured,
        # "},{" opening an item of 3 required fields added 11 tokens at once.  And
        # by the most it grew between two checks so far: in the replay part of
        # budget_bench, '"],"ordered_related_items":["' (a uuid item) took a
        # completion from 3 to 38 tokens with 25 left, after earlier uuid items.
        # And a structural tag's output may open a whole new segment (a tool call) wherever it is complete.
        if self.segment < 0:
            self.segment = (closer.segment((self.backend, self.spec), self.matcher, self.spec.segments)
                            if accepted == 0 else 0)
        calm_at = self.closing.margin + (len(found) + max(self.growth, self.segment) if found is not None else 0)
        if found is not None and spare <= calm_at:
            self.close_state = CloseState.CALM
            # A screened row (see screen) is checked at every token: its screen reads the spare then.
            self.next_check = accepted + (max(1, (spare - 1) // 2) if self.calm_ok else 1)
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
        check = self._value_check(closer) if self.scalar_tokens is not None else None
        if last is not None:
            found = last[self.completion_at:] if self.completion_kept else closer.resume(self.matcher, last)
            if found is not None and check is not None and not check(closer.text(found)):
                found = None  # it ends the output invalid now (a top-level string's format): search again
            if found is None:
                found = closer.complete(self.matcher, check)
        elif self.tokens_accepted == 0:  # a new matcher's state: the same for every sequence of the constraint
            found = closer.initial((self.backend, self.spec), self.matcher, check)
        else:
            found = closer.complete(self.matcher, check)
        self.completion, self.completion_at, self.completion_kept = found, 0, True
        return found

    def _took(self, closer: Closer) -> None:
        """Fold the last :meth:`accept`'s tokens into the per-output state :meth:`plan` reads."""
        new = self.new_tokens
        self.new_tokens = ()
        self.utf8_need = closer.utf8_need(self.utf8_need, new)
        if (self.budget and self.completion is not None and self.next_check > self.tokens_accepted
                and self.close_state == CloseState.OPEN and closer.opens(new)):
            # A new object or array may need a long required tail: checked now, not at the next
            # spaced check, where it could have outgrown the budget meanwhile (see plan).
            self.next_check = self.tokens_accepted
        if self.repeats is not None:
            self.digit_run = closer.digit_run(self.digit_run, new)
        if self.scalar_tokens is not None:
            self.scalar_tokens.extend(int(t) for t in new)

    def _value_check(self, closer: Closer) -> Callable[[bytes], bool] | None:
        """What post-validation will say of a top-level scalar ended by a given completion (see
        :meth:`Closer.complete`); None where the output's text is not known exactly (tokens accepted
        by two :meth:`accept` calls without a :meth:`plan` between them, which the engine never does).

        One ``jsonschema`` validation of the whole scalar per candidate (8-23 us for a string with a
        format), only for outputs that are one scalar, only at budget and runaway checks.
        """
        tokens = self.scalar_tokens
        schema = self.spec.schema
        if tokens is None or schema is None or len(tokens) != self.tokens_accepted:
            return None
        validator = validator_for(schema)
        prefix = closer.text(tokens)

        def check(completion: bytes) -> bool:
            return bool(validator.validate_text(prefix + completion).valid)

        return check

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

    def screen(self, closer: Closer, allowed: Sequence[int], stop_token: int) -> list[int]:
        """The tokens of ``allowed`` (the grammar's, at a calm row that is not :attr:`calm_ok`) after which a
        completion still fits the budget.

        Each one is taken, a completion of the state after it searched
        (:meth:`Closer.complete`: a choice's or a regex's, 10-100 us), and
        rolled back: kept when that completion and the stop token fit in
        what the budget leaves after it.  The stop token, where allowed,
        always fits.  So near its budget a regex may still write its own
        ending, and a choice its own alternative, where either fits.

        Raises
        ------
        MatcherFailed
            The matcher failed during a search.
        """
        room = self.budget - self.tokens_accepted - 2  # after the token: the completion and the stop token
        matcher = self.matcher
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

    @property
    def whole_chars_only(self) -> bool:
        """Whether a calm row takes only tokens that end on a character boundary
        (:meth:`Closer.calm_tokens`): a character begun now might not end before the completion must start.

        No check can start a completion inside a character, so a due check
        waits for its end: at most :data:`UTF8_MAX_OWED` tokens.  From a spare
        (budget left after the last completion found and the stop token) of
        ``UTF8_MAX_OWED + 1``, one more byte-level lead could take the spare
        below 0 before the check: the output then ran to ``max_tokens``
        unclosed (``bench/processor_bench.py``, the tiny stand-in, 16 rows,
        128 tokens: 2 outputs of each batch's 16; one began a 3-byte
        character at spare 2).
        """
        return self.budget - self.tokens_accepted - 1 - self.completion_len <= UTF8_MAX_OWED + 1

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
