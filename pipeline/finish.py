"""The ``FINISH`` document: what the ``llm`` model says on a request's last response.

Its own module because the ``llm`` model writes it and ``postprocessing``
reads it, and the ``llm`` model must import nothing of the grammar engines:
on the GPU image it runs in TensorRT-LLM's Python environment, which keeps
TensorRT-LLM's own xgrammar and llguidance (deploy/docker/Dockerfile).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from grammar_backend.errors import status_of

__all__ = ["MAX_ERROR_CHARS", "FinalState", "cut_error", "finish_json"]

#: Longest ``RESULT.error`` sent to a client: messages that quote a value (an
#: unknown kind, a bad option) must never echo a megabyte payload back.
MAX_ERROR_CHARS = 1000


def cut_error(message: str | None) -> str | None:
    """``message`` cut to :data:`MAX_ERROR_CHARS`, saying how long it was."""
    if message is None or len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"


@dataclass(frozen=True)
class FinalState:
    """What ``llm`` reports on its last response."""

    finish_reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    status: str | None = None
    close_reason: str | None = None
    stop_string: bool = False
    backend: str | None = None
    value_retries: int = 0
    value_dropped_tokens: int = 0

    @classmethod
    def rejected(cls, err: BaseException) -> FinalState:
        """The final state of a request refused before generation (no tokens)."""
        return cls("error", "", 0, 0, error=str(err), status=status_of(err))


def finish_json(final: FinalState, constraint: dict[str, str] | None) -> str:
    """The ``FINISH`` tensor of ``llm``'s last response: the final state plus the constraint."""
    return json.dumps({**dataclasses.asdict(final), "constraint": constraint}, ensure_ascii=False)
