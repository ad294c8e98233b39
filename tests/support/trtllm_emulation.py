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
import math
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

from llm_runtime.engine import TorchEngine
from tests.support import poll

__all__ = ["Guide", "GuidedDecoder", "GuidedRequest", "GuidedRequests", "LlmRequestNames", "Trtllm", "apply_rows",
           "install"]


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
                   list(request.py_draft_tokens or ()), request.py_num_accepted_draft_tokens)


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
class Trtllm:
    """What :func:`install` made: the executor of the last ``LLM`` built (None before one is)."""

    executor: _Executor | None = None
    module: types.ModuleType | None = None


def install(monkeypatch: pytest.MonkeyPatch, engine: TorchEngine,
            decoder_cls: Callable[..., GuidedDecoder] = GuidedDecoder, manual: bool = False) -> Trtllm:
    """Put the emulated ``tensorrt_llm`` modules in ``sys.modules`` for one test (``monkeypatch`` undoes it).

    ``manual``: the executor runs an iteration only when the test calls
    ``tick()`` (the worst case of timing, made exact: the engine reacts to a
    response before the next iteration starts).
    """
    made = Trtllm()
    guided = types.ModuleType("tensorrt_llm._torch.pyexecutor.guided_decoder")
    guided.GuidedDecoder = decoder_cls  # type: ignore[attr-defined]
    guided.GuidedRequests = GuidedRequests  # type: ignore[attr-defined]
    guided.GuidedRequest = GuidedRequest  # type: ignore[attr-defined]
    creator = types.ModuleType("tensorrt_llm._torch.pyexecutor.py_executor_creator")
    creator.GuidedDecoder = decoder_cls  # type: ignore[attr-defined]

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            # create_py_executor: the decoder by its global name, in this process.
            decoder = creator.GuidedDecoder(guided_decoding_config=kwargs["guided_decoding_backend"],
                                            max_num_sequences=kwargs["max_batch_size"],
                                            vocab_size_padded=engine.vocab_size)
            self._executor = types.SimpleNamespace(engine=types.SimpleNamespace(guided_decoder=decoder))
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
