"""The grammar hook an engine calls after its forward and before it samples.

:class:`GrammarLogitsProcessor` is the one object through which an engine that
owns its own decode loop (TensorRT-LLM) consumes the ``grammar`` model's
bitmask.  TensorRT-LLM cannot be installed here: ``tests/unit/test_grammar_hook.py``
drives it in TensorRT-LLM's call order with the real tiny torch model.  It
reads a step's answer as the torch scheduler does
(:meth:`llm_runtime.mask.MaskStep.row_kind`); unlike the scheduler it cannot
append forced tokens or drop tokens, so it never jumps forward and its
sequences run without value checks.

Call contract (TensorRT-LLM's batched logits processor,
``tensorrt_llm.sampling_params.BatchedLogitsProcessor.__call__(req_ids,
logits, token_ids, stream_ptr, client_ids)``): once per decode step, after the
forward, with every request of the step that asked for it; ``logits[i]``
belongs to ``req_ids[i]`` and is modified in place; ``token_ids[i][beam]`` is
the request's whole token history (prompt first); the work is queued on the
CUDA stream ``stream_ptr``.  The processor

1. finds, for each row it knows, the tokens sampled since its previous call
   (the history past the prompt and the tokens already fed),
2. sends ONE batched ``MaskProvider.step`` for all constrained rows (over BLS:
   one request to the ``grammar`` model per step, whatever the batch),
3. copies the rows into one preallocated (pinned, on CUDA) host bitmask, moves
   it to the device on the engine's stream and applies it in place with
   ``xgrammar.apply_token_bitmask_inplace`` -- the logits never leave the device.

A row the grammar side ends (terminated, or a row error) gets a mask that
allows only the end tokens, so an engine that cannot be told to stop a
request from here (TensorRT-LLM) ends it at this step; the row's error and
close state are kept for :meth:`GrammarLogitsProcessor.remove`, which the
engine adapter calls when the request finishes (it ends the grammar sequence).

The processor runs serially with the forward: its cost is added to the step,
unlike the torch scheduler's default overlap mode.  See
:class:`ProcessorStats` for the counters that measure it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar

from grammar_backend.closing import CloseState

from .errors import EngineError
from .mask import ROW_ERROR, ROW_MASK, ROW_STOP, ConstraintRequest, MaskProvider, MaskStep, bitmask_width

__all__ = ["GrammarLogitsProcessor", "ProcessorStats", "RowOutcome"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowOutcome:
    """What the grammar side said about a request, read when it finishes.

    Attributes
    ----------
    error : str or None
        The grammar side's row error (the request must end with ``"error"``).
    close_state : int
        The last :class:`grammar_backend.closing.CloseState` of the row.
    terminated : bool
        The grammar accepted its stop token (the end-token mask was applied).
    """

    error: str | None
    close_state: int
    terminated: bool


@dataclass(frozen=True)
class ProcessorStats:
    """Counters of :class:`GrammarLogitsProcessor` since its creation.

    Attributes
    ----------
    calls : int
        Processor calls that had at least one constrained row.
    grammar_requests : int
        ``MaskProvider.step`` calls (one per such call: the batching contract).
    rows : int
        Constrained rows masked, summed over calls.
    grammar_s : float
        Seconds spent in ``MaskProvider.step``.
    apply_s : float
        Seconds spent copying and applying the bitmask (host-side time; on
        CUDA the kernels are queued on the engine's stream).
    """

    calls: int
    grammar_requests: int
    rows: int
    grammar_s: float
    apply_s: float


@dataclass(eq=False)
class _Row:
    seq_id: int
    prompt_len: int
    fed: int = 0  # generated tokens already accepted by the grammar side
    error: str | None = None
    close_state: int = CloseState.OPEN
    terminated: bool = False


class GrammarLogitsProcessor:
    """Masks the constrained rows of a decode step with ONE grammar request.

    Parameters
    ----------
    provider : MaskProvider
        The grammar side (BLS to the ``grammar`` model in Triton).
    vocab_size : int
        Width of the logits rows.
    end_token_ids : iterable of int
        The engine's end tokens: the only tokens left to a row the grammar side ended.
    max_rows : int
        Most rows of one call (the engine's batch size); the buffers are
        preallocated for it.
    device : torch.device or str
        Where the logits live.

    Notes
    -----
    Thread safety: :meth:`start`, :meth:`remove` and :meth:`__call__` may be
    called from different threads (TensorRT-LLM calls the processor on its
    executor thread while requests join and leave from others).  ``__call__``
    and the grammar ``end`` of :meth:`remove` never overlap, so the provider
    never sees a sequence ended during its step.
    """

    def __init__(
        self,
        provider: MaskProvider,
        *,
        vocab_size: int,
        end_token_ids: Iterable[int],
        max_rows: int,
        device: torch.device | str = "cpu",
    ) -> None:
        ends = sorted({int(t) for t in end_token_ids})
        if not ends or ends[0] < 0 or ends[-1] >= vocab_size:
            raise EngineError(f"end_token_ids must be non-empty ids in [0, {vocab_size}), got {ends}")
        if max_rows < 1:
            raise EngineError(f"max_rows must be positive, got {max_rows}")
        self._provider = provider
        self._vocab = vocab_size
        self._max_rows = max_rows
        self._device = torch.device(device)
        w = bitmask_width(vocab_size)
        pin = self._device.type == "cuda"
        # Reused every call: grammar-step inputs, the host bitmask aligned with the
        # logits rows, its device copy, and the end-tokens-only row.
        self._ids = np.zeros(max_rows, dtype=np.uint64)
        self._tokens = np.zeros((max_rows, 1), dtype=np.int32)
        self._counts = np.zeros(max_rows, dtype=np.int32)
        self._host = torch.full((max_rows, w), -1, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = self._host if not pin else torch.empty((max_rows, w), dtype=torch.int32, device=self._device)
        # On CUDA the host rows are copied asynchronously: the next call waits for
        # the previous copy before it rewrites them.
        self._copied = torch.cuda.Event() if pin else None
        self._end_row = np.zeros(w, dtype=np.int32)
        for t in ends:
            self._end_row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        self._rows: dict[int, _Row] = {}
        self._lock = threading.Lock()  # guards _rows
        self._step_lock = threading.Lock()  # __call__ vs. the grammar end of remove()
        self._calls = 0
        self._requests = 0
        self._masked = 0
        self._grammar_s = 0.0
        self._apply_s = 0.0

    # -- membership -----------------------------------------------------------
    def start(self, key: int, seq_id: int, constraint: ConstraintRequest, prompt_len: int) -> str:
        """Create the grammar sequence (blocking: may compile) and register its row; returns its backend.

        Parameters
        ----------
        key : int
            The engine's id of the request (``req_ids`` entries of the calls).
        seq_id : int
            The grammar sequence id.
        constraint : ConstraintRequest
            Forwarded to ``MaskProvider.start``.
        prompt_len : int
            Prompt tokens at the head of the request's token history.

        Raises
        ------
        grammar_backend.errors.GrammarError
            From ``MaskProvider.start`` (bad constraint, compile failure, ...).
        EngineError
            If ``key`` is already registered (the grammar sequence is ended again).
        """
        backend = self._provider.start(seq_id, constraint)
        with self._lock:
            clash = key in self._rows
            if not clash:
                self._rows[key] = _Row(seq_id, prompt_len)
        if clash:
            with self._step_lock:
                self._provider.end([seq_id])
            raise EngineError(f"request {key} already has a grammar row")
        return backend

    def remove(self, keys: Sequence[int]) -> list[RowOutcome | None]:
        """Forget the rows of finished requests and end their grammar sequences (one call).

        Returns
        -------
        list of (RowOutcome or None)
            One per key; ``None`` for a key without a row (an unconstrained request).
        """
        with self._lock:
            rows = [self._rows.pop(k, None) for k in keys]
        ended = [r.seq_id for r in rows if r is not None]
        if ended:
            with self._step_lock:
                self._provider.end(ended)
        return [None if r is None else RowOutcome(r.error, r.close_state, r.terminated) for r in rows]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._rows

    @property
    def row_count(self) -> int:
        """Registered rows (constrained requests in flight)."""
        with self._lock:
            return len(self._rows)

    def outcome(self, key: int) -> RowOutcome | None:
        """The row's state now (``None``: no such row)."""
        with self._lock:
            r = self._rows.get(key)
        return None if r is None else RowOutcome(r.error, r.close_state, r.terminated)

    def stats(self) -> ProcessorStats:
        """The counters (see :class:`ProcessorStats`)."""
        return ProcessorStats(self._calls, self._requests, self._masked, self._grammar_s, self._apply_s)

    # -- the per-step call ----------------------------------------------------
    def __call__(
        self,
        req_ids: Sequence[int],
        logits: torch.Tensor | Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[Sequence[int]]],
        stream_ptr: int | None = None,
        client_ids: Sequence[int | None] | None = None,
    ) -> None:
        """Mask, in place, the logits of every registered row of this step.

        Parameters
        ----------
        req_ids : sequence of int
            The engine's request ids of the rows.
        logits : torch.Tensor or sequence of torch.Tensor
            ``[B, vocab]`` (row ``i`` for ``req_ids[i]``) or one tensor per row
            whose last dimension is the vocabulary (TensorRT-LLM's batched form).
        token_ids : sequence
            ``token_ids[i][beam]``: the request's token history, prompt first;
            one beam only.
        stream_ptr : int or None
            The CUDA stream the engine queued the logits on (``None`` on CPU).
        client_ids : sequence or None
            Unused (part of TensorRT-LLM's signature).
        """
        del client_ids
        with self._step_lock:
            try:
                self._masked_step(req_ids, logits, token_ids, stream_ptr)
            except Exception as err:  # noqa: BLE001 -- never into the engine's loop: the rows fail instead
                # Raised inside TensorRT-LLM's forward (PyTorch backend) it would fail
                # the whole batch, across its C++ callback it could stop the executor.
                _log.exception("grammar processor failed; failing its rows")
                self._fail_rows(req_ids, logits, f"grammar processor failed: {err}")

    def _masked_step(
        self,
        req_ids: Sequence[int],
        logits: torch.Tensor | Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[Sequence[int]]],
        stream_ptr: int | None,
    ) -> None:
        with self._lock:
            rows = [(i, self._rows.get(int(k))) for i, k in enumerate(req_ids)]
        live = [(i, r) for i, r in rows if r is not None]
        if not live:
            return
        if len(live) > self._max_rows or len(req_ids) > self._max_rows:
            raise EngineError(f"{len(req_ids)} rows exceed the processor's {self._max_rows}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous call's copy has left the host buffer
        c = 0
        widest = 1
        stepped: list[tuple[int, _Row]] = []
        for i, r in live:
            beams = token_ids[i]
            history = beams[0] if len(beams) == 1 else ()
            n = len(history) - r.prompt_len - r.fed
            if r.error is None and len(beams) != 1:
                r.error = f"beam width {len(beams)} is not supported with a grammar (1 only)"
            elif r.error is None and n < 0:
                r.error = f"token history shrank ({len(history)} < {r.prompt_len + r.fed})"
            if r.error is not None or r.terminated:
                # The row has ended on the grammar side: only an end token is left.
                self._host_np[i] = self._end_row
                continue
            if n > self._tokens.shape[1]:
                # More than one new token (speculative or multi-token steps): grow once.
                grown = np.zeros((self._max_rows, max(n, 2 * self._tokens.shape[1])), dtype=np.int32)
                grown[:, : self._tokens.shape[1]] = self._tokens
                self._tokens = grown
            start = r.prompt_len + r.fed
            for k in range(n):
                self._tokens[c, k] = history[start + k]
            widest = max(widest, n)
            self._ids[c] = r.seq_id
            self._counts[c] = n
            r.fed += n
            stepped.append((i, r))
            c += 1
        t0 = time.perf_counter()
        out: MaskStep | None = None
        fault: str | None = None
        if c:
            try:
                out = self._provider.step(self._ids[:c], self._tokens[:c, :widest], self._counts[:c])
            except Exception as err:  # noqa: BLE001 -- every row of this call fails with it; the engine goes on
                _log.exception("MaskProvider.step failed; failing its %d constrained rows", c)
                fault = f"grammar step failed: {err}"
            else:
                fault = "MaskProvider.step returned None" if out is None else out.check(c, self._host_np.shape[1])
        t1 = time.perf_counter()
        for j, (i, r) in enumerate(stepped):
            dst = self._host_np[i]
            if fault is not None:
                r.error = fault
            elif out is not None:
                r.close_state = out.close_state(j)
                kind = out.row_kind(j)
                if kind == ROW_MASK:
                    dst[:] = out.bitmask[j]
                    continue
                if kind == ROW_STOP:
                    r.terminated = True
                elif kind == ROW_ERROR:
                    r.error = out.errors[j]
                else:  # never asked for: its sequences are started without value checks
                    r.error = "the grammar side dropped tokens, which a logits processor cannot take back"
            dst[:] = self._end_row
        masked = [i for i, _ in live]
        self._apply(logits, masked, len(req_ids), stream_ptr)
        self._calls += 1
        self._requests += 1 if c else 0
        self._masked += len(masked)
        self._grammar_s += t1 - t0
        self._apply_s += time.perf_counter() - t1

    def _fail_rows(self, req_ids: Sequence[int], logits: torch.Tensor | Sequence[torch.Tensor], error: str) -> None:
        """Mark every registered row of the call as failed and try to leave it only the end tokens."""
        rows = []
        with self._lock:
            for i, k in enumerate(req_ids):
                r = self._rows.get(int(k))
                if r is not None:
                    r.error = r.error or error
                    rows.append(i)
        if not rows or len(req_ids) > self._max_rows:
            return
        try:
            for i in rows:
                self._host_np[i] = self._end_row
            self._apply(logits, rows, len(req_ids), None)
        except Exception:  # noqa: BLE001 -- the rows are failed already; their requests end with the error
            _log.exception("grammar processor: the end-token mask could not be applied either")

    def _apply(
        self, logits: torch.Tensor | Sequence[torch.Tensor], rows: list[int], b: int, stream_ptr: int | None
    ) -> None:
        stream = None
        if self._copied is not None:
            # TensorRT-LLM queued the logits on its own stream: the copy and the
            # kernel go on that stream, so no host synchronisation is needed.
            stream = torch.cuda.ExternalStream(stream_ptr) if stream_ptr is not None else torch.cuda.current_stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dev = self._dev[:b]
            if self._copied is not None:
                dev.copy_(self._host[:b], non_blocking=True)
                self._copied.record()
            if isinstance(logits, torch.Tensor):
                xgrammar.apply_token_bitmask_inplace(logits, dev, vocab_size=self._vocab, indices=rows)
                if logits.shape[-1] > self._vocab:
                    for i in rows:
                        logits[i, self._vocab :] = -math.inf
                return
            for i in rows:
                row = logits[i]
                flat = row.view(-1, row.shape[-1])  # [beams (1), vocab]
                xgrammar.apply_token_bitmask_inplace(flat, dev[i : i + 1], vocab_size=self._vocab)
                if flat.shape[-1] > self._vocab:
                    # An engine may pad its logits past the vocabulary (TensorRT-LLM pads the
                    # LM head for tensor parallelism); the bitmask leaves those ids alone.
                    flat[:, self._vocab :] = -math.inf
