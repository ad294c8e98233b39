"""The ``FINISH`` document: what the ``llm`` model says on a request's last response.

Its own module because the ``llm`` model writes it and ``postprocessing``
reads it, and the ``llm`` model must import nothing of the grammar engines:
on the GPU image it runs in TensorRT-LLM's Python environment, which keeps
TensorRT-LLM's own xgrammar and llguidance (deploy/docker/Dockerfile).
The document is a generator's :class:`contract.finish.FinishEvent`, one key
per field, plus the request's constraint.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from contract.finish import FinishEvent

__all__ = ["MAX_ERROR_CHARS", "cut_error", "finish_json", "read_finish"]

#: Longest ``RESULT.error`` sent to a client: messages that quote a value (an
#: unknown kind, a bad option) must never echo a megabyte payload back.
MAX_ERROR_CHARS = 1000


def cut_error(message: str | None) -> str | None:
    """``message`` cut to :data:`MAX_ERROR_CHARS`, saying how long it was."""
    if message is None or len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"


def finish_json(final: FinishEvent, constraint: dict[str, str] | None) -> str:
    """The ``FINISH`` tensor of ``llm``'s last response: the final state plus the constraint."""
    return json.dumps({**dataclasses.asdict(final), "constraint": constraint}, ensure_ascii=False)


def read_finish(finish: bytes | str) -> tuple[FinishEvent, dict[str, str] | None]:
    """The final state and constraint of a ``FINISH`` document (the inverse of :func:`finish_json`).

    Raises
    ------
    ValueError
        ``finish`` is not JSON (:class:`json.JSONDecodeError`).
    KeyError
        It has no ``constraint``.
    TypeError
        Its other keys are not :class:`FinishEvent`'s fields.
    """
    doc: dict[str, Any] = json.loads(finish)
    constraint: dict[str, str] | None = doc.pop("constraint")
    return FinishEvent(**doc), constraint
