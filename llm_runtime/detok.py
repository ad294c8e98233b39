"""Incremental detokenization with stop strings.

:class:`IncrementalDetokenizer` turns one token at a time into text deltas:

* UTF-8 safe: a character whose bytes span several tokens is emitted once, when
  its last byte arrives, never as a partial character.  The byte-level work is
  ``tokenizers.decoders.DecodeStream`` (Rust; it re-decodes only the few tokens
  since the last complete character, so the cost per token is O(1)).
* Stop strings: text is never emitted past the start of a stop string.  Any
  suffix of the pending text that could still grow into a stop string is held
  back until it either completes one (the output ends right before it) or
  cannot any more (it is emitted).

The concatenation of every delta returned by :meth:`push` and :meth:`finish`
equals :attr:`text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from .errors import RequestError

__all__ = ["IncrementalDetokenizer", "special_token_ids"]

REPLACEMENT_CHAR = "\ufffd"


def special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (skipped in the output text)."""
    return frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)


class IncrementalDetokenizer:
    """Stream text out of a token sequence.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The model's tokenizer.
    stop : sequence of str
        Stop strings (non-empty).  The output ends right before the first one.
    special_ids : frozenset of int or None
        Precomputed :func:`special_token_ids` (computed when ``None``).
    skip_special_tokens : bool
        Leave special tokens out of the text (default).

    Raises
    ------
    RequestError
        If a stop string is empty or not a string.
    """

    __slots__ = (
        "_finished",
        "_held",
        "_ids",
        "_max_stop",
        "_n_tokens",
        "_pending",
        "_pieces",
        "_special",
        "_stopped",
        "_stops",
        "_stream",
        "_tok",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Sequence[str] = (),
        special_ids: frozenset[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop[{i}]", "must be a non-empty string")
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._special = special_token_ids(tokenizer) if special_ids is None else special_ids
        self._n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
        self._ids: list[int] = []
        self._pieces: list[str] = []
        self._held = ""
        self._pending = False
        self._stopped = False
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string was found; no more tokens may be pushed."""
        return self._stopped

    @property
    def text(self) -> str:
        """The text emitted so far (all deltas joined)."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to emit (may be ``""``).

        Raises
        ------
        ValueError
            If the id is outside the tokenizer, or the stream is stopped/finished.
        """
        if self._stopped or self._finished:
            raise ValueError("detokenizer: push after stop or finish")
        if not 0 <= token_id < self._n_tokens:
            raise ValueError(f"token id {token_id} is outside the tokenizer's {self._n_tokens} tokens")
        self._ids.append(token_id)
        piece = self._stream.step(self._tok, token_id)
        if piece is None:
            if token_id not in self._special:
                self._pending = True  # bytes of an incomplete character are buffered
            return ""
        self._pending = False
        return self._advance(piece, final=False)

    def finish(self) -> str:
        """End of generation: return the held-back text (if no stop string cut it).

        Bytes of an incomplete character at the very end are emitted as U+FFFD,
        as ``tokenizer.decode`` renders them.
        """
        if self._finished:
            raise ValueError("detokenizer: finish called twice")
        self._finished = True
        if self._stopped:
            return ""
        tail = ""
        if self._pending:
            full = self._tok.decode(self._ids, skip_special_tokens=True)
            seen = "".join(self._pieces) + self._held
            tail = full[len(seen) :] if full.startswith(seen) else REPLACEMENT_CHAR
        return self._advance(tail, final=True)

    def _advance(self, piece: str, *, final: bool) -> str:
        buf = self._held + piece
        if self._stops:
            cut = -1
            for s in self._stops:
                at = buf.find(s)
                if at >= 0 and (cut < 0 or at < cut):
                    cut = at
            if cut >= 0:
                self._stopped = True
                self._held = ""
                return self._emit(buf[:cut])
            if not final:
                hold = self._hold_length(buf)
                self._held = buf[len(buf) - hold :] if hold else ""
                return self._emit(buf[: len(buf) - hold])
        self._held = ""
        return self._emit(buf)

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            tail = buf[-k:]
            for s in self._stops:
                if len(s) > k and s.startswith(tail):
                    return k
        return 0

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
