"""A scripted "model" driving the real grammar engine: closing exercised without a language model.

The model writes a script (the start of an output), then a loop of text
again and again (a runaway), one token per step, through
:meth:`GrammarEngine.step`'s real masks.  Where the mask refuses the token it
wants, it takes the token the engine's closer would write next (a model the
mask blocks near its budget is left with little else), else the lowest
allowed one.  Deterministic: the same engine state gives the same output.

Used by the closing tests (``tests/unit/test_closing_kinds.py``) and
``bench/budget_bench.py``'s kinds part.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from grammar_backend.bitmask import allowed_tokens
from grammar_backend.protocol import CLOSE_STATE_REASONS, CloseState
from grammar_backend.spec import ConstraintSpec
from grammar_service.engine import GrammarEngine


@dataclass(frozen=True)
class Replay:
    """One scripted output.

    Attributes
    ----------
    text : str
        The output's text (the stop token left out).
    tokens : int
        Tokens taken, the stop token included.
    stopped : bool
        Whether the grammar took the stop token: the output is a complete sentence of its constraint.
    closed : CloseState or None
        Why the output was closed early (``BUDGET`` or ``REPETITION``), None when it was not.
    """

    text: str
    tokens: int
    stopped: bool
    closed: CloseState | None


def replay(engine: GrammarEngine, decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
           seq_id: int, spec: ConstraintSpec, script: str, loop: str, budget: int,
           step_s: list[float] | None = None) -> Replay:
    """Write ``script`` then ``loop`` forever (nothing more once the script ends, with ``loop`` empty: the stop
    token) under ``spec`` with ``max_tokens`` = ``budget``; see the module docstring.  ``step_s``: each
    :meth:`GrammarEngine.step`'s wall time is appended there.

    Raises
    ------
    GrammarError
        The start failed (a compile error or limit), or a step reported the row's error.
    """
    head, body = encode(script), encode(loop)
    stop = int(engine.tokenizer_info.stop_token_ids[0])
    engine.start(seq_id, spec, budget=budget, timeout_s=600)
    taken: list[int] = []
    closed: CloseState | None = None
    ids = np.array([seq_id], np.uint64)
    wanted_at = 0
    try:
        while len(taken) < budget:
            last = taken[-1:]
            t0 = time.perf_counter()
            out = engine.step(ids, np.array([last or [0]], np.int32), np.array([len(last)], np.int32))
            if step_s is not None:
                step_s.append(time.perf_counter() - t0)
            if out.errors[0] is not None:
                raise out.errors[0]
            if int(out.closing[0]) in CLOSE_STATE_REASONS:
                closed = CloseState(int(out.closing[0]))
            allowed = allowed_tokens(out.bitmask[0], engine.vocab_size)
            if wanted_at < len(head):
                wanted = head[wanted_at]
            else:
                wanted = body[(wanted_at - len(head)) % len(body)] if body else stop
            if wanted in set(allowed.tolist()):
                token, wanted_at = wanted, wanted_at + 1
            else:
                completion = engine.closer.complete(engine.table.get(seq_id).matcher)
                token = completion[0] if completion else stop
                if not np.isin(token, allowed):
                    token = int(allowed[0])
            taken.append(int(token))
            if token == stop:
                break
    finally:
        engine.end([seq_id])
    stopped = bool(taken) and taken[-1] == stop
    return Replay(decode([t for t in taken if t != stop]), len(taken), stopped, closed)
