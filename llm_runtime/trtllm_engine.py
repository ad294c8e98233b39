"""The TensorRT-LLM engine of the ``llm`` model (GPU, NGC ``trtllm-python-py3`` image).

NOT RUN where this project is built and tested: ``tensorrt_llm`` has no
wheel these machines can install and CI has no GPU.  It is written against
the documented LLM API of TensorRT-LLM 1.x (the references below, read with
the project's search tool in ``NVIDIA/TensorRT-LLM``), and every piece of its
grammar logic is the shared :class:`llm_runtime.grammar_hook.GrammarLogitsProcessor`,
which the torch scheduler runs in every test (``grammar_mode="processor"``).
What runs here: :func:`native_guided_kwargs`, the sampling mapping
(:func:`trtllm_sampling_kwargs`) and the refusal when the package is missing.

Why not the stock C++ ``tensorrtllm`` Triton backend: it wires no logits
post-processor (TensorRT-LLM issue 6202: ``LogitsPostProcessorConfig`` "is
currently hardcoded to null" in ``model_instance_state.cc``), and an ensemble
runs each step once per request, not per decode step.  So the ``llm`` model
runs the LLM API inside the Python backend.

How the bitmask reaches TensorRT-LLM (``trtllm_backend``)
--------------------------------------------------------
``tensorrt`` (``from tensorrt_llm._tensorrt_engine import LLM``, a built engine)
    ``LLM(batched_logits_processor=...)`` + ``SamplingParams(apply_batched_logits_processor=True)``:
    the executor calls ``BatchedLogitsProcessor.__call__(req_ids, logits,
    token_ids, stream_ptr, client_ids)`` ONCE per step for every request that
    set the flag (``tensorrt_llm/sampling_params.py``), so a step costs ONE
    grammar request.  ``client_ids`` are the LLM API's request ids (the worker
    builds ``tllm.Request(client_id=request.id, ...)``), which
    :class:`_BatchedHook` maps to grammar rows.
``pytorch`` (``from tensorrt_llm import LLM``, a Hugging Face checkpoint)
    The PyTorch backend of 1.0-1.2 ignores ``batched_logits_processor``; it
    calls each request's ``SamplingParams.logits_processor`` in
    ``PyTorchModelEngine._execute_logit_post_processors``
    (``_torch/pyexecutor/model_engine.py``) with ``(req_id, logits [1, 1, V],
    [prompt + generated], None, None)``, once per request per step.  A step
    then costs one grammar request PER CONSTRAINED REQUEST (a BLS round trip
    each): use ``grammar_mode: native`` there when latency matters.  With the
    overlap scheduler the token histories lag one step (TensorRT-LLM PR
    16785), so the engine runs with ``disable_overlap_scheduler=True``.

Both wirings need the executor in this process: the processor calls the
``grammar`` model over BLS, which only works inside the Python-backend stub,
and the LLM API otherwise runs a single-GPU executor in an MPI worker process
(``TLLM_WORKER_USE_SINGLE_PROCESS=1`` keeps it here).  Tensor parallelism is
therefore refused in ``processor`` mode (rank 0 pickles processors to the
other ranks).

``grammar_mode: native`` forwards the validated constraint as
``GuidedDecodingParams`` to TensorRT-LLM's own xgrammar decoder; the
``grammar`` model still validates and compiles it once (errors, fidelity
report) and postprocessing still validates the output, but budget closing,
runaway closing and the shared compile cache do not apply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np
from tokenizers import Tokenizer

import contract
from grammar_backend.errors import ConfigError, InvalidArgument
from grammar_backend.metrics import Snapshot
from grammar_backend.spec import ConstraintKind, ConstraintOptions, SpecLimits, constraint_spec

from .detok import IncrementalDetokenizer, special_token_ids
from .engine import checkpoint_end_tokens
from .errors import (
    CANCELLED,
    Overloaded,
    RequestError,
    SchedulerClosed,
    config_error,
    status_of,
)
from .grammar_hook import GrammarLogitsProcessor, ProcessorStats
from .mask import ConstraintRequest, MaskProvider
from .scheduler import (
    EventCallback,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SchedulerConfig,
    TokenEvent,
    check_request,
    closed_finish,
)

__all__ = [
    "TRTLLM_BACKENDS",
    "TRTLLM_GRAMMAR_MODES",
    "TrtllmConfig",
    "TrtllmGenerator",
    "import_tensorrt_llm",
    "native_guided_kwargs",
    "trtllm_sampling_kwargs",
]

_log = logging.getLogger(__name__)

TRTLLM_BACKENDS: Final = ("pytorch", "tensorrt")
TRTLLM_GRAMMAR_MODES: Final = ("processor", "native")
#: How long a batched call waits for generate_async to return the id of a
#: request it already sees (the executor can run a step before the caller binds it).
_BIND_WAIT_S: Final = 5.0


def import_tensorrt_llm() -> ModuleType:
    """Import ``tensorrt_llm``, or fail with the reason and the remedy.

    Raises
    ------
    grammar_backend.errors.ConfigError
        When the package is missing (anywhere but the NGC ``trtllm-python-py3``
        image) or no CUDA device is visible.
    """
    try:
        import tensorrt_llm  # type: ignore[import-not-found,unused-ignore]
    except ImportError as err:
        raise ConfigError(
            "llm: engine 'tensorrt_llm' needs the tensorrt_llm package and a CUDA GPU "
            f"(the NGC tritonserver trtllm-python-py3 image, see deploy/gpu/README.md): {err}; "
            "use engine 'torch' elsewhere"
        ) from err
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("llm: engine 'tensorrt_llm' needs a CUDA GPU (torch.cuda.is_available() is False)")
    return tensorrt_llm  # type: ignore[no-any-return]


@dataclass(frozen=True)
class TrtllmConfig:
    """Settings of :class:`TrtllmGenerator`.

    Attributes
    ----------
    model_dir : str
        The Hugging Face checkpoint folder: ``tokenizer.json`` (the output is
        detokenized here, not by TensorRT-LLM), the end tokens, ``vocab_size``,
        and the model itself for the ``pytorch`` backend.
    engine_dir : str
        The built TensorRT engine folder (``tensorrt`` backend only, required there).
    backend : str
        One of :data:`TRTLLM_BACKENDS` (see the module docstring).
    grammar_mode : str
        One of :data:`TRTLLM_GRAMMAR_MODES`.
    max_batch, max_seq_len : int
        TensorRT-LLM's ``max_batch_size`` and ``max_seq_len``.
    kv_cache_free_fraction : float
        ``KvCacheConfig.free_gpu_memory_fraction``.
    tensor_parallel_size : int
        GPUs per replica (``native`` mode only above 1).
    """

    model_dir: str
    engine_dir: str = ""
    backend: str = "pytorch"
    grammar_mode: str = "processor"
    max_batch: int = 64
    max_seq_len: int = 4096
    kv_cache_free_fraction: float = 0.85
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.backend not in TRTLLM_BACKENDS:
            raise config_error("trtllm_backend", f"must be one of {', '.join(TRTLLM_BACKENDS)}, got {self.backend!r}")
        if self.grammar_mode not in TRTLLM_GRAMMAR_MODES:
            raise config_error("grammar_mode", f"engine tensorrt_llm takes {', '.join(TRTLLM_GRAMMAR_MODES)}, "
                                               f"got {self.grammar_mode!r}")
        for name in ("max_batch", "max_seq_len", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(name, f"must be a positive integer, got {value!r}")
        if self.grammar_mode == "processor" and self.tensor_parallel_size != 1:
            raise config_error("tensor_parallel_size", "grammar_mode 'processor' runs the executor in this process "
                                                       "(BLS works only here): 1 GPU per replica, or use 'native'")
        if (self.backend == "tensorrt") != bool(self.engine_dir):
            raise config_error("engine_dir", "is required with trtllm_backend 'tensorrt' and only there")
        f = self.kv_cache_free_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise config_error("kv_cache_free_fraction", f"must be in (0, 1), got {f!r}")


def native_guided_kwargs(constraint: ConstraintRequest) -> dict[str, Any]:
    """``GuidedDecodingParams`` keyword arguments for a constraint (``grammar_mode: native``).

    TensorRT-LLM's decoder takes the constraint text only, with its own JSON
    formatting defaults, so a request whose grammar-shaping options differ
    from the defaults, or a Lark grammar, is refused rather than served with
    another meaning.

    Raises
    ------
    grammar_backend.errors.InvalidArgument
        A constraint native mode cannot express (naming the field).
    """
    spec = constraint_spec(constraint.kind, constraint.payload, constraint.options_json, SpecLimits(),
                           validated=constraint.validated)
    if spec.options.backend == "llguidance":
        raise InvalidArgument("grammar_options.backend", "the server's native grammar mode masks with TensorRT-LLM's "
                                                         "xgrammar backend")
    if spec.options.canonical() != ConstraintOptions().canonical():
        raise InvalidArgument("options", "strict, whitespace, indent and any_order are not supported by the "
                                         "server's native grammar mode (TensorRT-LLM's own defaults apply)")
    kind = spec.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return {"json": spec.payload}
    if kind is ConstraintKind.JSON_OBJECT:
        # Not TensorRT-LLM's json_object (xgrammar's builtin JSON grammar, any
        # value): the contract's meaning, an object, as a schema.
        return {"json": contract.JSON_OBJECT_SCHEMA}
    if kind is ConstraintKind.REGEX:
        return {"regex": spec.payload}
    if kind is ConstraintKind.EBNF:
        return {"grammar": spec.payload}
    if kind is ConstraintKind.CHOICE:
        from grammar_backend.compile import choice_ebnf

        return {"grammar": choice_ebnf(spec.document)}
    if kind is ConstraintKind.STRUCTURAL_TAG:
        return {"structural_tag": json.dumps(spec.document)}
    raise InvalidArgument("grammar_type", f"{kind.value!r} is not supported by the server's native grammar mode "
                                          "(TensorRT-LLM takes EBNF grammars, not Lark)")


def trtllm_sampling_kwargs(
    max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, end_ids: Iterable[int]
) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` keyword arguments for our validated sampling fields.

    Greedy (temperature 0) is ``top_k=1``; the first end token is ``end_id``
    (required without a TensorRT-LLM tokenizer) and the others are stop token ids.
    Detokenization and stop strings stay ours (:class:`IncrementalDetokenizer`),
    so every engine cuts text the same way.
    """
    ends = sorted(end_ids)
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "end_id": ends[0],
        "pad_id": ends[0],
        "stop_token_ids": ends[1:] or None,
        "detokenize": False,
        "n": 1,
    }
    if temperature == 0:
        kwargs["top_k"] = 1
    else:
        kwargs.update(temperature=float(temperature), top_k=top_k or None, top_p=float(top_p))
    if seed is not None:
        kwargs["seed"] = seed
    return kwargs


class _BatchedHook:
    """The ``tensorrt`` backend's batched processor: maps client ids to grammar rows, then one call.

    A request's id is known only when ``generate_async`` returns, and the
    executor may run its first step before that: an unknown id is waited for
    (at most ``_BIND_WAIT_S``) only while some ``generate_async`` call is in
    flight (:meth:`submitting`); an aborted request keeps coming for a step or
    two after :meth:`unbind`, and gets no row (-1) without any wait.
    """

    def __init__(self, processor: GrammarLogitsProcessor) -> None:
        self._processor = processor
        self._keys: dict[int, int] = {}
        self._pending = 0
        self._cond = threading.Condition()

    def submitting(self) -> None:
        with self._cond:
            self._pending += 1

    def bind(self, client_id: int | None, key: int) -> None:
        """``generate_async`` returned (``client_id`` None: it raised)."""
        with self._cond:
            self._pending -= 1
            if client_id is not None:
                self._keys[client_id] = key
            self._cond.notify_all()

    def unbind(self, client_id: int) -> None:
        with self._cond:
            self._keys.pop(client_id, None)

    def __call__(self, req_ids: Sequence[int], logits: Sequence[Any], token_ids: Sequence[Sequence[Sequence[int]]],
                 stream_ptr: int, client_ids: Sequence[int | None]) -> None:
        with self._cond:
            self._cond.wait_for(
                lambda: self._pending == 0 or all(c in self._keys for c in client_ids if c is not None),
                _BIND_WAIT_S)
            # An unbound row (key -1) stays unmasked for this call only; its tokens are
            # fed to the grammar at the next call, which fails the request if it refuses them.
            keys = [self._keys.get(c, -1) if c is not None else -1 for c in client_ids]
        self._processor(keys, logits, token_ids, stream_ptr)


@dataclass(eq=False)
class _Request:
    rid: str
    seq_id: int
    prompt: np.ndarray
    max_tokens: int
    sampling: dict[str, Any]
    constraint: ConstraintRequest | None
    callback: EventCallback
    detok: IncrementalDetokenizer
    guided: dict[str, Any] | None = None
    result: Any = None  # tensorrt_llm RequestOutput
    cancelled: bool = False
    finished: bool = False
    has_row: bool = False
    backend: str | None = None  # the grammar backend that masks it
    generated: int = 0


class TrtllmGenerator:
    """In-flight batched generation by TensorRT-LLM, masked by the ``grammar`` model.

    The same surface as :class:`llm_runtime.scheduler.Scheduler` for the
    ``llm`` model: :meth:`submit`, :meth:`cancel`, :meth:`close`,
    :meth:`summary`; the same events, and the same metric snapshots (``on_metrics``).

    Parameters
    ----------
    config : TrtllmConfig
        Engine settings.
    provider : MaskProvider
        The grammar side (BLS to the ``grammar`` model).
    limits : SchedulerConfig
        Request limits shared with the torch scheduler (``max_tokens_cap``,
        ``max_queued``, stop strings, start threads).
    on_metrics : callable, optional
        Receives the ``llm`` gauges (live and waiting requests) whenever they
        change; TensorRT-LLM's own iteration stats hold the per-step figures.
    """

    def __init__(self, config: TrtllmConfig, provider: MaskProvider, limits: SchedulerConfig | None = None,
                 on_metrics: Callable[[Snapshot], None] | None = None) -> None:
        trt = import_tensorrt_llm()
        self._on_metrics = on_metrics
        from tensorrt_llm.llmapi import KvCacheConfig  # type: ignore[import-not-found,unused-ignore]
        from tensorrt_llm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
            GuidedDecodingParams,
            LogitsProcessor,
            SamplingParams,
        )

        self._guided_cls = GuidedDecodingParams
        self._sampling_cls = SamplingParams
        self._cfg = config
        self._limits = limits if limits is not None else SchedulerConfig()
        self._provider = provider
        hf = Path(config.model_dir)
        tok_file = hf / "tokenizer.json"
        if not tok_file.is_file():
            raise config_error("model_dir", f"{str(hf)!r} has no tokenizer.json")
        self._tokenizer = Tokenizer.from_file(str(tok_file))
        self._special = special_token_ids(self._tokenizer)
        self._eos = checkpoint_end_tokens(hf)
        try:
            self._vocab = int(json.loads((hf / "config.json").read_text(encoding="utf-8"))["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise config_error("model_dir", f"{str(hf)!r}/config.json names no vocab_size: {err}") from err
        self._processor: GrammarLogitsProcessor | None = None
        self._batched: _BatchedHook | None = None
        kwargs: dict[str, Any] = {
            "model": config.engine_dir or config.model_dir,
            "skip_tokenizer_init": True,
            "max_batch_size": config.max_batch,
            "max_seq_len": config.max_seq_len,
            "tensor_parallel_size": config.tensor_parallel_size,
            "kv_cache_config": KvCacheConfig(free_gpu_memory_fraction=config.kv_cache_free_fraction),
        }
        if config.grammar_mode == "processor":
            if os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1") != "1":
                raise config_error("TLLM_WORKER_USE_SINGLE_PROCESS", "must be 1 in grammar_mode 'processor' "
                                                                     "(the processor calls BLS from this process)")
            self._processor = GrammarLogitsProcessor(provider, vocab_size=self._vocab, end_token_ids=self._eos,
                                                     max_rows=config.max_batch, device="cuda")
            if config.backend == "tensorrt":
                self._batched = _BatchedHook(self._processor)
                kwargs["batched_logits_processor"] = self._batched
            else:
                kwargs["disable_overlap_scheduler"] = True
        else:
            kwargs["guided_decoding_backend"] = "xgrammar"
            # TensorRT-LLM's guided decoder builds its xgrammar tokenizer info from
            # its own tokenizer (create_py_executor asserts one; the TensorRT path
            # calls _xgrammar_tokenizer_info on it): load it here. Output is still
            # detokenized by us (SamplingParams.detokenize=False).
            kwargs["skip_tokenizer_init"] = False
            kwargs["tokenizer"] = config.model_dir
        if config.backend == "tensorrt":
            from tensorrt_llm._tensorrt_engine import LLM  # type: ignore[import-not-found,unused-ignore]
        else:
            LLM = trt.LLM
        self._row_processor = _row_processor_class(LogitsProcessor) if self._processor is not None else None
        self._llm = LLM(**kwargs)
        self._lock = threading.Lock()
        self._live: dict[str, _Request] = {}
        self._closing = False
        self._max_live = 0
        self._starts = ThreadPoolExecutor(self._limits.start_threads, thread_name_prefix="llm-grammar-start")
        self._finishers = ThreadPoolExecutor(4, thread_name_prefix="llm-trtllm-finish")
        self._drained = threading.Condition(self._lock)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llm-trtllm-loop", daemon=True)
        self._thread.start()

    # -- the Scheduler surface ------------------------------------------------
    def processor_stats(self) -> ProcessorStats | None:
        return None if self._processor is None else self._processor.stats()

    def summary(self) -> dict[str, float | int]:
        """Figures logged by the ``llm`` model at shutdown."""
        out: dict[str, float | int] = {"max_live": self._max_live}
        ps = self.processor_stats()
        if ps is not None:
            out.update(dataclasses.asdict(ps))
        return out

    def submit(self, request: GenerationRequest, callback: EventCallback) -> str:
        """Queue a request; thread-safe (see :meth:`llm_runtime.scheduler.Scheduler.submit`)."""
        checked = check_request(request, callback, self._limits, vocab_size=self._vocab,
                                context_len=self._cfg.max_seq_len)
        p = checked.params
        req = _Request(
            rid=request.request_id or f"req-{secrets.token_hex(16)}",
            seq_id=secrets.randbits(64) or 1,
            prompt=checked.prompt,
            max_tokens=request.max_tokens,
            sampling=trtllm_sampling_kwargs(request.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, self._eos),
            constraint=checked.constraint,
            callback=callback,
            detok=IncrementalDetokenizer(self._tokenizer, stop=checked.stop, special_ids=self._special),
        )
        with self._lock:
            if self._closing:
                raise SchedulerClosed("the engine is closed")
            if len(self._live) >= self._limits.max_queued:
                raise Overloaded(f"{len(self._live)} requests are queued (max_queued {self._limits.max_queued})")
            if req.rid in self._live:
                raise RequestError("request_id", f"{req.rid!r} is already in flight")
            self._live[req.rid] = req
            self._max_live = max(self._max_live, len(self._live))
        self._publish()
        if req.constraint is None:
            asyncio.run_coroutine_threadsafe(self._run(req), self._loop)
        else:
            self._starts.submit(self._start, req)
        return req.rid

    def cancel(self, request_id: str) -> bool:
        """Abort a request; it ends with a ``CANCELLED`` :class:`FinishEvent`."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None:
                return False
            req.cancelled = True
            result = req.result
        if result is not None:
            self._loop.call_soon_threadsafe(result.abort)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Abort what is in flight, wait until every request has its final event, then shut down.

        Requests still live after ``timeout`` (an executor that stopped
        answering) are left to the shutdown; it is logged.
        """
        with self._lock:
            self._closing = True
            live = list(self._live)
        for rid in live:
            self.cancel(rid)
        self._starts.shutdown(wait=True)
        with self._drained:
            if not self._drained.wait_for(lambda: not self._live, timeout):
                _log.error("TensorRT-LLM: %d requests still live at shutdown", len(self._live))
        self._llm.shutdown()
        self._finishers.shutdown(wait=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()

    def _publish(self) -> None:
        if self._on_metrics is None:
            return
        with self._lock:
            live = len(self._live)
            waiting = sum(1 for r in self._live.values() if r.result is None)
        snap = Snapshot()
        snap.put("llm_live_requests", live)
        snap.put("llm_waiting_requests", waiting)
        try:
            self._on_metrics(snap)
        except Exception:  # noqa: BLE001 -- metrics must never fail requests; logged
            _log.exception("publishing the llm metrics failed")

    # -- per request ------------------------------------------------------------
    def _start(self, req: _Request) -> None:
        """On a start thread: compile (the grammar model), then hand the request to the loop."""
        c = req.constraint
        if c is None:
            return
        try:
            if self._processor is not None:
                req.backend = self._processor.start(req.seq_id, req.seq_id, c, int(req.prompt.shape[0]))
                req.has_row = True
            else:
                # Native: the grammar model validates and compiles once (errors,
                # fidelity report); TensorRT-LLM's own decoder masks.
                req.guided = native_guided_kwargs(c)
                self._provider.start(req.seq_id, c)
                self._provider.end([req.seq_id])
                req.backend = "xgrammar"  # TensorRT-LLM's guided decoder (guided_decoding_backend)
        except Exception as err:  # noqa: BLE001 -- delivered to the request as its FinishEvent
            self._deliver_finish(req, "error", error=str(err), status=status_of(err))
            return
        asyncio.run_coroutine_threadsafe(self._run(req), self._loop)

    async def _run(self, req: _Request) -> None:
        reason: FinishReason = "error"
        error: str | None = None
        status: str | None = None
        stop_string = False
        try:
            if req.cancelled:
                raise _Cancelled
            sampling = dict(req.sampling)
            if self._row_processor is not None and req.has_row and self._batched is None:
                sampling["logits_processor"] = self._row_processor(self._processor, req.seq_id)
            if self._batched is not None and req.has_row:
                sampling["apply_batched_logits_processor"] = True
            if req.guided is not None:
                sampling["guided_decoding"] = self._guided_cls(**req.guided)
            batched = self._batched if req.has_row else None
            if batched is not None:
                batched.submitting()
            try:
                result = self._llm.generate_async({"prompt_token_ids": req.prompt.tolist()},
                                                  self._sampling_cls(**sampling), streaming=True)
            except BaseException:
                if batched is not None:
                    batched.bind(None, req.seq_id)
                raise
            req.result = result
            if batched is not None:
                batched.bind(result.request_id, req.seq_id)
            if req.cancelled:
                result.abort()
            async for out in result:
                done = False
                for tok in out.outputs[0].token_ids_diff:
                    req.generated += 1
                    if tok in self._eos:
                        reason, done = "stop", True
                        break
                    delta = req.detok.push(tok)
                    if req.detok.stopped:
                        stop_string, reason, done = True, "stop", True
                        result.abort()
                    req.callback(TokenEvent(delta, (int(tok),)))
                    if done:
                        break
                if done:
                    break
                if out.finished:
                    fr = out.outputs[0].finish_reason
                    reason = "length" if fr == "length" else "stop"
                    if fr == "cancelled":
                        raise _Cancelled
            if req.cancelled:
                raise _Cancelled
        except _Cancelled:
            reason, error, status = "error", "request cancelled", CANCELLED
        except Exception as err:  # noqa: BLE001 -- the request ends with the error; the engine goes on
            _log.exception("TensorRT-LLM request %s failed", req.rid)
            reason, error, status = "error", f"generation failed: {err}", status_of(err)
            if req.result is not None:
                req.result.abort()
        finally:
            if self._batched is not None and req.result is not None:
                self._batched.unbind(req.result.request_id)
        # Ending the grammar row is a BLS call that may wait for a processor step:
        # off the loop thread, which serves every other stream.
        await asyncio.get_running_loop().run_in_executor(
            self._finishers, functools.partial(self._deliver_finish, req, reason, error=error, status=status,
                                               stop_string=stop_string))

    def _deliver_finish(self, req: _Request, reason: FinishReason, *, error: str | None = None,
                        status: str | None = None, stop_string: bool = False) -> None:
        if req.finished:
            return
        req.finished = True
        close_reason = None
        if req.has_row and self._processor is not None:
            outcome = self._processor.remove([req.seq_id])[0]
            if outcome is None and reason != "error":
                reason, error, status = "error", "the grammar row is missing", "INTERNAL"
            elif outcome is not None and outcome.error is not None and reason != "error":
                reason, error, status = "error", outcome.error, "INTERNAL"
            elif outcome is not None and reason != "error":
                reason, close_reason = closed_finish(reason, outcome.close_state, stop_string)
        with self._lock:
            self._live.pop(req.rid, None)
            self._drained.notify_all()
        self._publish()
        tail = req.detok.finish()
        try:
            if tail:
                req.callback(TokenEvent(tail, ()))
            req.callback(FinishEvent(reason, req.detok.text, int(req.prompt.shape[0]), req.generated,
                                     error=error, error_status=status, close_reason=close_reason,
                                     stop_string=stop_string, backend=req.backend))
        except Exception:  # noqa: BLE001 -- a caller's bug must not stop the loop; logged
            _log.exception("event callback of request %s raised", req.rid)


class _Cancelled(Exception):
    """The request was cancelled (by :meth:`TrtllmGenerator.cancel` or TensorRT-LLM)."""


def _row_processor_class(base: type) -> type:
    """The ``pytorch`` backend's per-request processor, a ``tensorrt_llm`` ``LogitsProcessor``."""

    class RowProcessor(base):  # type: ignore[misc,valid-type]
        """Forwards TensorRT-LLM's per-request call to the shared processor as a batch of one."""

        def __init__(self, processor: GrammarLogitsProcessor, key: int) -> None:
            super().__init__()
            self._processor = processor
            self._key = [key]

        def __call__(self, req_id: int, logits: Any, token_ids: list[list[int]], stream_ptr: int | None,
                     client_id: int | None) -> None:
            del req_id, client_id
            self._processor(self._key, [logits], [token_ids], stream_ptr)

    return RowProcessor
