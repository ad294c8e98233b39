"""The ``FINISH`` document: what the ``llm`` model says on a request's last response.

Its own module because the ``llm`` model writes it and ``postprocessing``
reads it, and the ``llm`` model must import nothing of the grammar engines:
on the GPU image it runs in TensorRT-LLM's Python environment, which keeps
TensorRT-LLM's own xgrammar and llguidance (deploy/docker/Dockerfile).
The document is a generator's :class:`contract.finish.FinishEvent`, one key
per field, plus the request's constraint and, for a request with a thinking
section, its ``reasoning`` (:class:`contract.reasoning.Reasoning`; absent
otherwise, so the document of other requests is as it was).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from contract.finish import FinishEvent
from contract.reasoning import Reasoning

__all__ = ["MAX_ERROR_CHARS", "cut_error", "finish_json", "read_finish", "read_finish_reasoning"]

#: Longest ``RESULT.error`` sent to a client: messages that quote a value (an
#: unknown kind, a bad option) must never echo a megabyte payload back.
MAX_ERROR_CHARS = 1000


def cut_error(message: str | None) -> str | None:
    """``message`` cut to :data:`MAX_ERROR_CHARS`, saying how long it was."""
    if message is None or len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"


def finish_json(final: FinishEvent, constraint: dict[str, str] | None, reasoning: Reasoning | None = None) -> str:
    """The ``FINISH`` tensor of ``llm``'s last response: the final state plus the constraint (and the reasoning)."""
    doc: dict[str, Any] = {**dataclasses.asdict(final), "constraint": constraint}
    if reasoning is not None:
        doc["reasoning"] = reasoning.as_dict()
    return json.dumps(doc, ensure_ascii=False)


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
    final, constraint, _ = read_finish_reasoning(finish)
    return final, constraint


def read_finish_reasoning(finish: bytes | str) -> tuple[FinishEvent, dict[str, str] | None, Reasoning | None]:
    """:func:`read_finish`, and the request's thinking section (None: it had none).

    Raises
    ------
    ValueError, KeyError, TypeError
        As :func:`read_finish`.
    """
    doc: dict[str, Any] = json.loads(finish)
    constraint: dict[str, str] | None = doc.pop("constraint")
    reasoning = doc.pop("reasoning", None)
    return FinishEvent(**doc), constraint, None if reasoning is None else Reasoning(**reasoning)
