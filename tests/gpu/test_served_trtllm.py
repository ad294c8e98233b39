"""The GPU image's served ensemble, end to end over gRPC: TensorRT-LLM behind the grammar model.

Runs inside the image of ``deploy/docker/Dockerfile``, as its user, through
``deploy/gpu/test_gpu.sh`` (``make test-gpu``): in the grammar environment
(``/opt/grammar-env``, where the launcher, the gateway and this client run,
with pytest layered over it), starting the server as the image's entrypoint
does: the repository rendered by ``deploy/docker/entrypoint.sh``
(``RENDER_ONLY``), the llm model's stub in TensorRT-LLM's environment
(``$TRTLLM_PYTHON``'s prefix), the grammar-side stubs in theirs
(``EXECUTION_ENV_PATH``).  Needs an NVIDIA GPU, tensorrt_llm in
``$TRTLLM_PYTHON`` and a checkpoint at ``$TRTLLM_TEST_MODEL``; skips cleanly
elsewhere, and fails under ``REQUIRE_ASSETS=1``.

NOT RUN where this project is built (no GPU, no image).  Why not TensorRT-LLM
in the test's own process: that needs tensorrt_llm and the project's xgrammar
0.2.9 in one interpreter, which the image keeps apart on purpose (TensorRT-LLM
pins its own xgrammar).  In-process, the engine runs over TensorRT-LLM's
executor as emulated (``tests/unit/test_trtllm_generator.py``).

Collected with the standard library, pytest and ``tests.support`` only: the
client, the launcher and the gateway are imported by the fixtures
(``tests/unit/test_deploy_images.py`` collects this directory with them
blocked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support import assets

if TYPE_CHECKING:
    from deploy.server import TritonServer

pytestmark = [pytest.mark.gpu, pytest.mark.trtllm, pytest.mark.triton]

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _prefix(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The GPU image's server on loopback, with the image's settings and the test checkpoint."""
    from deploy.server import ServerConfig, TritonServer

    model = assets.trtllm_test_model()
    tmp = tmp_path_factory.mktemp("gpu")
    repo = tmp / "repo"
    env = {**os.environ, "RENDER_ONLY": "1", "RENDER_DIR": str(repo), "MODEL_DIR": str(model),
           "ENGINE": "tensorrt_llm", "DEVICE": "cuda", "MAX_BATCH": "16", "GRAMMAR_MODE": "processor",
           "GRAMMAR_STORE_DIR": str(tmp / "store")}
    rendered = subprocess.run([str(REPO / "deploy" / "docker" / "entrypoint.sh")], env=env, capture_output=True,
                              text=True, check=False)
    assert rendered.returncode == 0, rendered.stderr
    server = TritonServer(ServerConfig(model_repository=repo, models=("constrained_llm",),
                                       python_env=_prefix(assets.TRTLLM_PYTHON), log_file=tmp / "tritonserver.log",
                                       ready_timeout_s=1800.0))
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(served: TritonServer) -> Iterator[Any]:
    from client import Client

    with Client(served.grpc_url, timeout_s=600) as c:
        yield c


def test_a_constrained_output_parses_and_validates(client: Any) -> None:
    from client import Constraint

    result = client.generate("Invent a person as JSON.", constraint=Constraint.json_schema(SCHEMA), max_tokens=96,
                             temperature=0.0)
    doc = json.loads(result.text)
    assert set(doc) == {"name", "age"} and 0 <= doc["age"] <= 120
    assert result.finish_reason == "stop"


def test_a_stop_string_under_a_constraint_ends_cleanly_and_the_server_goes_on(client: Any) -> None:
    """The stop string ends the request before TensorRT-LLM's own end: no error for it or for the next."""
    from client import Constraint

    result = client.generate("Invent a person as JSON.", constraint=Constraint.json_schema(SCHEMA), max_tokens=96,
                             temperature=0.0, stop=['"age"'], require_complete=False)
    assert (result.finish_reason, result.stop_string) == ("stop", True)
    assert '"age"' not in result.text
    again = client.generate("Invent a person as JSON.", constraint=Constraint.json_schema(SCHEMA), max_tokens=96,
                            temperature=0.0)
    assert set(json.loads(again.text)) == {"name", "age"}


def test_sixteen_constrained_streams_at_once_are_all_valid(served: TritonServer) -> None:
    from client import Client, Constraint

    results: list[Any] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(served.grpc_url, timeout_s=600) as c:
                results.append(c.generate(f"Invent person number {i} as JSON.",
                                          constraint=Constraint.json_schema(SCHEMA), max_tokens=96, temperature=0.7,
                                          seed=i))
        except BaseException as err:  # noqa: BLE001 -- reported below with every other one
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert errors == [] and len(results) == 16
    for r in results:
        assert set(json.loads(r.text)) == {"name", "age"}


def test_the_tests_run_beside_tensorrt_llm_not_in_its_environment() -> None:
    """The image's split: TensorRT-LLM's environment is another one, and this one has no tensorrt_llm.
    (Environments, not interpreters: every venv's python links to the same base interpreter.)"""
    assert _prefix(assets.TRTLLM_PYTHON) != Path(sys.prefix)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorrt_llm') is None)"
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 1
