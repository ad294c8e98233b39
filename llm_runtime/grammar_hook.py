"""The grammar side of TensorRT-LLM's guided decoder: one grammar call per step for every constrained row.

TensorRT-LLM's PyTorch backend builds one token bitmask per step for all
guided rows in ``GuidedDecoder`` (``tensorrt_llm/_torch/pyexecutor/guided_decoder.py``):
``add_batch`` wraps the scheduled requests, ``execute(logits)`` calls
``build()`` -> ``_build(requests)`` on the host, copies ``bitmask_host`` and
``token_mask_host`` to the device on its own stream and masks the logits
there.  Its ``_build`` runs one xgrammar matcher per row, in a Python loop.
:class:`GrammarRows` is what :mod:`llm_runtime.trtllm_decoder` runs in its
place: it reads the same ``GuidedRequests`` and makes ONE
``MaskProvider.step`` for all constrained rows (the grammar channel to the
``grammar`` model), then writes the rows at TensorRT-LLM's offsets.  The
copy and the masking stay TensorRT-LLM's.

No ``tensorrt_llm`` import here: ``tests/unit/test_grammar_hook.py`` drives
this class in TensorRT-LLM's exact per-step order (overlap scheduler,
context chunks, pause and resume) with the real tiny torch model and the
real grammar engine.

What a ``GuidedRequests`` gives (TensorRT-LLM 1.2.x, read in
``guided_decoder.py``: ``GuidedRequest.from_llm_request``,
``require_matcher_init``, ``require_matcher_advance``,
``GuidedRequests.valid_requests_with_offsets``, ``num_bitmask_tokens``):

* ``valid_requests_with_offsets()`` yields each request that has guided
  params and a slot, with its bitmask row (its position in the scheduled
  batch, contexts first; a generation row is followed by its draft rows);
* ``require_matcher_init()``: the last context chunk (also when a paused
  request is scheduled again: its context is rebuilt from all its tokens);
* ``require_matcher_advance()``: a generation step; ``new_token`` is the
  token sampled at the previous step (with the overlap scheduler too:
  ``_executor_loop_overlap`` calls ``add_batch`` again after
  ``_update_requests`` of the previous batch);
* ``seq_slot`` is reused by later requests; a finished request is not
  scheduled again.

Which grammar sequence a row belongs to travels in the request itself: the
guide string of its ``GuidedDecodingParams`` (:meth:`GrammarRows.guide`), so no
TensorRT-LLM request id has to be bound to it, and TensorRT-LLM's pickling of
requests carries plain strings only.

A row the grammar side ended (stop accepted, or a row error) gets a mask that
allows only the end tokens, so TensorRT-LLM ends the request at this step; a
row error is also returned in ``_build``'s failure list (TensorRT-LLM 1.2
ends those requests with the error).  :meth:`GrammarRows.remove` returns the
row's outcome when the request finishes and ends its grammar sequence.

A request the engine ends before TensorRT-LLM does (a stop string, a stall,
an exception) is aborted, and TensorRT-LLM drops it only at a later
iteration (``_handle_canceled_requests``): the next one or two builds still
list it, under the overlap scheduler also from ``previous_batch``.  Removing
its row then would fail those builds' rows with "no grammar sequence", which
TensorRT-LLM turns into ``_handle_errors`` mid-iteration.  So the engine
:meth:`~GrammarRows.retire`-s the row instead: its outcome is read and its
grammar sequence ended at once, and until TensorRT-LLM's final output lets
the engine :meth:`~GrammarRows.remove` it, the row is written with the end
tokens only and never fails.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np

from grammar_backend.protocol import REASONING_STATES, CloseState, bitmask_width

from .errors import EngineError
from .mask import ROW_ERROR, ROW_MASK, ROW_STOP, ConstraintRequest, MaskProvider, MaskStep, StepRows

__all__ = ["GUIDE_PREFIX", "GrammarRows", "GuidedRequestView", "GuidedRequestsView", "RowOutcome", "RowsStats"]

_log = logging.getLogger(__name__)

#: The guide (a regex) a constrained request carries: the prefix, then the grammar sequence id.
#: A literal regex on purpose: were TensorRT-LLM's own matcher ever to run on it
#: (the decoder not installed), the output would be this literal, never an
#: unconstrained text that looks right.
GUIDE_PREFIX: Final = "constrained-llm-sequence-"
_GUIDE_RE: Final = re.compile(re.escape(GUIDE_PREFIX) + r"([1-9][0-9]{0,19})")


class _Guide(Protocol):
    @property
    def guide(self) -> str | None: ...


class GuidedRequestView(Protocol):
    """The fields of TensorRT-LLM's ``GuidedRequest`` that :meth:`GrammarRows.build` reads."""

    @property
    def guided_decoding_params(self) -> _Guide | None: ...
    @property
    def request_id(self) -> int | None: ...
    @property
    def seq_slot(self) -> int | None: ...
    @property
    def new_token(self) -> int | None: ...
    @property
    def is_draft(self) -> bool: ...
    @property
    def draft_tokens(self) -> Sequence[int] | None: ...
    def require_matcher_init(self) -> bool: ...
    def require_matcher_advance(self) -> bool: ...


class GuidedRequestsView(Protocol):
    """The part of TensorRT-LLM's ``GuidedRequests`` that :meth:`GrammarRows.build` reads."""

    @property
    def num_bitmask_tokens(self) -> int: ...
    def valid_requests_with_offsets(self) -> Iterator[tuple[GuidedRequestView, int]]: ...


@dataclass(frozen=True)
class RowOutcome:
    """What the grammar side said about a request, read when it finishes.

    Attributes
    ----------
    error : str or None
        The row's error (the request must end with ``"error"``).
    close_state : int
        The last :class:`grammar_backend.protocol.CloseState` of the row.
    terminated : bool
        The grammar accepted its stop token (only end tokens were left).
    reasoning_tokens : int or None
        Masks built for the row inside its thinking section (one per token
        TensorRT-LLM sampled there; None: never in one).
    reasoning_cut : bool
        One of them forced the end marker.
    """

    error: str | None
    close_state: int
    terminated: bool
    reasoning_tokens: int | None = None
    reasoning_cut: bool = False


@dataclass(frozen=True)
class RowsStats:
    """Counters of :class:`GrammarRows` since its creation.

    Attributes
    ----------
    builds : int
        ``build`` calls that had at least one constrained row.
    grammar_requests : int
        ``MaskProvider.step`` calls (one per such build: the batching contract).
    rows : int
        Rows written, summed over builds.
    grammar_s, build_s : float
        Seconds in ``MaskProvider.step``, and in the whole of ``build``.
    """

    builds: int
    grammar_requests: int
    rows: int
    grammar_s: float
    build_s: float


@dataclass(eq=False)
class _Row:
    seq_id: int
    stepped: bool = False  # a mask was computed: a sampled token is due at the next step
    error: str | None = None
    close_state: int = CloseState.OPEN
    terminated: bool = False
    reasoning_tokens: int | None = None
    reasoning_cut: bool = False
    retired: bool = False  # ended here, its grammar sequence too; TensorRT-LLM may still list it

    def outcome(self) -> RowOutcome:
        return RowOutcome(self.error, self.close_state, self.terminated, self.reasoning_tokens, self.reasoning_cut)


#: Fills the unused entries of the per-step row list (no allocation per step).
_NO_ROW: Final = _Row(0)


class GrammarRows:
    """Writes the bitmask rows of TensorRT-LLM's guided decoder with ONE grammar request per step.

    Parameters
    ----------
    provider : MaskProvider
        The grammar side (the grammar channel to the ``grammar`` model).
    vocab_size : int
        The tokenizer's vocabulary: the grammar side's rows are
        ``bitmask_width(vocab_size)`` words wide.
    end_token_ids : iterable of int
        The only tokens left to a row the grammar side ended.
    max_rows : int
        Most constrained rows of one step (the engine's batch size); the
        step buffers are preallocated for it.

    Notes
    -----
    Thread safety: :meth:`start` and :meth:`remove` run on the engine
    adapter's threads while :meth:`build` runs on TensorRT-LLM's executor
    thread.  A grammar ``end`` never overlaps a ``step``.
    """

    def __init__(self, provider: MaskProvider, *, vocab_size: int, end_token_ids: Iterable[int],
                 max_rows: int) -> None:
        ends = sorted({int(t) for t in end_token_ids})
        if not ends or ends[0] < 0 or ends[-1] >= vocab_size:
            raise EngineError(f"end_token_ids must be non-empty ids in [0, {vocab_size}), got {ends}")
        if max_rows < 1:
            raise EngineError(f"max_rows must be positive, got {max_rows}")
        self._provider = provider
        self._ends = ends
        self.width = bitmask_width(vocab_size)
        self._max_rows = max_rows
        # Reused every step: the grammar-step inputs and where each answer goes.
        self._ids = np.zeros(max_rows, dtype=np.uint64)
        self._tokens = np.zeros((max_rows, 1), dtype=np.int32)
        self._counts = np.zeros(max_rows, dtype=np.int32)
        self._offsets = np.zeros(max_rows, dtype=np.int64)
        self._request_ids = np.zeros(max_rows, dtype=np.int64)
        self._stepped: list[_Row] = [_NO_ROW] * max_rows
        self._end_row = np.zeros(0, dtype=np.int32)  # sized to the decoder's rows at the first build
        self._by_seq: dict[int, _Row] = {}
        self._by_slot: dict[int, _Row] = {}
        self._lock = threading.Lock()  # guards _by_seq
        self._step_lock = threading.Lock()  # build vs. the grammar end of remove()
        self._builds = 0
        self._requests = 0
        self._rows = 0
        self._grammar_s = 0.0
        self._build_s = 0.0

    def __reduce__(self) -> tuple[object, ...]:
        # It holds the grammar channel and lives in the executor's process; were
        # TensorRT-LLM ever to carry it to another process, fail with the reason.
        raise TypeError("GrammarRows lives in the llm model's process with the executor and cannot be pickled "
                        "(TLLM_WORKER_USE_SINGLE_PROCESS=1, tensor_parallel_size 1)")

    # -- membership -------------------------------------------------------------
    @staticmethod
    def guide(seq_id: int) -> str:
        """The ``GuidedDecodingParams(regex=...)`` guide that names grammar sequence ``seq_id``."""
        return f"{GUIDE_PREFIX}{seq_id}"

    def start(self, seq_id: int, constraint: ConstraintRequest) -> str:
        """Create the grammar sequence (blocking: may compile) and register it; returns its backend.

        Raises
        ------
        grammar_backend.errors.GrammarError
            From ``MaskProvider.start`` (bad constraint, compile failure, ...).
        EngineError
            If ``seq_id`` is not positive (a guide could not name it).

        A sequence id started twice is refused by the provider (the grammar side
        owns its sequences); nothing is registered then.
        """
        if seq_id < 1:
            raise EngineError(f"seq_id must be positive, got {seq_id}")
        backend = self._provider.start(seq_id, constraint)
        with self._lock:
            self._by_seq[seq_id] = _Row(seq_id)
        return backend

    def remove(self, seq_ids: Sequence[int]) -> list[RowOutcome | None]:
        """Forget requests TensorRT-LLM has finished and end their grammar sequences (one call).

        Returns each row's outcome, ``None`` for an unknown id.
        """
        with self._lock:
            rows = [self._by_seq.pop(s, None) for s in seq_ids]
        gone = {r.seq_id for r in rows if r is not None}
        if gone:
            with self._step_lock:
                for slot in [k for k, r in self._by_slot.items() if r.seq_id in gone]:
                    del self._by_slot[slot]
                ended = [r.seq_id for r in rows if r is not None and not r.retired]
                if ended:
                    self._provider.end(ended)
        return [None if r is None else r.outcome() for r in rows]

    def retire(self, seq_id: int) -> RowOutcome | None:
        """End a request's grammar sequence while TensorRT-LLM may still list it; returns its outcome.

        For a request the engine ended and aborted before TensorRT-LLM's final
        output for it: until :meth:`remove`, every build writes its row with the
        end tokens only and reports no failure (see the module docstring).
        ``None`` for an unknown id.
        """
        with self._lock:
            row = self._by_seq.get(seq_id)
        if row is None:
            return None
        with self._step_lock:
            if not row.retired:
                row.retired = True
                self._provider.end([seq_id])
        return row.outcome()

    @property
    def row_count(self) -> int:
        """Rows registered: constrained requests in flight, retired ones included until :meth:`remove`."""
        with self._lock:
            return len(self._by_seq)

    def outcome(self, seq_id: int) -> RowOutcome | None:
        """The row's state now (``None``: no such row)."""
        with self._lock:
            r = self._by_seq.get(seq_id)
        return None if r is None else r.outcome()

    def stats(self) -> RowsStats:
        """The counters (see :class:`RowsStats`)."""
        return RowsStats(self._builds, self._requests, self._rows, self._grammar_s, self._build_s)

    # -- the per-step call --------------------------------------------------------
    def build(self, requests: GuidedRequestsView, bitmask: np.ndarray, token_mask: np.ndarray) -> list[tuple[int, str]]:
        """Write the bitmask rows of one step, in place, with one grammar request.

        Parameters
        ----------
        requests : GuidedRequestsView
            TensorRT-LLM's ``GuidedRequests`` of this step.
        bitmask : numpy.ndarray
            int32 ``[rows, words]``: the decoder's ``bitmask_host`` (at least
            :attr:`width` words; the words past it are left 0, so ids past the
            tokenizer's vocabulary stay masked).
        token_mask : numpy.ndarray
            int32 ``[rows]``: the decoder's ``token_mask_host``; 1 where a row was written.

        Returns
        -------
        list of (int, str)
            ``(request_id, error)`` of every row that failed at this step.
            Never raises: an exception inside TensorRT-LLM's executor loop
            would fail the whole batch.
        """
        t0 = time.perf_counter()
        failed: list[tuple[int, str]] = []
        with self._step_lock:
            try:
                self._build(requests, bitmask, token_mask, failed)
            except Exception as err:  # noqa: BLE001 -- never into the executor loop: the rows fail instead
                _log.exception("grammar rows: the step failed; failing its rows")
                self._fail_all(requests, bitmask, token_mask, f"grammar step failed: {err}", failed)
        self._build_s += time.perf_counter() - t0
        return failed

    def _build(self, requests: GuidedRequestsView, bitmask: np.ndarray, token_mask: np.ndarray,
               failed: list[tuple[int, str]]) -> None:
        if bitmask.shape[1] < self.width:
            raise EngineError(f"bitmask_host has {bitmask.shape[1]} words per row, the vocabulary needs {self.width}")
        if self._end_row.shape[0] != bitmask.shape[1]:
            self._end_row = np.zeros(bitmask.shape[1], dtype=np.int32)
            for t in self._ends:
                self._end_row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        token_mask[: requests.num_bitmask_tokens] = 0
        c = 0
        for req, offset in requests.valid_requests_with_offsets():
            init = req.require_matcher_init()
            if not (init or req.require_matcher_advance()):
                continue  # an earlier context chunk: no mask yet
            slot = req.seq_slot
            if init:
                row = self._row_of_guide(req)
                if slot is not None and row is not None:
                    self._by_slot[slot] = row
                # A paused request scheduled again: the token sampled before it was paused is still due.
                feed = row is not None and row.stepped
            else:
                row = self._by_slot.get(slot) if slot is not None else None
                feed = True
            rid = -1 if req.request_id is None else int(req.request_id)
            if row is None:
                failed.append((rid, "no grammar sequence for this request"))
                self._write_end(bitmask, token_mask, offset)
                continue
            if row.retired:
                self._write_end(bitmask, token_mask, offset)  # its abort is on its way: no failure
                continue
            if row.error is None and (req.is_draft or req.draft_tokens):
                row.error = "speculative decoding is not supported with the grammar model's constraints"
                failed.append((rid, row.error))
            if row.error is not None or row.terminated:
                self._write_end(bitmask, token_mask, offset)
                continue
            if c == self._max_rows:
                raise EngineError(f"more than {self._max_rows} constrained rows in one step")
            token = req.new_token
            if feed and token is None:
                row.error = "the request has no sampled token to feed"
                failed.append((rid, row.error))
                self._write_end(bitmask, token_mask, offset)
                continue
            self._ids[c] = row.seq_id
            self._tokens[c, 0] = token if feed else 0
            self._counts[c] = 1 if feed else 0
            self._offsets[c] = offset
            self._stepped[c] = row
            self._request_ids[c] = rid
            c += 1
        if not c:
            return
        t0 = time.perf_counter()
        out: MaskStep | None = None
        rows: StepRows | None = None
        fault: str | None = None
        try:
            out = self._provider.step(self._ids[:c], self._tokens[:c], self._counts[:c])
        except Exception as err:  # noqa: BLE001 -- every row of this step fails with it; the engine goes on
            _log.exception("MaskProvider.step failed; failing its %d constrained rows", c)
            fault = f"grammar step failed: {err}"
        else:
            read = "MaskProvider.step returned None" if out is None else out.read(c, self.width)
            fault, rows = (read, None) if isinstance(read, str) else (None, read)
        self._grammar_s += time.perf_counter() - t0
        for j in range(c):
            row, offset, rid = self._stepped[j], int(self._offsets[j]), int(self._request_ids[j])
            self._stepped[j] = _NO_ROW
            row.stepped = True
            if rows is not None and out is not None:
                row.close_state = rows.close[j]
                if row.close_state in REASONING_STATES:
                    row.reasoning_tokens = (row.reasoning_tokens or 0) + 1
                    row.reasoning_cut = row.reasoning_cut or row.close_state == CloseState.REASONING_END
                kind = rows.kind[j]
                if kind == ROW_MASK:
                    bitmask[offset, : self.width] = out.bitmask[j]
                    token_mask[offset] = 1
                    continue
                if kind == ROW_STOP:
                    row.terminated = True
                elif kind == ROW_ERROR:
                    row.error = out.errors[j]
                else:  # never asked for: these sequences run without value checks
                    row.error = "the grammar side dropped tokens, which TensorRT-LLM's decoder cannot take back"
            else:
                row.error = fault
            if row.error is not None:
                failed.append((rid, row.error))
            self._write_end(bitmask, token_mask, offset)
        self._builds += 1
        self._requests += 1
        self._rows += c

    def _row_of_guide(self, req: GuidedRequestView) -> _Row | None:
        params = req.guided_decoding_params
        m = _GUIDE_RE.fullmatch((params.guide if params is not None else None) or "")
        if m is None:
            return None
        with self._lock:
            return self._by_seq.get(int(m.group(1)))

    def _write_end(self, bitmask: np.ndarray, token_mask: np.ndarray, offset: int) -> None:
        bitmask[offset] = self._end_row
        token_mask[offset] = 1

    def _fail_all(self, requests: GuidedRequestsView, bitmask: np.ndarray, token_mask: np.ndarray, error: str,
                  failed: list[tuple[int, str]]) -> None:
        """Fail every constrained row of the step and try to leave it only the end tokens."""
        failed.clear()
        try:
            for req, offset in requests.valid_requests_with_offsets():
                row = self._by_slot.get(req.seq_slot) if req.seq_slot is not None else None
                if row is None or not row.retired:  # a retired row's abort is on its way: never failed
                    if row is not None:
                        row.error = row.error or error
                    failed.append((-1 if req.request_id is None else int(req.request_id), error))
                if self._end_row.shape[0] == bitmask.shape[1]:
                    self._write_end(bitmask, token_mask, offset)
        except Exception:  # noqa: BLE001 -- the rows are failed already; their requests end with the error
            _log.exception("grammar rows: the end-token rows could not be written either")
