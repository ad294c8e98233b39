"""Load a tokenizer from local files and describe it to xgrammar.

A :class:`TokenizerBundle` ties together the Hugging Face tokenizer (for
prompt encoding and detokenization), the :class:`xgrammar.TokenizerInfo` that
every grammar compile needs, the width of the model's logits (the bitmask
width), the stop tokens, and a fingerprint that identifies all of it.  The
fingerprint is part of every compile-cache key: a compiled grammar is only
valid for the exact vocabulary, mask width and stop tokens it was built for.

Sources are always local (``local_files_only=True``); no model hub is ever
contacted.  Three kinds are accepted:

* a Hugging Face folder (``tokenizer.json`` and/or ``tokenizer_config.json``,
  optionally ``config.json`` and ``generation_config.json``);
* a folder holding just ``tokenizer.json`` (then the stop tokens must be
  passed explicitly, since such a file does not say which token ends a turn);
* a ``.gguf`` file, whose embedded tokenizer transformers converts.

The fingerprint (the decoded vocabulary, hashed) costs under a second for
Qwen3's, paid once per bundle at load; nothing recomputes it.  No bench times
loading; the costs of each part, and of a GGUF tokenizer, are in
docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import xgrammar

from grammar_backend.errors import TokenizerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TokenizerBundle", "load_tokenizer"]

#: Bumped whenever the fingerprint's input layout changes, so old cache
#: entries can never collide with new ones.
_FINGERPRINT_VERSION: Final = b"grammar_backend.tokenizer.fingerprint/v1\n"

_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TokenizerBundle:
    """A loaded tokenizer and everything a grammar compile needs to know about it.

    Attributes
    ----------
    hf : PreTrainedTokenizerBase
        The Hugging Face tokenizer (prompt encoding, chat template, decoding).
    info : xgrammar.TokenizerInfo
        xgrammar's view of the vocabulary, sized to ``vocab_size``.
    vocab_size : int
        The model's logits width, possibly padded beyond the tokenizer
        (``>= len(hf)``); it is the bitmask width in bits.
    stop_token_ids : tuple of int
        Tokens that end generation (the grammar accepts them at its end).
    fingerprint : str
        Hex sha256 over xgrammar's metadata, the decoded vocabulary bytes in
        id order, ``vocab_size`` and ``stop_token_ids``.  Identical across
        processes for identical inputs; part of every compile-cache key.
    """

    hf: PreTrainedTokenizerBase
    info: xgrammar.TokenizerInfo
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    fingerprint: str

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's tokenizer spells it, no special tokens added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def special_ids(self) -> frozenset[int]:
        """The tokenizer's special added tokens: the ones a detokenizer leaves out of the output text."""
        decoder = getattr(self.hf, "added_tokens_decoder", {})
        return frozenset(int(i) for i, token in decoder.items() if getattr(token, "special", False))


def load_tokenizer(
    source: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> TokenizerBundle:
    """Load a tokenizer from a local folder or ``.gguf`` file.

    Parameters
    ----------
    source : str or os.PathLike
        A Hugging Face folder (``tokenizer.json`` and/or ``tokenizer_config.json``),
        or a ``.gguf`` file.
    vocab_size : int, optional
        The model's logits width.  Default: ``vocab_size`` of the folder's
        ``config.json`` (or ``text_config.vocab_size``), or ``{arch}.vocab_size``
        of a GGUF file, else the tokenizer's own size.
    stop_token_ids : sequence of int, optional
        Tokens that end generation.  Default: ``eos_token_id`` of
        ``generation_config.json``, else of ``config.json`` (for GGUF: the
        ``tokenizer.ggml.eos_token_id`` and ``eot_token_id`` entries), else the
        tokenizer's eos token.

    Returns
    -------
    TokenizerBundle

    Raises
    ------
    TokenizerError
        The source is missing or not a tokenizer, a config file is malformed,
        ``vocab_size`` is smaller than the tokenizer, no stop token is known, or
        a stop token is out of range.  The message names the path and the reason.
    """
    path = Path(source)
    if vocab_size is not None:
        _check_vocab_size_arg(path, vocab_size)
    explicit_stops = None if stop_token_ids is None else _check_stop_ids_arg(path, stop_token_ids)

    if not path.exists():
        raise TokenizerError(f"tokenizer {path}: no such file or directory")
    if path.is_dir():
        _require_tokenizer_files(path)
        # Read config.json before AutoTokenizer does: transformers also parses
        # it and would report a malformed one with an unrelated TypeError.
        meta_vocab, meta_stops = _folder_metadata(path)
        hf = _load_hf_folder(path)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        hf = _load_gguf(path)
        meta_vocab, meta_stops = (None, None)
        if vocab_size is None or explicit_stops is None:
            meta_vocab, meta_stops = _gguf_metadata(path)
    else:
        raise TokenizerError(f"tokenizer {path}: not a directory or a .gguf file")

    tokenizer_size = _tokenizer_size(path, hf)
    if vocab_size is not None:
        width, width_origin = vocab_size, "vocab_size argument"
    elif meta_vocab is not None:
        width, width_origin = meta_vocab, "model config vocab_size"
    else:
        width, width_origin = tokenizer_size, "tokenizer size"
    if width < tokenizer_size:
        raise TokenizerError(
            f"tokenizer {path}: vocab_size {width} ({width_origin}) is smaller than the "
            f"tokenizer's {tokenizer_size} tokens"
        )

    if explicit_stops is not None:
        stops = explicit_stops
    elif meta_stops:
        stops = meta_stops
    else:
        eos = getattr(hf, "eos_token_id", None)
        if not isinstance(eos, int) or isinstance(eos, bool):
            raise TokenizerError(
                f"tokenizer {path}: no stop token: neither generation_config.json, config.json "
                "nor the tokenizer names an eos token; pass stop_token_ids"
            )
        stops = (eos,)
    for tid in stops:
        if not 0 <= tid < width:
            raise TokenizerError(
                f"tokenizer {path}: stop token id {tid} is outside the vocabulary [0, {width})"
            )

    try:
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=width, stop_token_ids=list(stops))
    except (ValueError, TypeError, RuntimeError) as err:
        raise TokenizerError(f"tokenizer {path}: xgrammar cannot describe it: {err}") from err

    return TokenizerBundle(
        hf=hf,
        info=info,
        vocab_size=width,
        stop_token_ids=stops,
        fingerprint=_fingerprint(info, width, stops),
    )


def _fingerprint(info: xgrammar.TokenizerInfo, vocab_size: int, stops: tuple[int, ...]) -> str:
    # Every variable-length part is length-prefixed so that two different
    # vocabularies can never concatenate to the same byte stream.  Computed
    # once per bundle, at load (its cost: the module's docstring).
    h = hashlib.sha256(_FINGERPRINT_VERSION)
    meta = info.dump_metadata().encode("utf-8")
    h.update(len(meta).to_bytes(8, "little"))
    h.update(meta)
    decoded = info.decoded_vocab
    h.update(len(decoded).to_bytes(8, "little"))
    for token in decoded:
        h.update(len(token).to_bytes(4, "little"))
        h.update(token)
    h.update(vocab_size.to_bytes(8, "little"))
    h.update(len(stops).to_bytes(8, "little"))
    for tid in stops:
        h.update(tid.to_bytes(8, "little"))
    return h.hexdigest()


def _check_vocab_size_arg(path: Path, vocab_size: object) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise TokenizerError(f"tokenizer {path}: vocab_size must be a positive integer, got {vocab_size!r}")


def _check_stop_ids_arg(path: Path, stop_token_ids: Sequence[int]) -> tuple[int, ...]:
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Sequence):
        raise TokenizerError(
            f"tokenizer {path}: stop_token_ids must be a sequence of integers, got {stop_token_ids!r}"
        )
    if len(stop_token_ids) == 0:
        raise TokenizerError(f"tokenizer {path}: stop_token_ids must not be empty")
    for tid in stop_token_ids:
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise TokenizerError(f"tokenizer {path}: stop_token_ids entry {tid!r} is not an integer")
    if len(set(stop_token_ids)) != len(stop_token_ids):
        raise TokenizerError(f"tokenizer {path}: stop_token_ids {list(stop_token_ids)} has duplicates")
    return tuple(stop_token_ids)


def _require_tokenizer_files(path: Path) -> None:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerError(f"tokenizer {path}: not a tokenizer folder (no tokenizer.json or tokenizer_config.json)")


def _load_hf_folder(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    # The `tokenizers` Rust extension raises bare `Exception` for a malformed
    # tokenizer.json (e.g. "data did not match any variant of untagged enum"),
    # and transformers raises KeyError/ValueError/OSError for others, so the
    # boundary catches Exception and re-raises it as a TokenizerError.
    except Exception as err:
        raise TokenizerError(f"tokenizer {path}: not a loadable tokenizer: {type(err).__name__}: {err}") from err


def _load_gguf(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    # Same reason as in _load_hf_folder: the converters raise many types.
    except Exception as err:
        raise TokenizerError(
            f"tokenizer {path}: not a loadable GGUF tokenizer: {type(err).__name__}: {err}"
        ) from err


def _tokenizer_size(path: Path, hf: PreTrainedTokenizerBase) -> int:
    # A vocabulary may have holes (ids with no token), so the mask must cover
    # the largest id, not just the number of entries; xgrammar sizes its own
    # default the same way.
    vocab = hf.get_vocab()
    if not vocab:
        raise TokenizerError(f"tokenizer {path}: the vocabulary is empty")
    return max(len(hf), len(vocab), max(vocab.values()) + 1)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"tokenizer {path}: cannot read it: {err}") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"tokenizer {path}: top level is {type(data).__name__}, expected an object")
    return data


def _int_field(path: Path, data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise TokenizerError(f"tokenizer {path}: {key} must be a positive integer, got {value!r}")
    return value


def _eos_field(path: Path, data: dict[str, Any]) -> tuple[int, ...] | None:
    value = data.get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    out: list[int] = []
    for tid in ids:
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            raise TokenizerError(f"tokenizer {path}: eos_token_id entry {tid!r} is not a non-negative integer")
        if tid not in out:  # configs sometimes repeat an id; order is kept
            out.append(tid)
    return tuple(out) or None


def _folder_metadata(path: Path) -> tuple[int | None, tuple[int, ...] | None]:
    """Return (vocab_size, stop ids) from config.json / generation_config.json."""
    config_path = path / "config.json"
    config = _read_json(config_path)
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path)

    vocab: int | None = None
    config_stops: tuple[int, ...] | None = None
    if config is not None:
        vocab = _int_field(config_path, config, "vocab_size")
        config_stops = _eos_field(config_path, config)
        # Multimodal checkpoints keep the language model's settings in text_config.
        text = config.get("text_config")
        if isinstance(text, dict):
            if vocab is None:
                vocab = _int_field(config_path, text, "vocab_size")
            if config_stops is None:
                config_stops = _eos_field(config_path, text)
    gen_stops = _eos_field(gen_path, gen) if gen is not None else None
    return vocab, gen_stops or config_stops


def _gguf_metadata(path: Path) -> tuple[int | None, tuple[int, ...] | None]:
    """Return (vocab_size, stop ids) from a GGUF file's key/value metadata."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (OSError, ValueError) as err:
        raise TokenizerError(f"tokenizer {path}: cannot read the GGUF metadata: {err}") from err

    def scalar(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    arch = scalar("general.architecture")
    vocab = scalar(f"{arch}.vocab_size") if isinstance(arch, str) else None
    if vocab is None:
        # llama.cpp writes the embedding as ne = [hidden, vocab].
        for tensor in reader.tensors:
            if tensor.name == "token_embd.weight":
                vocab = int(tensor.shape[-1])
                break
    stops: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        tid = scalar(key)
        if tid is not None and int(tid) not in stops:
            stops.append(int(tid))
    return (None if vocab is None else int(vocab)), (tuple(stops) or None)
