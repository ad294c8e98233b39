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

__all__ = ["TRTLLM_GUIDED_API", "TRTLLM_HOST_BUFFERS", "TRTLLM_VERSION", "check_trtllm_api", "host_buffers",
           "import_tensorrt_llm"]

#: The TensorRT-LLM release this engine is written against (NGC tritonserver
#: 26.04-26.07 trtllm-python-py3).  The grammar decoder subclasses private API,
#: so another version is refused at load (:func:`check_trtllm_api`).
TRTLLM_VERSION: Final = "1.2.1"
#: What :func:`check_trtllm_api` requires of ``tensorrt_llm._torch.pyexecutor.guided_decoder``:
#: each class, and the methods (with their parameters) or attributes the grammar decoder uses.
TRTLLM_GUIDED_API: Final[dict[str, dict[str, tuple[str, ...] | None]]] = {
    "GuidedDecoder": {"add_batch": None, "build": ("self",), "_build": ("self", "requests"), "execute": None},
    "GuidedRequests": {"valid_requests_with_offsets": ("self",), "num_bitmask_tokens": None},
    "GuidedRequest": {"require_matcher_init": ("self",), "require_matcher_advance": ("self",),
                      "from_llm_request": None, "guided_decoding_params": None, "request_id": None,
                      "seq_slot": None, "new_token": None, "is_draft": None, "draft_tokens": None},
}


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
