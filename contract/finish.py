"""The final state of a generation: one type from the generator to postprocessing.

The generators (:class:`llm_runtime.scheduler.Scheduler`,
:class:`llm_runtime.trtllm_engine.TrtllmGenerator`) end every request with a
:class:`FinishEvent`; the ``llm`` model serializes it as its ``FINISH``
document (:func:`pipeline.finish.finish_json`, one key per field) and
``postprocessing`` reads it back into the same type
(:func:`pipeline.finish.read_finish`).  It lives here, below both
``llm_runtime`` and ``pipeline`` (neither imports the other), and imports the
standard library only, like the rest of :mod:`contract`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from contract.errors import status_of

__all__ = ["FinishEvent", "FinishReason"]

#: The finish reasons a generator reports (the values of ``contract.FINISH_REASONS``).
FinishReason = Literal["stop", "length", "error"]


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a request: its final state.

    ``finish_reason``: ``"stop"`` (end token, grammar terminated, or stop string),
    ``"length"`` (``max_tokens``) or ``"error"`` (``error`` says why,
    ``status`` is a gRPC status name; ``"CANCELLED"`` after ``Scheduler.cancel``).
    ``completion_tokens`` counts every sampled token, the end token included.
    ``close_reason``: the grammar side forced a completion that ended the
    output (``"budget"``: ``finish_reason`` is then ``"length"``;
    ``"repetition"``: ``"stop"``), see :mod:`grammar_backend.closing`.
    ``stop_string``: the output ended at one of the request's stop strings.
    ``backend``: the grammar backend that served the constraint (None: no
    constraint, or it failed to start).
    ``value_retries``: times a completed value broke the schema and its tokens
    were dropped, to be generated again or, once per output with the
    ``value_retries`` option spent and ``on_repeat: close``, to close the
    output before them (:mod:`grammar_backend.values`);
    ``value_dropped_tokens``: how many tokens that dropped in all (sampled,
    so spent, but not in ``completion_tokens``).
    ``reasoning_tokens``: tokens sampled inside the thinking section, its end
    marker included (:mod:`contract.reasoning`; counted where the grammar side
    tracks it, a constrained request; None elsewhere); ``reasoning_cut``: the
    server ended the thinking by forcing the end marker.  Both count within
    ``completion_tokens``.
    ``seed``: the seed the request's draws used (the request's, or one drawn
    for it when it gave none), so the output can be replayed; None for a
    request refused before generation.

    The field names and their order are the keys of the ``FINISH`` document.
    """

    finish_reason: FinishReason
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
    reasoning_tokens: int | None = None
    reasoning_cut: bool = False
    seed: int | None = None

    @classmethod
    def rejected(cls, err: BaseException) -> FinishEvent:
        """The final state of a request refused before generation (no tokens)."""
        return cls("error", "", 0, 0, error=str(err), status=status_of(err))
