"""The step protocol between the decode loop and the grammar side: one answer type, one table of its fields.

A decode step asks the grammar side to accept each row's new tokens and to
answer with the next masks.  The answer, :class:`MaskStep`, is the same
whichever way it travels: built by the engine (:meth:`GrammarEngine.step
<grammar_service.engine.GrammarEngine.step>`'s result, :meth:`StepResult.answer
<grammar_service.engine.StepResult.answer>`), sent over the grammar channel
(:mod:`grammar_service.transport.channel`) or as the ``grammar`` model's BLS tensors
(:func:`answer_tensors`, :func:`answer_from_tensors`), and read by the decode
loop (:meth:`MaskStep.read`).

:data:`STEP_FIELDS` is the one list of the answer's per-row arrays: the name
of the attribute, the BLS tensor (``model_repository/grammar/config.pbtxt.in``
declares it), the wire dtype, whether it is ``[B]`` or ``[B, F]``, and when it
is sent.  The channel's encoding and the BLS tensors are derived from it; a
per-row field is one line there, its producer (the engine) and its consumer
(:meth:`MaskStep.read`).  The bitmask goes apart: through the caller's
shared-memory mask buffer, or as the ``BITMASK`` tensor where there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Final

import numpy as np

import contract

__all__ = ["BITMASK_TENSOR", "CLOSE_STATE_REASONS", "DRAFT_BITMASK_TENSOR", "DRAFT_TENSORS", "JUMP_TENSORS",
           "REASONING_STATES", "ROW_DROP", "ROW_ERROR", "ROW_MASK", "ROW_STOP", "STEP_FIELDS", "STEP_TENSORS",
           "CloseState", "Field", "MaskStep", "Sent", "StepRows", "answer_from_tensors", "answer_tensors",
           "bitmask_width"]


class CloseState(IntEnum):
    """Where a sequence stands with respect to closing: the grammar step's ``CLOSING`` output, read by ``llm``."""

    OPEN = 0
    BUDGET = 1  # forcing a completion because the budget runs out
    REPETITION = 2  # forcing a completion because the output repeats itself
    CALM = 3  # near the budget: no token that opens structure (the model may still finish on its own)
    REASONING = 4  # in its thinking section (contract.reasoning): free text, no stop token; the answer is not begun
    REASONING_END = 5  # forcing the end marker of its thinking section: the thinking budget ran out


#: The states of a row inside its thinking section: a token sampled under one of them is a reasoning token.
REASONING_STATES: Final = frozenset({CloseState.REASONING, CloseState.REASONING_END})

#: RESULT ``close_reason`` of each forcing state.
CLOSE_STATE_REASONS: Final[Mapping[int, str]] = dict(
    zip((CloseState.BUDGET, CloseState.REPETITION), contract.CLOSE_REASONS, strict=True))


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words in a bitmask row, ``ceil(vocab_size / 32)``: the mask shape both sides agree on."""
    return (vocab_size + 31) // 32


#: What one row of a step's answer means (:meth:`MaskStep.row_kind`): sample it under its mask; it
#: failed (``errors[j]`` says why); its grammar ended (the stop token was accepted); a value check
#: dropped its last tokens (it is fed again, not sampled).
ROW_MASK, ROW_ERROR, ROW_STOP, ROW_DROP = 0, 1, 2, 3


class Sent(Enum):
    """When a field of the answer is sent (None in :class:`MaskStep` where it is not)."""

    ALWAYS = "always"
    #: Only when some row has a non-zero value: an all-zero BLS tensor of B rows costs the round trip
    #: its copy for nothing (about 0.1 ms at B = 64, inside ``bench/grammar_step_bench.py``'s ``bls tensor``).
    NONZERO = "nonzero"
    #: Only when the step asked for jump-forward.
    JUMP = "jump"
    #: Only when the step carried draft tokens (speculative decoding).
    DRAFTS = "drafts"
    #: Only when some row failed (the row errors, as text).
    ERRORS = "errors"


@dataclass(frozen=True)
class Field:
    """One per-row array of :class:`MaskStep` as it crosses a transport."""

    name: str  # the MaskStep attribute
    tensor: str  # the grammar model's output tensor
    dtype: type[np.generic]  # on every transport (BLS: the tensor's TYPE_*; the channel: its bytes)
    sent: Sent
    wide: bool = False  # [B, F] rather than [B]; F: the step's widest forced run, or its draft width (DRAFTS)


#: The answer's per-row fields, in the channel's order (flag bit ``1 << i`` for the ``i``-th optional one).
STEP_FIELDS: Final[tuple[Field, ...]] = (
    Field("terminated", "TERMINATED", np.bool_, Sent.ALWAYS),
    Field("closing", "CLOSING", np.int8, Sent.ALWAYS),
    Field("dropped", "DROPPED", np.int32, Sent.NONZERO),
    Field("hold", "HOLD", np.int32, Sent.NONZERO),
    Field("forced_counts", "FORCED_COUNT", np.int32, Sent.JUMP),
    Field("forced_tokens", "FORCED_TOKENS", np.int32, Sent.JUMP, wide=True),
    Field("forced_safe", "FORCED_SAFE", np.int32, Sent.JUMP),
    Field("draft_valid", "DRAFT_VALID", np.int32, Sent.DRAFTS),
    Field("draft_closing", "DRAFT_CLOSING", np.int8, Sent.DRAFTS, wide=True),
    Field("errors", "ROW_ERROR", np.object_, Sent.ERRORS),
)
#: The mask's tensor where the caller has no mask buffer (int32 ``[B, W]``).
BITMASK_TENSOR: Final = "BITMASK"
#: The draft positions' masks where the caller has no mask buffer (int32 ``[D, B, W]``).
DRAFT_BITMASK_TENSOR: Final = "DRAFT_BITMASK"
#: The per-row tensors a step's caller asks for (with or without jump-forward, with or without drafts).
STEP_TENSORS: Final = tuple(f.tensor for f in STEP_FIELDS if f.sent not in (Sent.JUMP, Sent.DRAFTS))
JUMP_TENSORS: Final = tuple(f.tensor for f in STEP_FIELDS if f.sent is Sent.JUMP)
DRAFT_TENSORS: Final = tuple(f.tensor for f in STEP_FIELDS if f.sent is Sent.DRAFTS)


# Not frozen: one is built every decode step, and a frozen dataclass's __init__ (object.__setattr__
# per field) costs four times as much (docs/benchmarks.md, the serving path's fifth round).
@dataclass(slots=True)
class MaskStep:
    """The grammar side's answer to one decode step.

    Attributes
    ----------
    bitmask : np.ndarray
        int32 ``[B, W]``; row ``i`` belongs to ``seq_ids[i]`` of the step call;
        ``W = ceil(vocab_size / 32)``; bit ``j`` of a row set = token ``j`` allowed.
    terminated : np.ndarray
        bool ``[B]``: the grammar accepted its stop token.
    errors : tuple of (str or None)
        Per-row error (``None`` = ok).  A row error finishes only that sequence,
        with finish reason ``"error"``.
    closing : np.ndarray or None
        int8 ``[B]``: non-zero where the grammar side forces a completion
        (:class:`grammar_backend.protocol.CloseState`); None: no row is closing.
    forced_tokens, forced_counts : np.ndarray or None
        Jump-forward (only when the step asked for it): int32 ``[B, F]`` and
        ``[B]``; row ``i``'s first ``forced_counts[i]`` tokens spell the text
        its grammar forces next (:mod:`grammar_backend.jump`).
    dropped : np.ndarray or None
        int32 ``[B]``: tokens the row's value check dropped (None: no row
        did).  The row's last ``dropped[i]`` tokens are no longer part of
        its output; its mask here is not sampled: the next step feeds the
        token before them again, with no token to accept.
    hold : np.ndarray or None
        int32 ``[B]``: how many of the row's last tokens a value check may
        still drop, so not streamed yet (None: no row holds any).
    forced_safe : np.ndarray or None
        int32 ``[B]`` (with forced tokens): for a row whose forced tokens
        start its output, how many of the first of them no value check can
        drop once accepted; 0 (or None): hold them until the next step's
        ``hold``.
    draft_valid : np.ndarray or None
        int32 ``[B]`` (a step with drafts): how many of row ``i``'s draft
        masks hold; the target may accept its drafts up to there at most.
    draft_bitmask : np.ndarray or None
        int32 ``[D, B, W]`` (a step with drafts): ``draft_bitmask[j, i]`` is
        the mask of the position after row ``i``'s drafts ``0..j``
        (:meth:`GrammarEngine.step <grammar_service.engine.GrammarEngine.step>`);
        rows past ``draft_valid[i]`` are all ones.
    draft_closing : np.ndarray or None
        int8 ``[B, D]`` (a step with drafts): ``draft_closing[i, j]`` is the
        close state (as :attr:`closing`) of the position after row ``i``'s
        drafts ``0..j``, for ``j < draft_valid[i]`` (0 past it): a target
        that accepts drafts learns the state of the position where it
        samples, as a one-token step would (a stop sampled there while the
        grammar closes at the budget is a ``length`` finish).
    grammar_s : float
        How long the step took on the grammar side itself (NaN: not
        reported); the rest of the caller's wait is the call's transport.
    active : int
        The grammar side's live sequences after the step (-1: not reported).
    """

    bitmask: np.ndarray
    terminated: np.ndarray
    errors: tuple[str | None, ...]
    closing: np.ndarray | None = None
    forced_tokens: np.ndarray | None = None
    forced_counts: np.ndarray | None = None
    dropped: np.ndarray | None = None
    hold: np.ndarray | None = None
    forced_safe: np.ndarray | None = None
    draft_valid: np.ndarray | None = None
    draft_bitmask: np.ndarray | None = None
    draft_closing: np.ndarray | None = None
    grammar_s: float = float("nan")
    active: int = -1

    def row_kind(self, j: int) -> int:
        """What row ``j`` means: :data:`ROW_ERROR`, :data:`ROW_STOP`, :data:`ROW_DROP` or :data:`ROW_MASK`
        (:func:`_row_kind`: the one reading of an answer, for every engine)."""
        return _row_kind(self.errors[j], bool(self.terminated[j]),
                         0 if self.dropped is None else int(self.dropped[j]))

    def close_state(self, j: int) -> int:
        """Row ``j``'s :class:`~grammar_backend.protocol.CloseState` (0: open)."""
        return 0 if self.closing is None else int(self.closing[j])

    def held(self, j: int) -> int:
        """How many of row ``j``'s last tokens a value check may still drop."""
        return 0 if self.hold is None else int(self.hold[j])

    def forced(self, j: int, limit: int, count: int | None = None) -> tuple[int, ...]:
        """Row ``j``'s forced tokens, at most ``limit`` of them (empty when fewer than two: one forced
        token saves no forward, it is sampled under the mask).  ``count``: the row's forced-token
        count where the caller read it already (:meth:`rows`)."""
        fc, ft = self.forced_counts, self.forced_tokens
        if fc is None or ft is None:
            return ()
        n = min(int(fc[j]) if count is None else count, limit)
        return tuple(ft[j, :n].tolist()) if n >= 2 else ()

    def forced_safe_of(self, j: int) -> int:
        """How many of row ``j``'s first forced tokens stream as soon as they are taken."""
        return 0 if self.forced_safe is None else int(self.forced_safe[j])

    def read(self, rows: int, width: int) -> StepRows | str:
        """Check that this answer fits a step of ``rows`` rows of ``width`` words, and read every row at once.

        The decode loop reads all of a step's rows: one ``tolist`` per array
        costs less than five numpy element reads per row, and the checks run
        on those lists, not as numpy reductions of their own (one pass instead
        of a check and a read: docs/benchmarks.md, the serving path's fifth
        round).

        Returns
        -------
        StepRows or str
            Each row's :meth:`row_kind`, :meth:`close_state`, :meth:`held`,
            forced-token count and :meth:`forced_safe_of`; or why the answer
            does not fit.
        """
        bm, term, errors = self.bitmask, self.terminated, self.errors
        if not isinstance(bm, np.ndarray) or bm.dtype != np.int32 or bm.shape != (rows, width):
            return f"bitmask must be int32 [{rows}, {width}], got {getattr(bm, 'dtype', type(bm))} {getattr(bm, 'shape', '')}"
        if not isinstance(term, np.ndarray) or term.shape != (rows,):
            return f"terminated must be bool [{rows}]"
        if len(errors) != rows:
            return f"errors must have {rows} entries, got {len(errors)}"
        zeros = [0] * rows
        close = _column(self.closing, rows, zeros)
        if close is None:
            return f"closing must be int8 [{rows}] or None"
        dropped = _column(self.dropped, rows, zeros)
        held = _column(self.hold, rows, zeros)
        safe = _column(self.forced_safe, rows, zeros)
        if dropped is None or held is None or safe is None:
            name = "dropped" if dropped is None else "hold" if held is None else "forced_safe"
            return f"{name} must be int32 [{rows}] or None"
        ft, fc = self.forced_tokens, self.forced_counts
        if (ft is None) != (fc is None):
            return "forced_tokens and forced_counts come together"
        forced = zeros
        if ft is not None and fc is not None:
            if not isinstance(ft, np.ndarray) or ft.ndim != 2 or ft.shape[0] != rows or _column(fc, rows, zeros) is None:
                return f"forced tokens must be [{rows}, F] with counts [{rows}]"
            forced = fc.tolist()
            if fc.dtype != np.int32 or (rows and (min(forced) < 0 or max(forced) > ft.shape[1])):
                return f"forced counts must be int32 in 0..{ft.shape[1]}"
        stops: list[bool] = term.tolist()
        if errors.count(None) == rows and not any(stops) and not any(dropped):
            kind = [ROW_MASK] * rows  # the usual step: every row samples under its mask
        else:
            kind = [_row_kind(e, t, d) for e, t, d in zip(errors, stops, dropped, strict=True)]
        return StepRows(kind=kind, close=close, held=held, forced=forced, forced_safe=safe)


def _column(value: np.ndarray | None, rows: int, zeros: list[int]) -> list[int] | None:
    """A per-row answer array as a list (``zeros`` where it is None); None where it is not ``[rows]``."""
    if value is None:
        return zeros
    if not isinstance(value, np.ndarray) or value.shape != (rows,):
        return None
    return value.tolist()  # type: ignore[no-any-return]


def _row_kind(error: str | None, terminated: bool, dropped: int) -> int:
    if error is not None:
        return ROW_ERROR
    if terminated:
        return ROW_STOP
    if dropped > 0:
        return ROW_DROP
    return ROW_MASK


@dataclass(frozen=True, slots=True)
class StepRows:
    """A :class:`MaskStep` read row by row (:meth:`MaskStep.read`): one list entry per row."""

    kind: list[int]
    close: list[int]
    held: list[int]
    forced: list[int]
    forced_safe: list[int]


# ------------------------------------------------------------------------- BLS tensors
def answer_tensors(answer: MaskStep, *, with_bitmask: bool) -> list[tuple[str, np.ndarray]]:
    """The answer as the grammar model's output tensors (name, array): the fields it holds, the bitmask
    where the caller has no mask buffer (``with_bitmask``)."""
    out = [(BITMASK_TENSOR, answer.bitmask)] if with_bitmask else []
    if with_bitmask and answer.draft_bitmask is not None:
        out.append((DRAFT_BITMASK_TENSOR, answer.draft_bitmask))
    for f in STEP_FIELDS:
        value = getattr(answer, f.name)
        if f.sent is Sent.ERRORS:
            if any(e is not None for e in value):
                out.append((f.tensor, np.array([(e or "").encode() for e in value], np.object_)))
        elif value is not None:
            out.append((f.tensor, value))
    return out


def answer_from_tensors(output: Callable[[str], Any], rows: int, bitmask: np.ndarray,
                        draft_bitmask: np.ndarray | None = None) -> MaskStep:
    """The answer from the grammar model's output tensors: ``output(name)`` is the named tensor's array
    (None: not sent); ``bitmask`` the mask (its tensor, or the caller's mask buffer); ``draft_bitmask`` the
    draft positions' masks (likewise; None: the step had no drafts)."""
    fields: dict[str, Any] = {}
    for f in STEP_FIELDS:
        value = output(f.tensor)
        if f.sent is Sent.ERRORS:
            fields[f.name] = (tuple((bytes(e).decode() or None) for e in value) if value is not None
                              else (None,) * rows)
        else:
            fields[f.name] = value
    return MaskStep(bitmask=bitmask, draft_bitmask=draft_bitmask, **fields)
