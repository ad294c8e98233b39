"""IncrementalDetokenizer: UTF-8 safe streaming and stop strings."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llm_runtime.detok import IncrementalDetokenizer
from llm_runtime.errors import RequestError
from standins.tiny_model import TinyModelInfo
from tests.support import assets

TEXTS = (
    "hello world",
    "caf\u00e9 na\u00efve \u00fcber",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001f600\U0001f680 and \U0001f9e0!",
    '{"name": "Ada", "tags": ["x", "\u00e9"]}',
    "mixed \u4e2d\u6587 text \ud55c\uad6d\uc5b4 end",
)


@pytest.fixture(scope="module")
def tiny_tok(tiny: TinyModelInfo) -> Tokenizer:
    return Tokenizer.from_file(str(tiny.path / "tokenizer.json"))


@functools.cache
def _qwen(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(params=["tiny", "qwen3"])
def tok(request: pytest.FixtureRequest, tiny_tok: Tokenizer) -> Tokenizer:
    if request.param == "tiny":
        return tiny_tok
    return _qwen(assets.qwen3_dir())


def stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop=stop)
    deltas = []
    for i in ids:
        if d.stopped:
            break
        deltas.append(d.push(i))
    deltas.append(d.finish())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_and_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok)
    emitted = ""
    for i in ids:
        delta = d.push(i)
        assert "\ufffd" not in delta  # no partial character ever leaves
        emitted += delta
        assert text.startswith(emitted)
    emitted += d.finish()
    assert emitted == text == d.text


def test_multibyte_character_emitted_once_complete(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode("\U0001f9e0").ids  # 4 UTF-8 bytes
    assert len(ids) >= 2, "the tiny tokenizer must split this character across tokens"
    d = IncrementalDetokenizer(tiny_tok)
    deltas = [d.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "\U0001f9e0"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tiny_tok: Tokenizer) -> None:
    ids = tiny_tok.encode("ab\U0001f9e0").ids
    cut = ids[:-1]
    d = IncrementalDetokenizer(tiny_tok)
    assert "".join(d.push(i) for i in cut) == "ab"
    assert d.finish().endswith("\ufffd")
    assert d.text == tiny_tok.decode(cut)


def test_special_tokens_are_skipped(tiny_tok: Tokenizer) -> None:
    end = tiny_tok.token_to_id("<|im_end|>")
    assert end is not None
    ids = tiny_tok.encode("yes").ids + [end] + tiny_tok.encode("no").ids
    deltas, d = stream(tiny_tok, ids)
    assert "".join(deltas) == d.text == "yesno"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Stop here. STOP! The end.", ("STOP!",), "Stop here. "),
        ("Stop here. STOP! The end.", ("The", "here"), "Stop "),  # earliest occurrence wins
        ("Stop here. STOP! The end.", ("end.",), "Stop here. STOP! The "),
        ("Stop here. STOP! The end.", ("xyz",), "Stop here. STOP! The end."),
        ("Stop here. STOP! The end.", ("S",), ""),
        ("abcabcabd", ("abcabd",), "abc"),  # a partial match that fails must restart correctly
        ("caf\u00e9 \U0001f600 done", ("\U0001f600",), "caf\u00e9 "),  # multi-byte stop string
        ("caf\u00e9 \U0001f600 done", ("\u00e9 \U0001f600 d",), "caf"),
        ("hello world", ("world", "o w"), "hell"),
    ],
)
def test_stop_strings(tok: Tokenizer, text: str, stop: tuple[str, ...], expected: str) -> None:
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok, stop=stop)
    emitted = ""
    for i in ids:
        if d.stopped:
            break
        emitted += d.push(i)
        # Nothing past the cut ever leaves, at any point of the stream.
        assert expected.startswith(emitted), (emitted, expected)
    emitted += d.finish()
    assert emitted == expected == d.text
    assert d.stopped == (expected != text)


def test_possible_stop_prefix_is_held_back_then_released(tiny_tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tiny_tok, stop=("STOP!",))
    out = [d.push(i) for i in tiny_tok.encode("a STO").ids]
    assert "".join(out) == "a "  # "STO" may still become "STOP!"
    out2 = [d.push(i) for i in tiny_tok.encode("x").ids]
    assert "".join(out2) == "STOx"  # it did not: released
    assert not d.stopped


@pytest.mark.parametrize(
    ("stop", "match"),
    [(("",), r"stop\[0\]: must be a non-empty string"), (("ok", 3), r"stop\[1\]: must be a non-empty string")],
)
def test_bad_stop_strings_rejected(tiny_tok: Tokenizer, stop: tuple[object, ...], match: str) -> None:
    with pytest.raises(RequestError, match=match):
        IncrementalDetokenizer(tiny_tok, stop=stop)  # type: ignore[arg-type]


def test_misuse_raises(tiny_tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tiny_tok, stop=("a",))
    with pytest.raises(ValueError, match="token id 100000 is outside the tokenizer's"):
        d.push(100000)
    d.push(tiny_tok.encode("a").ids[0])
    assert d.stopped
    with pytest.raises(ValueError, match="push after stop or finish"):
        d.push(5)
    d.finish()
    with pytest.raises(ValueError, match="finish called twice"):
        d.finish()
