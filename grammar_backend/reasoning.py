"""The thinking section of a reasoning request, on the grammar side.

With the ``reasoning`` option (:mod:`contract.reasoning`) a sequence starts in
its thinking section: its matcher is not used yet, its mask allows every
token but the stop tokens, the tokenizer's special tokens and the tokens that
would run past the end marker (below), and its tokens are watched, byte by
byte, for the end marker.  The token that completes the marker ends the
thinking; the matcher takes the tokens after it, from its start state, so the
constraint applies to the answer exactly as it does without ``reasoning``.

Mechanism: a per-sequence phase in front of the matcher, not a wrapper
grammar.  The same compiled grammar (and cache entry) serves requests with
and without thinking, both backends work alike (neither sees the thinking),
and the thinking is free text, which neither xgrammar's structural tags nor
llguidance's lazy lexemes can leave fully free without allowing the end
marker inside it.

The end marker is found across token boundaries with a KMP automaton over
bytes (:class:`MarkerTable`): the marker split over several tokens (``</``,
``think``, ``>``) ends the thinking as the one-token ``</think>`` does.  A
token that would complete the marker and go on past it (``>\\n\\n`` after
``</think``) is masked out while the marker is partly written: its extra
bytes would be the answer's first bytes, unchecked by the grammar.  The
model can always write the marker another way (the single-byte tokens), so
no thinking is refused, and the answer always starts on a token boundary.
Special tokens are masked because the output text leaves them out (the
detokenizer skips them), which would let the text and the bytes watched
here disagree about where the marker is.

The thinking budget: the server forces the end marker (its rest, from the
part already written, spelled by the tokenizer) token by token, through the
same single-token masks as budget closing, so the scheduler and TensorRT-LLM's
guided decoder take it without knowing about it:

(a) at ``max_reasoning_tokens`` (its end marker included): the marker is
    forced when its rest would no longer fit after one more token.  The
    bound holds, and is met exactly when the marker is not begun there: in
    the last tokens before it, where a begun marker's rest could outgrow
    what is left (``</`` needs ``think`` and ``>`` after it, the whole marker
    is one Qwen3 token), no token that begins the marker is allowed, and a
    marker begun just before them is finished at once (:meth:`Thinking.row`,
    :meth:`Thinking.due`);
(b) with ``on_budget: close`` (the default), when what is left of
    ``max_tokens`` falls to the answer's reserve: the marker's longest rest
    (:attr:`MarkerTable.worst`), plus the shortest valid answer (the closer's completion of a new matcher,
    :meth:`~grammar_backend.closing.Closer.initial`, cached per constraint),
    plus the margin, plus the stop token.  The margin (:class:`ReasoningConfig`)
    is ``margin_tokens`` plus ``margin_ratio`` times the shortest answer: by
    default the answer keeps room for twice its shortest form and 16 tokens,
    so it starts outside budget closing's calm zone (8 tokens plus the
    completion) and the model writes its own values; from there budget
    closing guarantees a complete answer whenever the shortest one fits.

Either way the marker never cuts a character: in the last
:data:`WHOLE_CHARS_AHEAD` tokens before a cut may come, a thinking row takes
only tokens that keep its text on character boundaries (a begun character
is finished, none is begun that its token does not end), so the thinking's
text has no bytes a reader cannot show (``tests/unit/test_reasoning_engine.py``
writes 4-byte characters one byte a token at 12 bounds and 12 budgets; how
many split one before this rule: docs/benchmarks.md, component costs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from grammar_backend.bitmask import pack_tokens
from grammar_backend.closing import UTF8_MAX_OWED, utf8_owed
from grammar_backend.errors import ConfigError
from grammar_backend.jump import PrefixIndex

__all__ = ["WHOLE_CHARS_AHEAD", "MarkerTable", "ReasoningConfig", "Thinking"]

#: How many tokens before the end marker may be forced a thinking row takes only tokens that keep its
#: text on character boundaries (:meth:`Thinking.row`): a character begun before them ends within
#: :data:`~grammar_backend.closing.UTF8_MAX_OWED` of them, so the marker never splits one.
WHOLE_CHARS_AHEAD = UTF8_MAX_OWED + 1

#: Spells bytes as vocabulary tokens (None: cannot).
Speller = Callable[[bytes], "tuple[int, ...] | None"]


@dataclass(frozen=True)
class ReasoningConfig:
    """How much of ``max_tokens`` the thinking leaves to the answer (rule (b) of the module docstring).

    Parameters
    ----------
    margin_tokens : int
        Tokens the answer keeps beyond its shortest form (and its stop token).
    margin_ratio : float
        And this many times the shortest answer's length.
    reserve_answer : bool
        False: rule (b) is off (the thinking runs until the model ends it or
        ``max_reasoning_tokens``): for measuring what the reserve buys
        (``bench/reasoning_bench.py``), not for serving.
    tables : int
        End markers whose tables are kept (one per distinct marker in use; at least 2).
    """

    margin_tokens: int = 16
    margin_ratio: float = 1.0
    reserve_answer: bool = True
    tables: int = 64

    def __post_init__(self) -> None:
        if self.margin_tokens < 0 or not self.margin_ratio >= 0 or self.tables < 2:
            raise ConfigError("reasoning: margin_tokens and margin_ratio must be >= 0 and tables at least 2")

    def reserve(self, rest: int, answer: int) -> int:
        """Tokens kept for the end marker's ``rest`` and an answer whose shortest form is ``answer`` tokens."""
        return rest + answer + self.margin_tokens + math.ceil(self.margin_ratio * answer) + 1


class MarkerTable:
    """One end marker over one vocabulary: its byte automaton, masks and spellings.

    Built once per marker per engine (cached), in about 20 ms for Qwen3's
    151,669 tokens (timed alone: the scan for tokens that hold the whole
    marker); each mask row and spelling on first use.

    Parameters
    ----------
    marker : bytes
        The end marker's UTF-8 bytes.
    index : PrefixIndex
        The vocabulary's pieces, sorted (shared with jump-forward and the value checks).
    vocab_size : int
        The mask width in tokens.
    banned : iterable of int
        Tokens never allowed while thinking: the stop tokens and the special tokens.
    spell : callable
        Bytes -> tokens spelling them exactly (the tokenizer's own spelling
        where it round-trips), or None.
    """

    def __init__(self, marker: bytes, index: PrefixIndex, vocab_size: int, banned: Iterable[int],
                 spell: Speller) -> None:
        if not marker:
            raise ConfigError("reasoning: an empty end marker")
        self.marker = marker
        self._index = index
        self._vocab_size = vocab_size
        self._banned = sorted(set(banned))
        self._spell = spell
        m = len(marker)
        # KMP automaton: _dfa[k][b] is the marker prefix matched after byte b from state k (m: complete).
        dfa = [[0] * 256 for _ in range(m)]
        dfa[0][marker[0]] = 1
        fallback = 0
        for k in range(1, m):
            dfa[k] = list(dfa[fallback])
            dfa[k][marker[k]] = k + 1
            fallback = dfa[fallback][marker[k]]
        self._dfa = dfa
        # Borders: _border[k] is the longest proper prefix of marker[:k] that is also its suffix.
        border = [0] * (m + 1)
        for k in range(2, m + 1):
            j = border[k - 1]
            while j and marker[j] != marker[k - 1]:
                j = border[j]
            border[k] = j + 1 if marker[j] == marker[k - 1] else 0
        self._border = border
        vocab = index.vocab
        special = index.special
        # Tokens that hold the whole marker: the one way to complete it from state 0 (once per marker).
        self._holding = [t for t, piece in enumerate(vocab) if marker in piece and t not in special]
        self._rows: dict[int, np.ndarray] = {}
        self._rests: dict[int, tuple[int, ...] | None] = {}
        self._worst = -1
        self._calm: np.ndarray | None = None
        self._whole: dict[tuple[int, int, bool], np.ndarray] = {}
        index.char_rows(vocab_size)  # built here, at a request's start, not in a step (once per vocabulary)

    @property
    def states(self) -> int:
        """The automaton's states before completion (the marker's length in bytes)."""
        return len(self.marker)

    def advance(self, state: int, piece: bytes) -> tuple[int, int]:
        """``(state, end)`` after ``piece``: ``end`` is how many of its bytes complete the marker (-1: not complete).

        One list lookup a byte, no allocation; stops at the completion.
        """
        dfa, m = self._dfa, len(self.marker)
        for i, byte in enumerate(piece):
            state = dfa[state][byte]
            if state == m:
                return state, i + 1
        return state, -1

    def piece(self, token: int) -> bytes:
        """``token``'s bytes (special tokens spell nothing here: they are masked)."""
        vocab = self._index.vocab
        return vocab[token] if 0 <= token < len(vocab) else b""

    def row(self, state: int) -> np.ndarray:
        """The packed mask of a thinking row whose output ends with ``marker[:state]`` (cached)."""
        row = self._rows.get(state)
        if row is None:
            row = np.invert(pack_tokens(sorted({*self._banned, *self.overrunning(state)}), self._vocab_size))
            self._rows[state] = row
        return row

    def overrunning(self, state: int) -> list[int]:
        """Tokens that, taken in ``state``, complete the marker before their last byte.

        Such a token either holds the whole marker, or begins with the rest of
        a marker prefix the output already ends with (``state`` or one of its
        borders) and goes on; each candidate is run through the automaton.
        """
        index, vocab = self._index, self._index.vocab
        candidates: set[int] = set(self._holding)
        j = state
        while j:
            candidates.update(int(t) for t in index.starting(self.marker[j:], longer=True))
            j = self._border[j]
        out = []
        for token in candidates:
            piece = vocab[token]
            _, end = self.advance(state, piece)
            if 0 < end < len(piece):
                out.append(token)
        return sorted(out)

    @property
    def worst(self) -> int:
        """The most tokens the marker's rest takes from any state (from 1 where it is one token)."""
        if self._worst < 0:
            self._worst = max((len(r) for k in range(self.states) if (r := self.rest(k)) is not None), default=1)
        return self._worst

    def calm_row(self) -> np.ndarray:
        """:meth:`row` of state 0 without the tokens that begin the marker (their text ends with a proper
        prefix of it): where a begun marker's rest might no longer fit, the marker is not begun (cached)."""
        if self._calm is None:
            prefixes = tuple(self.marker[:j] for j in range(1, len(self.marker)))
            special = self._index.special
            begin = [t for t, piece in enumerate(self._index.vocab)
                     if prefixes and piece.endswith(prefixes) and t not in special]
            self._calm = np.bitwise_and(self.row(0), np.invert(pack_tokens(begin, self._vocab_size))) \
                if begin else self.row(0)
        return self._calm

    def whole_row(self, state: int, owed: int, calm: bool) -> np.ndarray:
        """:meth:`row` (``calm``: :meth:`calm_row`) without the tokens that would leave a text owing ``owed``
        UTF-8 continuation bytes inside a character (:meth:`PrefixIndex.char_rows`; cached).

        A vocabulary with no such token allowed there keeps the row whole: a
        mask that allows nothing would fail the request.
        """
        key = (state, owed, calm)
        row = self._whole.get(key)
        if row is None:
            base = self.calm_row() if calm else self.row(state)
            row = np.bitwise_and(base, self._index.char_rows(self._vocab_size)[owed])
            if not row.any():
                row = base
            self._whole[key] = row
        return row

    def rest(self, state: int) -> tuple[int, ...] | None:
        """Tokens spelling ``marker[state:]``, the rest of a marker whose first ``state`` bytes are written
        (cached; None: the vocabulary cannot spell it exactly).  Appended, they complete the marker at
        their last byte and not before (``state`` is the longest marker prefix the output ends with)."""
        if state not in self._rests:
            self._rests[state] = self._spell(self.marker[state:])
        return self._rests[state]


class Thinking:
    """One sequence's thinking section (see the module docstring).

    Parameters
    ----------
    table : MarkerTable
    limit : int
        ``max_reasoning_tokens`` (0: none).
    """

    __slots__ = ("answer", "cut", "forced", "forced_at", "limit", "owed", "state", "table", "tokens")

    def __init__(self, table: MarkerTable, limit: int) -> None:
        self.table = table
        self.limit = limit
        #: The automaton's state: the output ends with marker[:state].
        self.state = 0
        #: Tokens taken in the thinking section so far.
        self.tokens = 0
        #: The end marker's rest being forced (None: not forcing) and how much of it is taken.
        self.forced: tuple[int, ...] | None = None
        self.forced_at = 0
        #: The server forced the end marker.
        self.cut = False
        #: The shortest answer's length in tokens (-1: not looked up yet).
        self.answer = -1
        #: UTF-8 continuation bytes the thinking's text owes (0: it ends on a character boundary).
        self.owed = 0

    @property
    def forcing(self) -> bool:
        """Whether the end marker is being forced (this step's mask is its next token)."""
        return self.forced is not None

    def take(self, token: int) -> int:
        """Take one token; returns how many of its bytes come after the completed marker (-1: still thinking).

        0 is the one answer the thinking mask allows (it masks the tokens that
        overrun the marker, :meth:`MarkerTable.overrunning`).
        """
        piece = self.table.piece(token)
        self.state, end = self.table.advance(self.state, piece)
        self.owed = utf8_owed(self.owed, piece)
        self.tokens += 1
        if end >= 0:
            return len(piece) - end
        forced = self.forced
        if forced is not None:
            if self.forced_at < len(forced) and token == forced[self.forced_at]:
                self.forced_at += 1
            else:  # the engine did not take the forced token (never with this mask): decide again
                self.forced = None
        return end

    def near_limit(self) -> bool:
        """Whether one more token could begin a marker whose rest no longer fits in ``max_reasoning_tokens``."""
        return bool(self.limit) and self.tokens + 1 + self.table.worst > self.limit

    def row(self, budget: int, config: ReasoningConfig) -> np.ndarray:
        """This step's mask when nothing is forced (:meth:`MarkerTable.row`, or its calm form near the limit).

        Within :data:`WHOLE_CHARS_AHEAD` tokens of a cut (:meth:`due`'s
        rules, ``budget`` and ``config`` as there) only tokens that keep the
        text on character boundaries are allowed (:meth:`MarkerTable.whole_row`):
        a forced marker would otherwise cut the thinking inside a character,
        whose bytes no text can show.
        """
        calm = self.state == 0 and self.near_limit()
        if self._cut_within(WHOLE_CHARS_AHEAD, budget, config):
            return self.table.whole_row(self.state, self.owed, calm)
        return self.table.calm_row() if calm else self.table.row(self.state)

    def _cut_within(self, ahead: int, budget: int, config: ReasoningConfig) -> bool:
        """Whether :meth:`due` may force the marker within ``ahead`` more tokens (by either rule)."""
        worst = self.table.worst
        if self.limit and self.tokens + ahead + worst >= self.limit:
            return True
        return bool(budget) and config.reserve_answer and \
            budget - self.tokens - ahead <= config.reserve(worst, max(self.answer, 0))

    def due(self, budget: int, config: ReasoningConfig) -> tuple[int, ...] | None:
        """The end marker's rest to force now, or None (the thinking goes on).

        ``budget``: the request's ``max_tokens`` under ``on_budget: close``
        (0: no reserve for the answer); the reserve needs :attr:`answer`, the
        shortest answer's length, set by the caller before.
        """
        rest = self.table.rest(self.state)
        if rest is None:
            return None  # wait for a state whose rest the vocabulary spells (byte-level vocabularies always do)
        if self.limit and (self.tokens + len(rest) >= self.limit or (self.state and self.near_limit())):
            return rest  # a marker begun near the limit is finished while it still fits
        if not (budget and config.reserve_answer):
            return None
        # The longest rest, not this one: a marker begun after this check still leaves the answer its room.
        past = config.reserve(self.table.worst, max(self.answer, 0)) - (budget - self.tokens)
        if past < 0:
            return None
        # Inside a character (which :meth:`row` has ended by now unless the vocabulary cannot), the cut
        # waits for its end while the answer's margin covers the wait.
        if self.owed and past < min(UTF8_MAX_OWED, config.margin_tokens):
            return None
        return rest
