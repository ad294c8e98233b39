"""The launcher's command line: run a supervised ``tritonserver`` in the foreground.

``python -m deploy`` (the command the Makefile, the images' entrypoint and
the docs use; deploy/__main__.py) runs :func:`main`.  It lives apart from deploy/server.py so that the modules' imports form no circle:
:mod:`deploy.supervisor` needs :mod:`deploy.server`'s ``TritonServer`` and
``ServerError``, and the launcher needs all three (deploy.server ->
deploy.gateway; deploy.supervisor -> deploy.server; deploy.launch -> both and
deploy.health).

Usage::

    python -m deploy --model-repository build/model_repository --grpc-port 8001
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from deploy.gateway import GatewayError, GatewaySecurity
from deploy.health import HealthServer
from deploy.server import DEFAULT_HOST, LOG_TAG, ServerConfig, ServerError, TritonServer
from deploy.supervisor import Supervisor, default_probes
from openai_api.server import try_lines

__all__ = ["SUPERVISOR_JOIN_S", "gateway_security", "main"]

# How long the launcher waits for the supervisor thread at shutdown (it may be in
# the middle of a restart); part of the pod's stop budget (deploy/k8s deployment).
SUPERVISOR_JOIN_S: Final = 60.0

#: ``(flag, environment variable, help)`` of the gateway's security options.
_GATEWAY_SECURITY_FLAGS: Final = (
    ("--tls-cert", "GATEWAY_TLS_CERT", "PEM certificate chain: serve TLS (needs --tls-key)"),
    ("--tls-key", "GATEWAY_TLS_KEY", "PEM private key of --tls-cert"),
    ("--tls-client-ca", "GATEWAY_TLS_CLIENT_CA", "PEM CA bundle: require client certificates it signed (mutual TLS)"),
    ("--api-keys-file", "GATEWAY_API_KEYS_FILE",
     "JSON file of API key hashes (deploy/gateway.py parse_keys); reloaded when it changes"),
)


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value) if value else None


def gateway_security(args: argparse.Namespace) -> GatewaySecurity:
    """The gateway's :class:`GatewaySecurity` from parsed launcher flags.

    Raises
    ------
    GatewayError
        Certificate and key not given together, or a client CA without them.
    """
    return GatewaySecurity(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                           api_keys_file=args.api_keys_file)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy",
        description="Run the tritonserver bundled in nvidia-pytriton in the foreground.",
    )
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--host", default=DEFAULT_HOST, help="address of every endpoint (default %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=0, help="0 = a free port")
    parser.add_argument("--http-port", type=int, default=0, help="0 = a free port")
    parser.add_argument("--metrics-port", type=int, default=0, help="0 = a free port")
    parser.add_argument("--model", dest="models", action="append", default=[], help="wait for this model (repeat)")
    parser.add_argument("--python-env", type=Path, default=Path(sys.prefix),
                        help="the environment whose packages stubs without an EXECUTION_ENV_PATH see "
                             "(default: this interpreter's, %(default)s)")
    parser.add_argument("--log-file", type=Path, default=None,
                        help="also write tritonserver's log to this file (appended across restarts); "
                             "its lines always go to stdout, prefixed 'triton: '")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds (default %(default)s)")
    parser.add_argument("--stop-grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--client-hint", default=None, help="command line printed once ready")
    parser.add_argument("--openai-port", type=int, default=0,
                        help="serve the OpenAI-compatible API (/v1/chat/completions) here; 0 = off")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve /v2/health/live and /v2/health/ready for probes here (deploy/health.py)")
    # The gateway's TLS and API keys; each flag falls back to its environment
    # variable (what deploy/k8s sets from mounted Secrets); an empty value is unset.
    # None of them: plaintext and keyless (`make serve` on loopback).
    security = parser.add_argument_group("gateway TLS and API keys (public gRPC port)")
    for flag, env, what in _GATEWAY_SECURITY_FLAGS:
        security.add_argument(flag, type=Path, default=_env_path(env), metavar="FILE",
                              help=f"{what} (env {env})")
    parser.add_argument("extra", nargs="*", help="extra tritonserver arguments, after --")
    return parser.parse_args(argv)


def _say(line: str, *, err: bool = False) -> None:
    """Write ``line`` and its newline in one write: tritonserver's log is copied to stdout by another thread
    (``deploy.server``), and ``print`` writes the text and the newline apart, so a copied line could land
    between them (seen once in ``tests/integration/test_launcher.py``)."""
    out = sys.stderr if err else sys.stdout
    out.write(line + "\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run a server in the foreground until Ctrl-C/SIGTERM; returns the exit status."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="server: %(message)s", stream=sys.stderr)
    try:
        config = ServerConfig(
            model_repository=args.model_repository,
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            models=tuple(args.models),
            log_file=args.log_file,
            # The launcher is a container's process 1 and `make serve`'s
            # foreground job: Triton's lines belong on its stdout, next to its own.
            log_stdout=True,
            log_verbose=args.log_verbose,
            ready_timeout_s=args.ready_timeout,
            stop_grace_s=args.stop_grace,
            exit_timeout_s=max(0, min(20, int(args.stop_grace) - 1)),
            extra_args=tuple(args.extra),
            python_env=args.python_env,
            gateway_security=gateway_security(args),
            openai_port=args.openai_port or None,
        )
    except (ValueError, GatewayError) as err:
        print(f"server: error: {err}", file=sys.stderr)
        return 2

    stop_requested = threading.Event()
    ready = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()
        if not ready.is_set():
            # Still starting (model loads can take minutes): abort the wait.
            raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    server = TritonServer(config)
    try:
        server.start()
        where = f"stdout ('{LOG_TAG.strip()}' lines)" + (f" and {server.log_path}" if server.log_path else "")
        _say(f"server: starting tritonserver (pid {server.pid}), log to {where}")
        server.wait_ready()
        ready.set()
    except ServerError as err:
        server.stop()
        _say(f"server: error: {err}", err=True)
        return 1
    except KeyboardInterrupt:
        code = server.stop()
        _say(f"server: interrupted before ready; stopped (tritonserver exit status {code})", err=True)
        return 130
    cfg = server.config
    _say(f"server: ready: grpc={server.grpc_url} http={server.http_url} metrics={server.metrics_url} "
         f"models={','.join(cfg.models) or '-'} pid={server.pid}")
    if server.openai is not None:
        _say(f"server: openai: {server.openai.url}")
        for line in try_lines(server.openai.url, cfg.public_models[0],
                              keys=cfg.gateway_security.api_keys_file is not None, python=sys.executable):
            _say(f"server: try: {line}")
    if args.client_hint:
        _say(f"server: try: {args.client_hint}")
    _say("server: Ctrl-C to stop")
    # Supervision: a dead tritonserver, or one whose grammar/llm stub died, is
    # restarted with backoff while the gateway reports not ready (deploy/supervisor.py).
    repo = config.model_repository
    probes = tuple(p for p in default_probes() if (repo / p.model).is_dir())
    supervisor = Supervisor(server, probes)
    watcher = threading.Thread(target=supervisor.run, name="supervisor", daemon=True)
    watcher.start()
    health = None
    if args.health_port is not None:
        def ready_now() -> tuple[bool, str]:
            gateway = server.gateway
            if gateway is None or not server.is_running():
                return False, "tritonserver is not running"
            return gateway.health

        def gateway_metrics() -> str:
            gateway, front = server.gateway, server.openai
            return ("" if gateway is None else gateway.metrics_text()) + ("" if front is None else front.metrics_text())

        def begin_drain() -> None:
            # The preStop drain (deploy/drain.py): GOAWAY now, streams in flight finish.
            gateway = server.gateway
            if gateway is not None:
                gateway.begin_drain()

        health = HealthServer(cfg.host, args.health_port, ready_now, metrics=gateway_metrics, on_drain=begin_drain)
        health.start()
        _say(f"server: health: http://{cfg.host}:{health.port}/v2/health/ready")
    while not stop_requested.wait(0.5):
        pass
    if health is not None:
        health.stop()
    supervisor.stop()
    watcher.join(SUPERVISOR_JOIN_S)
    code = server.stop()
    _say(f"server: stopped (tritonserver exit status {code})")
    return 0

