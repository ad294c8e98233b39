"""Ending a constrained output early and still validly: budget closing and runaway detection.

A constrained output is valid only if it *finishes*.  With a small model most
realistic JSON schemas run out of ``max_tokens`` inside a value the model
keeps extending (``"bin/bin/bin..."``, the same array item again and again).
This module holds the two pieces the grammar engine uses to end such an
output as a complete sentence of its grammar:

* :class:`Closer` finds a short completion of a matcher's current state (the
  fewest characters that make the grammar complete), spelled as vocabulary
  tokens.  The engine forces those tokens, then the stop token, when the
  sequence's spare budget runs out.
* :class:`RepeatDetector` notices a runaway: the last tokens are one short
  unit repeated back to back, or the output ends in a long run of digits.

Both work on any grammar xgrammar compiles (JSON Schema, regex, EBNF); the
search alphabet favours JSON's closing characters, and a grammar whose
completion the bounded search cannot find is reported, never guessed.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xgrammar as xgr

from grammar_backend.bitmask import Matcher
from grammar_backend.errors import ConfigError
from grammar_backend.lru import Lru
from grammar_backend.spec import Segments

__all__ = [
    "UTF8_MAX_OWED",
    "Closer",
    "CloserConfig",
    "ClosingConfig",
    "RepeatConfig",
    "RepeatDetector",
    "utf8_owed",
]


#: Characters tried first outside strings, in order: they close containers
#: and strings, or start the cheapest JSON values (``0``, ``""``, ``[]``,
#: ``{}``; ``true``/``false``/``null`` are completed by jump-forward).
_CLOSERS = '}]",0:[{1-.tfne'
#: Whitespace a grammar may need to end (a regex's ``[0-9]+\n\}``, an EBNF's
#: ``"\t"``): JSON takes it only between tokens, where a closer is tried first.
_CONTROLS = "\n\t\r"
_SPACES = _CONTROLS + " "
#: Tried where no closer is accepted (a string with a pattern or a minimum
#: length, an enum key, a regex): every other printable character, then
#: :data:`_SPACES`.  Letters go after every other character (see :data:`_STRUCTURE`).
_FILLERS = "".join(c for c in string.printable if c not in _CLOSERS and c not in string.whitespace) + _SPACES
#: Accepted inside a free JSON string, never by JSON structure: its
#: acceptance tells the search it is inside a string, where only ``"``
#: closes (``}`` and ``]`` would be content).
_STRING_PROBE = "~"
#: Bytes of the tokens a calm mask leaves out (see :meth:`Closer.calm_tokens`).
_OPENERS = b'{[,:"'
#: Where a tail of an earlier completion may start (see :meth:`Closer.resume`).
_BOUNDARIES = frozenset(b',}]"')


#: The most continuation bytes a UTF-8 character owes after its lead byte.
UTF8_MAX_OWED = 3


def utf8_owed(need: int, data: bytes) -> int:
    """The UTF-8 continuation bytes still owed after ``data``, given ``need`` owed before it."""
    for byte in data:
        if byte < 0x80:
            need = 0
        elif byte < 0xC0:
            need = need - 1 if need else 0
        else:
            need = 3 if byte >= 0xF0 else 2 if byte >= 0xE0 else 1
    return need


def _stack(first: str) -> tuple[str, ...]:
    """Every candidate character, ``first`` in that order then the rest, as a stack (top = tried first)."""
    order = first + "".join(c for c in _CLOSERS + _FILLERS if c not in first)
    return tuple(reversed(order))


# Outside strings letters go last (after all punctuation and digits): in
# JSON they only start literals, which the grammar then forces; in a regex
# they would extend a word forever.
_STRUCTURE = _stack("".join(c for c in _CLOSERS + _FILLERS if not c.isalpha()))
#: Closers that end one level of nesting each: repeated, they end the next (``}}]}``, an EBNF's ``))``),
#: so recent use does not send them last.
_NESTED = '}])"'
#: Every character the search tries without :meth:`Closer.extra`.
_ALPHABET = frozenset(_CLOSERS + _FILLERS)
#: Inside a string, after the quote: the separators of common formats (email,
#: URI, date, host), then letters and digits.  Characters used in the last
#: :data:`_RECENT` characters go last, so a pattern or format that rejects the
#: quote is walked forward (``jo`` -> ``jo@a``) instead of looping on one letter.
_IN_STRING = '@.-:/' + string.ascii_lowercase + string.digits + string.ascii_uppercase
_RECENT = 8
#: Most characters :meth:`Closer.extra` adds to the search's alphabet: more means a grammar open to
#: any text there (a string's content), where the fixed alphabet serves.
_MAX_EXTRA = 64
# After a digit, other digits go last: otherwise the search would extend a
# number forever.  Digits from 0.
_AFTER_DIGIT = _stack("".join(c for c in _CLOSERS + _FILLERS if not c.isdigit()) + string.digits)
#: Constraints whose first completion :class:`Closer` keeps.
_INITIAL_CACHE = 1024
#: Most tails of an earlier completion :meth:`Closer.resume` tries before a new search.
_RESUME_TRIES = 24
#: A rejected candidate costs about a microsecond (timed alone); a node may try the whole alphabet.
_TRIES_PER_NODE = 32


@dataclass(frozen=True)
class CloserConfig:
    """Bounds of one completion search.

    Parameters
    ----------
    max_nodes : int
        Most states expanded; past it the search gives up (the sequence then
        ends truncated, as without closing).  ``bench/budget_bench.py
        ../shared/data/maskbench-dev`` (part 1, the search) reports how often
        completions are found within it and what a search costs; more nodes
        found no more (docs/benchmarks.md, component costs).
    max_chars : int
        Longest completion considered, in characters.  A large schema's
        required tail is long: at the start of 200 maskbench-dev schemas of
        3-20k characters, 32 had no completion within 512 characters (their
        outputs could never be closed, and each failed search ran its full
        node bound at every check), 2 within 4,096 (a hand-run; the rest of
        that round is in docs/benchmarks.md).
    """

    max_nodes: int = 400
    max_chars: int = 4096

    def __post_init__(self) -> None:
        if self.max_nodes < 1 or self.max_chars < 1:
            raise ConfigError("closing: max_nodes and max_chars must be positive")


@dataclass(frozen=True)
class RepeatConfig:
    """What counts as a runaway.

    The last ``min_tokens`` or more tokens (and at least ``min_repeats``
    periods) are one unit of at most ``max_period`` tokens repeated back to
    back.  Checked every ``every`` tokens over the last ``window`` tokens.

    A value can also run away without a short unit: ``31415926535...`` or a
    counter's digits repeat no period the check above sees, and each digit
    is a token of its own in SmolLM2's and Qwen3's vocabularies.  So the
    output's last ``max_digits`` characters or more being ASCII digits, in
    one run across tokens, is a runaway too (a length-aware check over the
    10-symbol alphabet).  The longest digit run in the valid test instances
    of all 2,890 maskbench-dev schemas is 50 characters (test fillers such as
    ``"1234567890..."``; realistic ones stop at 20: int64, card numbers,
    millisecond timestamps), so 64 leaves every valid one alone.
    """

    max_period: int = 16
    min_repeats: int = 4
    min_tokens: int = 24
    window: int = 64
    every: int = 4
    max_digits: int = 64

    def __post_init__(self) -> None:
        if self.max_period < 1 or self.min_repeats < 2 or self.every < 1 or self.max_digits < 1:
            raise ConfigError("closing.repeat: need max_period >= 1, min_repeats >= 2, every >= 1, max_digits >= 1")
        if self.window < max(self.min_tokens, self.max_period * self.min_repeats):
            raise ConfigError("closing.repeat: window must hold min_tokens and min_repeats periods")


@dataclass(frozen=True)
class ClosingConfig:
    """When the engine looks for a completion and forces it.

    Parameters
    ----------
    margin : int
        A sequence turns calm when its spare tokens fall to ``margin`` plus
        its completion's length (see
        :meth:`~grammar_backend.sequences.GrammarSequence.plan`): from there
        on it is checked every token and may not open structure, so its
        completion cannot outgrow the budget before it is forced.
    search, repeat : CloserConfig, RepeatConfig
    """

    margin: int = 8
    search: CloserConfig = field(default_factory=CloserConfig)
    repeat: RepeatConfig = field(default_factory=RepeatConfig)

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ConfigError("closing: margin must be >= 0")


class Closer:
    """Finds short completions of a matcher's state and spells them as tokens.

    One per engine (it holds the vocabulary's spelling table, built once).

    Parameters
    ----------
    tokenizer_info : xgrammar.TokenizerInfo
    config : CloserConfig
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, config: CloserConfig | None = None) -> None:
        self.config = config if config is not None else CloserConfig()
        self._stops = [int(t) for t in tokenizer_info.stop_token_ids]
        special = {int(t) for t in tokenizer_info.special_token_ids}
        special.update(self._stops)
        spelling: dict[bytes, int] = {}
        self._calm: list[int] = []
        #: The calm tokens that end on a character boundary (:meth:`calm_tokens`).
        self._calm_whole: list[int] = []
        #: Each token's bytes (b"" for special tokens), to turn a completion back into text.
        self._pieces: list[bytes] = []
        #: Per token: its ASCII digits at the end of its text, and whether that is all of it
        #: (:meth:`digit_run`; two list lookups a token, no allocation).
        self._digit_tail: list[int] = []
        self._all_digits: list[bool] = []
        #: Per token: whether its text opens a container (:meth:`opens`).
        self._opens: list[bool] = []
        for token_id, piece in enumerate(tokenizer_info.decoded_vocab):
            data = bytes(piece) if piece and token_id not in special else b""
            self._pieces.append(data)
            tail = len(data) - len(data.rstrip(b"0123456789"))
            self._digit_tail.append(tail)
            self._all_digits.append(bool(data) and tail == len(data))
            self._opens.append(b"{" in data or b"[" in data)
            if data:
                spelling.setdefault(data, token_id)
                if not any(c in data for c in _OPENERS):
                    self._calm.append(token_id)
                    if utf8_owed(0, data) == 0:
                        self._calm_whole.append(token_id)
        self._spelling = spelling
        self._longest = max(len(p) for p in spelling)
        #: Per token: the code point its text starts with (-1: none, or not a whole character), and one
        #: mask row for :meth:`extra`.
        self._first = np.array([_first_code(p) for p in self._pieces], dtype=np.int32)
        self._mask = np.zeros((1, (tokenizer_info.vocab_size + 31) // 32), dtype=np.int32)
        # The first completion of a constraint is the same for every sequence
        # of it (a new matcher's state): searched once, 0.4-1.5 ms each time
        # otherwise.  Values are (completion,) so that "none found" is cached too.
        self._initial: Lru[Hashable, tuple[tuple[int, ...] | None]] = Lru(_INITIAL_CACHE)
        self._segment: Lru[Hashable, int] = Lru(_INITIAL_CACHE)

    def complete(self, matcher: Matcher, check: Callable[[bytes], bool] | None = None, *,
                 shortest: bool = False, max_nodes: int | None = None, widen: bool = True) -> tuple[int, ...] | None:
        """Tokens that make ``matcher``'s grammar complete from its current state.

        The matcher is left exactly as it was (the search accepts and rolls
        back; a fork would copy the whole token history: 13 ms after 2,400
        characters, timed alone).  Returns ``()`` when the grammar is complete already and
        None when the bounded search finds no completion.

        Parameters
        ----------
        matcher : Matcher
        check : callable, optional
            What post-validation will say of the output ended by a completion
            (given the completion's UTF-8 text): where the grammar leaves a
            keyword unenforced (``format: idn-email`` is a free string to
            xgrammar), the first complete text may still be invalid.  A
            completion it refuses is passed over and the search goes on,
            within the same node bound; where no completion passes, the first
            one found is returned (it still ends the output parseable, and
            post-validation reports the value).
        shortest : bool
            Spend the whole node bound on the shortest completion in
            characters, not the first found (:meth:`initial`: once per
            constraint).  A choice's first found may be its longest
            alternative, which a small budget cannot hold where a short one fits.
        max_nodes : int, optional
            A tighter node bound than the configuration's (a screen of many
            tokens, each needing only a short completion).
        widen : bool
            Where the search finds nothing, search again with the characters
            the grammar allows next that the alphabet lacks (:meth:`extra`:
            one mask fill).
        """
        text = self._search(matcher, check, shortest, max_nodes or self.config.max_nodes, widen)
        if text is None:
            return None
        tokens = self.spell(text.encode("utf-8"))
        if tokens is None or not self.accepts(matcher, tokens):
            return None
        return tokens

    def initial(self, key: Hashable, matcher: Matcher,
                check: Callable[[bytes], bool] | None = None) -> tuple[int, ...] | None:
        """:meth:`complete` of a new matcher of the constraint ``key`` (cached per constraint).

        ``check`` (see :meth:`complete`) must be the same for every new matcher of ``key``: at the
        start the output is empty, so a check derived from the constraint alone is.
        """
        cached = self._initial.get(key)
        if cached is None:
            cached = self._initial.put(key, (self.complete(matcher, check, shortest=True),))
        return cached[0]

    def utf8_need(self, need: int, tokens: Sequence[int] | np.ndarray) -> int:
        """The UTF-8 continuation bytes still owed after ``tokens``, given ``need`` owed before them."""
        pieces = self._pieces
        for token in tokens:
            t = int(token)
            need = utf8_owed(need, pieces[t] if 0 <= t < len(pieces) else b"")
        return need

    def resume(self, matcher: Matcher, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        """A tail of an earlier completion (``tokens``) that completes ``matcher``'s state now.

        The output moved on since ``tokens`` was found, but it mostly writes
        what the schema asks for next, so the end of the earlier completion
        (the fields still missing, the closing brackets) usually still ends
        the output.  Tails are tried from the whole one on, each starting at
        a value boundary (``,``, ``}``, ``]`` or ``"``: only a token cut
        there is spelled again), at most :data:`_RESUME_TRIES` of them: the
        first that fits follows the output most closely.  A tail that does
        not fit fails at its first tokens, the accepted one costs its length
        in tokens: far less than a new :meth:`complete` (figures:
        docs/benchmarks.md, component costs, closing).  The matcher is left
        as it was; None when no tail tried completes it.
        """
        pieces = self._pieces
        tries = 0
        for k, token in enumerate(tokens):
            piece = pieces[token] if 0 <= token < len(pieces) else b""
            for j in range(len(piece)):
                if (k or j) and piece[j] not in _BOUNDARIES:
                    continue
                head = tokens[k : k + 1] if j == 0 else self.spell(piece[j:])
                if head is None:
                    continue
                tail = head + tokens[k + 1 :]
                if self.accepts(matcher, tail):
                    return tail
                tries += 1
                if tries >= _RESUME_TRIES:
                    return None
        return None

    def _search(self, matcher: Matcher, check: Callable[[bytes], bool] | None, shortest: bool,
                max_nodes: int, widen: bool = True) -> str | None:
        """Depth-first search over appended pieces, most closing piece first.

        At each state the piece tried first is the grammar's forced
        continuation (jump-forward) when there is one, else a character of
        :data:`_CLOSERS` in order, then :data:`_FILLERS`.  A character that
        repeats the previous one (a digit after a digit, ``}}``...) is tried
        last, so the search does not run down an endless number or string.
        The matcher moves one piece per level and is rolled back on return.
        A complete text that ``check`` refuses is kept as the fallback and
        the search goes on (see :meth:`complete`).
        """
        if matcher.is_completed() and (check is None or check(b"")):
            return ""
        found = self._walk(matcher, check, "", shortest, max_nodes)
        if found is None and widen:
            # The grammar may need a character the fixed alphabet lacks (a regex's "[0-9]+€"): a second
            # walk adds what may come next here.  Only where the first found nothing, so a JSON
            # schema's search, whose characters are all in the alphabet, costs what it did.
            extra = self.extra(matcher)
            if extra:
                found = self._walk(matcher, check, extra, shortest, max_nodes)
        return found

    def extra(self, matcher: Matcher) -> str:
        """The characters that may come next in ``matcher``'s state and are not in the search's alphabet.

        The first characters of the tokens its mask allows (one mask fill);
        "" where they are more than :data:`_MAX_EXTRA` (a string's content:
        any text), where the fixed alphabet serves.
        """
        mask = self._mask
        matcher.fill_next_token_bitmask(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: len(self._first)]
        codes = np.unique(self._first[bits.astype(bool)])
        out = [chr(c) for c in codes.tolist() if c >= 0 and chr(c) not in _ALPHABET]
        return "".join(out) if len(out) <= _MAX_EXTRA else ""

    def _walk(self, matcher: Matcher, check: Callable[[bytes], bool] | None, extra: str, shortest: bool,
              max_nodes: int) -> str | None:
        """One depth-first walk of :meth:`_search` (``extra``: see :func:`_candidates`; ``shortest``: see
        :meth:`complete`, a branch and bound on the characters)."""
        first: str | None = "" if matcher.is_completed() else None
        best: str | None = None
        cfg = self.config
        limit = cfg.max_chars
        path: list[str] = []
        chars = 0
        stack = [_candidates(matcher, (), extra)]
        nodes = tries = 0
        try:
            while stack and nodes < max_nodes and tries < _TRIES_PER_NODE * max_nodes:
                options = stack[-1]
                if not options:
                    stack.pop()
                    if path:
                        matcher.rollback(1)
                        chars -= len(path.pop())
                    continue
                piece = options.pop()
                tries += 1
                if chars + len(piece) > limit or not matcher.accept_string(piece):
                    continue
                nodes += 1
                path.append(piece)
                chars += len(piece)
                if matcher.is_completed():
                    text = "".join(path)
                    if check is None or check(text.encode("utf-8")):
                        if not shortest:
                            return text
                        best, limit = text, chars - 1  # only shorter ones from here on: a leaf
                        matcher.rollback(1)
                        chars -= len(path.pop())
                        continue
                    if first is None:
                        first = text
                stack.append(_candidates(matcher, path, extra))
            return best if best is not None else first
        finally:
            if path:
                matcher.rollback(len(path))

    def digit_run(self, run: int, tokens: Sequence[int] | np.ndarray) -> int:
        """The ASCII digits ending the output after ``tokens``, given ``run`` ending it before them.

        Two list lookups a token: called by
        :meth:`~grammar_backend.sequences.GrammarSequence.plan` on every new
        token of a sequence with runaway closing (see :class:`RepeatConfig`).
        """
        tails, whole = self._digit_tail, self._all_digits
        size = len(tails)
        for token in tokens:
            t = int(token)
            if 0 <= t < size:
                run = run + tails[t] if whole[t] else tails[t]
            else:
                run = 0
        return run

    def opens(self, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether one of ``tokens`` opens an object or an array (its text has ``{`` or ``[``).

        Opening a container is where a completion grows most at once (an
        object's required properties: 182 tokens after one ``{``
        of a 30-property object), so the budget check comes right after it.
        """
        flags = self._opens
        size = len(flags)
        for token in tokens:  # a loop, not any(<generator>): no allocation per token
            t = int(token)
            if 0 <= t < size and flags[t]:
                return True
        return False

    def text(self, tokens: Sequence[int] | np.ndarray) -> bytes:
        """The UTF-8 bytes ``tokens`` spell (special tokens spell nothing)."""
        pieces = self._pieces
        size = len(pieces)
        return b"".join(pieces[int(t)] for t in tokens if 0 <= int(t) < size)

    def calm_tokens(self, whole_chars: bool = False, openers: bytes = b"") -> list[int]:
        """Tokens that open no structure: none of ``{ [ , : "`` in their text (stop tokens included).

        Near its budget a sequence may only take these (or its completion's
        next token), so its completion cannot grow while the model finishes
        the value it is writing.  ``whole_chars``: only those that also end
        on a character boundary (a byte-level token may stop inside one: a
        lead byte alone owes up to :data:`UTF8_MAX_OWED` more tokens, during
        which no completion can start); a continuation byte ends one.
        ``openers``: more bytes that open structure (a structural tag's
        segment starts: :attr:`~grammar_backend.spec.ConstraintSpec.segments`).
        """
        calm = self._calm_whole if whole_chars else self._calm
        if openers:
            pieces = self._pieces
            calm = [t for t in calm if not any(c in pieces[t] for c in openers)]
        return sorted(calm + self._stops)

    def segment(self, key: Hashable, matcher: Matcher, segments: Segments) -> int:
        """The fewest tokens one more tagged segment adds to an output of ``matcher``'s constraint (0: none opens).

        A structural tag's output may open one more segment (a tool call)
        where it could end: a whole call's completion at once
        (``<tool_call>{"name": ...}</tool_call>``: about 30 tokens for two
        arguments with SmolLM2's vocabulary).  Taken after the
        constraint's shortest output (from the new matcher ``matcher``):
        each begin, or separator and begin, the grammar accepts there,
        spelled, plus the completion after it; the shortest.  0 where none is
        accepted (``stop_after_first``: one call and no more).  Searched once
        per constraint (``key``), like :meth:`initial`; the matcher is left as it was.
        """
        cached = self._segment.get(key)
        if cached is not None:
            return cached
        lengths: list[int] = []
        shortest = self.complete(matcher)
        taken = 0
        try:
            for token in shortest or ():
                if not matcher.accept_token(token):
                    break
                taken += 1
            else:
                for opener in (*segments.begins, *(s + b for s in segments.separators for b in segments.begins)):
                    head = self.spell(opener.encode("utf-8"))
                    if head is None or not matcher.accept_string(opener):
                        continue
                    try:
                        tail = self.complete(matcher)
                    finally:
                        matcher.rollback(1)
                    if tail is not None:
                        lengths.append(len(head) + len(tail))
        finally:
            if taken:
                matcher.rollback(taken)
        return self._segment.put(key, min(lengths, default=0))

    def spell(self, data: bytes) -> tuple[int, ...] | None:
        """``data`` as vocabulary tokens, longest match first; None if some byte has no token."""
        tokens: list[int] = []
        i = 0
        while i < len(data):
            for size in range(min(self._longest, len(data) - i), 0, -1):
                token = self._spelling.get(data[i : i + size])
                if token is not None:
                    tokens.append(token)
                    i += size
                    break
            else:
                return None
        return tuple(tokens)

    @staticmethod
    def accepts(matcher: Matcher, tokens: tuple[int, ...]) -> bool:
        """Whether ``tokens`` are accepted and leave the grammar complete; the matcher is left as it was."""
        completes = getattr(matcher, "completes", None)
        if completes is not None:  # llguidance: one native call (LlgMatcher.completes)
            return bool(completes(tokens))
        done = 0
        try:
            for token in tokens:
                if not matcher.accept_token(token):
                    return False
                done += 1
            return bool(matcher.is_completed())
        finally:
            if done:
                matcher.rollback(done)


def _candidates(matcher: Matcher, path: Sequence[str], extra: str = "") -> list[str]:
    """The pieces to try after ``path`` (the completion so far), as a stack (the last one is tried first).

    ``extra``: characters the grammar needs that the fixed alphabet lacks (:meth:`Closer.extra`), tried
    after every fixed character but letters (and, after a digit, digits).
    """
    forced = matcher.find_jump_forward_string()
    if forced:
        return [forced]  # every completion starts with it
    recent = "".join(path[-_RECENT:])[-_RECENT:]
    if matcher.accept_string(_STRING_PROBE):
        matcher.rollback(1)
        # Raw control characters are never JSON string content: a regex's "[^\n]+\n" is the one to take them.
        order = ['"', *_CONTROLS, *(c for c in _IN_STRING if c not in recent), *(c for c in _IN_STRING if c in recent),
                 *extra]
        if tuple(path[-2:]) == ('"', '"'):
            order.append(order.pop(0))  # still inside a string after '""': a quote is content here, not the end
        return order[::-1]
    after_digit = bool(path) and path[-1][-1:].isdigit()
    stack: Sequence[str] = _AFTER_DIGIT if after_digit else _STRUCTURE
    if extra:
        late = [c for c in stack[::-1] if c.isalpha() or (after_digit and c.isdigit())]
        stack = [*late[::-1], *extra[::-1], *(c for c in stack if c not in late)]
    used = {c for c in recent if c not in _NESTED and not c.isdigit()}  # digits: see _AFTER_DIGIT
    if not used:
        return list(stack)
    # Recently used characters go last: a regex loop such as "(ab)+c" reaches its "c", an EBNF's
    # 'term (("+" | "-") term)* "\n"' its newline instead of "0-0-0-..." to the search's bound.
    return [c for c in stack if c in used] + [c for c in stack if c not in used]


def _first_code(data: bytes) -> int:
    """The code point ``data`` starts with (-1: empty, or it does not start with a whole UTF-8 character)."""
    for size in range(1, min(4, len(data)) + 1):
        try:
            return ord(data[:size].decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return -1


class RepeatDetector:
    """Notices when a sequence's last tokens are one short unit repeated back to back.

    Keeps the last ``window`` tokens in a list; :meth:`push` is O(1)
    amortized and :meth:`repeating` (called every ``every`` tokens) compares
    at most ``max_period`` pairs of list slices of ``min_tokens`` entries or
    more (about 5 us in all, timed alone; the same check on numpy arrays took 40 us).

    Parameters
    ----------
    config : RepeatConfig
    """

    __slots__ = ("_tail", "config")

    def __init__(self, config: RepeatConfig) -> None:
        self.config = config
        self._tail: list[int] = []  # the last tokens, oldest first (at most 2 * window before a trim)

    def push(self, token: int) -> None:
        """Record one accepted token."""
        tail = self._tail
        tail.append(token)
        if len(tail) >= 2 * self.config.window:
            del tail[: len(tail) - self.config.window]

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens."""
        if count > 0:
            del self._tail[-count:]

    def fork(self) -> RepeatDetector:
        """A copy that goes on apart (the tail copied)."""
        twin = RepeatDetector(self.config)
        twin._tail = self._tail.copy()
        return twin

    def repeating(self, digit_run: int = 0) -> bool:
        """Whether the output runs away (see :class:`RepeatConfig`).

        Parameters
        ----------
        digit_run : int
            The ASCII digits ending the output (:meth:`Closer.digit_run`): a
            run of ``max_digits`` or more is a runaway whatever its period.
        """
        cfg = self.config
        if digit_run >= cfg.max_digits:
            return True
        tail = self._tail
        held = min(len(tail), cfg.window)
        if held < cfg.min_tokens:
            return False
        for period in range(1, cfg.max_period + 1):
            span = max(cfg.min_tokens, period * cfg.min_repeats)
            if span > held:
                break
            window = tail[-span:]
            if window[period:] == window[:-period]:
                return True
        return False
