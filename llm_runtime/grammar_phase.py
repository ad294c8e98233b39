"""A decode step's grammar work, owned by one object for both of the scheduler's grammar modes.

:class:`GrammarPhase` builds the step's one grammar request (each
constrained row's new tokens: the one sampled, the ones jumped, or none for
a row that joins or is fed again after a drop), issues it, times it and
hands back the answer.  The two modes differ only in *when* the request
runs:

* ``overlap`` (the default): :meth:`GrammarPhase.launch` sends it before
  the forward, :meth:`GrammarPhase.collect` takes the answer after; the
  mask of step ``t`` depends only on tokens up to ``t - 1``, as the forward
  does, so the two run side by side.  A provider that can send a step and
  answer it later (:class:`~llm_runtime.mask.StepSender`: the grammar
  channel) is called on the loop's thread; another is called on a worker
  thread;
* ``processor``: the request runs in :meth:`GrammarPhase.collect`, after the
  forward, as an engine's logits processor would call it.

Either way the scheduler reads the answer the same way
(:meth:`llm_runtime.mask.MaskStep.row_kind`), so jump-forward, value checks
and closing behave alike in both.

:class:`JumpPolicy` decides how wide a step's jumps may be.  A jump feeds
several forced tokens in the next forward, right-padded to the widest row,
so every row pays for the width: the policy keeps the width whose tokens per
second, measured on this engine, beat a plain step.  At 16 rows of the tiny
stand-in on one CPU thread a forward 8 tokens wide cost 2.7 times a one-token
decode (``make bench-path``; docs/benchmarks.md), so jumps that a fixed fill
rule admitted made constrained steps slower; on SmolLM2 a wide forward costs
relatively less, and on a GPU nearly nothing.  The whole step is measured
(forward, the grammar accepting the jumped tokens, masking, streaming),
since all of it grows with the width.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final, Protocol

import numpy as np

from .errors import config_error
from .mask import MaskProvider, MaskStep, PendingStep, StepRows, StepSender

__all__ = ["GrammarPhase", "JumpPolicy", "PhaseRow"]

_log = logging.getLogger(__name__)

#: Weight of a new measurement in :class:`JumpPolicy`'s moving averages.
_EMA: Final = 0.1


def _draft_fault(step: MaskStep, rows: int, drafts: int, width: int) -> str:
    """Why the draft part of an answer does not fit a step of ``rows`` rows with ``drafts`` draft
    positions of ``width`` words ("": it fits)."""
    valid, masks, closing = step.draft_valid, step.draft_bitmask, step.draft_closing
    if not isinstance(valid, np.ndarray) or valid.shape != (rows,):
        return f"draft_valid must be int32 [{rows}] in a step with drafts"
    if not isinstance(masks, np.ndarray) or masks.dtype != np.int32 or masks.shape != (drafts, rows, width):
        return f"draft_bitmask must be int32 [{drafts}, {rows}, {width}] in a step with drafts"
    if not isinstance(closing, np.ndarray) or closing.shape != (rows, drafts):
        return f"draft_closing must be int8 [{rows}, {drafts}] in a step with drafts"
    if rows and (int(valid.min()) < 0 or int(valid.max()) > drafts):
        return f"draft_valid must be in 0..{drafts}"
    return ""


class JumpPolicy:
    """How wide a step's jumps and drafts may be, from what wider forwards are measured to cost on this engine.

    Parameters
    ----------
    min_fill : float
        The prior: a forward ``K`` wide costs ``1 + min_fill * (K - 1)``
        times a one-token decode of the same rows until measured, so its
        forced tokens must fill this share of the padding to pay.  0: jumps
        always pay until measured.

    Notes
    -----
    :meth:`record` takes the time of every decode step no prompt joined: a
    moving average per batch size for one token wide, and per (batch size,
    width) the ratio to it.  :meth:`width` picks the jump width that adds the
    most tokens per unit of that cost, or 0 where a plain step does better;
    :meth:`draft_width` the same for drafts, weighed by how likely each is
    kept.
    """

    def __init__(self, min_fill: float) -> None:
        self._fill = min_fill
        self._base: dict[int, float] = {}  # rows -> seconds of a one-token forward
        self._ratio: dict[tuple[int, int], float] = {}  # (rows, width) -> cost relative to one token wide

    def record(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows fed ``width`` tokens wide took ``seconds`` (no prompt joined it)."""
        if not seconds > 0:
            return
        if width <= 1:
            old = self._base.get(rows)
            self._base[rows] = seconds if old is None else old + _EMA * (seconds - old)
            return
        base = self._base.get(rows)
        if base is None:
            return
        ratio = seconds / base
        old = self._ratio.get((rows, width))
        self._ratio[(rows, width)] = ratio if old is None else old + _EMA * (ratio - old)

    def cost(self, rows: int, width: int) -> float:
        """A step ``width`` tokens wide relative to one token wide (measured, else the prior)."""
        if width <= 1:
            return 1.0
        measured = self._ratio.get((rows, width))
        return measured if measured is not None else 1.0 + self._fill * (width - 1)

    def draft_width(self, rows: int, floor: int, base: float, drafts: Sequence[tuple[int, float]]) -> int:
        """The forward width of a step whose rows propose drafts (speculation), at least ``floor``.

        ``drafts`` holds each drafting row's draft count and the chance it keeps each next draft
        (:attr:`llm_runtime.speculation.PromptLookup.acceptance`); ``base`` is the tokens the step adds
        without drafts (a token a row, and the jumps beyond).  A width ``W`` lets a row keep up to
        ``W - 1`` drafts, ``a + a**2 + ...`` of them expected, for :meth:`cost` ``(rows, W)``: the width
        that adds the most tokens per unit of cost wins (the narrower on a tie), ``floor`` where drafts
        do not pay.
        """
        best, best_rate = floor, base / self.cost(rows, floor)
        for w in range(floor + 1, 1 + max((k for k, _ in drafts), default=0) + 1):
            gain = sum(_kept(min(k, w - 1), a) for k, a in drafts)
            rate = (base + gain) / self.cost(rows, w)
            if rate > best_rate:
                best, best_rate = w, rate
        return best

    def width(self, lengths: Sequence[int], rows: int) -> int:
        """The jump width for this step: its rows' forced-token counts ``lengths`` (each at least 2), 0: none.

        The width maximises ``(rows + tokens jumped beyond one) / cost`` (the
        wider one on a tie); it must at least match a plain step (``rows / 1``).
        """
        best, best_rate = 0, float(rows)
        for k in range(2, max(lengths, default=0) + 1):
            rate = (rows + sum(min(n, k) - 1 for n in lengths)) / self.cost(rows, k)
            if rate >= best_rate:
                best, best_rate = k, rate
        return best


def _kept(n: int, a: float) -> float:
    """Expected drafts kept of ``n`` when each next one is kept with chance ``a``: ``a + a**2 + ... + a**n``."""
    return n * a if a >= 1.0 else a * (1.0 - a**n) / (1.0 - a)


class PhaseRow(Protocol):
    """What :class:`GrammarPhase` reads of a constrained row (the scheduler's sequence state)."""

    seq_id: int
    jump: tuple[int, ...]
    in_engine: bool
    refeed: bool
    last_token: int
    accepted: tuple[int, ...]
    drafts: tuple[int, ...]


class GrammarPhase:
    """One decode step's grammar request: built, issued (overlapped or after the forward) and timed.

    Parameters
    ----------
    provider : MaskProvider
        The grammar side.
    max_rows : int
        Most constrained rows of a step (the buffers are preallocated).
    max_jump_tokens : int
        Most forced tokens a row may feed (the token buffer's width); 0: the
        request never asks for forced tokens.
    max_draft_tokens : int
        Most draft tokens a row may carry (speculation); a row's new tokens
        are then its accepted drafts and the token sampled after them.
    overlap : bool
        Run the request beside the forward (True) or after it (False).

    Attributes
    ----------
    step : MaskStep or None
        The answer of the last :meth:`collect` (None: failed or no request).
    rows : StepRows or None
        That answer read row by row (:meth:`MaskStep.read`), with :attr:`step`.
    error : BaseException or str or None
        Why the last request failed (an exception, or a malformed answer).
    wait_s, call_s, grammar_s : float
        Seconds the loop waited for the answer after its forward (all of the
        call in processor mode), the call itself (a sent step's: until its
        answer arrived, :meth:`PendingStep.result`), and the part of it the
        grammar side reported as its own work (NaN where not reported).
    loop_s : float
        Seconds of the loop's own time the step's grammar work took, outside
        the forward: :meth:`launch`, :meth:`collect` (its wait included) and
        what the caller adds with :meth:`charge` (reading the answer and
        masking).  Every second of it lengthens the step.
    requests : int
        Grammar requests issued.
    """

    def __init__(self, provider: MaskProvider, *, max_rows: int, max_jump_tokens: int, overlap: bool,
                 max_draft_tokens: int = 0) -> None:
        if max_rows < 1:
            raise config_error("scheduler.max_batch_size", f"must be positive, got {max_rows}")
        self._provider = provider
        self._jump_forward = max_jump_tokens > 0
        self._ids = np.zeros(max_rows, dtype=np.uint64)
        self._tokens = np.zeros((max_rows, max(1, max_jump_tokens, 1 + max_draft_tokens)), dtype=np.int32)
        self._counts = np.zeros(max_rows, dtype=np.int32)
        self._drafts = np.zeros((max_rows, max(1, max_draft_tokens)), dtype=np.int32)
        self._draft_counts = np.zeros(max_rows, dtype=np.int32)
        self._draft_width = 0  # the step's widest row of drafts (0: no row has any)
        self._sender: StepSender | None = provider if overlap and isinstance(provider, StepSender) else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llm-grammar-step") if overlap else None
        self._future: Future[tuple[MaskStep, float]] | None = None
        self._sent: PendingStep | BaseException | None = None  # sent over a StepSender, or why not
        self._pending: tuple[int, int] | None = None  # processor mode: (rows, token width) to run at collect
        self._rows = 0
        self.step: MaskStep | None = None
        self.rows: StepRows | None = None
        self.error: BaseException | str | None = None
        self.wait_s = self.call_s = self.grammar_s = self.loop_s = math.nan
        self.requests = 0

    def launch(self, rows: Sequence[PhaseRow]) -> None:
        """Build the request for ``rows`` (each constrained row, in the step's order); overlap mode starts it."""
        t0 = time.perf_counter()
        self._launch(rows)
        self.loop_s = time.perf_counter() - t0

    def _launch(self, rows: Sequence[PhaseRow]) -> None:
        width = 1
        dw = 0
        for j, s in enumerate(rows):
            self._ids[j] = s.seq_id
            if s.jump:
                n = len(s.jump)
                self._tokens[j, :n] = s.jump
                self._counts[j] = n
                width = max(width, n)
            elif s.accepted and not s.refeed:  # the drafts the target kept, then the token sampled after them
                n = len(s.accepted) + 1
                self._tokens[j, : n - 1] = s.accepted
                self._tokens[j, n - 1] = s.last_token
                self._counts[j] = n
                width = max(width, n)
            elif s.in_engine and not s.refeed:
                self._tokens[j, 0] = s.last_token
                self._counts[j] = 1
            else:  # joins now, or fed again after a drop: nothing to accept
                self._tokens[j, 0] = 0
                self._counts[j] = 0
            d = len(s.drafts)
            self._draft_counts[j] = d
            if d:
                self._drafts[j, :d] = s.drafts
                dw = max(dw, d)
        self.step, self.rows, self.error = None, None, None
        self.wait_s = self.call_s = self.grammar_s = math.nan
        self.requests += 1
        self._rows = n = len(rows)
        self._draft_width = dw
        drafts, draft_counts = (self._drafts[:n, :dw], self._draft_counts[:n]) if dw else (None, None)
        if self._sender is not None:
            try:
                self._sent = self._sender.send_step(self._ids[:n], self._tokens[:n, :width], self._counts[:n],
                                                    jump_forward=self._jump_forward, drafts=drafts,
                                                    draft_counts=draft_counts)
            except Exception as err:  # noqa: BLE001 -- reported by collect, as a failed answer
                self._sent = err
            if self._sent is not None:
                return
        if self._pool is not None:
            self._future = self._pool.submit(self._call, n, width)
        else:
            self._pending = (n, width)

    def collect(self, width: int) -> None:
        """Get the answer (overlap: wait for it; processor: run the request now) and check its shape.

        ``width`` is the bitmask width the answer must have.  Afterwards
        :attr:`step` holds a well-formed answer and :attr:`rows` its reading,
        or :attr:`error` says why there is none (every constrained row of the
        step then fails with it).
        """
        t0 = time.perf_counter()
        self._collect(width)  # catches every failure: it becomes the step's error
        self.loop_s += time.perf_counter() - t0

    def _collect(self, width: int) -> None:
        t0 = time.perf_counter()
        try:
            if self._sent is not None:
                sent, self._sent = self._sent, None
                if isinstance(sent, BaseException):
                    raise sent
                self.step, self.call_s = sent.result()
            elif self._future is not None:
                future, self._future = self._future, None
                self.step, self.call_s = future.result()
            elif self._pending is not None:
                (rows, tokens), self._pending = self._pending, None
                self.step, self.call_s = self._call(rows, tokens)
            else:
                return
        except Exception as err:  # noqa: BLE001 -- every constrained row of the step fails with it
            _log.exception("MaskProvider.step failed; failing the step's constrained rows")
            self.error = err
            self.step = None
            return
        finally:
            self.wait_s = time.perf_counter() - t0
        step = self.step
        if step is None:
            self.error = "MaskProvider.step returned None"
            return
        self.grammar_s = step.grammar_s
        read = step.read(self._rows, width)
        if isinstance(read, str):
            self.error, self.step = read, None
        elif self._draft_width and (fault := _draft_fault(step, self._rows, self._draft_width, width)):
            self.error, self.step = fault, None
        else:
            self.rows = read

    def charge(self, seconds: float) -> None:
        """Add ``seconds`` of the loop's time on this step's grammar work to :attr:`loop_s`."""
        self.loop_s += seconds

    def _call(self, count: int, width: int) -> tuple[MaskStep, float]:
        t0 = time.perf_counter()
        dw = self._draft_width
        if dw:
            result = self._provider.step(self._ids[:count], self._tokens[:count, :width], self._counts[:count],
                                         jump_forward=self._jump_forward, drafts=self._drafts[:count, :dw],
                                         draft_counts=self._draft_counts[:count])
        else:  # a provider without speculation takes the step as before
            result = self._provider.step(self._ids[:count], self._tokens[:count, :width], self._counts[:count],
                                         jump_forward=self._jump_forward)
        return result, time.perf_counter() - t0

    def close(self) -> None:
        """Stop the worker thread (after the loop stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
