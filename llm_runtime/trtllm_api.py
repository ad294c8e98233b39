"""What the TensorRT-LLM engine requires of the installed ``tensorrt_llm``: its version and its private API.

The one home of the pin (:data:`TRTLLM_VERSION`), the import that refuses any
other release (:func:`import_tensorrt_llm`) and the check of the guided-decoder
classes the grammar decoder subclasses (:func:`check_trtllm_api`).  Both
:mod:`llm_runtime.trtllm_engine` and :mod:`llm_runtime.trtllm_decoder` import
it; it imports neither, so the engine's lazy import of the decoder (only in
``grammar_mode: processor``) closes no circle.  It imports ``tensorrt_llm``
only inside :func:`import_tensorrt_llm`, so it loads (and the check runs
against stand-ins, ``tests/unit/test_trtllm_engine.py``) where the package is
missing.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Final

import numpy as np

from grammar_backend.errors import ConfigError

__all__ = ["TRTLLM_GUIDED_API", "TRTLLM_HOST_BUFFERS", "TRTLLM_ONE_MODEL_MODES", "TRTLLM_SPEC_MODES", "TRTLLM_VERSION",
           "check_trtllm_api", "host_buffers", "import_tensorrt_llm", "speculative_refusal"]

#: The TensorRT-LLM release this engine is written against (NGC tritonserver
#: 26.04-26.07 trtllm-python-py3).  The grammar decoder subclasses private API,
#: so another version is refused at load (:func:`check_trtllm_api`).
TRTLLM_VERSION: Final = "1.2.1"
#: What :func:`check_trtllm_api` requires of ``tensorrt_llm._torch.pyexecutor.guided_decoder``:
#: each class, and the methods (with their parameters) or attributes the grammar decoder uses.
#: ``CapturableGuidedDecoder``'s host functions are wrapped by TensorRT-LLM's ``@hostfunc`` (their
#: signature is the wrapper's): only their presence is checked; the methods the grammar decoder
#: overrides, which they call, with their parameters.
TRTLLM_GUIDED_API: Final[dict[str, dict[str, tuple[str, ...] | None]]] = {
    "GuidedDecoder": {"add_batch": None, "build": ("self",), "_build": ("self", "requests"), "execute": None,
                      "_rollback_rejected_tokens": ("self", "requests")},
    "CapturableGuidedDecoder": {
        "add_batch": None, "fetch_batch": None, "init_disagg_gen_requests": None, "build": None, "execute": None,
        "add_draft_batch": None, "fetch_draft_batch": None, "execute_draft_batch": None,
        "rollback_rejected_tokens": None, "rollback_draft_tokens": None, "_build": ("self", "requests"),
        "_rollback_rejected_tokens": ("self", "requests"), "_rollback_draft_tokens": ("self", "requests"),
        "_init_disagg_gen_requests": ("self", "requests")},
    "GuidedRequests": {"valid_requests_with_offsets": ("self",), "num_bitmask_tokens": None,
                       "max_num_draft_tokens": None, "__len__": ("self",)},
    "GuidedRequest": {"require_matcher_init": ("self",), "require_matcher_advance": ("self",),
                      "from_llm_request": None, "guided_decoding_params": None, "request_id": None,
                      "seq_slot": None, "new_token": None, "is_draft": None, "draft_tokens": None,
                      "num_accepted_draft_tokens": None, "cast_to_draft": ("self",)},
}

#: ``SpeculativeDecodingMode`` names (``tensorrt_llm/_torch/speculative/interface.py`` as stored around
#: 1.2, the enum MTP .. AUTO) whose executor masks with ``GuidedDecoder``: no speculation, and the modes with
#: a drafter (``support_guided_decoder()``: ``is_none() or has_spec_drafter()``).  ``create_py_executor``
#: builds that decoder by its global name, and hands the drafter the same one (``get_spec_drafter(...,
#: guided_decoder=guided_decoder)``): the grammar decoder serves them.  AUTO is resolved to one of these
#: (``suggest_spec_config``) before the decoder is built.
TRTLLM_SPEC_MODES: Final = ("NONE", "EAGLE3", "DRAFT_TARGET", "MTP_EAGLE", "NGRAM", "USER_PROVIDED",
                            "SAVE_HIDDEN_STATES")
#: The one-model modes (``support_capturable_guided_decoder()``: ``is_mtp_one_model() or
#: is_eagle3_one_model()``): ``create_py_executor`` builds ``CapturableGuidedDecoder`` by that name and hands
#: it to the model engine (``model_engine.set_guided_decoder``), not to the executor.  Served by
#: :class:`llm_runtime.trtllm_decoder.GrammarCapturableDecoder`: one grammar request a target build, the
#: draft steps unmasked (:mod:`llm_runtime.grammar_hook`, "One-model speculative modes").
TRTLLM_ONE_MODEL_MODES: Final = ("MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL")


#: The host buffers ``GuidedDecoder.__init__`` creates (instance attributes, so
#: :func:`check_trtllm_api` cannot see them on the class) that the grammar
#: decoder writes: name -> dimensions (int32, on the host).
TRTLLM_HOST_BUFFERS: Final = {"bitmask_host": 2, "token_mask_host": 1}


def import_tensorrt_llm() -> ModuleType:
    """Import ``tensorrt_llm``, or fail with the reason and the remedy.

    Raises
    ------
    grammar_backend.errors.ConfigError
        When the package is missing (anywhere but the NGC ``trtllm-python-py3``
        image), is not :data:`TRTLLM_VERSION`, or no CUDA device is visible.
    """
    try:
        import tensorrt_llm  # type: ignore[import-not-found,unused-ignore]
    except ImportError as err:
        raise ConfigError(
            "llm: engine 'tensorrt_llm' needs the tensorrt_llm package and a CUDA GPU "
            f"(the NGC tritonserver trtllm-python-py3 image, see deploy/gpu/README.md): {err}; "
            "use engine 'torch' elsewhere"
        ) from err
    version = getattr(tensorrt_llm, "__version__", None)
    if version != TRTLLM_VERSION:
        raise ConfigError(f"llm: engine 'tensorrt_llm' is written against TensorRT-LLM {TRTLLM_VERSION} "
                          f"(private guided-decoder API), found {version!r}; use the image of deploy/docker/Dockerfile")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("llm: engine 'tensorrt_llm' needs a CUDA GPU (torch.cuda.is_available() is False)")
    return tensorrt_llm  # type: ignore[no-any-return]


def check_trtllm_api(guided_decoder: ModuleType, creator: ModuleType) -> None:
    """Refuse, naming what differs, a TensorRT-LLM whose guided-decoder API is not the one read.

    Parameters
    ----------
    guided_decoder : module
        ``tensorrt_llm._torch.pyexecutor.guided_decoder``.
    creator : module
        ``tensorrt_llm._torch.pyexecutor.py_executor_creator``, which must
        build the decoder by the global name ``GuidedDecoder`` (replaced while
        ``LLM(...)`` runs, :func:`llm_runtime.trtllm_decoder.installed`).

    Raises
    ------
    grammar_backend.errors.ConfigError
        Every difference at once, with the version the engine expects.
    """
    problems: list[str] = []
    for cls_name, members in TRTLLM_GUIDED_API.items():
        cls = getattr(guided_decoder, cls_name, None)
        if not isinstance(cls, type):
            problems.append(f"{cls_name} is missing")
            continue
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        for name, params in members.items():
            member = getattr(cls, name, None)
            if member is None and name not in fields:
                problems.append(f"{cls_name}.{name} is missing")
            elif params is not None:
                if not callable(member):
                    problems.append(f"{cls_name}.{name} is not a method")
                    continue
                found = tuple(inspect.signature(member).parameters)
                if found != params:
                    problems.append(f"{cls_name}.{name} takes ({', '.join(found)}), expected ({', '.join(params)})")
    if getattr(creator, "GuidedDecoder", None) is not getattr(guided_decoder, "GuidedDecoder", None):
        problems.append("py_executor_creator does not build GuidedDecoder by that name")
    # The one-model modes' decoder, where the creator names it (check_installed refuses an executor whose
    # model engine did not get the grammar's).
    capturable = getattr(creator, "CapturableGuidedDecoder", None)
    if capturable is not None and capturable is not getattr(guided_decoder, "CapturableGuidedDecoder", None):
        problems.append("py_executor_creator does not build CapturableGuidedDecoder by that name")
    if problems:
        raise ConfigError(f"llm: TensorRT-LLM's guided decoder is not the {TRTLLM_VERSION} API this engine hooks: "
                          + "; ".join(problems))


def host_buffers(decoder: object, width: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy views of a built ``GuidedDecoder``'s ``bitmask_host`` and ``token_mask_host``.

    Parameters
    ----------
    decoder : object
        The decoder after ``GuidedDecoder.__init__`` ran.
    width : int
        Words per row the grammar side writes (:attr:`GrammarRows.width`).

    Raises
    ------
    grammar_backend.errors.ConfigError
        A buffer missing, or not an int32 host tensor of the shape the
        grammar decoder writes (every difference at once, with the version).
    """
    problems: list[str] = []
    views: dict[str, np.ndarray] = {}
    for name, dims in TRTLLM_HOST_BUFFERS.items():
        buffer = getattr(decoder, name, None)
        if buffer is None:
            problems.append(f"GuidedDecoder.{name} is missing")
            continue
        try:
            view = buffer.numpy()  # a CPU tensor's memory, shared; a CUDA tensor refuses
        except (AttributeError, TypeError, RuntimeError) as err:
            problems.append(f"GuidedDecoder.{name} is not a host tensor ({type(buffer).__name__}: {err})")
            continue
        if view.dtype != np.int32 or view.ndim != dims:
            problems.append(f"GuidedDecoder.{name} is {view.dtype} {tuple(view.shape)}, expected int32 with {dims} "
                            f"dimension{'s' if dims > 1 else ''}")
            continue
        views[name] = view
    bitmask, token_mask = views.get("bitmask_host"), views.get("token_mask_host")
    if bitmask is not None and token_mask is not None:
        if bitmask.shape[1] < width:
            problems.append(f"GuidedDecoder.bitmask_host has {bitmask.shape[1]} words per row, the vocabulary "
                            f"needs {width}")
        if token_mask.shape[0] != bitmask.shape[0]:
            problems.append(f"GuidedDecoder.token_mask_host has {token_mask.shape[0]} rows, bitmask_host "
                            f"{bitmask.shape[0]}")
    if problems or bitmask is None or token_mask is None:
        raise ConfigError(f"llm: TensorRT-LLM's guided decoder is not the {TRTLLM_VERSION} API this engine hooks: "
                          + "; ".join(problems))
    return bitmask, token_mask


def speculative_refusal(mode: str | None) -> str | None:
    """Why the grammar decoder refuses TensorRT-LLM's speculative decoding mode ``mode`` (None: served).

    Parameters
    ----------
    mode : str or None
        ``spec_config.spec_dec_mode.name`` of the executor's model engine
        (None: no speculative config, as ``NONE``).

    Returns
    -------
    str or None
        The refusal, naming the mode; ``None`` for :data:`TRTLLM_SPEC_MODES`
        and :data:`TRTLLM_ONE_MODEL_MODES`.

    Notes
    -----
    The one-model modes mask through ``CapturableGuidedDecoder``, whose
    builds are CUDA host functions (``cudaLaunchHostFunc``) inside the model's
    forward.  They are served with the target rows masked and the draft steps
    unmasked (:mod:`llm_runtime.grammar_hook`, "One-model speculative
    modes"); what was read of 1.2.1 for that:

    * the accepted count is the verification's (``num_accepted_tokens``,
      copied to pinned memory), which ``fetch_draft_batch(0)`` clamps to
      ``num_advanced_tokens[slot]``, a plain list the grammar decoder sets;
    * every Python host function runs with the GIL taken on a driver
      thread, TensorRT-LLM's own xgrammar build too (the GIL/CUDA-mutex
      hazard of its tech blog 12 is theirs as much as ours); the grammar
      channel's socket wait releases the GIL while it blocks, but it
      holds the grammar stream for a round trip (hidden behind the target
      forward), and the deadlock freedom of the Triton stub's other threads
      is unverified;
    * ``build`` drops what ``_build`` returns (07dacbbc), and the executor's
      ``guided_decoder`` is None, so no failure reaches
      ``_handle_guided_decoder_errors``: a failed row is written with the
      end tokens only and the engine reads the row's error at the request's end.

    None of it has run on a GPU (no ``tensorrt_llm`` where this project is
    built): verified by emulation only (``tests/unit/test_grammar_hook_one_model.py``).
    A mode 1.2.1 was not read to have is refused by name.
    """
    if mode is None or mode in TRTLLM_SPEC_MODES or mode in TRTLLM_ONE_MODEL_MODES:
        return None
    return (f"llm: TensorRT-LLM's speculative decoding mode {mode} is not one TensorRT-LLM {TRTLLM_VERSION} was "
            f"read to have ({', '.join(TRTLLM_SPEC_MODES + TRTLLM_ONE_MODEL_MODES)}); the grammar model's "
            "constraints do not serve it")
