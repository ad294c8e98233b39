"""Parameters of the ``llm`` Triton model and how they build its scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from grammar_backend.errors import ConfigError
from llm_runtime.engine import EngineConfig, TorchEngine
from llm_runtime.mask import MaskProvider
from llm_runtime.scheduler import Scheduler, SchedulerConfig

ENGINES = ("torch", "tensorrt_llm")


@dataclass(frozen=True)
class LlmModelConfig:
    """``config.pbtxt`` parameters of ``llm``.

    ``engine``: ``torch`` (the embedded default, CPU or GPU) or
    ``tensorrt_llm``.  The TensorRT-LLM engine needs a GPU and the
    ``tensorrt_llm`` package, neither of which exists on the machines this
    build is developed and tested on, so it is refused at load time with a
    clear message instead of being shipped untested.
    """

    model_dir: str
    engine: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 16
    max_seq_len: int = 2048
    torch_threads: int = 0
    grammar_model: str = "grammar"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"llm: engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "tensorrt_llm":
            raise ConfigError(
                "llm: engine 'tensorrt_llm' is not available in this build (no GPU or tensorrt_llm package "
                "where it was built and tested); use engine 'torch'"
            )

    def build_scheduler(self, mask_provider: MaskProvider) -> Scheduler:
        """Load the model and start the decode loop."""
        engine = TorchEngine(
            self.model_dir,
            EngineConfig(device=self.device, dtype=self.dtype, max_batch_size=self.max_batch,
                         max_seq_len=self.max_seq_len, num_threads=self.torch_threads or None),
        )
        return Scheduler(engine, mask_provider, SchedulerConfig(max_batch_size=self.max_batch))


def bls_scheduler(config: LlmModelConfig, pb_utils: ModuleType) -> Scheduler:
    """The scheduler of the Triton model: masks come from ``config.grammar_model`` over BLS."""
    from llm_runtime.bls import BlsMaskProvider

    return config.build_scheduler(BlsMaskProvider(pb_utils, config.grammar_model))


def stats_summary(scheduler: Scheduler) -> dict[str, float | int]:
    """Percentiles of the scheduler's per-step counters (logged by the llm model at shutdown).

    In the Triton deployment ``grammar_s`` is the BLS round trip to the
    grammar model and ``mask_wait_s`` the part of it not hidden behind the forward.
    """
    import numpy as np

    s = scheduler.stats()
    out: dict[str, float | int] = {"steps": s.steps, "max_batch_size_seen": s.max_batch_size_seen}
    for name, values in (("forward_s", s.forward_s), ("grammar_s", s.grammar_s), ("mask_wait_s", s.mask_wait_s)):
        finite = values[np.isfinite(values)]
        for q in (50, 99):
            out[f"{name}_p{q}"] = float(np.percentile(finite, q)) if finite.size else float("nan")
    return out
