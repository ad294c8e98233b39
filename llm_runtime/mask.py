"""The interface between the decode loop and the grammar side.

The runtime never interprets a constraint: it forwards a :class:`ConstraintRequest`
to a :class:`MaskProvider` (implemented in-process over the grammar engine, or
over Triton BLS to the ``grammar`` model) and gets back, for every decode step,
the packed bitmask of the tokens each constrained sequence may take next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# One definition of the packed-mask width, shared with the grammar side.
from contract import bitmask_width

__all__ = ["ROW_DROP", "ROW_ERROR", "ROW_MASK", "ROW_STOP", "ConstraintRequest", "MaskProvider", "MaskStep",
           "PendingStep", "StepRows", "StepSender", "bitmask_width"]

#: What one row of a step's answer means (:meth:`MaskStep.row_kind`): sample it under its mask; it
#: failed (``errors[j]`` says why); its grammar ended (the stop token was accepted); a value check
#: dropped its last tokens (it is fed again, not sampled).
ROW_MASK, ROW_ERROR, ROW_STOP, ROW_DROP = 0, 1, 2, 3


@dataclass(frozen=True)
class ConstraintRequest:
    """A constraint, opaque to the runtime and forwarded to the grammar side.

    Attributes
    ----------
    kind : str
        e.g. ``"json_schema"``, ``"regex"``, ``"choice"``.
    payload : str
        The schema, regex, grammar text, ... (empty for ``json_object``).
    options_json : str
        ``""`` or a JSON object of grammar options.
    budget : int
        The request's ``max_tokens`` (set by the scheduler), for budget
        closing; 0: none.
    validated : bool
        The constraint is preprocessing's validated wire form
        (:meth:`grammar_backend.spec.ConstraintSpec.wire`): the grammar side
        trusts it instead of validating it again.
    value_checks : bool
        The caller drops the tokens ``MaskStep.dropped`` reports (set by the
        scheduler, which can): completed values are checked
        (:mod:`grammar_backend.values`).
    """

    kind: str
    payload: str
    options_json: str
    budget: int = 0
    validated: bool = False
    value_checks: bool = False


# Not frozen: one is built every decode step, and a frozen dataclass's __init__ (object.__setattr__
# per field) costs 0.8 us against 0.2 us for these ten fields.
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
        (:class:`grammar_backend.closing.CloseState`); None: no row is closing.
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
    grammar_s : float
        How long the step took on the grammar side itself (NaN: not
        reported); the rest of the caller's wait is the call's transport.
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
    grammar_s: float = float("nan")

    def row_kind(self, j: int) -> int:
        """What row ``j`` means: :data:`ROW_ERROR`, :data:`ROW_STOP`, :data:`ROW_DROP` or :data:`ROW_MASK`
        (:func:`_row_kind`: the one reading of an answer, for every engine)."""
        return _row_kind(self.errors[j], bool(self.terminated[j]),
                         0 if self.dropped is None else int(self.dropped[j]))

    def close_state(self, j: int) -> int:
        """Row ``j``'s :class:`~grammar_backend.closing.CloseState` (0: open)."""
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
        costs less than five numpy element reads per row (about 3 us a row),
        and the checks run on those lists, not as numpy reductions of their
        own (a separate check and read cost the tiny stand-in's loop 14 and
        8 us a step at 16 rows, served, against 2.3 and 2.9 us measured alone).

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


class MaskProvider(Protocol):
    """The grammar side, as the decode loop drives it.

    Threading: ``start`` runs on a compile worker thread and may overlap
    ``step``/``end`` calls (for other sequences) made from the loop's step
    worker / loop thread; ``step`` calls never overlap each other.  Arrays passed
    to ``step`` are reused buffers: do not keep references after returning.
    """

    def start(self, seq_id: int, constraint: ConstraintRequest) -> str:
        """Create the sequence's grammar state; blocking (may compile).

        Returns the grammar backend that serves it (``contract.BACKENDS``).
        Raises :class:`grammar_backend.errors.GrammarError` subclasses.
        """
        ...

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
             jump_forward: bool = False) -> MaskStep:
        """Accept the tokens sampled since the previous step and return the next mask.

        Parameters
        ----------
        seq_ids : np.ndarray
            uint64 ``[B]``.
        tokens : np.ndarray
            int32 ``[B, K]``; row ``i`` holds ``counts[i]`` accepted tokens.
        counts : np.ndarray
            int32 ``[B]``; 0 on a sequence's first step.
        jump_forward : bool
            Also return each row's forced tokens (``MaskStep.forced_tokens``).

        Returns
        -------
        MaskStep
            The mask for the NEXT token of each row.
        """
        ...

    def end(self, seq_ids: Sequence[int]) -> None:
        """Free the sequences' grammar state (each started sequence ends exactly once)."""
        ...


class PendingStep(Protocol):
    """A step sent to the grammar side and not yet answered (:meth:`StepSender.send_step`)."""

    def result(self) -> tuple[MaskStep, float]:
        """Wait for the answer; returns it and the call's round trip in seconds (send to answer)."""
        ...


@runtime_checkable
class StepSender(Protocol):
    """A :class:`MaskProvider` that can send a step and be asked for its answer later, with no thread.

    The overlap mode sends before the forward and takes the answer after
    it; a provider without this method is called on a worker thread.
    """

    def send_step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
                  jump_forward: bool = False) -> PendingStep | None:
        """Send the step (arguments as :meth:`MaskProvider.step`; copied before it returns).

        Returns ``None`` where the step cannot be sent without waiting for
        its answer now (the caller then runs :meth:`MaskProvider.step` on
        a thread).  Between this call and the result's, the provider takes
        no other ``step`` or ``end``.
        """
        ...
