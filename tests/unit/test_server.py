"""Unit tests of deploy.server that need no running tritonserver."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.server import (
    ServerConfig,
    TritonDistribution,
    TritonNotFoundError,
    TritonServer,
    ensure_python_stub,
    find_free_port,
    listening_ports,
    locate_tritonserver,
    server_environment,
)


def fake_distribution(root: Path) -> TritonDistribution:
    """A distribution laid out like the wheel's, with a real (shell) stub file."""
    (root / "stubs").mkdir(parents=True)
    (root / "backends" / "python").mkdir(parents=True)
    stub = root / "stubs" / "triton_python_backend_stub"
    stub.write_bytes(b"#!/bin/sh\necho stub\n")
    return TritonDistribution(
        root=root,
        binary=root / "bin" / "tritonserver",
        backend_dir=root / "backends",
        cache_dir=root / "caches",
        libs_dir=root / "libs",
        stub_source=stub,
        stub_target=root / "backends" / "python" / "triton_python_backend_stub",
        python_version="3.11",
    )


# ---------------------------------------------------------------- ServerConfig
@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"grpc_port": -1}, ValueError, r"^grpc_port: must be in 0\.\.65535 \(0 = pick a free port\), got -1$"),
        ({"http_port": 65536}, ValueError, r"^http_port: must be in 0\.\.65535"),
        ({"grpc_port": 9000, "metrics_port": 9000}, ValueError,
         r"^ports: grpc/http/metrics/internal/openai ports must differ"),
        ({"grpc_port": 9000, "openai_port": 9000}, ValueError,
         r"^ports: grpc/http/metrics/internal/openai ports must differ, got \[9000, 9000\]$"),
        ({"openai_port": 9000, "gateway": False}, ValueError,
         r"^openai_port: the OpenAI-compatible endpoint needs the gateway \(gateway=True\)$"),
        ({"openai_port": 70000}, ValueError, r"^openai_port: must be in 0\.\.65535"),
        ({"log_verbose": -1}, ValueError, r"^log_verbose: must be >= 0, got -1$"),
        ({"ready_timeout_s": 0.0}, ValueError, r"^ready_timeout_s: must be > 0, got 0\.0$"),
        ({"stop_grace_s": -1.0}, ValueError, r"^stop_grace_s: must be > 0"),
        ({"exit_timeout_s": 30, "stop_grace_s": 30.0}, ValueError, r"^exit_timeout_s: must be in \[0, stop_grace_s=30\.0\)"),
        ({"models": ["m"]}, TypeError, r"^models: must be a tuple of model names"),
        ({"models": ("",)}, ValueError, r"^models: model names must be non-empty"),
        ({"extra_args": ("--x", 1)}, TypeError, r"^extra_args: must be a tuple of strings"),
    ],
)
def test_server_config_rejects(fields: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ServerConfig(model_repository=Path("repo"), **fields)  # type: ignore[arg-type]


def test_server_config_defaults_bind_loopback_and_this_venv() -> None:
    cfg = ServerConfig(model_repository=Path("repo"))
    assert (cfg.host, cfg.grpc_port, cfg.http_port, cfg.metrics_port) == ("127.0.0.1", 0, 0, 0)
    assert cfg.python_env == Path(sys.prefix)


def test_command_line_is_loopback_and_complete(tmp_path: Path) -> None:
    cfg = ServerConfig(tmp_path, grpc_port=18001, http_port=18000, metrics_port=18002, gateway=False,
                       extra_args=("--strict-readiness=true",))
    server = TritonServer(cfg)
    dist = locate_tritonserver()
    assert server.command() == [
        str(dist.binary),
        f"--model-repository={tmp_path}",
        f"--backend-directory={dist.backend_dir}",
        f"--cache-directory={dist.cache_dir}",
        "--grpc-address=127.0.0.1",
        "--http-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        "--grpc-port=18001",
        "--http-port=18000",
        "--metrics-port=18002",
        "--log-verbose=0",
        "--exit-timeout-secs=20",
        "--allow-gpu-metrics=false",
        "--strict-readiness=true",
    ]
    assert (server.grpc_url, server.http_url) == ("127.0.0.1:18001", "127.0.0.1:18000")
    assert server.metrics_url == "http://127.0.0.1:18002/metrics"
    assert server.internal_headers == {}


def test_behind_the_gateway_tritonserver_is_loopback_and_restricted(tmp_path: Path) -> None:
    cfg = ServerConfig(tmp_path, host="0.0.0.0", grpc_port=18001, http_port=18000, metrics_port=18002,
                       internal_grpc_port=18003)
    server = TritonServer(cfg)
    command = server.command()
    (secret,) = server.internal_headers.values()
    assert len(secret) >= 40
    restricted = "inference,model-repository,shared-memory,trace,logging,statistics,model-config"
    assert command[4:14] == [
        "--grpc-address=127.0.0.1",  # only the gateway reaches it
        "--http-address=0.0.0.0",
        "--metrics-address=0.0.0.0",
        "--grpc-port=18003",
        "--http-port=18000",
        "--metrics-port=18002",
        "--log-verbose=0",
        "--exit-timeout-secs=20",
        "--allow-gpu-metrics=false",
        f"--grpc-restricted-protocol={restricted}:x-constrained-llm-internal={secret}",
    ]
    assert command[14:] == [f"--http-restricted-api={restricted}:x-constrained-llm-internal={secret}"]
    assert server.grpc_url == "0.0.0.0:18001"
    assert server.internal_grpc_url == "127.0.0.1:18003"
    assert server.internal_headers == {"triton-grpc-protocol-x-constrained-llm-internal": secret}
    # A new server object never reuses a secret.
    assert TritonServer(cfg).internal_headers != server.internal_headers


# ---------------------------------------------------------------- distribution
def test_locate_tritonserver_finds_the_wheel_layout() -> None:
    dist = locate_tritonserver()
    assert dist.root.parts[-2:] == ("pytriton", "tritonserver")
    assert os.access(dist.binary, os.X_OK)
    assert dist.stub_source == dist.root / "python_backend_stubs" / "3.11" / "triton_python_backend_stub"
    assert dist.stub_target == dist.backend_dir / "python" / "triton_python_backend_stub"
    assert dist.libs_dir.name == "nvidia_pytriton.libs" and dist.libs_dir.is_dir()


def test_locate_tritonserver_rejects_unknown_python_version() -> None:
    with pytest.raises(TritonNotFoundError, match=r"^no Python-backend stub for Python 2\.7 in the wheel: "):
        locate_tritonserver("2.7")


def test_a_system_tritonserver_is_used_where_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU image's /opt/tritonserver layout (TRITONSERVER_ROOT): binary and stub in place, nothing copied."""
    monkeypatch.setenv("TRITONSERVER_ROOT", str(tmp_path))
    with pytest.raises(TritonNotFoundError, match=r"^TRITONSERVER_ROOT=.*bin/tritonserver missing or not executable"):
        locate_tritonserver()
    for rel in ("bin/tritonserver", "backends/python/triton_python_backend_stub"):
        exe = tmp_path / rel
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    dist = locate_tritonserver("3.12")
    assert (dist.binary, dist.backend_dir, dist.libs_dir) == (
        tmp_path / "bin" / "tritonserver", tmp_path / "backends", tmp_path / "lib")
    assert dist.stub_source == dist.stub_target
    assert ensure_python_stub(dist) == dist.stub_target


def test_ensure_python_stub_installs_once_and_repairs(tmp_path: Path) -> None:
    dist = fake_distribution(tmp_path)
    target = ensure_python_stub(dist)
    assert target == dist.stub_target
    assert target.read_bytes() == dist.stub_source.read_bytes()
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert subprocess.run([target], capture_output=True, check=True).stdout == b"stub\n"

    inode = target.stat().st_ino
    ensure_python_stub(dist)
    assert target.stat().st_ino == inode  # identical stub: left alone

    target.chmod(0o644)  # not executable: replaced
    ensure_python_stub(dist)
    assert os.access(target, os.X_OK)

    target.write_bytes(b"#!/bin/sh\necho other\n")  # different content: replaced
    ensure_python_stub(dist)
    assert target.read_bytes() == dist.stub_source.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["triton_python_backend_stub"]  # no temp files


def test_ensure_python_stub_reports_unwritable_target(tmp_path: Path) -> None:
    dist = fake_distribution(tmp_path)
    dist = replace(dist, stub_target=tmp_path / "no" / "such" / "dir" / "stub")
    with pytest.raises(TritonNotFoundError, match=r"^cannot install the Python-backend stub at .*/no/such/dir/stub: "):
        ensure_python_stub(dist)


# ---------------------------------------------------------------- environment
def test_server_environment_puts_venv_first(tmp_path: Path) -> None:
    dist = fake_distribution(tmp_path / "dist")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3.11")
    env = server_environment(dist, venv, {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/lib", "KEEP": "1"})
    assert env == {
        "PATH": f"{venv}/bin:/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "LD_LIBRARY_PATH": f"/opt/lib:{dist.libs_dir}",
        "KEEP": "1",
    }
    assert server_environment(dist, venv, {})["LD_LIBRARY_PATH"] == str(dist.libs_dir)


def test_server_environment_rejects_non_venv(tmp_path: Path) -> None:
    with pytest.raises(TritonNotFoundError, match=r"^python_env .*/empty: no bin/python3, not a virtualenv$"):
        server_environment(fake_distribution(tmp_path / "d"), tmp_path / "empty", {})


# ---------------------------------------------------------------- ports
def test_find_free_port_and_listening_ports() -> None:
    port = find_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        assert port not in listening_ports(os.getpid())  # bound, not listening
        sock.listen()
        assert port in listening_ports(os.getpid())
    assert port not in listening_ports(os.getpid())


def test_listening_ports_of_missing_process() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessLookupError, match=rf"^no process {proc.pid}$"):
        listening_ports(proc.pid)


@pytest.mark.parametrize(("log", "reasons"), [
    (2 * ('E1203 backend_model.cc:692] "ERROR: Failed to create instance: ConfigError: preprocessing: no chat '
          'template. Add one\\n\\nAt:\\n  /work/x.py(3)"\n')
     + 'E1203 model_lifecycle.cc:654] "failed to load \'llm\': Failed to create instance: bad dtype"\n',
     ["ConfigError: preprocessing: no chat template. Add one", "bad dtype"]),
    ("I1203 server.cc] all models ready\n", []),
])
def test_load_failures_name_each_reason_once(log: str, reasons: list[str]) -> None:
    from deploy.server import load_failures

    assert load_failures(log) == reasons
