"""MaskProvider over an in-process :class:`grammar_service.engine.GrammarEngine`.

Used where the language model and the grammar engine share a process (tests,
benchmarks measuring the BLS round trip against the direct call).  The
returned bitmask is a view of the engine's reused buffer: the scheduler
consumes it before it asks for the next step, so no copy is made.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from grammar_backend.spec import constraint_spec
from grammar_service.engine import GrammarEngine
from llm_runtime.mask import ConstraintRequest, MaskStep


class LocalMaskProvider:
    """Implements :class:`llm_runtime.mask.MaskProvider` with direct engine calls."""

    def __init__(self, engine: GrammarEngine) -> None:
        self.engine = engine

    def start(self, seq_id: int, constraint: ConstraintRequest) -> str:
        """Validate (unless preprocessing did), compile (cached) and create the matcher; returns its backend."""
        spec = constraint_spec(constraint.kind, constraint.payload, constraint.options_json,
                               self.engine.config.limits, validated=constraint.validated)
        self.engine.start(seq_id, spec, budget=constraint.budget, value_checks=constraint.value_checks)
        return self.engine.table.get(seq_id).backend

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        """Accept new tokens and fill the next masks (and the draft positions')."""
        t0 = time.perf_counter()
        out = self.engine.step(seq_ids, tokens, counts, jump_forward=jump_forward, drafts=drafts,
                               draft_counts=draft_counts)
        return out.answer(jump_forward=jump_forward, copy=False, seconds=time.perf_counter() - t0)

    def end(self, seq_ids: Sequence[int]) -> None:
        """Free the matchers."""
        self.engine.end(seq_ids)
