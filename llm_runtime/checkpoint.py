"""What every engine reads from a Hugging Face checkpoint folder without loading it (no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import config_error

__all__ = ["checkpoint_end_tokens"]


def checkpoint_end_tokens(path: Path) -> frozenset[int]:
    """The end tokens a Hugging Face checkpoint names (``eos_token_id`` of
    ``generation_config.json`` and ``config.json``, an id or a list).

    Shared by every engine, so the torch and TensorRT-LLM engines end on the same tokens.

    Raises
    ------
    grammar_backend.errors.ConfigError
        If neither file names one, or a file is not JSON.
    """
    eos: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise config_error("model_dir", f"{str(file)!r} is not a JSON object: {err}") from err
        if isinstance(value, int) and not isinstance(value, bool):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(int(v) for v in value)
    if not eos:
        raise config_error("model_dir", "neither generation_config.json nor config.json names an eos_token_id")
    return frozenset(eos)
