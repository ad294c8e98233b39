"""The interface between the decode loop and the grammar side.

The runtime never interprets a constraint: it forwards a :class:`ConstraintRequest`
to a :class:`MaskProvider` (implemented in-process over the grammar engine, or
over the grammar channel to the ``grammar`` model) and gets back, for every decode step,
the packed bitmask of the tokens each constrained sequence may take next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# One definition of the packed-mask width, shared with the grammar side.
# The step's answer and its reading: the step protocol, one definition for every transport.
from grammar_backend.protocol import ROW_DROP, ROW_ERROR, ROW_MASK, ROW_STOP, MaskStep, StepRows, bitmask_width

__all__ = ["ROW_DROP", "ROW_ERROR", "ROW_MASK", "ROW_STOP", "ConstraintRequest", "MaskProvider", "MaskStep",
           "PendingStep", "StepRows", "StepSender", "bitmask_width"]


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

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
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
        drafts, draft_counts : np.ndarray, optional
            int32 ``[B, D]`` and ``[B]``: draft tokens proposed after each
            row's new tokens; the masks of the positions after them come back
            as ``MaskStep.draft_bitmask`` (speculative decoding).  They are
            not kept: the tokens the target accepts come back as the next
            step's ``tokens``.

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

    def send_step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
                  drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> PendingStep | None:
        """Send the step (arguments as :meth:`MaskProvider.step`; copied before it returns).

        Returns ``None`` where the step cannot be sent without waiting for
        its answer now (the caller then runs :meth:`MaskProvider.step` on
        a thread).  Between this call and the result's, the provider takes
        no other ``step`` or ``end``.
        """
        ...
