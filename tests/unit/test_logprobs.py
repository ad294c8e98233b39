"""Token log probabilities' wire form: each token's text and bytes (llm_runtime.logprobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from llm_runtime.logprobs import TokenLogprobs, TokenText, forced, logprobs_json
from standins.tiny_model import TinyModelInfo
from tests.support import assets

TEXTS = ["hello world", "caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e \u4e2d\u6587", "emoji \U0001f600 done",
         '{"name": "Ada", "age": 36}']


def _tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def _pieces_join_to_text(tok: Tokenizer, text: str) -> tuple[bytes, str, list[tuple[str, list[int]]]]:
    ids = tok.encode(text, add_special_tokens=False).ids
    tt = TokenText(tok)
    pieces = [tt.piece(i) for i in ids]
    return b"".join(bytes(raw) for _, raw in pieces), tok.decode(ids), pieces


@pytest.mark.parametrize("text", TEXTS)
def test_logprobs_bytes_of_a_byte_level_vocabulary_join_to_the_text(tiny: TinyModelInfo, text: str) -> None:
    """The tiny checkpoint splits multi-byte characters across tokens: each token's bytes are its own,
    its text U+FFFD where they are part of a character (OpenAI's rule), and the bytes join to the output."""
    joined, decoded, pieces = _pieces_join_to_text(_tokenizer(tiny.path), text)
    assert joined == decoded.encode("utf-8") == text.encode("utf-8")
    for token, raw in pieces:
        assert token == bytes(raw).decode("utf-8", "replace")


def test_logprobs_a_partial_character_is_replaced_in_text_and_exact_in_bytes(tiny: TinyModelInfo) -> None:
    tok = _tokenizer(tiny.path)
    split = [p for p in _pieces_join_to_text(tok, "\U0001f600")[2]]
    assert len(split) > 1  # the corpus leaves the emoji's four bytes in pieces
    assert all("\ufffd" in token for token, _ in split)
    assert b"".join(bytes(raw) for _, raw in split) == "\U0001f600".encode()


@pytest.mark.parametrize("text", TEXTS)
def test_logprobs_bytes_of_smollm2_join_to_the_text(text: str) -> None:
    joined, decoded, _ = _pieces_join_to_text(_tokenizer(assets.smollm2_dir()), text)
    assert joined == decoded.encode("utf-8")


def _sentencepiece() -> Tokenizer:
    """A SentencePiece-style vocabulary: '▁' for a space, <0xNN> byte fallback (Llama 2, Mistral)."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581hello": 257, "\u2581world": 258,
             "\u2581caf": 259}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


@pytest.mark.parametrize(("ids", "expected"), [
    ([257, 258], [(" hello", [32, 104, 101, 108, 108, 111]), (" world", [32, 119, 111, 114, 108, 100])]),
    ([259, 1 + 0xC3, 1 + 0xA9], [(" caf", [32, 99, 97, 102]), ("\ufffd", [0xC3]), ("\ufffd", [0xA9])]),
])
def test_logprobs_bytes_of_a_sentencepiece_vocabulary(ids: list[int], expected: list[tuple[str, list[int]]]) -> None:
    tok = _sentencepiece()
    tt = TokenText(tok)
    assert [tt.piece(i) for i in ids] == expected
    assert b"".join(bytes(raw) for _, raw in expected) == tok.decode(ids).encode()


def test_logprobs_special_tokens_are_their_content(tiny: TinyModelInfo) -> None:
    tok = _tokenizer(tiny.path)
    end = tok.token_to_id("<|im_end|>")
    assert end is not None
    assert TokenText(tok).piece(end) == ("<|im_end|>", list(b"<|im_end|>"))


@pytest.mark.parametrize(("k", "top"), [(0, ()), (1, ((7, 0.0),)), (5, ((7, 0.0),))])
def test_logprobs_forced_tokens_are_certain(k: int, top: tuple[tuple[int, float], ...]) -> None:
    """A token appended without sampling: log probability 0, itself its only alternative (none for k=0)."""
    assert forced(7, k) == TokenLogprobs(7, 0.0, top)


def test_logprobs_json_is_openais_content_shape(tiny: TinyModelInfo) -> None:
    tok = _tokenizer(tiny.path)
    tt = TokenText(tok)
    a, b = tok.encode("yes no", add_special_tokens=False).ids[:2]
    doc = json.loads(logprobs_json([TokenLogprobs(a, -0.25, ((a, -0.25), (b, -1.5))), forced(b, 0)], tt))
    text_a, raw_a = tt.piece(a)
    text_b, raw_b = tt.piece(b)
    assert doc == [
        {"token": text_a, "logprob": -0.25, "bytes": raw_a,
         "top_logprobs": [{"token": text_a, "logprob": -0.25, "bytes": raw_a},
                          {"token": text_b, "logprob": -1.5, "bytes": raw_b}]},
        {"token": text_b, "logprob": 0.0, "bytes": raw_b, "top_logprobs": []},
    ]
    assert logprobs_json([], tt) == "[]"
