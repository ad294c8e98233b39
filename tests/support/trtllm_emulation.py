"""TensorRT-LLM 1.2's guided decoder and LLM API, emulated where the package cannot be installed (no GPU, no wheel).

Two levels, both following what was read in TensorRT-LLM's sources (the
versions named in ``llm_runtime/trtllm_engine.py`` and ``deploy/gpu/README.md``):

* the guided decoder's data: :class:`GuidedRequest` (the fields
  :class:`llm_runtime.grammar_hook.GrammarRows` reads, its two predicates
  verbatim), :class:`GuidedRequests` (rows at batch offsets, contexts first,
  a generation row followed by its draft rows)
  and :class:`GuidedDecoder` (``bitmask_host`` and ``token_mask_host`` made in
  ``__init__``; ``add_batch``; ``build`` -> ``_build(requests)``;
  ``rollback_rejected_tokens`` -> ``_rollback_rejected_tokens(requests)``;
  ``execute(logits)`` builds, masks the rows whose ``token_mask`` is 1 and
  returns the failed rows);
* :func:`install`: the modules :class:`llm_runtime.trtllm_engine.TrtllmGenerator`
  imports (``tensorrt_llm`` with ``LLM``, ``llmapi``, ``sampling_params`` and
  ``_torch.pyexecutor.guided_decoder`` / ``py_executor_creator``), whose
  ``LLM`` builds its executor in this process (the decoder by the name
  ``py_executor_creator.GuidedDecoder``, which the engine replaces) and runs
  ``PyExecutor._executor_loop``'s order on a thread: fetch new requests and
  cancels -> schedule -> ``add_batch`` -> forward -> ``execute`` -> sample ->
  ``_handle_guided_decoder_errors`` (an error response; the request ends) ->
  ``_update_requests`` -> ``_handle_canceled_requests`` (finish reason
  ``cancelled``, the token of that iteration included) -> ``_handle_responses``;
  requests past ``max_batch_size`` wait for a slot.
  ``GenerationResult.abort()`` queues a cancel that the next iteration
  fetches, so that iteration still schedules and builds the request; ``async
  for`` over a result yields one output per iteration (``token_ids_diff``)
  and stops after the final one; an error response raises.

The forward is the tiny torch model's (:class:`llm_runtime.engine.TorchEngine`), greedy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import queue
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, ConfigDict

from llm_runtime.engine import TorchEngine
from tests.support import poll

__all__ = ["ONE_MODEL_MODES", "CapturableGuidedDecoder", "Drafter", "Guide", "GuidedDecoder", "GuidedRequest",
           "GuidedRequests", "LlmRequestNames", "Trtllm", "apply_rows", "install"]

#: The one-model speculative modes: the emulated LLM builds ``py_executor_creator.CapturableGuidedDecoder``.
ONE_MODEL_MODES = ("MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL")

#: A one-model drafter: ``(request_id, position in the output, draft step) -> proposed token``.
Drafter = Callable[[int, int, int], int]


@dataclass
class Guide:
    """``tllm.GuidedDecodingParams`` as the executor holds it: ``guide`` is the string the request was given."""

    guide: str | None


@dataclass(slots=True)
class GuidedRequest:
    """TensorRT-LLM's ``GuidedRequest`` (the fields GrammarRows reads, the two predicates verbatim)."""

    guided_decoding_params: Guide | None
    request_id: int
    seq_slot: int | None
    is_context_init_state: bool
    is_last_context_chunk: bool
    is_generation_in_progress_state: bool
    new_token: int | None
    is_draft: bool = False
    draft_tokens: list[int] = field(default_factory=list)
    num_accepted_draft_tokens: int | None = None
    prev_seq_slot: int | None = None
    is_generation_only_first_iteration: bool = False

    def cast_to_draft(self) -> None:
        self.is_draft = True
        self.draft_tokens = []

    def require_matcher_init(self) -> bool:
        if self.guided_decoding_params is None or self.is_draft:
            return False
        return self.is_context_init_state and self.is_last_context_chunk

    def require_matcher_advance(self) -> bool:
        if self.guided_decoding_params is None:
            return False
        if self.is_draft:
            return (self.is_context_init_state and self.is_last_context_chunk) or self.is_generation_in_progress_state
        return self.is_generation_in_progress_state

    @classmethod
    def from_llm_request(cls, request: Any) -> GuidedRequest:
        """From an ``LlmRequest`` (the attributes it reads, by their names there; a draft request's slot is
        its target's)."""
        return cls(request.guided_decoding_params, request.py_request_id,
                   request.py_target_seq_slot if request.py_is_draft else request.py_seq_slot,
                   request.is_context_init_state, request.is_context_init_state and request.is_last_context_chunk,
                   request.is_generation_in_progress_state, request.get_last_tokens(0), request.py_is_draft,
                   list(request.py_draft_tokens or ()), request.py_num_accepted_draft_tokens,
                   getattr(request, "py_batch_idx", None))


@dataclass
class GuidedRequests:
    """TensorRT-LLM's ``GuidedRequests``: a generation row is followed by ``max_num_draft_tokens`` draft rows;
    a context row, and every row of a draft-model batch, has one."""

    requests: list[GuidedRequest]
    num_contexts: int
    max_num_draft_tokens: int = 0

    @property
    def num_bitmask_tokens(self) -> int:
        if self.requests and self.requests[0].is_draft:
            return len(self.requests)
        return self.num_contexts + (len(self.requests) - self.num_contexts) * (self.max_num_draft_tokens + 1)

    def __len__(self) -> int:
        return len(self.requests)

    def valid_requests(self) -> Iterator[GuidedRequest]:
        for req in self.requests:
            if req.guided_decoding_params is not None and req.seq_slot is not None:
                yield req

    def valid_requests_with_offsets(self) -> Iterator[tuple[GuidedRequest, int]]:
        offset = 0
        for req in self.requests:
            if req.guided_decoding_params is not None and req.seq_slot is not None:
                yield req, offset
            offset += 1
            if not req.is_draft and req.is_generation_in_progress_state:
                offset += self.max_num_draft_tokens


def apply_rows(logits: torch.Tensor, bitmask: np.ndarray, token_mask: np.ndarray, vocab: int) -> None:
    """``GuidedDecoder.execute`` after the build: the ``logits_bitmask`` kernel, rows with token_mask 1 only."""
    rows = [i for i in range(logits.shape[0]) if token_mask[i]]
    if rows:
        xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(bitmask[: logits.shape[0]]), vocab_size=vocab,
                                        indices=rows)


class GuidedDecoder:
    """TensorRT-LLM's ``GuidedDecoder``: the buffers its ``__init__`` makes, ``add_batch``, ``build``, ``execute``.

    ``_build`` is TensorRT-LLM's own matcher loop, which the project's
    subclass replaces; it is never reached here.  ``buffers`` leaves out any
    of the two host buffers (an API that moved them).
    """

    buffers: tuple[str, ...] = ("bitmask_host", "token_mask_host")

    def __init__(self, guided_decoding_config: object, max_num_sequences: int, vocab_size_padded: int,
                 max_num_draft_tokens: int = 0) -> None:
        del guided_decoding_config
        self.max_num_sequences = max_num_sequences
        self.max_num_draft_tokens = max_num_draft_tokens
        rows, words = max_num_sequences * (max_num_draft_tokens + 1), math.ceil(vocab_size_padded / 32)
        if "bitmask_host" in self.buffers:
            self.bitmask_host = torch.zeros((rows, words), dtype=torch.int32)
        if "token_mask_host" in self.buffers:
            self.token_mask_host = torch.zeros(rows, dtype=torch.int32)
        self.vocab_size_padded = vocab_size_padded
        self.requests: GuidedRequests | None = None

    def add_batch(self, scheduled: list[Any]) -> None:
        """``GuidedRequests.from_scheduled_requests``: contexts first, then generations."""
        contexts = sum(bool(r.is_context_init_state) for r in scheduled)
        self.requests = GuidedRequests([GuidedRequest.from_llm_request(r) for r in scheduled], contexts,
                                       self.max_num_draft_tokens)

    def build(self) -> list[tuple[int, str]]:
        assert self.requests is not None
        return self._build(self.requests)

    def _build(self, requests: GuidedRequests) -> list[tuple[int, str]]:
        raise AssertionError("TensorRT-LLM's own matchers: the grammar decoder replaces _build")

    def rollback_rejected_tokens(self) -> None:
        assert self.requests is not None
        self._rollback_rejected_tokens(self.requests)

    def _rollback_rejected_tokens(self, requests: GuidedRequests) -> None:
        raise AssertionError("TensorRT-LLM's own matchers: the grammar decoder replaces _rollback_rejected_tokens")

    def execute(self, logits: torch.Tensor) -> list[tuple[int, str]]:
        failed = self.build()
        apply_rows(logits, self.bitmask_host.numpy(), self.token_mask_host.numpy(), self.vocab_size_padded)
        return failed


class _HostStream:
    """The decoder's CUDA stream, for its host functions: run in order on their own thread (a CUDA driver
    thread); an exception is only recorded (``hostfunc.cpp``: ``PyErr_Print``) and the stream goes on."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self.ran = 0
        self.thread = threading.Thread(target=self._run, name="emulated-cuda-hostfunc", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (fn := self._queue.get()) is not None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 -- printed and dropped by TensorRT-LLM's trampoline
                self.errors.append(err)
            self.ran += 1
            self._queue.task_done()
        self._queue.task_done()

    def launch(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def synchronize(self) -> None:
        """``wait_event(bitmask_event)``: the main stream (here, the executor's thread) goes on after it."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join(10)


def hostfunc(method: Callable[..., None]) -> Callable[..., None]:
    """TensorRT-LLM's ``@hostfunc``: the call launches the method on the decoder's stream and returns."""

    @functools.wraps(method)
    def launch(self: CapturableGuidedDecoder, *args: Any, **kwargs: Any) -> None:
        self.stream.launch(functools.partial(method, self, *args, **kwargs))

    return launch


class CapturableGuidedDecoder(GuidedDecoder):
    """TensorRT-LLM 1.2.1's ``CapturableGuidedDecoder`` (guided_decoder.py at 40bb912b), its host functions
    verbatim but for the CUDA calls: the pinned ``new_tokens`` ``[D + 1, max_num_sequences]`` and
    ``num_accepted_tokens``; ``add_batch`` queues the requests; ``execute`` launches ``fetch_batch``,
    ``init_disagg_gen_requests``, ``build`` and the bitmask copy on the stream (:class:`_HostStream`), waits for
    it and masks; ``execute_draft_batch`` likewise with ``fetch_draft_batch``, ``rollback_rejected_tokens`` at
    step 0 and ``rollback_draft_tokens`` at the last.  TensorRT-LLM's own ``_build`` and rollbacks (its
    matchers) are never reached: the grammar decoder overrides them."""

    def __init__(self, guided_decoding_config: object, max_num_sequences: int, vocab_size_padded: int,
                 max_num_draft_tokens: int = 0) -> None:
        super().__init__(guided_decoding_config, max_num_sequences, vocab_size_padded, max_num_draft_tokens)
        self.requests_hostfunc: GuidedRequests | None = None
        self.queue: queue.Queue[tuple[GuidedRequests, bool]] = queue.Queue()
        self.new_tokens = torch.zeros((max_num_draft_tokens + 1, max_num_sequences), dtype=torch.int32)
        self.num_accepted_tokens = torch.zeros(max_num_sequences, dtype=torch.int32)
        self.num_advanced_tokens: list[int] = [0] * max_num_sequences
        self.stream = _HostStream()
        rows = self.bitmask_host.shape[0]
        self.bitmask = np.zeros(tuple(self.bitmask_host.shape), dtype=np.int32)  # the device copies
        self.token_mask = np.zeros(rows, dtype=np.int32)

    def add_batch(self, scheduled: list[Any], new_tokens: torch.Tensor | None = None) -> None:  # type: ignore[override]
        super().add_batch(scheduled)
        if new_tokens is not None:
            self.new_tokens.copy_(new_tokens)
        assert self.requests is not None
        self.queue.put((self.requests, new_tokens is not None))

    @hostfunc
    def fetch_batch(self) -> None:
        # CUDA graph warmup calls model forward for multiple times for one prepared inputs
        if self.queue.empty():
            return
        self.requests_hostfunc, has_new_tokens = self.queue.get()
        if not has_new_tokens:
            return
        for req in self.requests_hostfunc.valid_requests():
            if req.prev_seq_slot is None:
                continue
            req.new_token, *req.draft_tokens = self.new_tokens[:, req.seq_slot].tolist()

    @hostfunc
    def build(self) -> None:  # type: ignore[override]
        self._build(self.requests_hostfunc)  # type: ignore[arg-type]

    @hostfunc
    def init_disagg_gen_requests(self) -> None:
        self._init_disagg_gen_requests(self.requests_hostfunc)  # type: ignore[arg-type]

    def _init_disagg_gen_requests(self, requests: GuidedRequests) -> None:
        raise AssertionError("TensorRT-LLM's own matchers: the grammar decoder replaces _init_disagg_gen_requests")

    @hostfunc
    def rollback_rejected_tokens(self) -> None:
        self._rollback_rejected_tokens(self.requests_hostfunc)  # type: ignore[arg-type]

    @hostfunc
    def rollback_draft_tokens(self) -> None:
        self._rollback_draft_tokens(self.requests_hostfunc)  # type: ignore[arg-type]

    def _rollback_draft_tokens(self, requests: GuidedRequests) -> None:
        raise AssertionError("TensorRT-LLM's own matchers: the grammar decoder replaces _rollback_draft_tokens")

    def copy_bitmask(self, num_bitmask_tokens: int | None = None) -> None:
        # An async copy on the stream; its row count is taken now, on the host, from self.requests.
        assert self.requests is not None
        n = self.requests.num_bitmask_tokens if num_bitmask_tokens is None else num_bitmask_tokens

        def copy() -> None:
            self.bitmask[:n] = self.bitmask_host.numpy()[:n]
            self.token_mask[:n] = self.token_mask_host.numpy()[:n]

        self.stream.launch(copy)

    def apply_bitmask(self, logits: torch.Tensor, num_bitmask_tokens: int | None = None) -> None:
        assert self.requests is not None
        n = self.requests.num_bitmask_tokens if num_bitmask_tokens is None else num_bitmask_tokens
        apply_rows(logits[:n], self.bitmask, self.token_mask, self.vocab_size_padded)

    def execute(self, logits: torch.Tensor, d2t: torch.Tensor | None = None) -> list[tuple[int, str]]:
        self.fetch_batch()
        self.init_disagg_gen_requests()
        self.build()
        self.copy_bitmask()
        self.stream.synchronize()  # bitmask_event
        self.apply_bitmask(logits)
        return []  # nothing reaches the executor: its guided_decoder is None in one-model mode

    def add_draft_batch(self, new_tokens: torch.Tensor, num_accepted_tokens: torch.Tensor, draft_step: int = 0) -> None:
        assert self.requests is not None
        batch_size = len(self.requests)
        assert new_tokens.size(0) == batch_size
        self.new_tokens[0, :batch_size].copy_(new_tokens)
        if draft_step == 0:
            assert num_accepted_tokens.size(0) == batch_size
            self.num_accepted_tokens[:batch_size].copy_(num_accepted_tokens)

    @hostfunc
    def fetch_draft_batch(self, draft_step: int = 0) -> None:
        assert self.requests_hostfunc is not None
        batch_size = len(self.requests_hostfunc)
        new_tokens_list = self.new_tokens[0, :batch_size].tolist()
        if draft_step == 0:
            num_accepted_tokens_list = self.num_accepted_tokens[:batch_size].tolist()
        for i, req in enumerate(self.requests_hostfunc.requests):
            if req.guided_decoding_params is None or (slot := req.seq_slot) is None:
                continue
            req.new_token = new_tokens_list[i]
            if draft_step == 0:
                # When overlap scheduler is enabled, it is possible that
                # - The EOS token is in the draft tokens, and
                # - Some draft tokens after the EOS token are accepted by the target model.
                # These requests should be terminated at this executor iteration.
                req.num_accepted_draft_tokens = min(num_accepted_tokens_list[i], self.num_advanced_tokens[slot]) - 1
                assert not req.is_draft
                req.cast_to_draft()
            else:
                assert req.is_draft

    def execute_draft_batch(self, logits: torch.Tensor, d2t: torch.Tensor | None = None, draft_step: int = 0) -> None:
        assert self.requests is not None
        self.fetch_draft_batch(draft_step=draft_step)
        if draft_step == 0:
            self.rollback_rejected_tokens()
        self.build()
        if draft_step == self.max_num_draft_tokens - 1:
            self.rollback_draft_tokens()
        self.copy_bitmask(num_bitmask_tokens=len(self.requests))
        self.stream.synchronize()
        self.apply_bitmask(logits, num_bitmask_tokens=len(self.requests))


class GuidedDecodingParams:
    """``tensorrt_llm.sampling_params.GuidedDecodingParams`` (the LLM API's)."""

    def __init__(self, *, json: str | None = None, regex: str | None = None, grammar: str | None = None,
                 json_object: bool = False, structural_tag: str | None = None) -> None:
        self.json, self.regex, self.grammar = json, regex, grammar
        self.json_object, self.structural_tag = json_object, structural_tag

    def executor_guide(self) -> Guide:
        """``_get_guided_decoding_params``: the one guide string the executor gets."""
        return Guide(self.json or self.regex or self.grammar or self.structural_tag)


class SamplingParams:
    """``tensorrt_llm.SamplingParams``: the fields the engine sets."""

    def __init__(self, **fields: Any) -> None:
        self.max_tokens: int = fields.pop("max_tokens")
        self.end_id: int = fields.pop("end_id")
        self.stop_token_ids: list[int] | None = fields.pop("stop_token_ids", None)
        self.guided_decoding: GuidedDecodingParams | None = fields.pop("guided_decoding", None)
        self.other = fields


class KvCacheConfig:
    def __init__(self, **fields: Any) -> None:
        self.fields = fields


class _DecodingConfig(BaseModel):
    """``tensorrt_llm.llmapi``'s speculative config classes as the 1.2.1 schema has them (pydantic, no extra keys;
    the draft model field ``speculative_model``), with the ``SpeculativeDecodingMode`` each gives
    (``spec_dec_mode``'s rule, ``_torch/speculative/interface.py`` at b35ac1b6)."""

    model_config = ConfigDict(extra="forbid")
    max_draft_len: int | None = None
    max_concurrency: int | None = None

    @property
    def mode(self) -> str:
        raise NotImplementedError


class _DraftModelConfig(_DecodingConfig):
    speculative_model: str | None = None


class EagleDecodingConfig(_DraftModelConfig):
    eagle3_one_model: bool = True
    eagle3_layers_to_capture: list[int] | None = None
    eagle3_model_arch: str = "llama3"

    @property
    def mode(self) -> str:
        return "EAGLE3_ONE_MODEL" if self.eagle3_one_model else "EAGLE3"


class DraftTargetDecodingConfig(_DraftModelConfig):
    @property
    def mode(self) -> str:
        return "DRAFT_TARGET"


class NGramDecodingConfig(_DecodingConfig):
    max_matching_ngram_size: int = 0
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True

    @property
    def mode(self) -> str:
        return "NGRAM"


class MTPDecodingConfig(_DecodingConfig):
    num_nextn_predict_layers: int = 1
    use_mtp_vanilla: bool = False
    mtp_eagle_one_model: bool = True

    @property
    def mode(self) -> str:
        if self.use_mtp_vanilla:
            return "MTP"
        return "MTP_EAGLE_ONE_MODEL" if self.mtp_eagle_one_model else "MTP_EAGLE"


@dataclass
class CompletionOutput:
    token_ids_diff: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]
    finished: bool


class RequestError(RuntimeError):
    """What the LLM API raises for an error response (``tensorrt_llm.executor.utils.RequestError``)."""


class LlmRequestNames:
    """What ``GuidedRequest.from_llm_request`` reads of an ``LlmRequest``, under TensorRT-LLM's names, from a
    request of an emulation (its ``request_id``, ``seq_slot``, ``tokens`` and ``state``).  The subclass says
    ``guided_decoding_params``, ``is_last_context_chunk`` and ``is_generation_in_progress_state``."""

    request_id: int
    seq_slot: int | None
    tokens: list[int]
    state: str
    py_is_draft = False
    py_draft_tokens: list[int] | None = None
    py_num_accepted_draft_tokens = 0
    py_target_seq_slot: int | None = None

    @property
    def py_request_id(self) -> int:
        return self.request_id

    @property
    def py_seq_slot(self) -> int | None:
        return self.seq_slot

    @property
    def is_context_init_state(self) -> bool:
        return self.state == "context"

    def get_last_tokens(self, beam: int) -> int:
        del beam
        return self.tokens[-1]


@dataclass(eq=False)
class _Request(LlmRequestNames):
    request_id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    result: GenerationResult
    seq_slot: int | None = None
    state: str = "context"  # context | generation | complete
    finish_reason: str | None = None

    is_last_context_chunk = True  # one context chunk

    @property
    def guided_decoding_params(self) -> Guide | None:
        guided = self.params.guided_decoding
        return None if guided is None else guided.executor_guide()

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state == "generation"


class GenerationResult:
    """``tensorrt_llm.executor.result.GenerationResult``, streaming."""

    def __init__(self, executor: _Executor, request_id: int) -> None:
        self.request_id = request_id
        self._executor = executor
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.done = False  # the final output was taken
        self.errored = False  # an error response was taken (raised); like TensorRT-LLM's, not ``done``
        self.aborted = False
        self.sent = 0  # outputs sent (executor thread) and taken (the consumer's loop)
        self.taken = 0
        self.waiting = False  # the consumer waits in ``async for`` with nothing left to take

    @property
    def settled(self) -> bool:
        """The consumer took everything it was sent, and waits for more or is through."""
        return self.taken == self.sent and (self.waiting or self.done or self.errored)

    def abort(self) -> None:
        self.aborted = True
        self._executor.cancel(self.request_id)

    def _put(self, kind: str, item: Any) -> None:  # from the executor's thread
        self.sent += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, item))

    def __aiter__(self) -> GenerationResult:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        self.waiting = self._queue.empty()
        try:
            kind, item = await self._queue.get()
        finally:
            self.waiting = False
        self.taken += 1
        if kind == "error":
            # TensorRT-LLM's result raises from its response handler before it marks itself done
            # (executor/result.py): nothing more comes, and a further wait would never end.
            self.errored = True
            raise RequestError(item)
        self.done = item.finished
        return item  # type: ignore[no-any-return]


class _Executor:
    """``PyExecutor._executor_loop`` (no overlap scheduler) on its own thread, over the tiny torch model."""

    def __init__(self, engine: TorchEngine, decoder: GuidedDecoder, max_batch: int, manual: bool) -> None:
        self.engine, self.decoder = engine, decoder
        self._ticks: int | None = 0 if manual else None  # iterations allowed (None: run freely)
        self.free = list(range(max_batch))
        self.active: list[_Request] = []
        self.failed: list[tuple[int, str]] = []  # every failed row _build returned
        self.results: list[GenerationResult] = []  # of every request, in arrival order
        self.iterations = 0
        self._new: list[_Request] = []
        self._cancels: list[int] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="emulated-py-executor", daemon=True)
        self._thread.start()

    def enqueue(self, req: _Request) -> None:
        self.results.append(req.result)
        with self._cv:
            self._new.append(req)
            self._cv.notify_all()  # the executor and a test in tick() wait on it

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify_all()  # the executor and a test in tick() wait on it

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()  # the executor and a test in tick() wait on it
        self._thread.join(60)

    def tick(self) -> None:
        """``manual``: run one iteration (waiting for a request if there is none yet); return when the
        consumers took its outputs and either wait for more or are through: the engine reacted to them
        before the next iteration starts."""
        with self._cv:
            assert self._ticks is not None, "the executor runs freely"
            self._ticks += 1
            self._cv.notify_all()
            assert self._cv.wait_for(lambda: self._ticks == 0, 60), "the iteration did not end"
        poll.wait_for(lambda: all(r.settled for r in self.results), 60, "the engine took every output")

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or ((self._new or self.active) and self._ticks != 0))
                if self._stop:
                    return
                # _fetch_and_activate_new_requests: as many as there are free slots; the rest wait.
                new, self._new = self._new[:len(self.free)], self._new[len(self.free):]
                cancels, self._cancels = set(self._cancels), []
            self._iterate(new, cancels)
            with self._cv:
                if self._ticks is not None:
                    self._ticks -= 1
                    self._cv.notify_all()

    def _iterate(self, new: list[_Request], cancels: set[int]) -> None:
        for r in new:
            r.seq_slot = self.free.pop(0)
        self.active += new
        # _handle_canceled_requests clears every cancel it fetched; one of a request still waiting for a
        # slot is dropped with it (the stored py_executor.py does the same: no final output then).
        batch = [r for r in self.active if r.state == "context"] + [r for r in self.active if r.state == "generation"]
        self.decoder.add_batch(batch)
        vocab = self.engine.vocab_size
        gen = [r for r in batch if r.state == "generation"]
        rows: dict[int, torch.Tensor] = {}
        if gen:
            for r, row in zip(gen, self.engine.decode([r.request_id for r in gen], [r.tokens[-1] for r in gen]),
                              strict=True):
                rows[r.request_id] = row
        for r in batch:
            if r.state == "context":
                rows[r.request_id] = self.engine.prefill(r.request_id, r.tokens).reshape(-1)
        logits = torch.stack([rows[r.request_id][:vocab] for r in batch])
        failed = self.decoder.execute(logits)
        self.failed += failed
        sampled = [int(t) for t in logits.argmax(-1)]
        # _handle_guided_decoder_errors: an error response, the request terminated
        errors = dict(failed)
        for r in [r for r in batch if r.request_id in errors]:
            r.result._put("error", errors[r.request_id])
            self._terminate(r)
        self.iterations += 1
        # _update_requests, _handle_canceled_requests, _handle_responses
        for r, token in zip(batch, sampled, strict=True):
            if r.state == "complete":
                continue
            r.tokens.append(token)
            r.state = "generation"
            ends = {r.params.end_id, *(r.params.stop_token_ids or ())}
            if token in ends:
                r.finish_reason = "stop"
            elif len(r.tokens) - r.prompt_len >= r.params.max_tokens:
                r.finish_reason = "length"
            elif r.request_id in cancels:
                r.finish_reason = "cancelled"
            r.result._put("output", RequestOutput([CompletionOutput([token], r.finish_reason)],
                                                  r.finish_reason is not None))
            if r.finish_reason is not None:
                self._terminate(r)

    def _terminate(self, r: _Request) -> None:
        r.state = "complete"
        self.active.remove(r)
        self.engine.release(r.request_id)
        assert r.seq_slot is not None
        self.free.append(r.seq_slot)


@dataclass
class OneModelTally:
    """What a one-model run did (the tests read it)."""

    drafted: int = 0
    accepted: int = 0  # drafts the verification accepted (the GPU's count, past an end token too)
    end_in_drafts: int = 0  # iterations whose accepted drafts held an end token
    stale_counts: int = 0  # target builds whose request's own num_accepted_draft_tokens was not the fresh one
    committed: list[tuple[int, int, int]] = field(default_factory=list)  # (request, grammar tokens, generated)


class _OneModelExecutor(_Executor):
    """``PyExecutor`` with a one-model speculative worker (EAGLE3_ONE_MODEL, MTP): ``model_engine.forward`` ->
    ``_prepare_tp_inputs`` (``guided_decoder.add_batch(scheduled, new_tokens=new_tokens_device)``: the previous
    iteration's ``next_new_tokens`` under the overlap scheduler, None in the plain loop) -> the spec worker's
    forward: the target forward, ``execute`` (the target build), the greedy verification
    (``sample_and_accept_draft_tokens``: drafts accepted while each is the target's pick, end tokens not
    looked at), then for each draft step ``add_draft_batch`` -> the draft forward -> ``execute_draft_batch``
    -> argmax.  The sampler's ``_update_requests`` (the tokens land, up to an end token or the length) runs
    right after in the plain loop, and after the NEXT iteration's forward with the overlap scheduler (so
    the host requests' fields are an iteration old when ``add_batch`` snapshots them, and a request that
    ended is scheduled once more).  The draft model is ``drafter``; the decoder's host functions run on
    its stream's thread."""

    def __init__(self, engine: TorchEngine, decoder: CapturableGuidedDecoder, max_batch: int, manual: bool,
                 drafter: Drafter, overlap: bool, warmup: bool) -> None:
        self.drafts = decoder.max_num_draft_tokens
        self.drafter, self.overlap, self.warmup = drafter, overlap, warmup
        self.capturable = decoder
        self.tally = OneModelTally()
        self.check: Callable[[_Request, int], None] | None = None  # (request, generated) after each target build
        self._device_new_tokens = torch.zeros((self.drafts + 1, max_batch), dtype=torch.int32)
        self._previous: set[int] = set()  # the requests of the previous batch
        self._pending: list[tuple[_Request, list[int], int | None, list[int]]] = []  # the previous batch's results
        self._generated: dict[int, list[int]] = {}  # the device's tokens after the prompt
        self._drafts: dict[int, list[int]] = {}  # the device's drafts of each request
        self._accepted_last: dict[int, int | None] = {}  # the last verification's accepted count
        self._results = []
        self.crash: BaseException | None = None  # what ended the loop (a test's check failed)
        super().__init__(engine, decoder, max_batch, manual)

    def shutdown(self) -> None:
        super().shutdown()
        self.capturable.stream.close()

    def _iterate(self, new: list[_Request], cancels: set[int]) -> None:
        try:
            self._iterate_one_model(new, cancels)
        except BaseException as err:  # noqa: BLE001 -- a test's check failed: never a silent hang of the consumers
            self.crash = err
            for r in self.active:
                with contextlib.suppress(RuntimeError):  # the consumer's loop may be closed already
                    r.result._put("error", f"emulation failed: {err!r}")
            self.active.clear()

    def _iterate_one_model(self, new: list[_Request], cancels: set[int]) -> None:
        for r in new:
            r.seq_slot = self.free.pop(0)
            self._generated[r.request_id] = []
        self.active += new
        batch = [r for r in self.active if r.state == "context"] + [r for r in self.active if r.state == "generation"]
        if batch:
            self._forward(batch)
            for r in batch:
                # _update_request_states: a context done is a generation request from now on (its first token
                # lands at _update_requests: an iteration later with the overlap scheduler).
                if r.state == "context":
                    r.state = "generation"
        # _update_requests, _handle_canceled_requests, _handle_responses: of this batch in the plain loop, of the
        # previous one (after this forward) with the overlap scheduler.
        if self.overlap:
            done, self._pending = self._pending, self._results
        else:
            done = self._results
        self._results = []
        self._update(done, cancels)
        self.iterations += 1

    def _forward(self, batch: list[_Request]) -> None:
        d, vocab, dec = self.drafts, self.engine.vocab_size, self.capturable
        for r in batch:
            r.py_batch_idx = r.seq_slot if r.request_id in self._previous else None  # type: ignore[attr-defined]
            if (r.state == "generation" and r.request_id in self._accepted_last
                    and r.py_num_accepted_draft_tokens != self._accepted_last[r.request_id]):
                self.tally.stale_counts += 1
        self._previous = {r.request_id for r in batch}
        dec.add_batch(batch, new_tokens=self._device_new_tokens.clone() if self.overlap else None)
        # The target forward: a context row has one position, a generation row its last token and its drafts.
        # The tiny engine extends every live sequence at once, before the new ones' prefill.
        out: dict[int, torch.Tensor] = {}
        gens = [r for r in batch if r.state == "generation"]
        if gens:
            fed = np.array([[self._last(r), *self._drafts[r.request_id]] for r in gens], dtype=np.int64)
            every = self.engine.extend([r.request_id for r in gens], fed, np.full(len(gens), d + 1), every=True)
            for i, r in enumerate(gens):
                out[r.request_id] = every[i, : d + 1, :vocab]
        for r in batch:
            if r.state == "context":
                out[r.request_id] = self.engine.prefill(r.request_id, list(r.tokens[: r.prompt_len])).reshape(
                    1, -1)[:, :vocab]
        logits = torch.cat([out[r.request_id] for r in batch]).clone()
        for _ in range(2 if self.warmup else 1):  # CUDA graph warmup: the forward again on the same inputs
            masked = logits.clone()
            dec.execute(masked)
        for r in batch:
            if self.check is not None and r.guided_decoding_params is not None:
                self.check(r, len(self._generated[r.request_id]))
        # The verification: greedy, every draft while it is the target's pick.
        results = []
        accepted_counts, bonus = [], []
        at = 0
        for r in batch:
            rid = r.request_id
            drafts = self._drafts.get(rid, []) if r.state == "generation" else []
            picks = [int(masked[at].argmax())]
            a = 0
            for j, t in enumerate(drafts):
                if t != picks[-1]:
                    break
                a += 1
                picks.append(int(masked[at + 1 + j].argmax()))
            at += 1 + (d if r.state == "generation" else 0)
            if r.state == "generation":
                self.engine.truncate(rid, r.prompt_len + len(self._generated[rid]) + a)
                self.tally.drafted += len(drafts)
                self.tally.accepted += a
                ends = {r.params.end_id, *(r.params.stop_token_ids or ())}
                if any(t in ends for t in drafts[:a]):
                    self.tally.end_in_drafts += 1
            self._generated[rid] += picks
            accepted_counts.append(1 + a)
            bonus.append(picks[-1])
            results.append((r, picks, a if drafts else None))
        # The draft steps.
        step_tokens = list(bonus)
        proposed: list[list[int]] = [[] for _ in batch]
        for i in range(d):
            # Warmup runs draft step 0 again too: its fetch_draft_batch finds the requests cast already
            # (TensorRT-LLM's own assert, printed), its rollback_rejected_tokens runs again.
            for _ in range(2 if self.warmup and i == 0 else 1):
                dec.add_draft_batch(torch.tensor(step_tokens, dtype=torch.int32),
                                    torch.tensor(accepted_counts, dtype=torch.int32), draft_step=i)
                draft_logits = torch.zeros(len(batch), vocab)
                for b, r in enumerate(batch):
                    draft_logits[b, self.drafter(r.request_id, len(self._generated[r.request_id]) + i, i) % vocab] = 1
                dec.execute_draft_batch(draft_logits, draft_step=i)
            step_tokens = [int(t) for t in draft_logits.argmax(-1)]
            for b in range(len(batch)):
                proposed[b].append(step_tokens[b])
        for b, r in enumerate(batch):
            self._drafts[r.request_id] = proposed[b]
            self._device_new_tokens[:, r.seq_slot] = torch.tensor([bonus[b], *proposed[b]], dtype=torch.int32)
        self._results = [(r, picks, a, proposed[b]) for b, (r, picks, a) in enumerate(results)]
        for r, _picks, count, _proposed in self._results:
            self._accepted_last[r.request_id] = count if count is not None else r.py_num_accepted_draft_tokens

    _results: list[tuple[_Request, list[int], int | None, list[int]]]

    def _last(self, r: _Request) -> int:
        generated = self._generated[r.request_id]
        return generated[-1] if generated else r.tokens[r.prompt_len - 1]

    def _update(self, done: list[tuple[_Request, list[int], int | None, list[int]]], cancels: set[int]) -> None:
        for r, picks, accepted, drafts in done:
            if r.state == "complete":
                continue
            ends = {r.params.end_id, *(r.params.stop_token_ids or ())}
            landed = []
            for t in picks:
                landed.append(t)
                r.tokens.append(t)
                if t in ends:
                    r.finish_reason = "stop"
                    break
                if len(r.tokens) - r.prompt_len >= r.params.max_tokens:
                    r.finish_reason = "length"
                    break
            r.state = "generation"
            r.py_draft_tokens = drafts
            if accepted is not None:
                r.py_num_accepted_draft_tokens = accepted
            if r.finish_reason is None and r.request_id in cancels:
                r.finish_reason = "cancelled"
            r.result._put("output", RequestOutput([CompletionOutput(landed, r.finish_reason)],
                                                  r.finish_reason is not None))
            if r.finish_reason is not None:
                self._terminate(r)


@dataclass
class Trtllm:
    """What :func:`install` made: the executor of the last ``LLM`` built (None before one is)."""

    executor: _Executor | None = None
    module: types.ModuleType | None = None


def install(monkeypatch: pytest.MonkeyPatch, engine: TorchEngine,
            decoder_cls: Callable[..., GuidedDecoder] = GuidedDecoder, manual: bool = False, *,
            spec_mode: str | None = None, drafter: Drafter | None = None, drafts: int = 3, overlap: bool = False,
            warmup: bool = False) -> Trtllm:
    """Put the emulated ``tensorrt_llm`` modules in ``sys.modules`` for one test (``monkeypatch`` undoes it).

    ``manual``: the executor runs an iteration only when the test calls
    ``tick()`` (the worst case of timing, made exact: the engine reacts to a
    response before the next iteration starts).  ``spec_mode``: the
    ``SpeculativeDecodingMode`` name the model engine's ``spec_config`` says
    (None: no speculation); a one-model mode (:data:`ONE_MODEL_MODES`) builds
    ``py_executor_creator.CapturableGuidedDecoder`` with ``drafts`` draft rows,
    hands it to the model engine (the executor's ``guided_decoder`` is None)
    and runs :class:`_OneModelExecutor` with ``drafter`` (default: the token
    0), the overlap scheduler or not, and ``warmup`` (each forward's target
    build and draft step 0 run twice on the same batch, as CUDA graph warmup).
    """
    made = Trtllm()
    guided = types.ModuleType("tensorrt_llm._torch.pyexecutor.guided_decoder")
    guided.GuidedDecoder = decoder_cls  # type: ignore[attr-defined]
    guided.CapturableGuidedDecoder = CapturableGuidedDecoder  # type: ignore[attr-defined]
    guided.GuidedRequests = GuidedRequests  # type: ignore[attr-defined]
    guided.GuidedRequest = GuidedRequest  # type: ignore[attr-defined]
    creator = types.ModuleType("tensorrt_llm._torch.pyexecutor.py_executor_creator")
    creator.GuidedDecoder = decoder_cls  # type: ignore[attr-defined]
    creator.CapturableGuidedDecoder = CapturableGuidedDecoder  # type: ignore[attr-defined]

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs  # what the engine passed
            mode, n_drafts = spec_mode, drafts
            speculative = kwargs.get("speculative_config")
            if speculative is not None:
                # The config object the engine built (TRTLLM_SPECULATIVE_CONFIG): its mode and draft length.
                mode = speculative.mode
                n_drafts = (speculative.num_nextn_predict_layers if isinstance(speculative, MTPDecodingConfig)
                            else speculative.max_draft_len)
                if mode not in ONE_MODEL_MODES:
                    raise NotImplementedError(f"the emulated executor drafts in the one-model modes only, not {mode} "
                                              "(tests/unit/test_grammar_hook_drafts.py drives the drafter modes)")
            spec = (None if mode is None
                    else types.SimpleNamespace(spec_dec_mode=types.SimpleNamespace(name=mode)))
            config = {"guided_decoding_config": kwargs["guided_decoding_backend"],
                      "max_num_sequences": kwargs["max_batch_size"], "vocab_size_padded": engine.vocab_size}
            self._exec: _Executor
            if mode in ONE_MODEL_MODES:
                # create_py_executor: support_capturable_guided_decoder() -> model_engine.set_guided_decoder(...)
                capturable = creator.CapturableGuidedDecoder(**config, max_num_draft_tokens=n_drafts)
                model_engine = types.SimpleNamespace(spec_config=spec, guided_decoder=capturable)
                self._executor = types.SimpleNamespace(engine=types.SimpleNamespace(
                    guided_decoder=None, model_engine=model_engine, drafter=None))
                self._exec = _OneModelExecutor(engine, capturable, kwargs["max_batch_size"], manual,
                                               drafter or (lambda rid, position, step: 0), overlap, warmup)
            else:
                # create_py_executor: the decoder by its global name, in this process.
                decoder = creator.GuidedDecoder(**config)
                self._executor = types.SimpleNamespace(engine=types.SimpleNamespace(
                    guided_decoder=decoder, model_engine=types.SimpleNamespace(spec_config=spec)))
                self._exec = _Executor(engine, decoder, kwargs["max_batch_size"], manual)
            self._ids = iter(range(1, 1 << 62))
            made.executor = self._exec

        def generate_async(self, inputs: dict[str, list[int]], sampling_params: SamplingParams,
                           streaming: bool) -> GenerationResult:
            assert streaming
            rid = next(self._ids)
            result = GenerationResult(self._exec, rid)
            prompt = list(inputs["prompt_token_ids"])
            self._exec.enqueue(_Request(rid, prompt, len(prompt), sampling_params, result))
            return result

        def shutdown(self) -> None:
            self._exec.shutdown()

    trt = types.ModuleType("tensorrt_llm")
    trt.__version__ = "1.2.1"  # type: ignore[attr-defined]
    trt.LLM = LLM  # type: ignore[attr-defined]
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = KvCacheConfig  # type: ignore[attr-defined]
    for cls in (EagleDecodingConfig, DraftTargetDecodingConfig, NGramDecodingConfig, MTPDecodingConfig):
        setattr(llmapi, cls.__name__, cls)
    sampling = types.ModuleType("tensorrt_llm.sampling_params")
    sampling.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sampling.GuidedDecodingParams = GuidedDecodingParams  # type: ignore[attr-defined]
    torch_pkg = types.ModuleType("tensorrt_llm._torch")
    pyexecutor = types.ModuleType("tensorrt_llm._torch.pyexecutor")
    pyexecutor.guided_decoder = guided  # type: ignore[attr-defined]
    pyexecutor.py_executor_creator = creator  # type: ignore[attr-defined]
    for module in (trt, llmapi, sampling, torch_pkg, pyexecutor, guided, creator):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    # The decoder module binds TensorRT-LLM's classes at import: import it afresh, and forget it after.
    monkeypatch.delitem(sys.modules, "llm_runtime.trtllm_decoder", raising=False)
    made.module = trt
    return made
