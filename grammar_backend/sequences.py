"""One sequence: its matcher and the policies applied to it, in one order (the table of them is
:mod:`grammar_service.table`).

A sequence's matcher is wrapped by three policies, each owning its slice of
the row's state:

* the thinking section (:class:`~grammar_backend.reasoning.Thinking`, when the
  request reasons first): free text up to its end marker, which the matcher
  never sees;
* the value checks (:class:`~grammar_backend.values.ValuePolicy`, with
  ``value_retries``): each completed value checked against the schema, one
  that breaks it dropped and retried;
* closing (:class:`~grammar_backend.close_plan.ClosePlan`): the output kept
  within its budget and stopped when it runs away.

Jump-forward reads the matcher after all three (the engine's step).

:meth:`GrammarSequence.accept` applies them in this order:

1. thinking takes the tokens up to its end marker (and the rest, if any,
   are the answer's first tokens);
2. a stop token is refused where the value checks refuse the output's end
   there (the stop, and what follows it, is dropped);
3. the matcher takes the tokens (all or none);
4. closing follows them (the completion it holds, the one it forces, the
   runaway detector);
5. the value checks scan them: a value that breaks the schema is dropped
   from the matcher and the scanner, closing is told (and, past the
   retries with runaway closing on, asked to close the output there).

Then :meth:`GrammarSequence.reason` (in the thinking section) or
:meth:`ClosePlan.plan <grammar_backend.close_plan.ClosePlan.plan>` (after it)
decides the step's forced, calm or free row.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from grammar_backend.bitmask import Matcher
from grammar_backend.close_plan import FREE, ClosePlan
from grammar_backend.closing import Closer, ClosingConfig
from grammar_backend.errors import MatcherFailed, SequenceError, TokenRejected
from grammar_backend.protocol import CloseState
from grammar_backend.reasoning import MarkerTable, ReasoningConfig, Thinking
from grammar_backend.spec import ConstraintSpec
from grammar_backend.values import ValueChecks, ValuePolicy, ValueRules

__all__ = ["FREE", "GrammarSequence"]


class GrammarSequence:
    """One sequence's matcher and counters (the request-level object), with its policies.

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
        The request's ``max_tokens`` (the stop token included); 0 = unknown
        (see :class:`ClosePlan`).
    closing : ClosingConfig
    """

    __slots__ = ("backend", "close", "created", "dropped", "last_used", "matcher", "reasoning", "recording",
                 "seq_id", "spec", "steps", "thinking", "tokens_accepted", "values")

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
        #: The closing policy (it forces nothing where neither budget nor runaway closing is on).
        self.close = ClosePlan(spec, backend, budget, closing if closing is not None else ClosingConfig())
        #: The value checks: off unless :meth:`check_values` turns them on, and off again once over.
        self.values: ValuePolicy | None = None
        #: Tokens the last :meth:`accept` dropped to retry a value that broke the schema (0: none).
        self.dropped = 0
        #: The thinking section in front of the matcher (None: none, or over; :meth:`think`).
        self.thinking: Thinking | None = None
        self.reasoning = ReasoningConfig()
        #: The matcher's tokens, kept where a list is set (a replay of the output wants them), else None.
        self.recording: list[int] | None = None

    def fork(self) -> GrammarSequence:
        """A copy for a step's draft positions (speculative decoding): it shares this sequence's matcher and
        goes on with its own thinking and closing state, without value checks.

        The caller accepts the drafts into the fork (so into the shared
        matcher), plans and fills each position as for a row, then rolls the
        matcher back by ``fork.tokens_accepted - self.tokens_accepted``: this
        sequence is left as it was.  Drafts are not scanned: a value they
        complete is checked when the target's accepted tokens come back as
        the next step's tokens, and dropped there if it breaks the schema
        (what follows it in the same step is dropped with it), as without
        speculation.
        """
        twin = copy.copy(self)
        twin.close = self.close.fork()
        twin.thinking = None if self.thinking is None else copy.copy(self.thinking)
        twin.values = None
        twin.recording = None
        return twin

    # ------------------------------------------------------------------ thinking

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
        if self.thinking is None:
            raise SequenceError(self.seq_id, "thinking_row: the sequence is not in its thinking section")
        return self.thinking.row(self.close.budget, self.reasoning)

    def reason(self, closer: Closer) -> int:
        """A thinking row's plan: the end marker's next token when it is forced (:data:`FREE`: think on).

        Raises
        ------
        MatcherFailed
            The matcher failed during the search for the shortest answer.
        """
        thinking = self.thinking
        if thinking is None:
            raise SequenceError(self.seq_id, "reason: the sequence is not in its thinking section")
        forced = thinking.forced
        if forced is not None and thinking.forced_at < len(forced):
            return forced[thinking.forced_at]
        budget = self.close.budget
        if thinking.answer < 0 and budget and self.reasoning.reserve_answer:
            # Once: the shortest answer is the start state's completion, cached per constraint (0: none found).
            found = self.close.find(closer, self.matcher, self.tokens_accepted)
            thinking.answer = 0 if found is None else len(found)
        rest = thinking.due(budget, self.reasoning)
        if rest is None:
            return FREE
        thinking.forced, thinking.forced_at, thinking.cut = rest, 0, True
        return rest[0]

    def _think(self, thinking: Thinking, tokens: Sequence[int] | np.ndarray) -> int:
        """Take thinking tokens; returns how many were the thinking's (the rest are the answer's).

        Raises
        ------
        SequenceError
            A token runs past the end marker (never under the thinking mask).
        """
        for i, token in enumerate(tokens):
            after = thinking.take(int(token))
            if after < 0:
                continue
            if after:
                raise SequenceError(self.seq_id, f"token {int(token)} runs {after} bytes past the reasoning end "
                                                 "marker (the thinking mask does not allow it)")
            self.thinking = None
            self.close.answer_begins(thinking.tokens)  # the thinking spent its tokens out of max_tokens
            return i + 1
        return len(tokens)

    # ------------------------------------------------------------------ value checks

    def check_values(self, checks: ValueChecks, rules: ValueRules, retries: int) -> None:
        """Check each value as it completes, dropping tokens to retry one that breaks the schema (``retries`` times)."""
        if retries > 0:
            self.values = ValuePolicy(self.seq_id, checks, rules, retries)

    # ------------------------------------------------------------------ the matcher

    @property
    def terminated(self) -> bool:
        """Whether the matcher accepted a stop token (no further token is legal)."""
        return bool(self.matcher.is_terminated())

    def accept(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Accept ``tokens`` atomically, the policies in the module's order.

        A value the checks refuse is backtracked: :attr:`dropped` says how
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
        thinking = self.thinking
        if thinking is not None:
            taken = self._think(thinking, tokens)
            if taken == len(tokens):
                self.dropped = 0
                return
            tokens = tokens[taken:]  # the answer's first tokens came in the same call
        if self.values is not None:
            stops = self.values.checks.stops
            for i, token in enumerate(tokens):
                if int(token) in stops:
                    self._accept_end(tokens, i)
                    return
        self._accept(tokens)

    def accept_each(self, tokens: Sequence[int], closer: Closer, stop_token: int) -> None:
        """:meth:`accept` one token at a time, planned after each (:meth:`reason` or :meth:`plan`) but the last.

        Several tokens that come back at once (the drafts a target accepted,
        a jump-forward run) leave the sequence as as many one-token steps
        would: closing checks the budget where it would have, and a value is
        checked or not as the row stood when it completed.  The caller plans
        after the last token, as after any accept.  A value that breaks the
        schema drops what follows it too (:attr:`dropped` counts it).

        Raises
        ------
        TokenRejected, SequenceError, MatcherFailed
            As :meth:`accept`; the matcher tokens this call accepted are rolled back.
        """
        start = self.tokens_accepted
        last = len(tokens) - 1
        try:
            for n, token in enumerate(tokens):
                self.accept((token,))
                if self.dropped:
                    self.dropped += last - n
                    return
                if n < last:
                    if self.thinking is not None:
                        self.reason(closer)
                    elif self.closes and not self.terminated:
                        self._plan_within(closer, stop_token, int(tokens[n + 1]))
        except (SequenceError, MatcherFailed):
            if self.tokens_accepted > start:
                self.rollback(self.tokens_accepted - start)
            raise

    def _plan_within(self, closer: Closer, stop_token: int, following: int) -> None:
        """:meth:`plan` at a position inside :meth:`accept_each`'s tokens, leaving the plan as a step would.

        A step does more to a calm row than plan it: where the grammar does not allow the
        row's calm token (the completion's next one), the step's mask phase asks
        :meth:`recheck` for a new completion, which the budget checks after it measure.
        Skipping it here left a row that took several tokens at once (accepted drafts)
        with another completion, so another close state, than one token a step: CALM
        where the step-by-step row was already in BUDGET.  The grammar's mask bit is asked
        of the matcher (:func:`_allows`), unless ``following`` (the next token taken) is that token.
        """
        token = self.plan(closer, stop_token)
        if token == FREE or token == following or self.forcing or self.close.utf8_need:
            return  # inside a character a recheck changes nothing
        if not _allows(self.matcher, token, stop_token):
            self.recheck(closer, stop_token)

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
        values = self.values
        if self.dropped or (self.close.forced is None and values is not None and values.refuses_end(int(tokens[i]))):
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
        if self.recording is not None:
            self.recording.extend(int(t) for t in tokens)
        close = self.close
        close.followed(tokens, self.tokens_accepted)
        self.dropped = 0
        values = self.values
        if values is None:
            return
        dropped, close_now = values.scan(matcher, [int(t) for t in tokens], checking=close.open,
                                         runaway=close.repeats is not None)
        if dropped:
            self._rolled_back(dropped)
            self.dropped = dropped
        if values.over:
            self.values = None
        if close_now:
            close.close_now()

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
                self.values.scanner.rollback(count)
            self._rolled_back(count)

    def _rolled_back(self, count: int) -> None:
        """Counters after the matcher (and the scanner) dropped ``count`` tokens."""
        self.tokens_accepted -= count
        if self.recording is not None:
            del self.recording[len(self.recording) - count:]
        self.close.rolled_back(count, self.tokens_accepted)

    # ------------------------------------------------------------------ closing

    @property
    def closes(self) -> bool:
        """Whether this sequence may be closed early (budget or repetition)."""
        return self.close.closes

    @property
    def close_state(self) -> CloseState:
        """Where the row stands with respect to closing (the step's ``CLOSING``)."""
        return self.close.close_state

    @property
    def forcing(self) -> bool:
        """Whether this step's mask is the single token :meth:`plan` returned."""
        return self.close.forced is not None

    def plan(self, closer: Closer, stop_token: int) -> int:
        """This step's closing token, or :data:`FREE` (:meth:`ClosePlan.plan`); after :meth:`accept`."""
        return self.close.plan(closer, self.matcher, self.tokens_accepted, stop_token)

    def recheck(self, closer: Closer, stop_token: int) -> int:
        """A calm row whose plan token the grammar does not allow here (:meth:`ClosePlan.recheck`)."""
        return self.close.recheck(closer, self.matcher, self.tokens_accepted, stop_token)

    def screen(self, closer: Closer, allowed: Sequence[int], stop_token: int) -> list[int]:
        """The tokens of ``allowed`` after which a completion still fits (:meth:`ClosePlan.screen`)."""
        return self.close.screen(closer, self.matcher, self.tokens_accepted, allowed, stop_token)

    @property
    def whole_chars_only(self) -> bool:
        """Whether a calm row takes only whole characters (:meth:`ClosePlan.whole_chars_only`)."""
        return self.close.whole_chars_only(self.tokens_accepted)


def _allows(matcher: Matcher, token: int, stop_token: int) -> bool:
    """Whether the grammar allows ``token`` next, as its mask bit would say; the matcher is left where it was."""
    if token == stop_token:
        return bool(matcher.is_completed())
    allows = getattr(matcher, "allows", None)
    if allows is not None:  # llguidance: checked without advancing (a limit met advancing fails it for good)
        return bool(allows(token))
    if not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True
