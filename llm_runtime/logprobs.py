"""Token log probabilities (request field ``logprobs``): what a generator reports, and its wire form.

A generator reports, for each token it adds to a request's output, a
:class:`TokenLogprobs` (ids and floats only: made on the decode loop, where
only the rows that asked pay for it).  The ``llm`` model turns them into
OpenAI's chat ``logprobs.content`` entries off the loop (:class:`TokenText`,
:func:`logprobs_json`): ``{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}``.  What the numbers mean is
:func:`contract.check_logprobs`'s: the log-softmax of the logits as the
grammar mask and the penalties left them, before temperature and
truncation; a forced token (:func:`forced`) has log probability 0.

A token's ``bytes`` are its own UTF-8 bytes, which for a byte-level
vocabulary may be part of a character; its ``token`` is those bytes
decoded with U+FFFD for an incomplete character (OpenAI's rule).  The
``bytes`` of a request's entries, joined, are its output's bytes (special
tokens excepted: their text is left out of the output, their entry names
them; and a SentencePiece decoder that strips the output's leading space,
Llama 2's, writes the first token one space shorter than its entry).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

from tokenizers import Tokenizer

__all__ = ["TokenLogprobs", "TokenText", "forced", "logprobs_json"]

#: A byte-fallback token of a SentencePiece vocabulary (``<0xE2>``).
_BYTE_TOKEN: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log probability and its most likely alternatives.

    Attributes
    ----------
    token : int
        The token id.
    logprob : float
        Its log probability (0.0 for a forced token).
    top : tuple of (int, float)
        The most likely tokens the grammar allowed and their log probabilities,
        most likely first: at most the request's ``logprobs`` of them.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def forced(token: int, k: int) -> TokenLogprobs:
    """The entry of a token appended without sampling (jump-forward): certain under the constraint."""
    return TokenLogprobs(token, 0.0, ((token, 0.0),) if k else ())


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: each of its 256 characters -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """A token id's text and UTF-8 bytes as OpenAI reports them, cached per id.

    The bytes come from the vocabulary entry, not from decoding the id alone
    (which renders a partial character as U+FFFD and, for a SentencePiece
    vocabulary, drops a word's leading space): byte-level vocabularies
    (GPT-2, Llama 3, Qwen, SmolLM2) map each character of the entry to its
    byte; SentencePiece ones read ``▁`` as a space and ``<0xNN>`` as byte NN;
    added tokens are their content.  Any other decoder: the id decoded alone.

    Not thread-safe: one instance per thread (the ``llm`` model's outbox).

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The model's tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        decoder = tokenizer.decoder
        spec = decoder.__getstate__().decode("utf-8", "replace") if decoder is not None else ""
        self._byte_level = '"ByteLevel"' in spec
        self._sentencepiece = not self._byte_level and ('"ByteFallback"' in spec or '"Metaspace"' in spec
                                                        or "\u2581" in spec)
        self._table = _byte_level_table() if self._byte_level else {}
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """``(token, bytes)`` of one id (the list is shared: do not modify it)."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        entry = self._tok.id_to_token(token_id)
        if entry is None:  # a padding id past the vocabulary: never sampled (Sampler.token_limit)
            return b""
        if self._byte_level:
            try:
                return bytes(self._table[c] for c in entry)
            except KeyError:  # not a byte-level entry after all
                return entry.encode("utf-8")
        if self._sentencepiece:
            byte = _BYTE_TOKEN.fullmatch(entry)
            return bytes((int(byte.group(1), 16),)) if byte else entry.replace("\u2581", " ").encode("utf-8")
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def entry(self, lp: TokenLogprobs) -> dict[str, Any]:
        """OpenAI's chat ``logprobs.content`` entry of one token."""
        text, raw = self.piece(lp.token)
        top = []
        for token_id, logprob in lp.top:
            alt_text, alt_raw = self.piece(token_id)
            top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
        return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}


def logprobs_json(entries: list[TokenLogprobs], text: TokenText) -> str:
    """The ``TOKEN_LOGPROBS`` tensor of one response: a JSON array of :meth:`TokenText.entry` objects."""
    return json.dumps([text.entry(lp) for lp in entries], ensure_ascii=False, separators=(",", ":"))
