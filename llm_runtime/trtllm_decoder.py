"""TensorRT-LLM's guided decoder with the ``grammar`` model behind it (imported only where tensorrt_llm is).

NOT RUN where this project is built and tested (no tensorrt_llm, no GPU).
:class:`GrammarModelDecoder` subclasses TensorRT-LLM's private
``GuidedDecoder`` (``tensorrt_llm/_torch/pyexecutor/guided_decoder.py``,
version :data:`llm_runtime.trtllm_api.TRTLLM_VERSION`) and overrides one
method: ``_build(requests)``, the host-side loop that fills
``bitmask_host``/``token_mask_host`` for a step.  Everything else is
TensorRT-LLM's: ``add_batch`` (called again after ``_update_requests`` under
the overlap scheduler), the pinned buffers, the copy on its own stream, the
``logits_bitmask`` kernel, and the handling of the failed rows ``_build``
returns.  Its rows come from :class:`llm_runtime.grammar_hook.GrammarRows`: one
grammar-channel request per step for every constrained row.

``create_py_executor`` builds the decoder as ``GuidedDecoder(**kwargs)``
with no hook for another class, so :func:`installed` replaces that name in
``py_executor_creator`` while ``LLM(...)`` builds its executor (in this
process: ``TLLM_WORKER_USE_SINGLE_PROCESS=1``), and :func:`check_installed`
refuses an executor that did not get it.  :func:`check_trtllm_api` checks the
names and signatures first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from tensorrt_llm._torch.pyexecutor import (  # type: ignore[import-not-found,unused-ignore]
    guided_decoder as _guided,
)
from tensorrt_llm._torch.pyexecutor import (  # type: ignore[import-not-found,unused-ignore]
    py_executor_creator as _creator,
)

from grammar_backend.errors import ConfigError

from .grammar_hook import GrammarRows
from .trtllm_api import check_trtllm_api, host_buffers

__all__ = ["GrammarModelDecoder", "check_installed", "installed"]


class GrammarModelDecoder(_guided.GuidedDecoder):  # type: ignore[misc,name-defined,unused-ignore]
    """``GuidedDecoder`` whose per-step build is one request to the ``grammar`` model.

    Parameters
    ----------
    *args, **kwargs
        What ``create_py_executor`` passes to ``GuidedDecoder`` (its buffers
        are sized from ``max_num_sequences`` and ``vocab_size_padded``).
    grammar : GrammarRows
        The grammar side, bound by :func:`installed`.
    """

    def __init__(self, *args: Any, grammar: GrammarRows, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grammar = grammar
        # Views of TensorRT-LLM's pinned host buffers, made once (checked: they are
        # instance attributes, which check_trtllm_api cannot see on the class); the
        # words past the tokenizer's vocabulary (vocab_size_padded) stay 0: never sampled.
        self._bitmask_np, self._token_mask_np = host_buffers(self, grammar.width)
        self._bitmask_np[:, grammar.width:] = 0

    def _build(self, requests: Any) -> list[tuple[int, str]]:
        return self.grammar.build(requests, self._bitmask_np, self._token_mask_np)


@contextlib.contextmanager
def installed(grammar: GrammarRows) -> Iterator[None]:
    """While the block runs, ``create_py_executor`` builds a :class:`GrammarModelDecoder` bound to ``grammar``."""
    check_trtllm_api(_guided, _creator)
    original = _creator.GuidedDecoder
    _creator.GuidedDecoder = functools.partial(GrammarModelDecoder, grammar=grammar)
    try:
        yield
    finally:
        _creator.GuidedDecoder = original


def check_installed(llm: Any) -> GrammarModelDecoder:
    """The executor's decoder, or a clear refusal where TensorRT-LLM did not build ours.

    ``llm._executor`` is the in-process worker with
    ``TLLM_WORKER_USE_SINGLE_PROCESS=1``, and its ``engine`` the ``PyExecutor``.
    """
    engine = getattr(getattr(llm, "_executor", None), "engine", None)
    decoder = getattr(engine, "guided_decoder", None)
    if not isinstance(decoder, GrammarModelDecoder):
        raise ConfigError("llm: TensorRT-LLM's executor does not mask with the grammar model "
                          f"(its guided decoder is {type(decoder).__name__}): it must run in this process "
                          "(TLLM_WORKER_USE_SINGLE_PROCESS=1, tensor_parallel_size 1, no speculative decoding)")
    return decoder
