"""TensorRT-LLM's guided decoder with the ``grammar`` model behind it (imported only where tensorrt_llm is).

NOT RUN where this project is built and tested (no tensorrt_llm, no GPU).
:class:`GrammarModelDecoder` subclasses TensorRT-LLM's private
``GuidedDecoder`` (``tensorrt_llm/_torch/pyexecutor/guided_decoder.py``,
version :data:`llm_runtime.trtllm_api.TRTLLM_VERSION`) and overrides
``_build(requests)``, the host-side loop that fills
``bitmask_host``/``token_mask_host`` for a step (and, for speculative
decoding, ``_rollback_rejected_tokens``: below).  Everything else is
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

Speculative decoding (TensorRT-LLM 1.2.1 as read, the sources named in
:mod:`llm_runtime.grammar_hook`): the modes with a drafter (EAGLE3 two-model,
DRAFT_TARGET, MTP_EAGLE, NGRAM, USER_PROVIDED) mask through this same decoder,
``max_num_draft_tokens`` draft rows after each generation row, and the draft
model's builds (``ModelDrafter``) go through it too.  The decoder also
overrides ``_rollback_rejected_tokens(requests)``: where TensorRT-LLM rolls its
matchers back to the accepted drafts, :meth:`GrammarRows.accepted` notes how
many were accepted (the grammar side never kept the drafts).  Its own
``_rollback_draft_tokens`` stays: with no matcher of TensorRT-LLM's advanced
(``num_advanced_draft_tokens`` is 0) it does nothing.  The one-model modes
(MTP, MTP_EAGLE_ONE_MODEL, EAGLE3_ONE_MODEL) build ``CapturableGuidedDecoder``
instead, by that name: :func:`installed` replaces it with a refusal, and
:func:`check_installed` refuses them by name too
(:func:`llm_runtime.trtllm_api.speculative_refusal` says why).  Verified only by
emulation (``tests/unit/test_grammar_hook_drafts.py``).
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

from contract import MAX_DRAFT_TOKENS
from grammar_backend.errors import ConfigError

from .grammar_hook import GrammarRows
from .trtllm_api import ONE_MODEL_REFUSAL, check_trtllm_api, host_buffers, speculative_refusal

__all__ = ["GrammarModelDecoder", "check_installed", "installed", "speculative_mode"]


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
        # create_py_executor passes spec_config.max_total_draft_tokens (0 without speculation); __init__ keeps it.
        drafts = getattr(self, "max_num_draft_tokens", 0)
        if isinstance(drafts, bool) or not isinstance(drafts, int) or not 0 <= drafts <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"llm: TensorRT-LLM lays out {drafts!r} draft tokens a row "
                              f"(speculative_config.max_total_draft_tokens); the grammar model answers "
                              f"0..{MAX_DRAFT_TOKENS}")
        grammar.reserve_drafts(drafts)

    def _build(self, requests: Any) -> list[tuple[int, str]]:
        return self.grammar.build(requests, self._bitmask_np, self._token_mask_np)

    def _rollback_rejected_tokens(self, requests: Any) -> None:
        # Called after the verification, before the draft model's builds (_executor_loop only).
        self.grammar.accepted(requests)


def _one_model_refused(*args: Any, **kwargs: Any) -> None:
    """Stands for ``CapturableGuidedDecoder`` while ``LLM(...)`` builds its executor: a one-model mode fails there."""
    del args, kwargs
    raise ConfigError(ONE_MODEL_REFUSAL)


@contextlib.contextmanager
def installed(grammar: GrammarRows) -> Iterator[None]:
    """While the block runs, ``create_py_executor`` builds a :class:`GrammarModelDecoder` bound to ``grammar``."""
    check_trtllm_api(_guided, _creator)
    original = _creator.GuidedDecoder
    # The one-model modes' decoder, by its name there (absent: nothing to replace).
    capturable = getattr(_creator, "CapturableGuidedDecoder", None)
    _creator.GuidedDecoder = functools.partial(GrammarModelDecoder, grammar=grammar)
    if capturable is not None:
        _creator.CapturableGuidedDecoder = _one_model_refused
    try:
        yield
    finally:
        _creator.GuidedDecoder = original
        if capturable is not None:
            _creator.CapturableGuidedDecoder = capturable


def speculative_mode(engine: Any) -> str | None:
    """The executor's ``SpeculativeDecodingMode`` name (``model_engine.spec_config``), None without one."""
    spec_config = getattr(getattr(engine, "model_engine", None), "spec_config", None)
    mode = getattr(spec_config, "spec_dec_mode", None)
    name = getattr(mode, "name", None)
    return name if isinstance(name, str) else None


def check_installed(llm: Any) -> GrammarModelDecoder:
    """The executor's decoder, or a clear refusal where TensorRT-LLM did not build ours.

    ``llm._executor`` is the in-process worker with
    ``TLLM_WORKER_USE_SINGLE_PROCESS=1``, and its ``engine`` the ``PyExecutor``.
    A speculative decoding mode is refused by name unless it masks through this
    decoder (:func:`llm_runtime.trtllm_api.speculative_refusal`), and so is a
    drafter that masks its drafts with another decoder.
    """
    engine = getattr(getattr(llm, "_executor", None), "engine", None)
    refusal = speculative_refusal(speculative_mode(engine))
    if refusal is not None:
        raise ConfigError(refusal)
    decoder = getattr(engine, "guided_decoder", None)
    if not isinstance(decoder, GrammarModelDecoder):
        raise ConfigError("llm: TensorRT-LLM's executor does not mask with the grammar model "
                          f"(its guided decoder is {type(decoder).__name__}): it must run in this process "
                          "(TLLM_WORKER_USE_SINGLE_PROCESS=1, tensor_parallel_size 1)")
    # ModelDrafter masks the draft model's steps with the executor's decoder (create_py_executor hands it the
    # same one); a drafter without one (n-gram, user-provided) proposes unmasked drafts, which is served.
    drafting = getattr(getattr(engine, "drafter", None), "guided_decoder", None)
    if drafting is not None and drafting is not decoder:
        raise ConfigError("llm: TensorRT-LLM's drafter masks its drafts with another guided decoder "
                          f"({type(drafting).__name__}), not the grammar model's")
    return decoder
