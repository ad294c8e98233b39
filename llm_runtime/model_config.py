"""Parameters of the ``llm`` Triton model and how they build its generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Final, Protocol

from tokenizers import Tokenizer

import contract
from grammar_backend.errors import ConfigError
from telemetry import Snapshot

from .mask import MaskProvider
from .remote_mask import RemoteMaskProvider
from .scheduler import (
    SCHEDULER_GRAMMAR_MODES,
    EventCallback,
    GenerationRequest,
    Scheduler,
    SchedulerConfig,
)
from .streaming import MAX_STREAM_INTERVAL_MS
from .trtllm_engine import TRTLLM_GRAMMAR_MODES, TRTLLM_SAMPLERS, TrtllmConfig
from .trtllm_speculative import parse_speculative_config

ENGINES: Final = ("torch", "tensorrt_llm")
#: The grammar modes each engine takes; the first is its default.
ENGINE_GRAMMAR_MODES: Final = {"torch": SCHEDULER_GRAMMAR_MODES, "tensorrt_llm": TRTLLM_GRAMMAR_MODES}


class Generator(Protocol):
    """What the ``llm`` model drives: :class:`Scheduler` or :class:`~llm_runtime.trtllm_engine.TrtllmGenerator`."""

    def submit(self, request: GenerationRequest, callback: EventCallback) -> str: ...
    def cancel(self, request_id: str) -> bool: ...
    def close(self, timeout: float | None = 30.0) -> None: ...
    def summary(self) -> dict[str, float | int]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...


@dataclass(frozen=True)
class LlmModelConfig:
    """``config.pbtxt`` parameters of ``llm``.

    ``engine``: ``torch`` (the embedded default, CPU or GPU) or
    ``tensorrt_llm`` (GPU, the NGC ``trtllm-python-py3`` image; refused with
    the reason where the package or a GPU is missing).  ``grammar_mode``:
    ``""`` = the engine's default; torch takes ``overlap`` (default) or
    ``processor``; tensorrt_llm takes ``processor`` (default) or ``native``
    (see :mod:`llm_runtime.trtllm_engine`; TensorRT-LLM's PyTorch backend, which
    loads ``model_dir``).  ``kv_cache_free_fraction`` and ``trtllm_sampler``
    (TensorRT-LLM's ``sampler_type``, ``""`` = TorchSampler, see
    :attr:`~llm_runtime.trtllm_engine.TrtllmConfig.sampler_type`) apply to tensorrt_llm only, and so does
    ``trtllm_speculative_config`` (TensorRT-LLM's ``speculative_config`` as a JSON object,
    :mod:`llm_runtime.trtllm_speculative`; ``""``: none).
    ``stream_interval_ms``: after the first text delta (sent at once), a
    request's text is sent once this many milliseconds have passed since its
    last response, and at the end (:class:`llm_runtime.streaming.DeltaCoalescer`;
    0: every token).  Each response costs IPC in two processes, an ensemble
    step and a gateway message, so a longer interval trades the smoothness
    of the stream for throughput at GPU token rates (docs/benchmarks.md).
    ``max_prefill_tokens`` (torch only; None: the scheduler's default for the device) bounds
    the prompt positions one step prefills
    (:attr:`~llm_runtime.scheduler.SchedulerConfig.max_prefill_tokens`;
    TensorRT-LLM bounds a step with its own ``max_num_tokens``).
    ``draft_tokens`` (torch only; 0, the default: off) is prompt-lookup
    speculation for the requests that do not set their own
    (:attr:`~llm_runtime.scheduler.SchedulerConfig.draft_tokens`); a request
    may ask for it either way, up to ``contract.MAX_DRAFT_TOKENS``, so the
    grammar channel's mask buffer holds that many draft positions a row.
    """

    model_dir: str
    engine: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 16
    max_seq_len: int = 2048
    torch_threads: int = 0
    grammar_model: str = "grammar"
    grammar_mode: str = ""
    kv_cache_free_fraction: float = 0.85
    trtllm_sampler: str = ""
    trtllm_speculative_config: str = ""
    stream_interval_ms: float = 0.0
    max_prefill_tokens: int | None = None
    draft_tokens: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"llm: engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        modes = ENGINE_GRAMMAR_MODES[self.engine]
        if self.grammar_mode and self.grammar_mode not in modes:
            raise ConfigError(f"llm: engine {self.engine!r} takes grammar_mode {', '.join(modes)}, "
                              f"got {self.grammar_mode!r}")
        if not 0 <= self.stream_interval_ms <= MAX_STREAM_INTERVAL_MS:
            raise ConfigError(f"llm: stream_interval_ms must be in 0..{MAX_STREAM_INTERVAL_MS}, "
                              f"got {self.stream_interval_ms}")
        if self.engine == "torch" and self.kv_cache_free_fraction != LlmModelConfig.kv_cache_free_fraction:
            raise ConfigError("llm: kv_cache_free_fraction applies to engine 'tensorrt_llm' only")
        if self.engine != "torch" and self.max_prefill_tokens is not None:
            raise ConfigError("llm: max_prefill_tokens applies to engine 'torch' only")
        if not 0 <= self.draft_tokens <= contract.MAX_DRAFT_TOKENS:
            raise ConfigError(f"llm: draft_tokens must be in 0..{contract.MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.engine != "torch" and self.draft_tokens:
            raise ConfigError("llm: draft_tokens (prompt-lookup speculation) applies to engine 'torch' only; "
                              "TensorRT-LLM speculates as trtllm_speculative_config sets it")
        if self.engine == "torch" and self.trtllm_sampler:
            raise ConfigError("llm: trtllm_sampler applies to engine 'tensorrt_llm' only")
        if self.trtllm_sampler and self.trtllm_sampler not in TRTLLM_SAMPLERS:
            raise ConfigError(f"llm: trtllm_sampler must be one of {', '.join(TRTLLM_SAMPLERS)} or empty, "
                              f"got {self.trtllm_sampler!r}")
        if self.engine == "torch" and self.trtllm_speculative_config.strip():
            raise ConfigError("llm: trtllm_speculative_config applies to engine 'tensorrt_llm' only (the torch "
                              "engine's speculation is draft_tokens)")
        if self.engine == "tensorrt_llm":
            self.trtllm_config()  # every TensorRT-LLM setting checked here, before the model loads

    @property
    def mode(self) -> str:
        """The grammar mode in force."""
        return self.grammar_mode or ENGINE_GRAMMAR_MODES[self.engine][0]

    def trtllm_config(self) -> TrtllmConfig:
        """The TensorRT-LLM engine's settings (engine ``tensorrt_llm``)."""
        return TrtllmConfig(model_dir=self.model_dir, grammar_mode=self.mode, max_batch=self.max_batch,
                            max_seq_len=self.max_seq_len, kv_cache_free_fraction=self.kv_cache_free_fraction,
                            sampler_type=self.trtllm_sampler or TRTLLM_SAMPLERS[0],
                            speculative=parse_speculative_config(self.trtllm_speculative_config))

    def build(self, mask_provider: MaskProvider, on_metrics: Callable[[Snapshot], None] | None = None) -> Generator:
        """Load the model and start generating (masks from ``mask_provider``; metric snapshots to ``on_metrics``)."""
        if self.engine == "tensorrt_llm":
            from .trtllm_engine import TrtllmGenerator

            return TrtllmGenerator(self.trtllm_config(), mask_provider, on_metrics=on_metrics)
        from .engine import TorchEngine, TorchEngineConfig

        engine = TorchEngine(
            self.model_dir,
            TorchEngineConfig(device=self.device, dtype=self.dtype, max_batch_size=self.max_batch,
                         max_seq_len=self.max_seq_len, num_threads=self.torch_threads or None),
        )
        limits = SchedulerConfig(max_batch_size=self.max_batch, grammar_mode=self.mode,
                                 max_prefill_tokens=self.max_prefill_tokens, draft_tokens=self.draft_tokens)
        return Scheduler(engine, mask_provider, limits, on_metrics=on_metrics)


def served_generator(config: LlmModelConfig, pb_utils: ModuleType,
                     on_metrics: Callable[[Snapshot], None] | None = None) -> tuple[Generator, RemoteMaskProvider]:
    """The generator of the Triton model and its provider (close it after the generator).

    Masks come from ``config.grammar_model`` over its channel (BLS where the channel cannot be opened),
    through a shared-memory mask buffer of ``max_batch`` rows (:mod:`grammar_service.transport.maskbuf`).
    """
    # Draft positions ride in the mask buffer after the step's rows: any torch request may ask for drafts
    # (GenerationRequest.draft_tokens), and TensorRT-LLM's drafter modes send theirs (GrammarRows).
    provider = RemoteMaskProvider(pb_utils, config.grammar_model, max_rows=config.max_batch,
                                  max_draft=contract.MAX_DRAFT_TOKENS)
    return config.build(provider, on_metrics), provider
