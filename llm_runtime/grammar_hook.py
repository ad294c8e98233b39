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
  batch, contexts first; a generation row is followed by
  ``max_num_draft_tokens`` rows for its drafts, a context or draft-model row
  has one);
* ``require_matcher_init()``: the last context chunk (also when a paused
  request is scheduled again: its context is rebuilt from all its tokens);
* ``require_matcher_advance()``: a generation step; ``new_token`` is the
  token sampled at the previous step (with the overlap scheduler too:
  ``_executor_loop_overlap`` calls ``add_batch`` again after
  ``_update_requests`` of the previous batch);
* ``seq_slot`` is reused by later requests; a finished request is not
  scheduled again.

Speculative decoding (issue 50 part 2): what TensorRT-LLM 1.2.1 does
--------------------------------------------------------------------
Read with the project's search tool (the 1.2.1 tag itself is not stored
there; each file's versions around it agree on all of this):
``tensorrt_llm/_torch/pyexecutor/guided_decoder.py`` at 07dacbbc and 40bb912b,
and its newest stored version (``_build`` returning the failed requests, PR
9078); ``pyexecutor/py_executor.py``, ``pyexecutor/py_executor_creator.py``,
``pyexecutor/sampler.py``, ``speculative/model_drafter.py`` and
``speculative/interface.py`` as stored around 1.2 (the index names no commit
for those versions: they are the ones whose ``create_py_executor`` passes
``max_num_draft_tokens=spec_config.max_total_draft_tokens`` and whose
``SpeculativeDecodingMode`` runs MTP .. SAVE_HIDDEN_STATES).

* ``GuidedRequest`` also carries ``is_draft`` (a request of the draft model,
  its ``seq_slot`` the target's), ``draft_tokens`` (``py_draft_tokens``,
  padded with 0 to the layout by ``pad_draft_tokens_for_cuda_graph``) and
  ``num_accepted_draft_tokens`` (``py_num_accepted_draft_tokens``: how many
  of the previous step's drafts the target accepted).  TorchSampler sets the
  latter only for a step that had drafts and did not stop at its first token
  (``update_requests``), so after a step without drafts it is an older step's.
* TensorRT-LLM's own ``_build`` accepts ``new_token`` and fills row
  ``offset``, then accepts each draft and fills ``offset + i`` until a draft
  the matcher refuses or one that ends it; those drafts stay accepted.
  ``_rollback_rejected_tokens`` (after the verification, before the next
  drafting loop) rolls back all but ``1 + num_accepted_draft_tokens`` of them;
  the draft model's builds (``ModelDrafter``: the same decoder, a request
  per target request with ``is_draft``, ``new_token`` the target's last token
  at the first draft step, then the previous draft) advance the matcher and
  ``_rollback_draft_tokens`` undoes them before the target's build.
* ``_executor_loop``: ``add_batch`` -> ``rollback_rejected_tokens`` ->
  ``drafter.prepare_draft_tokens`` (the draft model's builds) -> pad ->
  ``add_batch`` -> ``rollback_draft_tokens`` -> forward -> ``execute``
  (the target's build) -> sample.  ``_executor_loop_overlap`` with a draft
  model (``_handle_speculative_decoding``): ``_update_requests`` of the
  previous batch -> ``generate_draft_tokens_with_overlap`` (the draft
  model's builds) -> forward -> ``_process_draft_results`` (``add_batch``,
  ``rollback_draft_tokens``) -> ``add_batch`` -> ``execute``: it never calls
  ``rollback_rejected_tokens``.
* ``create_py_executor`` builds ``GuidedDecoder`` for no speculation and the
  modes with a drafter (EAGLE3, DRAFT_TARGET, MTP_EAGLE, NGRAM,
  USER_PROVIDED, SAVE_HIDDEN_STATES), and ``CapturableGuidedDecoder`` for the
  one-model modes (MTP, MTP_EAGLE_ONE_MODEL, EAGLE3_ONE_MODEL), handed to the
  model engine (below, and :mod:`llm_runtime.trtllm_decoder`).

What :class:`GrammarRows` does with them.  The grammar side never keeps a
draft: the tokens the target accepted are committed at the next build, as
one multi-token commit (``counts[i] > 1``), and the drafts are sent as
``MaskProvider.step``'s ``drafts``:

* a target row commits the tokens due (the drafts it sent last time that
  TensorRT-LLM accepted, then ``new_token``), sends its drafts (up to the
  layout), and writes row ``offset`` and rows ``offset + 1 ..`` from
  ``draft_bitmask`` for the drafts that hold (``draft_valid``), token_mask 1;
  the rows past them stay token_mask 0, as TensorRT-LLM leaves them: the
  target cannot accept the draft before them, so they are never sampled;
* ``_rollback_rejected_tokens`` is where TensorRT-LLM says, before its draft
  model's builds, how many drafts it accepted (:meth:`GrammarRows.accepted`);
* a draft-model row: the first draft build of an iteration commits the tokens
  due (the target's build then commits none, and checks that its
  ``new_token`` is the one fed); each later one asks for the mask after the
  drafts so far, never committing them.  Where TensorRT-LLM did not say how
  many drafts it accepted (its overlap loop), or the row cannot be known, the
  draft row is left unmasked (token_mask 0): drafts are proposals, the
  target's rows alone decide what is accepted;
* a row is never written all-zero (TensorRT-LLM issue 18896: an all-zero mask
  turns the logits into NaN): the grammar side's rows past the valid drafts
  are all ones, and those are not written here anyway.

One-model speculative modes (:meth:`GrammarRows.serve_one_model`)
------------------------------------------------------------------
``CapturableGuidedDecoder`` (same file, 07dacbbc and 40bb912b; the
speculative workers ``speculative/eagle3.py`` ``Eagle3OneModelWorker`` and
``speculative/mtp.py`` ``MTPWorker``, ``speculative/interface.py``, and
``pyexecutor/model_engine.py`` as stored around 1.2) runs its host work as
CUDA host functions on its own stream, inside the model's forward (captured
in its CUDA graph for generation-only batches): the target build
(``fetch_batch``, ``init_disagg_gen_requests``, ``build``), overlapping the
target forward, then one build per draft step (``fetch_draft_batch(i)``,
at step 0 ``rollback_rejected_tokens``, ``build``, at the last step
``rollback_draft_tokens``), each after the draft token before it was sampled
on the GPU.  Here:

* the target build is ONE grammar request for every target row, its drafts
  included (``fetch_batch`` sets ``new_token, *draft_tokens`` from the
  pinned ``new_tokens[:, slot]`` under the overlap scheduler, the request's
  own fields without it);
* the draft steps make no grammar request and leave their rows unmasked
  (token_mask 0): masking them would put D more blocking round trips in
  sequence on the GPU's critical path every iteration, none of them hidden
  behind a forward as the target build is.  The drafts are proposals: the
  masked target rejects a draft the grammar forbids, so the outputs are
  those without speculation, at some acceptance cost (TensorRT-LLM's tech
  blog 12, "Combining Guided Decoding and Speculative Decoding", Table 1:
  acceptance length 2.86 -> 2.65 on JSON Mode Eval and 2.55 -> 2.33 on
  JSON Schema Bench for EAGLE3 with 3 drafts, drafts masked -> not);
* the accepted count: ``fetch_draft_batch(0)`` sets each request's
  ``num_accepted_draft_tokens`` to ``min(num_accepted_tokens[i],
  num_advanced_tokens[slot]) - 1`` (the verification's count, from pinned
  memory) and casts it to draft; the step-0 ``_rollback_rejected_tokens``
  that follows hands those requests to :meth:`GrammarRows.record_accepted`,
  and the next target build commits with that count, never with the
  request's (an iteration older under the overlap scheduler).  The target
  build sets ``num_advanced_tokens[slot]`` to what TensorRT-LLM's own
  matcher would have advanced (``build(advanced=...)``), so its clamp still
  stops the count after an end token among the drafts; tokens after an
  accepted end token are never committed;
* the builds run on a CUDA driver thread, where an exception is only
  printed and the graph goes on: nothing raises, a failed row is written
  with the end tokens only (the request ends at this step; the engine reads
  the row's error when TensorRT-LLM's final output comes), and the grammar
  request goes over the channel only, never BLS (:meth:`GrammarRows._channel_step`).

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
from dataclasses import dataclass, field
from typing import Final, Protocol

import numpy as np

from contract import MAX_DRAFT_TOKENS
from grammar_backend.protocol import REASONING_STATES, CloseState, bitmask_width

from .errors import EngineError
from .mask import ROW_ERROR, ROW_MASK, ROW_STOP, ConstraintRequest, MaskProvider, MaskStep, StepRows, StepSender

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
    @property
    def num_accepted_draft_tokens(self) -> int | None: ...
    def require_matcher_init(self) -> bool: ...
    def require_matcher_advance(self) -> bool: ...


class GuidedRequestsView(Protocol):
    """The part of TensorRT-LLM's ``GuidedRequests`` that :meth:`GrammarRows.build` reads."""

    @property
    def num_bitmask_tokens(self) -> int: ...
    @property
    def max_num_draft_tokens(self) -> int: ...
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


#: No drafts (a row made before :meth:`GrammarRows.reserve_drafts`, the unused step entries).
_NO_DRAFTS: Final = np.zeros(0, dtype=np.int32)


@dataclass(eq=False)
class _Row:
    seq_id: int
    stepped: bool = False  # a mask was computed: a sampled token is due at the next step
    error: str | None = None
    reported: bool = False  # the error went out in a target build's failure list (a draft build's does not)
    close_state: int = CloseState.OPEN
    terminated: bool = False
    reasoning_tokens: int | None = None
    reasoning_cut: bool = False
    retired: bool = False  # ended here, its grammar sequence too; TensorRT-LLM may still list it
    # Speculative decoding (the module docstring): the drafts its last target build sent, never kept by
    # the grammar side; how many of them TensorRT-LLM accepted, as _rollback_rejected_tokens said before
    # this iteration's draft builds (-1: not said); the new token a draft build committed with them
    # (-1: none yet this iteration); the tokens the draft model proposed so far this iteration.
    drafts: np.ndarray = field(default_factory=lambda: _NO_DRAFTS)  # the shared empty one: never written
    n_drafts: int = 0
    accepted: int = -1
    told: bool = False  # one-model: ``accepted`` was recorded at the last draft step 0 (record_accepted)
    fed: int = -1
    chain: np.ndarray = field(default_factory=lambda: _NO_DRAFTS)
    chain_len: int = 0
    # The close state of the position after each of those drafts that holds (the answer's draft_closing):
    # where the target sampled the token after each accepted draft.
    closes: np.ndarray = field(default_factory=lambda: _NO_DRAFTS)

    def outcome(self) -> RowOutcome:
        return RowOutcome(self.error, self.close_state, self.terminated, self.reasoning_tokens, self.reasoning_cut)


#: Fills the unused entries of the per-step row list (no allocation per step).
_NO_ROW: Final = _Row(0)

#: What a step entry is: a target row (its due tokens and its drafts); the first draft-model build of an
#: iteration (commits the due tokens); a later draft-model build (the mask after the drafts so far).
_TARGET, _COMMIT, _CHAIN = 0, 1, 2


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
    max_draft_tokens : int
        Most draft tokens a row carries (TensorRT-LLM's
        ``max_num_draft_tokens``; 0: no speculative decoding).  The decoder,
        which learns it from TensorRT-LLM, calls :meth:`reserve_drafts`.

    Notes
    -----
    Thread safety: :meth:`start` and :meth:`remove` run on the engine
    adapter's threads while :meth:`build` and :meth:`accepted` run on
    TensorRT-LLM's executor thread (one-model: :meth:`build` and
    :meth:`record_accepted` on a CUDA driver thread, in host functions).  A
    grammar ``end`` never overlaps a ``step``; no lock here is held while
    waiting on the GPU.
    """

    def __init__(self, provider: MaskProvider, *, vocab_size: int, end_token_ids: Iterable[int],
                 max_rows: int, max_draft_tokens: int = 0) -> None:
        ends = sorted({int(t) for t in end_token_ids})
        if not ends or ends[0] < 0 or ends[-1] >= vocab_size:
            raise EngineError(f"end_token_ids must be non-empty ids in [0, {vocab_size}), got {ends}")
        if max_rows < 1:
            raise EngineError(f"max_rows must be positive, got {max_rows}")
        self._provider = provider
        self._ends = ends
        self._end_set = frozenset(ends)
        self.width = bitmask_width(vocab_size)
        self._max_rows = max_rows
        # Reused every step: the grammar-step inputs and where each answer goes.
        self._ids = np.zeros(max_rows, dtype=np.uint64)
        self._counts = np.zeros(max_rows, dtype=np.int32)
        self._offsets = np.zeros(max_rows, dtype=np.int64)
        self._request_ids = np.zeros(max_rows, dtype=np.int64)
        self._slots = np.zeros(max_rows, dtype=np.int64)
        self._stepped: list[_Row] = [_NO_ROW] * max_rows
        self._kinds = [_TARGET] * max_rows
        self._max_draft = 0
        self._tokens = np.zeros((max_rows, 1), dtype=np.int32)
        self._drafts = np.zeros((max_rows, 1), dtype=np.int32)
        self._draft_counts = np.zeros(max_rows, dtype=np.int32)
        self._end_row = np.zeros(0, dtype=np.int32)  # sized to the decoder's rows at the first build
        self._by_seq: dict[int, _Row] = {}
        self._by_slot: dict[int, _Row] = {}
        self._lock = threading.Lock()  # guards _by_seq
        self._step_lock = threading.Lock()  # build vs. the grammar end of remove()
        self._one_model = False  # serve_one_model: builds run in CUDA host functions
        self._builds = 0
        self._requests = 0
        self._rows = 0
        self._grammar_s = 0.0
        self._build_s = 0.0
        self.reserve_drafts(max_draft_tokens)

    def reserve_drafts(self, max_draft_tokens: int) -> None:
        """Size the step buffers (and every row's) for ``max_draft_tokens`` drafts a row; once, before steps.

        Raises
        ------
        EngineError
            Outside ``0..contract.MAX_DRAFT_TOKENS`` (the most a grammar step answers).
        """
        if not 0 <= max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise EngineError(f"max_draft_tokens must be within 0..{MAX_DRAFT_TOKENS} (the most draft tokens a "
                              f"grammar step answers), got {max_draft_tokens}")
        with self._step_lock:
            self._max_draft = max_draft_tokens
            # The tokens a step commits: the accepted drafts, then the new token.
            self._tokens = np.zeros((self._max_rows, 1 + max_draft_tokens), dtype=np.int32)
            self._drafts = np.zeros((self._max_rows, max(1, max_draft_tokens)), dtype=np.int32)
            with self._lock:
                for row in self._by_seq.values():
                    row.drafts, row.chain, row.closes = self._row_buffers()

    def serve_one_model(self) -> None:
        """Serve TensorRT-LLM's one-model speculative modes: the builds run in CUDA host functions.

        Called once, before any step, by :class:`llm_runtime.trtllm_decoder.GrammarCapturableDecoder`.
        From then on (see "One-model speculative modes" in the module
        docstring): :meth:`build` takes each target row's accepted-draft
        count from :meth:`record_accepted`, never from the request; skips the
        rows cast to draft (no grammar request for a draft step); and steps
        only over the grammar channel, never over BLS.  :meth:`start` opens
        the channel where it is not open yet (its thread is no host function).
        """
        self._one_model = True

    def _row_buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A row's draft buffers, made when it starts (never per step)."""
        if not self._max_draft:
            return _NO_DRAFTS, _NO_DRAFTS, _NO_DRAFTS
        return (np.zeros(self._max_draft, dtype=np.int32), np.zeros(self._max_draft, dtype=np.int32),
                np.zeros(self._max_draft, dtype=np.int32))

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
        if self._one_model:
            self._open_channel(seq_id)
        drafts, chain, closes = self._row_buffers()
        with self._lock:
            self._by_seq[seq_id] = _Row(seq_id, drafts=drafts, chain=chain, closes=closes)
        return backend

    def _open_channel(self, seq_id: int) -> None:
        """Open the provider's grammar channel here, on a start thread, where a one-model build cannot.

        ``RemoteMaskProvider`` opens its mask buffer at its first step (over
        BLS: the answer gives the width) and its step channel at the next
        one.  A one-model build never goes over BLS (:meth:`_channel_step`),
        so those first steps are made here: steps of no token on the new
        sequence, which commit nothing (its first build asks for the same mask
        again).  Never raises: where the channel stays closed, the builds fail
        their rows with the reason.
        """
        ids = np.array([seq_id], dtype=np.uint64)
        for _ in range(2):
            if getattr(self._provider, "channel_open", True):
                return
            try:
                with self._step_lock:
                    self._provider.step(ids, np.zeros((1, 1), dtype=np.int32), np.zeros(1, dtype=np.int32))
            except Exception:  # noqa: BLE001 -- the start succeeded; its builds fail the row with the reason
                _log.exception("grammar rows: opening the grammar channel failed")
                return

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

    # -- the per-step calls --------------------------------------------------------
    def accepted(self, requests: GuidedRequestsView) -> None:
        """TensorRT-LLM verified the last step's drafts: note how many each row's target accepted.

        What ``GuidedDecoder._rollback_rejected_tokens`` is called with (the
        target's requests, after ``_update_requests``, before the draft
        model's builds of the iteration): the first of those builds commits
        these drafts and the new token.  Never raises (TensorRT-LLM's executor
        loop); a count that does not fit is left for the target's build, which
        fails the row with it.
        """
        with self._step_lock:
            try:
                for req, _ in requests.valid_requests_with_offsets():
                    if req.is_draft or not req.require_matcher_advance() or req.seq_slot is None:
                        continue
                    row = self._by_slot.get(req.seq_slot)
                    if row is not None:
                        k = self._accepted_of(row, req)
                        row.accepted = k if isinstance(k, int) else -1
            except Exception:  # noqa: BLE001 -- never into the executor loop: the draft rows stay unmasked
                _log.exception("grammar rows: reading the accepted drafts failed")

    def record_accepted(self, requests: GuidedRequestsView) -> None:
        """One-model speculation: note how many drafts each row's target accepted, for its next target build.

        What ``CapturableGuidedDecoder._rollback_rejected_tokens`` is called
        with at draft step 0: the iteration's requests, cast to draft by
        ``fetch_draft_batch(0)``, whose ``num_accepted_draft_tokens`` it has
        just set from the verification's count (the pinned
        ``num_accepted_tokens``, clamped to ``num_advanced_tokens - 1``).  It
        is the only fresh count: under the overlap scheduler the request's own
        is an iteration older.  Set, never added: safe to run again on the
        same batch (CUDA graph warmup).  Never raises; a count that does not
        fit fails the row at its next target build.
        """
        with self._step_lock:
            try:
                for req, _ in requests.valid_requests_with_offsets():
                    if not req.is_draft or not req.require_matcher_advance() or req.seq_slot is None:
                        continue
                    row = self._by_slot.get(req.seq_slot)
                    if row is not None:
                        k = req.num_accepted_draft_tokens
                        row.accepted = k if isinstance(k, int) else -1
                        row.told = True
            except Exception:  # noqa: BLE001 -- in a host function: the rows fail at their next target build
                _log.exception("grammar rows: reading the accepted drafts failed")

    def build(self, requests: GuidedRequestsView, bitmask: np.ndarray, token_mask: np.ndarray,
              advanced: list[int] | None = None) -> list[tuple[int, str]]:
        """Write the bitmask rows of one step, in place, with one grammar request.

        Parameters
        ----------
        requests : GuidedRequestsView
            TensorRT-LLM's ``GuidedRequests`` of this step: the target's, or
            (``is_draft``) the draft model's.
        bitmask : numpy.ndarray
            int32 ``[rows, words]``: the decoder's ``bitmask_host`` (at least
            :attr:`width` words; the words past it are left 0, so ids past the
            tokenizer's vocabulary stay masked).
        token_mask : numpy.ndarray
            int32 ``[rows]``: the decoder's ``token_mask_host``; 1 where a row was written.
        advanced : list of int, optional
            The capturable decoder's ``num_advanced_tokens`` (by slot): set
            for every target row to 1 + the drafts its grammar holds (0 for a
            row written with the end tokens or not at all), so that
            TensorRT-LLM's clamp in ``fetch_draft_batch`` bounds the accepted
            count by them.

        Returns
        -------
        list of (int, str)
            ``(request_id, error)`` of every row that failed at this step
            (a draft-model build's failures wait for the target's build: its
            caller drops them).  Never raises: an exception inside
            TensorRT-LLM's executor loop would fail the whole batch.
        """
        t0 = time.perf_counter()
        failed: list[tuple[int, str]] = []
        with self._step_lock:
            try:
                self._build(requests, bitmask, token_mask, failed, advanced)
            except Exception as err:  # noqa: BLE001 -- never into the executor loop: the rows fail instead
                _log.exception("grammar rows: the step failed; failing its rows")
                self._fail_all(requests, bitmask, token_mask, f"grammar step failed: {err}", failed)
                if advanced is not None:
                    self._no_advance(requests, advanced)
        self._build_s += time.perf_counter() - t0
        return failed

    def _build(self, requests: GuidedRequestsView, bitmask: np.ndarray, token_mask: np.ndarray,
               failed: list[tuple[int, str]], advanced: list[int] | None) -> None:
        if bitmask.shape[1] < self.width:
            raise EngineError(f"bitmask_host has {bitmask.shape[1]} words per row, the vocabulary needs {self.width}")
        if self._end_row.shape[0] != bitmask.shape[1]:
            self._end_row = np.zeros(bitmask.shape[1], dtype=np.int32)
            for t in self._ends:
                self._end_row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        layout = int(requests.max_num_draft_tokens)
        if layout > self._max_draft:
            raise EngineError(f"TensorRT-LLM lays out {layout} draft rows a request, the grammar rows hold "
                              f"{self._max_draft} (GrammarRows.reserve_drafts)")
        token_mask[: requests.num_bitmask_tokens] = 0
        if advanced is not None:
            self._no_advance(requests, advanced)
        c = 0
        widest = 0  # the most drafts an entry of this step sends
        for req, offset in requests.valid_requests_with_offsets():
            if c == self._max_rows:
                raise EngineError(f"more than {self._max_rows} constrained rows in one step")
            if req.is_draft and self._one_model:
                continue  # a one-model draft step: no grammar request, the row stays unmasked (module docstring)
            sent = (self._add_draft_model(req, c) if req.is_draft
                    else self._add_target(req, offset, c, layout, bitmask, token_mask, failed))
            if sent < 0:
                continue  # no grammar work for this row
            self._slots[c] = -1 if req.seq_slot is None else int(req.seq_slot)
            self._offsets[c] = offset
            self._request_ids[c] = -1 if req.request_id is None else int(req.request_id)
            widest = max(widest, sent)
            c += 1
        if not c:
            return
        t0 = time.perf_counter()
        out: MaskStep | None = None
        rows: StepRows | None = None
        fault: str | None = None
        valid: list[int] = []
        try:
            step = self._channel_step if self._one_model else self._provider.step
            if widest:
                out = step(self._ids[:c], self._tokens[:c], self._counts[:c],
                           drafts=self._drafts[:c, :widest], draft_counts=self._draft_counts[:c])
            else:
                out = step(self._ids[:c], self._tokens[:c], self._counts[:c])
        except Exception as err:  # noqa: BLE001 -- every row of this step fails with it; the engine goes on
            _log.exception("MaskProvider.step failed; failing its %d constrained rows", c)
            fault = f"grammar step failed: {err}"
        else:
            read = "MaskProvider.step returned None" if out is None else out.read(c, self.width)
            fault, rows = (read, None) if isinstance(read, str) else (None, read)
            if rows is not None and out is not None and widest:
                drafts_read = self._read_drafts(out, c, widest)
                fault, valid = (drafts_read, []) if isinstance(drafts_read, str) else (None, drafts_read)
                rows = None if fault is not None else rows
        self._grammar_s += time.perf_counter() - t0
        answer = out if rows is not None else None
        for j in range(c):
            row, offset = self._stepped[j], int(self._offsets[j])
            self._stepped[j] = _NO_ROW
            kind = self._kinds[j]
            if kind == _TARGET:
                self._write_target(j, row, offset, rows, answer, valid, fault, bitmask, token_mask, failed)
                if advanced is not None:
                    self._advance(j, row, offset, valid, bitmask, token_mask, advanced)
            elif kind == _COMMIT:
                self._write_commit(j, row, offset, rows, answer, fault, bitmask, token_mask)
            else:
                self._write_chain(j, row, offset, rows, answer, valid, bitmask, token_mask)
        self._builds += 1
        self._requests += 1
        self._rows += c

    def _add_target(self, req: GuidedRequestView, offset: int, c: int, layout: int, bitmask: np.ndarray,
                    token_mask: np.ndarray, failed: list[tuple[int, str]]) -> int:
        """Step entry ``c`` for a target row: its due tokens and its drafts; the drafts sent (-1: no entry)."""
        init = req.require_matcher_init()
        if not (init or req.require_matcher_advance()):
            return -1  # an earlier context chunk: no mask yet
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
            return -1
        if row.retired:
            self._write_end(bitmask, token_mask, offset)  # its abort is on its way: no failure
            return -1
        if row.error is None and row.terminated:
            self._write_end(bitmask, token_mask, offset)
            return -1
        count = 0
        if row.error is None and feed:
            token = req.new_token
            if token is None:
                row.error = "the request has no sampled token to feed"
            elif row.fed >= 0:
                # This iteration's first draft build committed the due tokens, this new token last.
                if token != row.fed:
                    row.error = f"the new token {token} is not the {row.fed} the draft model's build fed"
            else:
                k = self._recorded_of(row) if self._one_model else self._accepted_of(row, req)
                if isinstance(k, str):
                    row.error = k
                else:
                    end = self._first_end(row.drafts[:k])
                    if end >= 0:
                        # TensorRT-LLM ended the request at an end token among the accepted drafts (one-model:
                        # the GPU's count runs past it, the clamp stops right after it): nothing after it is
                        # committed, and the grammar answers the stop (the row ends without an error).
                        self._tokens[c, : end + 1] = row.drafts[: end + 1]
                        count = end + 1
                        self._count_reasoning(row, end)
                    else:
                        self._tokens[c, :k] = row.drafts[:k]
                        self._tokens[c, k] = token
                        count = k + 1
                        self._count_reasoning(row, k)
        if row.error is not None:
            if not row.reported:
                row.reported = True
                failed.append((rid, row.error))
            self._write_end(bitmask, token_mask, offset)
            return -1
        sent = 0
        drafts = req.draft_tokens
        # TensorRT-LLM lays out draft rows after a generation row only (a context row has one); the drafts
        # past the layout would land in the next request's rows (07dacbbc's own _build does not bound them).
        if drafts and not init:
            sent = min(len(drafts), layout)
            # TensorRT-LLM pads them to the layout (pad_draft_tokens_for_cuda_graph): no slice to copy then.
            self._drafts[c, :sent] = drafts if len(drafts) == sent else drafts[:sent]
        self._draft_counts[c] = sent
        self._ids[c] = row.seq_id
        self._counts[c] = count
        self._stepped[c] = row
        self._kinds[c] = _TARGET
        return sent

    def _add_draft_model(self, req: GuidedRequestView, c: int) -> int:
        """Step entry ``c`` for a draft-model row; the drafts sent (-1: the row stays unmasked)."""
        if not req.require_matcher_advance():
            return -1
        # By its guide, not its slot: the draft request of a target still in its context chunks has the
        # target's slot before the target's first build made it this row's.
        row = self._row_of_guide(req)
        if row is None:
            return -1
        first = row.fed < 0
        # The iteration's first draft build commits (its new token is the target's last one, after the drafts
        # the target accepted); the later ones chain on it. Told by _rollback_rejected_tokens, once: unknown in
        # TensorRT-LLM's overlap loop, which never calls it, and the draft rows then stay unmasked.
        k = row.accepted
        if first:
            row.accepted = -1  # said once an iteration: a later draft build must never commit again
        if (row.retired or row.error is not None or row.terminated or not row.stepped or req.new_token is None
                or (first and k < 0)):
            return -1
        token = int(req.new_token)
        if first:
            self._tokens[c, :k] = row.drafts[:k]
            self._tokens[c, k] = token
            self._counts[c] = k + 1
            sent = 0
            self._kinds[c] = _COMMIT
        else:
            # A later draft build: the new token is the draft sampled at the one before; nothing is committed.
            sent = row.chain_len + 1
            if sent > self._max_draft:
                return -1
            row.chain[sent - 1] = token
            row.chain_len = sent
            self._drafts[c, :sent] = row.chain[:sent]
            self._counts[c] = 0
            self._kinds[c] = _CHAIN
        self._draft_counts[c] = sent
        self._ids[c] = row.seq_id
        self._stepped[c] = row
        return sent

    def _read_drafts(self, out: MaskStep, rows: int, widest: int) -> list[int] | str:
        """Each row's ``draft_valid`` (checked with the draft masks' shape), or why the answer does not fit."""
        dv, db = out.draft_valid, out.draft_bitmask
        if not isinstance(db, np.ndarray) or db.dtype != np.int32 or db.shape != (widest, rows, self.width):
            return (f"draft_bitmask must be int32 [{widest}, {rows}, {self.width}], got "
                    f"{getattr(db, 'dtype', type(db))} {getattr(db, 'shape', '')}")
        if not isinstance(dv, np.ndarray) or dv.shape != (rows,):
            return f"draft_valid must be int32 [{rows}]"
        valid: list[int] = dv.tolist()
        for j in range(rows):
            if not 0 <= valid[j] <= self._draft_counts[j]:
                return f"draft_valid[{j}] is {valid[j]}, outside 0..{int(self._draft_counts[j])}"
        return valid

    def _write_target(self, j: int, row: _Row, offset: int, rows: StepRows | None, out: MaskStep | None,
                      valid: list[int], fault: str | None, bitmask: np.ndarray, token_mask: np.ndarray,
                      failed: list[tuple[int, str]]) -> None:
        """A target row's answer: row ``offset`` and the rows of the drafts that hold, or the end tokens."""
        row.stepped = True
        row.fed, row.accepted, row.chain_len, row.told = -1, -1, 0, False
        sent = int(self._draft_counts[j])
        row.n_drafts = sent
        if sent:
            row.drafts[:sent] = self._drafts[j, :sent]
        if rows is not None and out is not None:
            row.close_state = rows.close[j]
            if row.close_state in REASONING_STATES:
                row.reasoning_tokens = (row.reasoning_tokens or 0) + 1
                row.reasoning_cut = row.reasoning_cut or row.close_state == CloseState.REASONING_END
            kind = rows.kind[j]
            if kind == ROW_MASK:
                bitmask[offset, : self.width] = out.bitmask[j]
                token_mask[offset] = 1
                if sent and out.draft_bitmask is not None:
                    # Row offset + 1 + i is the position after draft i. Past the drafts that hold, the rows stay
                    # token_mask 0 as TensorRT-LLM leaves them: the target cannot accept the draft before them.
                    held = valid[j]
                    bitmask[offset + 1: offset + 1 + held, : self.width] = out.draft_bitmask[:held, j]
                    token_mask[offset + 1: offset + 1 + held] = 1
                    if out.draft_closing is not None:
                        row.closes[:held] = out.draft_closing[j, :held]
                return
            if kind == ROW_STOP:
                row.terminated = True
            elif kind == ROW_ERROR:
                row.error = out.errors[j]
            else:  # never asked for: these sequences run without value checks
                row.error = "the grammar side dropped tokens, which TensorRT-LLM's decoder cannot take back"
        else:
            row.error = fault
        if row.error is not None:
            row.reported = True
            failed.append((int(self._request_ids[j]), row.error))
        self._write_end(bitmask, token_mask, offset)

    def _write_commit(self, j: int, row: _Row, offset: int, rows: StepRows | None, out: MaskStep | None,
                      fault: str | None, bitmask: np.ndarray, token_mask: np.ndarray) -> None:
        """The first draft build's answer: the due tokens are committed; the draft row is the next mask."""
        count = int(self._counts[j])
        k = count - 1
        if rows is None or out is None:
            # Whether the grammar side took the due tokens is unknown: the target's build fails the row.
            row.error = fault
            return
        self._count_reasoning(row, k)
        row.n_drafts = 0
        kind = rows.kind[j]
        if kind == ROW_MASK:
            row.fed = int(self._tokens[j, k])
            bitmask[offset, : self.width] = out.bitmask[j]
            token_mask[offset] = 1
        elif kind == ROW_STOP:
            row.terminated = True
        elif kind == ROW_ERROR:
            row.error = out.errors[j]
        else:
            row.error = "the grammar side dropped tokens, which TensorRT-LLM's decoder cannot take back"

    def _write_chain(self, j: int, row: _Row, offset: int, rows: StepRows | None, out: MaskStep | None,
                     valid: list[int], bitmask: np.ndarray, token_mask: np.ndarray) -> None:
        """A later draft build's answer: the mask after the drafts so far, if they all hold."""
        if rows is None or out is None or out.draft_bitmask is None:
            return  # nothing was committed: the draft row stays unmasked
        kind = rows.kind[j]
        if kind == ROW_ERROR:
            row.error = out.errors[j]  # the grammar side's verdict on the row (its matcher failed)
            return
        sent = int(self._draft_counts[j])
        if kind == ROW_MASK and valid[j] == sent:
            bitmask[offset, : self.width] = out.draft_bitmask[sent - 1, j]
            token_mask[offset] = 1
        # Otherwise a draft so far is one the grammar refuses (the target will reject it) or ends it: unmasked,
        # as TensorRT-LLM's is_draft_terminated leaves it.

    def _accepted_of(self, row: _Row, req: GuidedRequestView) -> int | str:
        """How many of the drafts ``row`` sent at its last target build TensorRT-LLM accepted, or why not known."""
        if not row.n_drafts:
            # TorchSampler sets py_num_accepted_draft_tokens only at a step with drafts: here it is an older one's.
            return 0
        k = req.num_accepted_draft_tokens
        if k is None or not 0 <= k <= row.n_drafts:
            return f"TensorRT-LLM accepted {k} of the {row.n_drafts} draft tokens sent"
        return int(k)

    def _recorded_of(self, row: _Row) -> int | str:
        """One-model: the accepted-draft count :meth:`record_accepted` noted for ``row``, or why not known."""
        if not row.n_drafts:
            return 0
        if not row.told:
            return f"TensorRT-LLM did not say how many of the {row.n_drafts} draft tokens sent it accepted"
        if not 0 <= row.accepted <= row.n_drafts:
            return f"TensorRT-LLM accepted {row.accepted} of the {row.n_drafts} draft tokens sent"
        return row.accepted

    def _first_end(self, tokens: np.ndarray) -> int:
        """The index of the first end token in ``tokens`` (-1: none)."""
        for i, t in enumerate(tokens.tolist()):
            if t in self._end_set:
                return i
        return -1

    def _channel_step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
                      drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        """A one-model build's grammar request: over the grammar channel, never over BLS.

        The build runs in a CUDA host function (a driver thread holding the
        GIL, the stream waiting on it): a BLS call there goes through the
        Triton stub's IPC, slower and never audited for that thread.
        ``RemoteMaskProvider`` sends over its channel where it is open and the
        step fits its mask buffer (``send_step``), and would otherwise fall
        back to BLS, so the row fails instead (:meth:`_open_channel` opens
        the channel at a start).  A provider that is no ``StepSender`` runs
        in this process (``LocalMaskProvider``): no BLS to avoid.
        """
        provider = self._provider
        if not isinstance(provider, StepSender):
            return provider.step(seq_ids, tokens, counts, drafts=drafts, draft_counts=draft_counts)
        if not getattr(provider, "channel_open", True):
            raise EngineError("the grammar channel is not open, and a build in a CUDA host function (one-model "
                              "speculative decoding) never goes over BLS")
        pending = provider.send_step(seq_ids, tokens, counts, drafts=drafts, draft_counts=draft_counts)
        if pending is None:
            raise EngineError("the step does not fit the grammar channel's mask buffer, and a build in a CUDA host "
                              "function (one-model speculative decoding) never goes over BLS")
        return pending.result()[0]

    def _no_advance(self, requests: GuidedRequestsView, advanced: list[int]) -> None:
        """Every target row's ``num_advanced_tokens`` to 0, as TensorRT-LLM's own ``_build`` starts a row."""
        try:
            for req, _ in requests.valid_requests_with_offsets():
                slot = req.seq_slot
                if not req.is_draft and slot is not None and 0 <= slot < len(advanced):
                    advanced[slot] = 0
        except Exception:  # noqa: BLE001 -- in a host function: the counts stay as they were
            _log.exception("grammar rows: resetting num_advanced_tokens failed")

    def _advance(self, j: int, row: _Row, offset: int, valid: list[int], bitmask: np.ndarray,
                 token_mask: np.ndarray, advanced: list[int]) -> None:
        """Step entry ``j``'s ``num_advanced_tokens``: what TensorRT-LLM's own matcher would have advanced.

        1 (the new token) + the drafts the grammar holds (``draft_valid``) +
        1 where the draft after them is an end token the mask there allows:
        TensorRT-LLM's ``_build`` counts the draft that terminates its matcher
        too, and ``fetch_draft_batch`` clamps the GPU's accepted count to this
        (the target may accept drafts past an end token, 1.2.1's comment
        there).  A row written with the end tokens only advances nothing (0):
        its request ends here.
        """
        slot = int(self._slots[j])
        if not 0 <= slot < len(advanced) or row.error is not None or row.terminated or not token_mask[offset]:
            return
        held = valid[j] if valid else 0
        n = 1 + held
        if held < row.n_drafts:
            t = int(row.drafts[held])
            mask = bitmask[offset + held]
            if t in self._end_set and (int(mask[t >> 5]) >> (t & 31)) & 1:
                n += 1
        advanced[slot] = n

    @staticmethod
    def _count_reasoning(row: _Row, accepted: int) -> None:
        # The target sampled a token at row offset (counted at that build) and one after each of the
        # ``accepted`` drafts, at the draft positions, under their close states (draft_closing): the row
        # is then where the last of them was sampled.
        for state in row.closes[:accepted].tolist():
            row.close_state = state
            if state in REASONING_STATES:
                row.reasoning_tokens = (row.reasoning_tokens or 0) + 1
                row.reasoning_cut = row.reasoning_cut or state == CloseState.REASONING_END

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
        """Fail every constrained row of the step and try to leave it only the end tokens.

        A draft-model build's rows are failed too (a step may have committed
        their due tokens), but reported and ended at the target's build; their
        draft rows stay unmasked.
        """
        failed.clear()
        for j in range(self._max_rows):
            self._stepped[j] = _NO_ROW
        try:
            for req, offset in requests.valid_requests_with_offsets():
                if req.is_draft:
                    row = self._row_of_guide(req)
                    if row is not None and not row.retired:
                        row.error = row.error or error
                    continue
                row = self._by_slot.get(req.seq_slot) if req.seq_slot is not None else None
                if row is None or not row.retired:  # a retired row's abort is on its way: never failed
                    if row is not None:
                        row.error = row.error or error
                        row.reported = True
                    failed.append((-1 if req.request_id is None else int(req.request_id), error))
                if self._end_row.shape[0] == bitmask.shape[1]:
                    self._write_end(bitmask, token_mask, offset)
        except Exception:  # noqa: BLE001 -- the rows are failed already; their requests end with the error
            _log.exception("grammar rows: the end-token rows could not be written either")
