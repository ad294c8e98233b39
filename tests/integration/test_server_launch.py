"""A real tritonserver (bundled in nvidia-pytriton) started by deploy.server.

The test-only model below runs inside the Python-backend stub, which embeds the
system libpython3.11; it imports torch, xgrammar and numpy and reports their
versions and file locations, proving that the stub sees this virtualenv's
packages (through PATH, see deploy/server.py).  It is decoupled, like the
project's `constrained_llm` ensemble, and is queried over real gRPC streaming.
"""

from __future__ import annotations

import errno
import importlib.metadata
import queue
import re
import socket
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from deploy.server import ServerStartError, TritonServer, listening_ports
from tests.support.procs import group_processes

pytestmark = pytest.mark.triton

MODEL = "stub_env"

CONFIG = f"""
name: "{MODEL}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "NAMES" data_type: TYPE_STRING dims: [ -1 ] }} ]
output [
  {{ name: "NAME" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "VERSION" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "LOCATION" data_type: TYPE_STRING dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

# Runs inside the stub.  One response per requested module, then an empty final
# response; an unknown module gets an error response naming it.
MODEL_PY = '''
import importlib
import importlib.metadata
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

ALLOWED = {"torch", "xgrammar", "numpy"}


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            names = pb_utils.get_input_tensor_by_name(request, "NAMES").as_numpy().reshape(-1)
            for raw in names:
                name = raw.decode("utf-8")
                if name == "sys":
                    version, location = sys.version.split()[0], sys.prefix
                elif name in ALLOWED:
                    module = importlib.import_module(name)
                    version, location = importlib.metadata.version(name), module.__file__
                else:
                    sender.send(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"NAMES: module {name!r} is not allowed")))
                    continue
                outputs = [
                    pb_utils.Tensor(key, np.array([value.encode("utf-8")], dtype=np.object_))
                    for key, value in (("NAME", name), ("VERSION", version), ("LOCATION", location))
                ]
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

BROKEN_MODEL_PY = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("initialize refused on purpose")

    def execute(self, requests):
        return None
"""


def write_repository(root: Path, model_py: str) -> Path:
    (root / MODEL / "1").mkdir(parents=True)
    (root / MODEL / "config.pbtxt").write_text(CONFIG, encoding="utf-8")
    (root / MODEL / "1" / "model.py").write_text(model_py, encoding="utf-8")
    return root


Response = tuple[str, str, str] | str  # (name, version, location) or an error message


def stream(url: str, names: list[str], timeout_s: float = 120.0) -> list[Response]:
    """Send one decoupled request over gRPC streaming; collect until the final flag."""
    results: queue.Queue[tuple[grpcclient.InferResult | None, InferenceServerException | None]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        tensor = grpcclient.InferInput("NAMES", [len(names)], "BYTES")
        tensor.set_data_from_numpy(np.array([n.encode() for n in names], dtype=np.object_))
        client.async_stream_infer(MODEL, [tensor], request_id="r1", enable_empty_final_response=True)
        out: list[Response] = []
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = results.get(timeout=max(0.0, deadline - time.monotonic()))
            if error is not None:
                out.append(error.message())
                continue
            assert result is not None
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
            out.append(tuple(result.as_numpy(k)[0].decode() for k in ("NAME", "VERSION", "LOCATION")))  # type: ignore[arg-type]
    finally:
        client.stop_stream()
        client.close()


def process_group(pgid: int) -> set[int]:
    """Pids whose process group is ``pgid`` (the server and its Python stubs)."""
    return {proc.pid for proc in group_processes(pgid)}


def port_is_free(port: int) -> bool:
    # SO_REUSEADDR as every server sets it: TIME_WAIT leftovers of closed client
    # connections do not count, only a socket still bound/listening does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            raise
        return True


@pytest.mark.slow
def test_stub_sees_venv_over_grpc_and_stops_cleanly(
    tmp_path: Path, start_triton: Callable[..., TritonServer]
) -> None:
    repo = write_repository(tmp_path / "repo", MODEL_PY)
    # Without the gateway: this test is about tritonserver and its stubs themselves.
    server = start_triton(repo, models=(MODEL,), ready_timeout_s=180.0, gateway=False)
    cfg = server.config
    ports = (cfg.grpc_port, cfg.http_port, cfg.metrics_port)
    assert cfg.host == "127.0.0.1"
    assert len(set(ports)) == 3 and all(ports)
    assert server.pid is not None
    pid = server.pid
    assert set(ports) <= listening_ports(pid)

    purelib = Path(sysconfig.get_paths()["purelib"])
    responses = stream(server.grpc_url, ["torch", "xgrammar", "numpy", "sys", "os"])
    assert responses == [
        ("torch", importlib.metadata.version("torch"), str(purelib / "torch" / "__init__.py")),
        ("xgrammar", importlib.metadata.version("xgrammar"), str(purelib / "xgrammar" / "__init__.py")),
        ("numpy", importlib.metadata.version("numpy"), str(purelib / "numpy" / "__init__.py")),
        # The stub's interpreter is the system 3.11 whose prefix is this venv.
        ("sys", sys.version.split()[0], sys.prefix),
        "NAMES: module 'os' is not allowed",
    ]

    # The metadata endpoint agrees that the model is decoupled and loaded.
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_model_ready(MODEL)
        assert client.get_model_config(MODEL).config.model_transaction_policy.decoupled is True
    finally:
        client.close()

    group = process_group(pid)
    assert pid in group and len(group) >= 2, f"expected the server and its stub in group {pid}: {group}"

    code = server.stop()
    assert code == 0, server.log_tail()
    assert not server.is_running()
    assert process_group(pid) == set()
    assert [p for p in ports if not port_is_free(p)] == []
    assert server.stop() == 0  # idempotent


@pytest.mark.slow
@pytest.mark.parametrize("log", [
    pytest.param({}, id="file"),
    # The launcher's mode: stdout only, the tail kept in memory.
    pytest.param({"log_file": None, "log_stdout": True}, id="stdout"),
])
def test_model_load_failure_raises_with_log_tail(
    tmp_path: Path, start_triton: Callable[..., TritonServer], log: dict[str, object], capfd: pytest.CaptureFixture[str]
) -> None:
    repo = write_repository(tmp_path / "repo", BROKEN_MODEL_PY)
    with pytest.raises(ServerStartError, match=r"(?s)exited with status 1 before it was ready.*initialize refused on purpose"):
        start_triton(repo, models=(MODEL,), ready_timeout_s=180.0, **log)
    out = capfd.readouterr().out
    if log:
        assert re.search(r"^triton: .*initialize refused on purpose", out, re.MULTILINE), out
    else:
        assert "triton: " not in out


def test_missing_repository_is_rejected_before_start(tmp_path: Path) -> None:
    from deploy.server import ServerConfig

    server = TritonServer(ServerConfig(model_repository=tmp_path / "absent"))
    with pytest.raises(ServerStartError, match=r"^model_repository .*/absent: not a directory$"):
        server.start()
    assert server.pid is None
    assert server.stop() is None
