"""The TensorRT-LLM engine of the ``llm`` model (GPU, NGC ``trtllm-python-py3`` image).

NOT RUN where this project is built and tested: ``tensorrt_llm`` has no
wheel these machines can install and CI has no GPU.  Pinned to TensorRT-LLM
:data:`llm_runtime.trtllm_api.TRTLLM_VERSION` (the NGC
``26.07-trtllm-python-py3`` image) and its PyTorch backend, the one backend
TensorRT-LLM keeps (the TensorRT engine backend and its
``batched_logits_processor`` were removed after v1.3.0rc20).  What runs
here: the grammar rows (:mod:`llm_runtime.grammar_hook`, driven in
TensorRT-LLM's per-step order by ``tests/unit/test_grammar_hook.py``), the
API check (:func:`llm_runtime.trtllm_api.check_trtllm_api`),
:func:`native_guided_kwargs`, the sampling mapping, the bounded wait
(:func:`next_output`) and the refusal when the package is missing.

How the bitmask reaches TensorRT-LLM (``grammar_mode: processor``)
-----------------------------------------------------------------
TensorRT-LLM's PyTorch executor builds one token bitmask per step for all
guided rows in ``GuidedDecoder`` (``_torch/pyexecutor/guided_decoder.py``)
and applies it on the GPU with one kernel; with the overlap scheduler the
host-side build runs while the next forward is queued.  The engine replaces
only the host-side build: :class:`llm_runtime.trtllm_decoder.GrammarModelDecoder`
(a subclass installed in place of ``GuidedDecoder`` while ``LLM(...)`` builds its
executor) answers ``_build`` with ONE grammar-channel request for every
constrained row (:class:`llm_runtime.grammar_hook.GrammarRows`).  Each
constrained request carries ``GuidedDecodingParams(regex=GrammarRows.guide(seq_id))``:
TensorRT-LLM then treats it as guided, and the row names its grammar
sequence.  The executor must run in this process (the grammar channel is
found over BLS, which works only in the Python-backend stub):
``TLLM_WORKER_USE_SINGLE_PROCESS=1``, one GPU per replica.

Why not per-request ``SamplingParams.logits_processor``: the PyTorch
backend calls them one request at a time (``PyTorchModelEngine._execute_logit_post_processors``),
so a step would cost one grammar round trip per constrained request, and
TensorRT-LLM 1.1-1.2 pickles them with every new request, even at world size 1
(``executor_request_queue._broadcast_new_requests`` -> ``MPIDist.broadcast``).
Nothing this engine hands TensorRT-LLM holds more than strings and numbers
(``tests/unit/test_trtllm_engine.py -k pickle``).

Sources read (the project's search tool; the TensorRT-LLM repository itself
is too large to mirror here, so these are the stored versions of each file,
checked at load by :func:`llm_runtime.trtllm_api.check_trtllm_api` against
the installed package):
``tensorrt_llm/_torch/pyexecutor/guided_decoder.py`` (commits 07dacbbc, 40bb912b,
and the later version whose ``_build``/``execute`` return failed requests),
``py_executor.py`` (``_executor_loop``, ``_executor_loop_overlap``: ``add_batch``
again after ``_update_requests``, then ``execute(logits)``), ``py_executor_creator.py``
(``create_py_executor``: ``GuidedDecoder(**kwargs)`` by name), ``grammar_matcher.py``
(0fccc5b9), ``executor/executor.py`` (``TLLM_WORKER_USE_SINGLE_PROCESS``),
``executor/base_worker.py`` (``setup_engine``), ``_torch/distributed/communicator.py``
(01002888) and ``executor_request_queue.py`` (007a7508); PyPI metadata of
tensorrt_llm 1.2.1 for its pins.

``grammar_mode: native`` forwards the validated constraint as
``GuidedDecodingParams`` to TensorRT-LLM's own xgrammar matchers; the
``grammar`` model still validates and compiles it once (errors, fidelity
report) and postprocessing still validates the output, but budget closing
(every ``on_budget`` acts as ``truncate``: see :func:`native_guided_kwargs`),
runaway closing and the shared compile cache do not apply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import json
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np
from tokenizers import Tokenizer

import contract
from contract.finish import FinishEvent, FinishReason
from grammar_backend.errors import InvalidArgument
from grammar_backend.regex_dialect import portable_regex
from grammar_backend.spec import ConstraintKind, ConstraintOptions, SpecLimits, choice_ebnf, constraint_spec
from telemetry import Snapshot

from .checkpoint import checkpoint_end_tokens
from .detok import IncrementalDetokenizer, special_token_ids
from .errors import (
    CANCELLED,
    EngineStalled,
    Overloaded,
    RequestError,
    SchedulerClosed,
    config_error,
    status_of,
)
from .grammar_hook import GrammarRows
from .mask import ConstraintRequest, MaskProvider
from .sampler import SamplingParams
from .scheduler import (
    EventCallback,
    GenerationRequest,
    SchedulerConfig,
    TokenEvent,
    check_request,
    closed_finish,
)
from .trtllm_api import import_tensorrt_llm
from .trtllm_speculative import SpeculativeConfig

__all__ = [
    "TRTLLM_GRAMMAR_MODES",
    "TRTLLM_LOGPROBS_REFUSAL",
    "TRTLLM_SAMPLERS",
    "TrtllmConfig",
    "TrtllmGenerator",
    "native_guided_kwargs",
    "next_output",
    "trtllm_sampling_kwargs",
]

_log = logging.getLogger(__name__)

TRTLLM_GRAMMAR_MODES: Final = ("processor", "native")
#: Why a request with ``logprobs`` is refused (at admission, by name): TensorRT-LLM's
#: ``SamplingParams.logprobs`` is not this field.  Read (the project's search tool):
#: ``sampling_params.py`` (1.0.0rc4) turns ``logprobs=0`` into no log probabilities
#: (``return_log_probs = bool(self.logprobs)``), and ``_torch/pyexecutor/sampler.py``'s
#: TorchSampler takes the log-softmax of the logits as the guided decoder masked them
#: (the same numbers, "not reflect temperature scaling, top-k/top-p masking") only for
#: requests whose ``py_num_logprobs`` is non-zero; TRTLLMSampler's come from the C++
#: decoder.  Neither is checked against 1.2.1 on a GPU, so none is passed off as this field.
TRTLLM_LOGPROBS_REFUSAL: Final = (
    "not served by the tensorrt_llm engine (TensorRT-LLM 1.2.1's log probabilities are not checked to be this "
    "field's: taken after the grammar mask and before temperature and truncation, with logprobs=0 reporting the "
    "token's own); use engine torch")
#: TensorRT-LLM's ``sampler_type`` values this engine takes (``auto`` is TorchSampler without beam search).
TRTLLM_SAMPLERS: Final = ("TorchSampler", "TRTLLMSampler")


@dataclass(frozen=True)
class TrtllmConfig:
    """Settings of :class:`TrtllmGenerator`.

    Attributes
    ----------
    model_dir : str
        The Hugging Face checkpoint folder: the model, ``tokenizer.json``
        (the output is detokenized here, not by TensorRT-LLM), the end tokens
        and ``vocab_size``.
    grammar_mode : str
        One of :data:`TRTLLM_GRAMMAR_MODES`.
    max_batch, max_seq_len : int
        TensorRT-LLM's ``max_batch_size`` and ``max_seq_len`` (required; the
        defaults are :class:`~llm_runtime.model_config.LlmModelConfig`'s).
    kv_cache_free_fraction : float
        ``KvCacheConfig.free_gpu_memory_fraction``.
    tensor_parallel_size : int
        GPUs per replica (``native`` mode only above 1).
    stall_timeout_s : float
        Longest wait for TensorRT-LLM's next output of a request; a request
        that gets none for this long is aborted and ends with an error (an
        executor that stopped answering never holds a stream forever).
    sampler_type : str
        One of :data:`TRTLLM_SAMPLERS`, TensorRT-LLM's ``sampler_type``.  Its
        default ``TorchSampler`` (1.2.1) accepts ``repetition_penalty``,
        ``frequency_penalty`` and ``presence_penalty`` in ``SamplingParams``
        and ignores them (TensorRT-LLM PR 16485, 2026-07, added them later), so
        under it a request with a penalty or ``min_p`` is refused by name;
        ``TRTLLMSampler`` (the C++ sampler's penalty kernels) applies them.
    speculative : SpeculativeConfig or None
        TensorRT-LLM's speculative decoding (``TRTLLM_SPECULATIVE_CONFIG``,
        :mod:`llm_runtime.trtllm_speculative`); None: none.
    """

    model_dir: str
    # No defaults: LlmModelConfig (max_batch, max_seq_len) holds the one default of each.
    max_batch: int
    max_seq_len: int
    grammar_mode: str = "processor"
    kv_cache_free_fraction: float = 0.85
    tensor_parallel_size: int = 1
    stall_timeout_s: float = 120.0
    sampler_type: str = "TorchSampler"
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.sampler_type not in TRTLLM_SAMPLERS:
            raise config_error("sampler_type", f"must be one of {', '.join(TRTLLM_SAMPLERS)}, got {self.sampler_type!r}")
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
        f = self.kv_cache_free_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise config_error("kv_cache_free_fraction", f"must be in (0, 1), got {f!r}")
        t = self.stall_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise config_error("stall_timeout_s", f"must be in (0, 3600], got {t!r}")
        spec = self.speculative
        if spec is not None and self.sampler_type == "TRTLLMSampler" and spec.decoding_type in ("Eagle", "Eagle3", "MTP"):
            # _torch/pyexecutor/_util.py validate_feature_combination (1.2 line) raises this after the model loads.
            raise config_error("trtllm_sampler", f"TensorRT-LLM 1.2.1 does not run TRTLLMSampler with decoding_type "
                                                 f"{spec.decoding_type} (its speculative sampler decides): use TorchSampler")


def occupancy(live: int, compiling: int, max_batch: int) -> tuple[int, int]:
    """The batch and queue gauges of the GPU path, from what this engine knows.

    TensorRT-LLM schedules at most ``max_batch_size`` of the requests it holds
    (fewer when the KV cache runs short, which only its iteration stats show;
    those are not read: see deploy/gpu/README.md) and queues the rest.  So the
    batch is what it holds, capped at ``max_batch``, and the waiting requests
    are those compiling here plus those queued there: the occupancy signals of
    the GPU overlay's autoscaler (deploy/k8s/overlays/gpu/hpa-patch.yaml).

    Parameters
    ----------
    live : int
        Requests not finished (compiling, queued or decoding).
    compiling : int
        Requests not yet handed to TensorRT-LLM (their grammar compiles).
    max_batch : int
        TensorRT-LLM's ``max_batch_size``.

    Returns
    -------
    tuple of (int, int)
        ``(llm_batch_size, llm_waiting_requests)``.
    """
    held = live - compiling
    batch = min(held, max_batch)
    return batch, compiling + held - batch


def native_guided_kwargs(constraint: ConstraintRequest) -> dict[str, Any]:
    """``GuidedDecodingParams`` keyword arguments for a constraint (``grammar_mode: native``).

    TensorRT-LLM's decoder takes the constraint text only, with its own JSON
    formatting defaults, so a request whose grammar-shaping options differ
    from the defaults, or a Lark grammar, is refused rather than served with
    another meaning.  Its decoder cannot close an output before
    ``max_tokens`` runs out: every ``on_budget`` is served as ``truncate``
    (finish reason ``length``, RESULT not complete).  Refusing ``close``
    would refuse every default request, so the mode is documented instead.

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
    if spec.options.reasoning is not None:
        # TensorRT-LLM's own decoder applies the grammar from the first token: the thinking would be constrained.
        raise InvalidArgument("reasoning", "a thinking section before a constrained answer is not served by the "
                                           "server's native grammar mode (use grammar_mode processor)")
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
        return {"regex": portable_regex(spec.payload)}
    if kind is ConstraintKind.EBNF:
        return {"grammar": spec.payload}
    if kind is ConstraintKind.CHOICE:
        return {"grammar": choice_ebnf(spec.document)}
    if kind is ConstraintKind.STRUCTURAL_TAG:
        return {"structural_tag": json.dumps(spec.document)}
    raise InvalidArgument("grammar_type", f"{kind.value!r} is not supported by the server's native grammar mode "
                                          "(TensorRT-LLM takes EBNF grammars, not Lark)")


def trtllm_sampling_kwargs(
    max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, end_ids: Iterable[int],
    *, penalties: SamplingParams | None = None, prompt_len: int = 0, sampler_type: str = "TorchSampler",
) -> dict[str, Any]:
    """``tensorrt_llm.SamplingParams`` keyword arguments for our validated sampling fields.

    Greedy (temperature 0) is ``top_k=1``; the first end token is ``end_id``
    (required without a TensorRT-LLM tokenizer) and the others are stop token ids.
    Detokenization and stop strings stay ours (:class:`IncrementalDetokenizer`),
    so every engine cuts text the same way.

    ``penalties`` (the request's checked :class:`SamplingParams`) map to the
    fields of the same names; its ``logprobs`` is refused
    (:data:`TRTLLM_LOGPROBS_REFUSAL`).  TensorRT-LLM counts the prompt for all three
    penalties unless ``prompt_ignore_length`` says how many prompt tokens to
    skip for frequency and presence (PR 8127, in 1.2): it is the prompt's
    length, so those two count the output only, as the torch engine and
    OpenAI's API do, and the repetition penalty still sees the prompt.

    Raises
    ------
    RequestError
        A penalty or ``min_p`` under ``TorchSampler``, which does not apply them
        (see :attr:`TrtllmConfig.sampler_type`); ``logprobs`` under either sampler.
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
    if penalties is not None and penalties.logprobs is not None:
        raise RequestError("logprobs", TRTLLM_LOGPROBS_REFUSAL)
    if penalties is not None:
        asked = {name: getattr(penalties, name) for name, neutral in contract.PENALTY_FIELDS.items()
                 if getattr(penalties, name) != neutral}
        if asked and sampler_type == "TorchSampler":
            name = next(iter(asked))
            raise RequestError(name, "is not applied by TensorRT-LLM 1.2.1's TorchSampler; the server must be "
                                     "rendered with TRTLLM_SAMPLER=TRTLLMSampler")
        if temperature == 0:
            asked.pop("min_p", None)  # no draw to narrow
        kwargs.update(asked)
        if "frequency_penalty" in asked or "presence_penalty" in asked:
            kwargs["prompt_ignore_length"] = prompt_len
    return kwargs


_T = TypeVar("_T")


async def next_output(outputs: AsyncIterator[_T], timeout_s: float) -> _T:
    """The next item of ``outputs``, waiting at most ``timeout_s``.

    Raises
    ------
    StopAsyncIteration
        ``outputs`` is exhausted.
    EngineStalled
        Nothing came within ``timeout_s`` (the pending read is cancelled).
    """
    try:
        return await asyncio.wait_for(anext(outputs), timeout_s)
    except TimeoutError as err:
        raise EngineStalled(f"TensorRT-LLM sent no output for {timeout_s:g} s") from err


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
    """In-flight batched generation by TensorRT-LLM's PyTorch backend, masked by the ``grammar`` model.

    The same surface as :class:`llm_runtime.scheduler.Scheduler` for the
    ``llm`` model: :meth:`submit`, :meth:`cancel`, :meth:`close`,
    :meth:`summary`; the same events, and the same metric snapshots (``on_metrics``).

    Parameters
    ----------
    config : TrtllmConfig
        Engine settings.
    provider : MaskProvider
        The grammar side (the grammar channel to the ``grammar`` model).
    limits : SchedulerConfig
        Request limits shared with the torch scheduler (``max_queued``, stop
        strings, start threads; ``max_tokens`` is bounded by preprocessing and
        by ``max_seq_len``).
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
        # TensorRT-LLM builds its guided decoder only with a backend and a tokenizer
        # (create_py_executor -> get_guided_decoding_config); the output is still
        # detokenized here (SamplingParams.detokenize=False).
        kwargs: dict[str, Any] = {
            "model": config.model_dir,
            "tokenizer": config.model_dir,
            "skip_tokenizer_init": False,
            "max_batch_size": config.max_batch,
            "max_seq_len": config.max_seq_len,
            "tensor_parallel_size": config.tensor_parallel_size,
            "kv_cache_config": KvCacheConfig(free_gpu_memory_fraction=config.kv_cache_free_fraction),
            "guided_decoding_backend": "xgrammar",
            "sampler_type": config.sampler_type,
        }
        if config.speculative is not None:
            kwargs["speculative_config"] = config.speculative.build(importlib.import_module("tensorrt_llm.llmapi"))
            _log.info("llm: TensorRT-LLM speculative decoding %s (mode %s, %d draft tokens a row)",
                      config.speculative.decoding_type, config.speculative.mode, config.speculative.draft_len)
        self._rows: GrammarRows | None = None
        if config.grammar_mode == "processor":
            if os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1") != "1":
                raise config_error("TLLM_WORKER_USE_SINGLE_PROCESS", "must be 1 in grammar_mode 'processor' "
                                                                     "(the grammar channel is reached from this process)")
            from . import trtllm_decoder

            self._rows = GrammarRows(provider, vocab_size=self._vocab, end_token_ids=self._eos,
                                     max_rows=config.max_batch)
            with trtllm_decoder.installed(self._rows):
                self._llm = trt.LLM(**kwargs)
            trtllm_decoder.check_installed(self._llm)
        else:
            self._llm = trt.LLM(**kwargs)
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
    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (the output is detokenized here)."""
        return self._tokenizer

    def summary(self) -> dict[str, float | int]:
        """Figures logged by the ``llm`` model at shutdown."""
        out: dict[str, float | int] = {"max_live": self._max_live}
        if self._rows is not None:
            out.update(dataclasses.asdict(self._rows.stats()))
        return out

    def submit(self, request: GenerationRequest, callback: EventCallback) -> str:
        """Queue a request; thread-safe (see :meth:`llm_runtime.scheduler.Scheduler.submit`)."""
        checked = check_request(request, callback, self._limits, vocab_size=self._vocab,
                                context_len=self._cfg.max_seq_len)
        if checked.draft_tokens:
            raise RequestError("draft_tokens", "prompt-lookup speculation is the torch engine's; TensorRT-LLM "
                                               "speculates for every request as the server sets it (TRTLLM_SPECULATIVE_CONFIG)")
        p = checked.params
        req = _Request(
            rid=request.request_id or f"req-{secrets.token_hex(16)}",
            seq_id=secrets.randbits(64) or 1,
            prompt=checked.prompt,
            max_tokens=request.max_tokens,
            sampling=trtllm_sampling_kwargs(request.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, self._eos,
                                            penalties=p, prompt_len=int(checked.prompt.shape[0]),
                                            sampler_type=self._cfg.sampler_type),
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
            if req is None or req.finished:
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
            compiling = sum(1 for r in self._live.values() if r.result is None)
        batch, waiting = occupancy(live, compiling, self._cfg.max_batch)
        snap = Snapshot()
        snap.put("llm_live_requests", live)
        snap.put("llm_batch_size", batch)
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
            if self._rows is not None:
                req.backend = self._rows.start(req.seq_id, c)
                req.has_row = True
                req.guided = {"regex": GrammarRows.guide(req.seq_id)}
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
        outputs: AsyncIterator[Any] | None = None
        held = False  # TensorRT-LLM holds the request: its final output has not come
        try:
            if req.cancelled:
                raise _Cancelled
            sampling = dict(req.sampling)
            if req.guided is not None:
                sampling["guided_decoding"] = self._guided_cls(**req.guided)
            result = self._llm.generate_async({"prompt_token_ids": req.prompt.tolist()},
                                              self._sampling_cls(**sampling), streaming=True)
            req.result, held = result, True
            if req.cancelled:
                result.abort()
            outputs = aiter(result)
            while True:
                try:
                    out = await next_output(outputs, self._cfg.stall_timeout_s)
                except StopAsyncIteration:
                    held = False
                    break
                except EngineStalled:
                    raise  # it may still hold the request: aborted below
                except Exception:
                    # An error response (the LLM API raises it): TensorRT-LLM has ended the
                    # request and sends nothing more for it.
                    held = False
                    raise
                held = not out.finished
                done = False
                for tok in out.outputs[0].token_ids_diff:
                    req.generated += 1
                    if tok in self._eos:
                        reason, done = "stop", True
                        break
                    delta = req.detok.push(tok)
                    if req.detok.stopped:
                        stop_string, reason, done = True, "stop", True
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
        if held:
            # Ended here first (a stop string, an end token before the final output, a
            # stall, an error): TensorRT-LLM drops the request at a later iteration.
            req.result.abort()
        # Ending the grammar row is a channel call that may wait for a decoder step:
        # off the loop thread, which serves every other stream.  The client gets its
        # answer now; a request TensorRT-LLM still holds keeps a retired row (end
        # tokens only, never a failure) until its final output.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._finishers, functools.partial(
            self._deliver_finish, req, reason, error=error, status=status, stop_string=stop_string, retire=held))
        if held:
            if outputs is not None:
                await self._until_final(req, outputs)
            try:
                await loop.run_in_executor(self._finishers, self._release, req)
            except RuntimeError:  # close() gave up waiting and shut the finishers down
                self._release(req)

    async def _until_final(self, req: _Request, outputs: AsyncIterator[Any]) -> None:
        """Wait for TensorRT-LLM's final output of an aborted request (no more than ``stall_timeout_s``
        between two outputs)."""
        try:
            while not (await next_output(outputs, self._cfg.stall_timeout_s)).finished:
                pass
        except StopAsyncIteration:
            pass
        except Exception:  # noqa: BLE001 -- its client has its answer; the row is released all the same
            _log.exception("TensorRT-LLM request %s: no final output after its abort; releasing its grammar row",
                           req.rid)

    def _deliver_finish(self, req: _Request, reason: FinishReason, *, error: str | None = None,
                        status: str | None = None, stop_string: bool = False, retire: bool = False) -> None:
        """Send the request's :class:`FinishEvent`.

        ``retire``: TensorRT-LLM still holds the request, so its grammar row is
        retired and the request stays live until :meth:`_release`; otherwise
        the row is removed and the request released here.
        """
        if req.finished:
            return
        req.finished = True
        close_reason = None
        reasoning_tokens, reasoning_cut = None, False
        if req.has_row and self._rows is not None:
            outcome = self._rows.retire(req.seq_id) if retire else self._rows.remove([req.seq_id])[0]
            if outcome is None and reason != "error":
                reason, error, status = "error", "the grammar row is missing", "INTERNAL"
            elif outcome is not None and outcome.error is not None and status != CANCELLED:
                # The row's own error, also where TensorRT-LLM ended the request for it
                # (the decoder's failed rows) with a message of its own.
                reason, error, status = "error", outcome.error, "INTERNAL"
            elif outcome is not None and reason != "error":
                reason, close_reason = closed_finish(reason, outcome.close_state, stop_string)
            if outcome is not None:
                reasoning_tokens, reasoning_cut = outcome.reasoning_tokens, outcome.reasoning_cut
        if not retire:
            self._forget(req)
        tail = req.detok.finish()
        try:
            if tail:
                req.callback(TokenEvent(tail, ()))
            req.callback(FinishEvent(finish_reason=reason, text=req.detok.text,
                                     prompt_tokens=int(req.prompt.shape[0]), completion_tokens=req.generated,
                                     error=error, status=status, close_reason=close_reason,
                                     stop_string=stop_string, backend=req.backend,
                                     reasoning_tokens=reasoning_tokens, reasoning_cut=reasoning_cut,
                                     seed=req.sampling.get("seed")))
        except Exception:  # noqa: BLE001 -- a caller's bug must not stop the loop; logged
            _log.exception("event callback of request %s raised", req.rid)

    def _release(self, req: _Request) -> None:
        """TensorRT-LLM is done with a request whose finish was delivered: remove its retired row."""
        if req.has_row and self._rows is not None:
            self._rows.remove([req.seq_id])
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        with self._lock:
            self._live.pop(req.rid, None)
            self._drained.notify_all()
        self._publish()


class _Cancelled(Exception):
    """The request was cancelled (by :meth:`TrtllmGenerator.cancel` or TensorRT-LLM)."""
