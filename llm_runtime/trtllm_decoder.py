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
(``num_advanced_draft_tokens`` is 0) it does nothing.

The one-model modes (MTP, MTP_EAGLE_ONE_MODEL, EAGLE3_ONE_MODEL) build
``CapturableGuidedDecoder`` by that name and hand it to the model engine
(``model_engine.set_guided_decoder`` -> the spec worker; the executor's
``guided_decoder`` stays None): :func:`installed` replaces that name with
:class:`GrammarCapturableDecoder`, and :func:`check_installed` finds it on
the model engine.  Its target build is one grammar request for every target
row and its drafts; its draft steps make none and leave their rows unmasked
(:mod:`llm_runtime.grammar_hook`, "One-model speculative modes", says why and
at what cost).  Verified only by emulation
(``tests/unit/test_grammar_hook_drafts.py``, ``tests/unit/test_grammar_hook_one_model.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
from tensorrt_llm._torch.pyexecutor import (  # type: ignore[import-not-found,unused-ignore]
    guided_decoder as _guided,
)
from tensorrt_llm._torch.pyexecutor import (  # type: ignore[import-not-found,unused-ignore]
    py_executor_creator as _creator,
)

from contract import MAX_DRAFT_TOKENS
from grammar_backend.errors import ConfigError

from .grammar_hook import GrammarRows
from .trtllm_api import TRTLLM_ONE_MODEL_MODES, TRTLLM_VERSION, check_trtllm_api, host_buffers, speculative_refusal

__all__ = ["GrammarCapturableDecoder", "GrammarModelDecoder", "check_installed", "installed", "speculative_mode"]

_log = logging.getLogger(__name__)


def _draft_layout(decoder: Any) -> int:
    """The draft rows TensorRT-LLM lays out after a generation row, checked against what a grammar step answers."""
    # create_py_executor passes spec_config.max_total_draft_tokens (0 without speculation); __init__ keeps it.
    drafts = getattr(decoder, "max_num_draft_tokens", 0)
    if isinstance(drafts, bool) or not isinstance(drafts, int) or not 0 <= drafts <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"llm: TensorRT-LLM lays out {drafts!r} draft tokens a row "
                          f"(speculative_config.max_total_draft_tokens); the grammar model answers "
                          f"0..{MAX_DRAFT_TOKENS}")
    return drafts


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
        grammar.reserve_drafts(_draft_layout(self))

    def _build(self, requests: Any) -> list[tuple[int, str]]:
        return self.grammar.build(requests, self._bitmask_np, self._token_mask_np)

    def _rollback_rejected_tokens(self, requests: Any) -> None:
        # Called after the verification, before the draft model's builds (_executor_loop only).
        self.grammar.accepted(requests)


class GrammarCapturableDecoder(_guided.CapturableGuidedDecoder):  # type: ignore[misc,name-defined,unused-ignore]
    """``CapturableGuidedDecoder`` (one-model speculation) whose target build is one request to the ``grammar`` model.

    Parameters
    ----------
    *args, **kwargs
        What ``create_py_executor`` passes to ``CapturableGuidedDecoder``
        (the same as to ``GuidedDecoder``).
    grammar : GrammarRows
        The grammar side, bound by :func:`installed`.

    Notes
    -----
    TensorRT-LLM's host functions (``fetch_batch``, ``build``, ...) stay its
    own, wrapped by its ``@hostfunc``; the methods they call are overridden,
    and each runs on a CUDA driver thread where an exception is only printed
    (so none escapes):

    * ``_init_disagg_gen_requests``: runs only in the target's sequence,
      right before its ``build``, so it marks the next ``_build`` as the
      target's; TensorRT-LLM's would compile a matcher from the guide (a
      literal regex here) for a disaggregated generation-only request, which
      this decoder cannot serve: such a request has no grammar row on this
      server, and its first build fails it ("no grammar sequence").
    * ``_build``: the target's is :meth:`GrammarRows.build`, which also sets
      ``num_advanced_tokens``; a draft step's writes token_mask 0 for its
      rows (no grammar request).  CUDA graph warmup runs the forward again on
      one prepared batch (``fetch_batch`` keeps the last one when its queue is
      empty): a target build of the same requests again commits nothing and
      restores the token_mask it wrote.
    * ``_rollback_rejected_tokens`` (draft step 0, the requests cast to
      draft): :meth:`GrammarRows.record_accepted`.
    * ``_rollback_draft_tokens``: nothing (no matcher advanced by drafts).
    """

    def __init__(self, *args: Any, grammar: GrammarRows, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grammar = grammar
        self._bitmask_np, self._token_mask_np = host_buffers(self, grammar.width)
        self._bitmask_np[:, grammar.width:] = 0
        advanced = getattr(self, "num_advanced_tokens", None)
        if not isinstance(advanced, list) or len(advanced) != getattr(self, "max_num_sequences", -1):
            raise ConfigError(f"llm: TensorRT-LLM's CapturableGuidedDecoder.num_advanced_tokens is not the list "
                              f"of max_num_sequences counts of {TRTLLM_VERSION} ({type(advanced).__name__})")
        self._advanced: list[int] = advanced
        grammar.reserve_drafts(_draft_layout(self))
        grammar.serve_one_model()
        self._target_next = False  # the next _build is the target's (set by _init_disagg_gen_requests)
        self._last_target: object | None = None  # the requests of the last target build (held: no id reuse)
        self._target_rows = np.zeros_like(self._token_mask_np)  # the token_mask it wrote
        self._target_n = 0

    def _init_disagg_gen_requests(self, requests: Any) -> None:
        del requests
        self._target_next = True

    def _build(self, requests: Any) -> list[tuple[int, str]]:
        target, self._target_next = self._target_next, False
        try:
            if requests is None:
                return []
            if not target:
                # A draft step: no grammar request (GrammarRows' module docstring); one row a request.
                self._token_mask_np[: len(requests)] = 0
                return []
            if requests is self._last_target:
                # The same batch again (CUDA graph warmup): its tokens are committed; its rows as written.
                self._token_mask_np[: self._target_n] = self._target_rows[: self._target_n]
                return []
            self._last_target = requests
            failed = self.grammar.build(requests, self._bitmask_np, self._token_mask_np, advanced=self._advanced)
            self._target_n = int(requests.num_bitmask_tokens)
            self._target_rows[: self._target_n] = self._token_mask_np[: self._target_n]
            # The host function drops this (1.2.1): the failed rows allow the end tokens only, so their requests
            # end at this step, and the engine reports each row's error from its outcome.
            return failed
        except Exception:  # noqa: BLE001 -- a host function must not raise (only printed; the graph goes on)
            _log.exception("grammar decoder: the one-model build failed")
            return []

    def _rollback_rejected_tokens(self, requests: Any) -> None:
        self.grammar.record_accepted(requests)

    def _rollback_draft_tokens(self, requests: Any) -> None:
        del requests  # no matcher was advanced by the drafts


@contextlib.contextmanager
def installed(grammar: GrammarRows) -> Iterator[None]:
    """While the block runs, ``create_py_executor`` builds a :class:`GrammarModelDecoder` bound to ``grammar``
    (a :class:`GrammarCapturableDecoder` in the one-model modes)."""
    check_trtllm_api(_guided, _creator)
    original = _creator.GuidedDecoder
    # The one-model modes' decoder, by its name there (absent: nothing to replace).
    capturable = getattr(_creator, "CapturableGuidedDecoder", None)
    _creator.GuidedDecoder = functools.partial(GrammarModelDecoder, grammar=grammar)
    if capturable is not None:
        _creator.CapturableGuidedDecoder = functools.partial(GrammarCapturableDecoder, grammar=grammar)
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


def check_installed(llm: Any) -> GrammarModelDecoder | GrammarCapturableDecoder:
    """The executor's decoder, or a clear refusal where TensorRT-LLM did not build ours.

    ``llm._executor`` is the in-process worker with
    ``TLLM_WORKER_USE_SINGLE_PROCESS=1``, and its ``engine`` the ``PyExecutor``.
    A speculative decoding mode is refused by name unless it masks through
    the grammar's decoders (:func:`llm_runtime.trtllm_api.speculative_refusal`),
    and so is a drafter that masks its drafts with another decoder.  In the
    one-model modes the executor has no guided decoder: the model engine has
    it (``model_engine.set_guided_decoder``).
    """
    engine = getattr(getattr(llm, "_executor", None), "engine", None)
    mode = speculative_mode(engine)
    refusal = speculative_refusal(mode)
    if refusal is not None:
        raise ConfigError(refusal)
    decoder: Any
    if mode in TRTLLM_ONE_MODEL_MODES:
        decoder = getattr(getattr(engine, "model_engine", None), "guided_decoder", None)
        if not isinstance(decoder, GrammarCapturableDecoder):
            raise ConfigError(f"llm: TensorRT-LLM's model engine does not mask with the grammar model in the "
                              f"one-model speculative mode {mode} (its guided decoder is {type(decoder).__name__}): "
                              "it must run in this process (TLLM_WORKER_USE_SINGLE_PROCESS=1, tensor_parallel_size 1)")
        return decoder
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
