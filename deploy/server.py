"""Start and stop the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel.

The wheel ships a complete Triton Inference Server 2.51 (CPU capable) under
``site-packages/pytriton/tritonserver``: ``bin/tritonserver``, the Python backend
``backends/python/libtriton_python.so``, and one Python-backend stub per Python
version under ``python_backend_stubs/<X.Y>/``.  The Python backend looks for its
stub beside ``libtriton_python.so``, so :func:`ensure_python_stub` copies the
stub for this interpreter's version there (once; idempotent, atomic).

Why PATH matters: the stub embeds the *system* ``libpython3.11`` (Debian
3.11.2).  At start-up that embedded interpreter computes ``sys.prefix`` from
the first ``python3`` it finds on ``PATH``; with the venv's ``bin/`` first it
finds the venv's ``pyvenv.cfg`` and so the venv's site-packages (torch,
xgrammar, ...).  A venv made by another 3.11 build (pyenv 3.11.7) breaks in the
stub on ``_ssl``; make the venv with ``/usr/bin/python3.11 -m venv``.

``LD_LIBRARY_PATH`` gets the wheel's ``nvidia_pytriton.libs`` appended, as
``pytriton.server.triton_server.TritonServer._get_env`` does: the binaries find
those libraries through their RPATH already, but backends loaded with
``dlopen`` from other directories may not.

Usage::

    with TritonServer(ServerConfig(model_repository=Path("build/model_repository"),
                                   models=("constrained_llm",))) as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

    python -m deploy --model-repository build/model_repository --grpc-port 8001  (deploy/launch.py)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import filecmp
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, Self, TextIO

import psutil

from deploy.gateway import (
    GRPC_SECRET_METADATA,
    Gateway,
    GatewayConfig,
    GatewayError,
    GatewaySecurity,
    new_secret,
    restriction_args,
)
from openai_api.server import OpenAIConfig, OpenAIServer, OpenAIServerError

__all__ = [
    "ServerConfig",
    "ServerError",
    "ServerStartError",
    "ServerTimeoutError",
    "TritonDistribution",
    "TritonNotFoundError",
    "TritonServer",
    "ensure_python_stub",
    "find_free_port",
    "listening_ports",
    "locate_tritonserver",
    "server_environment",
]

DEFAULT_HOST: Final = "127.0.0.1"
# Polling period of the readiness loop.  One is_server_ready round trip on
# loopback is far below a millisecond, so 0.2 s keeps the loop's own cost
# negligible while adding at most 0.2 s to a start-up that takes seconds
# (a stub's torch import alone).
_POLL_S: Final = 0.2
_LOG_TAIL_BYTES: Final = 6000
#: Triton's line for a model instance whose initialize() raised: the reason, up to the traceback.
_LOAD_FAILURE: Final = re.compile(r'Failed to create instance: (.*?)(?:\\n\\nAt:|"$)', re.MULTILINE)


def load_failures(log: str) -> list[str]:
    """The distinct reasons model instances failed to load, in ``log`` (Triton's own log text), oldest first.

    A model's ``initialize`` error (a ``ConfigError`` naming what to change) is
    logged by Triton long before its last lines ("failed to load all models"),
    so it is put at the head of the start error rather than left in the log.
    """
    return list(dict.fromkeys(m.group(1) for m in _LOAD_FAILURE.finditer(log)))
# What the launcher keeps of Triton's output when it goes to stdout and to no
# file: enough for the error messages of a failed start (:meth:`TritonServer.log_tail`).
_LOG_MEMORY_BYTES: Final = 1 << 20
# Prefix of Triton's lines (and its stubs') on the launcher's stdout, next to
# the launcher's own ``server: `` lines, so one ``kubectl logs`` shows both.
LOG_TAG: Final = "triton: "
# How many times start() picks fresh ports when the server could not bind an
# automatically chosen one (another process took it between our probe and the
# server's bind).  Explicitly given ports are never retried.
_BIND_RETRIES: Final = 3
# Triton 2.51 logs e.g. `failed to start HTTP service: Unavailable - Socket
# '127.0.0.1:48551' already in use` and exits.
_BIND_FAILURE_MARKER: Final = "already in use"
_PR_SET_PDEATHSIG: Final = 1
# tritonserver's gRPC endpoint behind the gateway: never reachable from outside the host.
_INTERNAL_HOST: Final = "127.0.0.1"


class ServerError(RuntimeError):
    """Base class of the launcher's errors."""


class TritonNotFoundError(ServerError, FileNotFoundError):
    """The bundled ``tritonserver`` (or a part of it) cannot be found or used."""


class ServerStartError(ServerError):
    """The server process exited, or a model failed, before becoming ready.

    The message ends with the tail of the server log.
    """


class ServerTimeoutError(ServerStartError, TimeoutError):
    """The server or a model did not become ready within the timeout."""


@dataclass(frozen=True)
class TritonDistribution:
    """Paths of the Triton Inference Server shipped in ``nvidia-pytriton``.

    Attributes
    ----------
    root : Path
        ``site-packages/pytriton/tritonserver``.
    binary : Path
        The ``tritonserver`` executable.
    backend_dir : Path
        Directory passed as ``--backend-directory``.
    cache_dir : Path
        Directory passed as ``--cache-directory``.
    libs_dir : Path
        The wheel's bundled shared libraries (``nvidia_pytriton.libs``).
    stub_source : Path
        The Python-backend stub for ``python_version`` inside the wheel.
    stub_target : Path
        Where the Python backend expects the stub (beside ``libtriton_python.so``).
    python_version : str
        ``"X.Y"`` of the stub.
    """

    root: Path
    binary: Path
    backend_dir: Path
    cache_dir: Path
    libs_dir: Path
    stub_source: Path
    stub_target: Path
    python_version: str


#: A system-wide Triton to use instead of the one in ``nvidia-pytriton``
#: (set in the GPU image: ``/opt/tritonserver`` of the NGC image).
TRITONSERVER_ROOT_ENV: Final = "TRITONSERVER_ROOT"


def locate_tritonserver(python_version: str | None = None) -> TritonDistribution:
    """Find the ``tritonserver`` bundled in the installed ``nvidia-pytriton`` wheel
    (or the system-wide one named by ``$TRITONSERVER_ROOT``).

    ``pytriton`` is located with :func:`importlib.util.find_spec`, which does not
    import it (importing pytriton pulls in numpy, sh, zmq, ... for nothing).

    Parameters
    ----------
    python_version : str, optional
        ``"X.Y"`` of the Python-backend stub; defaults to this interpreter's,
        which must be the venv's (the stub loads that venv's packages).

    Returns
    -------
    TritonDistribution

    Raises
    ------
    TritonNotFoundError
        If the wheel is not installed or a required file is missing.
    """
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    system_root = os.environ.get(TRITONSERVER_ROOT_ENV, "")
    if system_root:
        return _system_tritonserver(Path(system_root), version)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotFoundError(
            f"nvidia-pytriton is not installed in {sys.prefix}: pip install -r requirements.txt"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    root = package_dir / "tritonserver"
    dist = TritonDistribution(
        root=root,
        binary=root / "bin" / "tritonserver",
        backend_dir=root / "backends",
        cache_dir=root / "caches",
        libs_dir=package_dir.parent / "nvidia_pytriton.libs",
        stub_source=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        stub_target=root / "backends" / "python" / "triton_python_backend_stub",
        python_version=version,
    )
    if not os.access(dist.binary, os.X_OK):
        raise TritonNotFoundError(f"tritonserver binary missing or not executable: {dist.binary}")
    python_backend = dist.backend_dir / "python" / "libtriton_python.so"
    if not python_backend.is_file():
        raise TritonNotFoundError(f"Python backend missing: {python_backend}")
    if not dist.stub_source.is_file():
        raise TritonNotFoundError(f"no Python-backend stub for Python {version} in the wheel: {dist.stub_source}")
    return dist


def _system_tritonserver(root: Path, version: str) -> TritonDistribution:
    """A Triton installed system-wide (the NGC images' ``/opt/tritonserver``), stub already in place."""
    stub = root / "backends" / "python" / "triton_python_backend_stub"
    dist = TritonDistribution(
        root=root,
        binary=root / "bin" / "tritonserver",
        backend_dir=root / "backends",
        cache_dir=root / "caches",
        libs_dir=root / "lib",
        stub_source=stub,
        stub_target=stub,
        python_version=version,
    )
    for path in (dist.binary, stub):
        if not os.access(path, os.X_OK):
            raise TritonNotFoundError(f"{TRITONSERVER_ROOT_ENV}={root}: {path} missing or not executable")
    return dist


def ensure_python_stub(dist: TritonDistribution) -> Path:
    """Place the Python-backend stub beside ``libtriton_python.so``.

    Idempotent: an identical executable stub already in place is left alone.
    Otherwise the stub is copied to a temporary name in the target directory and
    renamed over the target, so a concurrent server start never sees a partial
    file.

    Returns
    -------
    Path
        The installed stub.

    Raises
    ------
    TritonNotFoundError
        If the stub cannot be installed or is not executable afterwards.
    """
    target = dist.stub_target
    if not (target.is_file() and os.access(target, os.X_OK) and filecmp.cmp(dist.stub_source, target, shallow=False)):
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=".stub-", dir=target.parent)
            os.close(fd)
            try:
                shutil.copyfile(dist.stub_source, tmp_name)
                os.chmod(tmp_name, 0o755)
                os.replace(tmp_name, target)
            except BaseException:
                os.unlink(tmp_name)
                raise
        except OSError as err:
            raise TritonNotFoundError(f"cannot install the Python-backend stub at {target}: {err}") from err
    if not os.access(target, os.X_OK):
        raise TritonNotFoundError(f"Python-backend stub is not executable: {target}")
    return target


def server_environment(
    dist: TritonDistribution, python_env: Path, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Build the environment of the ``tritonserver`` process.

    Parameters
    ----------
    dist : TritonDistribution
        The bundled server.
    python_env : Path
        The virtualenv whose packages the Python-backend stubs must see; its
        ``bin/`` goes first on ``PATH``.
    base : Mapping[str, str], optional
        Environment to start from (default: ``os.environ``).

    Raises
    ------
    TritonNotFoundError
        If ``python_env`` has no ``bin/python3``.
    """
    env = dict(os.environ if base is None else base)
    python_bin = python_env / "bin"
    if not (python_bin / "python3").exists():
        raise TritonNotFoundError(f"python_env {python_env}: no bin/python3, not a virtualenv")
    path = env.get("PATH", os.defpath)
    env["PATH"] = f"{python_bin}{os.pathsep}{path}" if path else str(python_bin)
    # The models import the packages (grammar_backend, triton_support, llm_runtime...) from this checkout.
    repo_root = str(Path(__file__).resolve().parents[1])
    py_path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{repo_root}{os.pathsep}{py_path}" if py_path else repo_root
    libs = str(dist.libs_dir)
    ld_path = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = f"{ld_path}{os.pathsep}{libs}" if ld_path else libs
    return env


def find_free_port(host: str = DEFAULT_HOST) -> int:
    """Return a TCP port on ``host`` that is free at the time of the call.

    The port is released before returning, so another process may take it
    before the server binds it; :class:`TritonServer` retries with fresh ports
    when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def listening_ports(pid: int) -> set[int]:
    """TCP ports on which process ``pid`` holds a listening socket (IPv4 and IPv6).

    From :meth:`psutil.Process.net_connections` (on Linux: the socket inodes
    among ``/proc/<pid>/fd`` matched with ``/proc/net/tcp{,6}``).  Threads
    share the fd table, so the main pid suffices.

    Raises
    ------
    ProcessLookupError
        If the process does not exist.
    PermissionError
        If the process's fds may not be read (another user's process).
    """
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess as err:
        raise ProcessLookupError(f"no process {pid}") from err
    except psutil.AccessDenied as err:
        raise PermissionError(f"cannot read the sockets of process {pid}: {err}") from err
    return {conn.laddr.port for conn in connections if conn.status == psutil.CONN_LISTEN}


def _validate_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name}: must be in 0..65535 (0 = pick a free port), got {port}")


@dataclass(frozen=True)
class ServerConfig:
    """How to run one ``tritonserver``.

    Attributes
    ----------
    model_repository : Path
        The (rendered) model repository.
    host : str
        Address every endpoint binds to (loopback by default).
    grpc_port, http_port, metrics_port : int
        Ports; 0 picks a free port at start.
    models : tuple[str, ...]
        Models that :meth:`TritonServer.wait_ready` waits for by default.
    log_file : Path or None
        A file that gets the server's stdout+stderr (appended to across
        supervisor restarts); None = a new file under the temp dir, unless
        ``log_stdout`` is set.
    log_stdout : bool
        Copy the server's output line by line, prefixed :data:`LOG_TAG`, to this
        process's stdout (a container's log); without ``log_file`` no file is
        written and the last 1 MiB stays in memory for :meth:`TritonServer.log_tail`.
    log_verbose : int
        ``--log-verbose`` level.
    ready_timeout_s : float
        Default timeout of :meth:`TritonServer.wait_ready`.
    stop_grace_s : float
        Time between SIGTERM and SIGKILL in :meth:`TritonServer.stop`.
    exit_timeout_s : int
        ``--exit-timeout-secs``: how long Triton itself waits for in-flight
        requests on shutdown; kept below ``stop_grace_s`` so that Triton's own
        orderly shutdown finishes before the SIGKILL.
    python_env : Path
        Virtualenv the Python backend stubs use (default: this interpreter's).
    extra_args : tuple[str, ...]
        Further ``tritonserver`` arguments, appended verbatim.
    gateway : bool
        Serve clients through :class:`deploy.gateway.Gateway` on ``grpc_port``
        (the default, and the only safe way with Triton 2.51: see that module).
        ``tritonserver``'s own gRPC endpoint then binds 127.0.0.1 on
        ``internal_grpc_port`` and its inference, control and statistics APIs
        (gRPC and HTTP) require a secret generated at each start.  False: clients
        reach ``tritonserver`` directly on ``grpc_port`` (tests of the server itself).
    public_models : tuple[str, ...]
        Models the gateway serves to clients.
    internal_grpc_port : int
        ``tritonserver``'s gRPC port behind the gateway; 0 picks a free one.
    gateway_security : GatewaySecurity
        TLS and API keys of the gateway (default: plaintext, no keys, for loopback).
    openai_port : int or None
        Serve the OpenAI-compatible endpoint (:mod:`openai_api.server`) on this
        port of ``host``, on the gateway's loop, with its TLS and keys; None:
        off; 0: a free port.  Needs ``gateway``.
    """

    model_repository: Path
    host: str = DEFAULT_HOST
    grpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0
    models: tuple[str, ...] = ()
    log_file: Path | None = None
    log_stdout: bool = False
    log_verbose: int = 0
    ready_timeout_s: float = 300.0
    stop_grace_s: float = 30.0
    exit_timeout_s: int = 20
    python_env: Path = field(default_factory=lambda: Path(sys.prefix))
    extra_args: tuple[str, ...] = ()
    gateway: bool = True
    public_models: tuple[str, ...] = ("constrained_llm",)
    internal_grpc_port: int = 0
    gateway_security: GatewaySecurity = field(default_factory=GatewaySecurity)
    openai_port: int | None = None

    def __post_init__(self) -> None:
        if self.openai_port is not None:
            _validate_port("openai_port", self.openai_port)
            if not self.gateway:
                raise ValueError("openai_port: the OpenAI-compatible endpoint needs the gateway (gateway=True)")
        for name in ("grpc_port", "http_port", "metrics_port", "internal_grpc_port"):
            _validate_port(name, getattr(self, name))
        explicit = [p for p in (self.grpc_port, self.http_port, self.metrics_port, self.internal_grpc_port,
                                self.openai_port) if p]
        if len(explicit) != len(set(explicit)):
            raise ValueError(f"ports: grpc/http/metrics/internal/openai ports must differ, got {explicit}")
        if self.log_verbose < 0:
            raise ValueError(f"log_verbose: must be >= 0, got {self.log_verbose}")
        if not self.ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s: must be > 0, got {self.ready_timeout_s}")
        if not self.stop_grace_s > 0:
            raise ValueError(f"stop_grace_s: must be > 0, got {self.stop_grace_s}")
        if not 0 <= self.exit_timeout_s < self.stop_grace_s:
            raise ValueError(
                f"exit_timeout_s: must be in [0, stop_grace_s={self.stop_grace_s}), got {self.exit_timeout_s}"
            )
        if not isinstance(self.models, tuple) or not all(isinstance(m, str) for m in self.models):
            raise TypeError(f"models: must be a tuple of model names, got {self.models!r}")
        if not all(self.models):
            raise ValueError(f"models: model names must be non-empty, got {self.models!r}")
        if not isinstance(self.extra_args, tuple) or not all(isinstance(a, str) for a in self.extra_args):
            raise TypeError(f"extra_args: must be a tuple of strings, got {self.extra_args!r}")


def _pick_ports(config: ServerConfig) -> ServerConfig:
    """Fill every 0 port with a distinct free port."""
    taken = {p for p in (config.grpc_port, config.http_port, config.metrics_port, config.internal_grpc_port,
                         config.openai_port) if p}

    def pick(port: int) -> int:
        while not port or port in taken:
            port = find_free_port(config.host)
        taken.add(port)
        return port

    return replace(
        config,
        grpc_port=config.grpc_port or pick(0),
        http_port=config.http_port or pick(0),
        metrics_port=config.metrics_port or pick(0),
        internal_grpc_port=(config.internal_grpc_port or pick(0)) if config.gateway else 0,
        # Picked once, so a restart by the supervisor keeps the port clients know.
        openai_port=None if config.openai_port is None else config.openai_port or pick(0),
    )


def _parent_death_signal_hook() -> Callable[[], None]:
    """Return a ``preexec_fn`` that makes the child get SIGTERM when we die.

    Without it a crashed test run or a SIGKILLed ``make serve`` leaves an
    orphan tritonserver holding its ports.  Linux fires this when the *thread*
    that forked exits, so start servers from a long-lived thread.  libc is
    loaded here, in the parent, so the child only makes the prctl call.
    """
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        raise TritonNotFoundError("cannot find libc for prctl(PR_SET_PDEATHSIG)")
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


class TritonServer:
    """One ``tritonserver`` process on loopback, from start to stop.

    Parameters
    ----------
    config : ServerConfig
        What to run.  Ports left at 0 are chosen at :meth:`start`; the chosen
        values are in :attr:`config` afterwards.

    Examples
    --------
    >>> with TritonServer(ServerConfig(Path("build/model_repository"), models=("grammar",))) as s:
    ...     print(s.grpc_url)
    """

    def __init__(self, config: ServerConfig) -> None:
        self._requested = config
        self.config = config
        self._process: subprocess.Popen[bytes] | None = None
        self._log_handle: TextIO | None = None
        self._log_path: Path | None = config.log_file
        # Lines pumped to stdout (log_stdout), newest last, at most _LOG_MEMORY_BYTES.
        self._log_memory: deque[bytes] = deque()
        self._log_memory_bytes = 0
        self._log_memory_lock = threading.Lock()
        self._log_pump: threading.Thread | None = None
        self._lock = threading.Lock()
        self._gateway: Gateway | None = None
        self._openai: OpenAIServer | None = None
        # Fresh per start; only the gateway (and this object) ever holds it.
        self._secret = new_secret()

    # ------------------------------------------------------------------ info
    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint (the form tritonclient.grpc takes)."""
        return f"{self.config.host}:{self.config.grpc_port}"

    @property
    def internal_grpc_url(self) -> str:
        """``host:port`` of tritonserver's own gRPC endpoint (behind the gateway; needs :attr:`internal_headers`)."""
        if not self.config.gateway:
            return self.grpc_url
        return f"{_INTERNAL_HOST}:{self.config.internal_grpc_port}"

    @property
    def internal_headers(self) -> dict[str, str]:
        """The gRPC headers that tritonserver's restricted APIs require (empty without the gateway)."""
        return {GRPC_SECRET_METADATA: self._secret} if self.config.gateway else {}

    @property
    def gateway(self) -> Gateway | None:
        """The running gateway (None before start or without one)."""
        return self._gateway

    @property
    def openai(self) -> OpenAIServer | None:
        """The running OpenAI-compatible endpoint (None before start or when off)."""
        return self._openai

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return f"{self.config.host}:{self.config.http_port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics`` of the Prometheus endpoint."""
        return f"http://{self.config.host}:{self.config.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, None before start."""
        return None if self._process is None else self._process.pid

    @property
    def log_path(self) -> Path | None:
        """The server's log file (kept after stop for post-mortems); None when it logs to stdout only."""
        return self._log_path

    @property
    def returncode(self) -> int | None:
        """Exit status once the process is gone, else None."""
        return None if self._process is None else self._process.poll()

    def is_running(self) -> bool:
        """True while the server process is alive."""
        return self._process is not None and self._process.poll() is None

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        """The last ``max_bytes`` of the server log, decoded leniently."""
        if self._log_path is None:
            with self._log_memory_lock:
                tail = b"".join(self._log_memory)
            return tail[-max_bytes:].decode("utf-8", errors="replace")
        if not self._log_path.exists():
            return ""
        with self._log_path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - max_bytes))
            return handle.read().decode("utf-8", errors="replace")

    def command(self) -> list[str]:
        """The ``tritonserver`` command line for the current config."""
        dist = locate_tritonserver()
        cfg = self.config
        # Behind the gateway tritonserver's gRPC endpoint is loopback only and
        # its inference/control APIs need the secret; health and metadata stay
        # open (probes, the readiness loop below).
        restricted = restriction_args(self._secret) if cfg.gateway else ()
        return [
            str(dist.binary),
            f"--model-repository={cfg.model_repository.resolve()}",
            f"--backend-directory={dist.backend_dir}",
            f"--cache-directory={dist.cache_dir}",
            f"--grpc-address={_INTERNAL_HOST if cfg.gateway else cfg.host}",
            f"--http-address={cfg.host}",
            f"--metrics-address={cfg.host}",
            f"--grpc-port={cfg.internal_grpc_port if cfg.gateway else cfg.grpc_port}",
            f"--http-port={cfg.http_port}",
            f"--metrics-port={cfg.metrics_port}",
            f"--log-verbose={cfg.log_verbose}",
            f"--exit-timeout-secs={cfg.exit_timeout_s}",
            # No GPU metrics on CPU machines: without this Triton probes DCGM at
            # start and logs an error line per probe.
            "--allow-gpu-metrics=false",
            *restricted,
            *cfg.extra_args,
        ]

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the process (does not wait for readiness; see :meth:`wait_ready`).

        Raises
        ------
        ServerError
            If this server is already running.
        TritonNotFoundError
            If the bundled server cannot be found or prepared.
        ServerStartError
            If the model repository does not exist.
        """
        with self._lock:
            if self.is_running():
                raise ServerError(f"tritonserver already running (pid {self.pid})")
            repo = self._requested.model_repository
            if not repo.is_dir():
                raise ServerStartError(f"model_repository {repo}: not a directory")
            dist = locate_tritonserver()
            ensure_python_stub(dist)
            env = server_environment(dist, self._requested.python_env)
            self.config = _pick_ports(self._requested)
            if self._log_path is None and not self._requested.log_stdout:
                fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
                os.close(fd)
                self._log_path = Path(name)
            if self._log_path is not None:
                self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._spawn(env, mode="w")
            if self.config.gateway:
                self._start_gateway()

    def restart_process(self, *, graceful: bool = True) -> None:
        """Replace the tritonserver process (same ports, same secret); the gateway stays up.

        Used by :class:`deploy.supervisor.Supervisor` when the server died or a
        composing model is broken.  Requests in flight on the old process end
        with UNAVAILABLE at the gateway.  The log is appended to, not replaced.
        Does not wait for readiness (see :meth:`wait_ready`).  ``graceful=False``
        kills at once: a server with a dead stub spends its whole exit timeout
        (20 s) waiting on it.
        """
        with self._lock:
            process = self._process
            if process is None:
                raise ServerError("restart_process() called before start()")
            self._terminate(process, graceful=graceful)
            dist = locate_tritonserver()
            self._spawn(server_environment(dist, self._requested.python_env), mode="a")

    def _spawn(self, env: dict[str, str], mode: Literal["w", "a"]) -> None:
        self._close_log()
        pump = self._requested.log_stdout
        # With the pump, the file belongs to that process's reader thread, which
        # closes it at EOF (an old process's reader may still drain after a restart).
        handle = None if self._log_path is None else self._log_path.open(mode, encoding="utf-8")
        if not pump:
            self._log_handle = handle
        self._process = subprocess.Popen(
            self.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pump else self._log_handle,
            stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C in the terminal reaches only the
            # launcher, which then stops the server in order; and stop()
            # can signal the whole group (server + Python stubs).
            start_new_session=True,
            # preexec_fn is unsafe only if the child touches a lock another
            # thread held at fork; the hook makes one pre-resolved prctl call.
            preexec_fn=_parent_death_signal_hook(),  # noqa: PLW1509
        )
        if pump:
            # One reader per process; it ends at EOF, when the server and every
            # stub holding the pipe have exited.  Triton logs per event, not per
            # token (log_verbose 0), so a line-by-line copy costs nothing measurable.
            self._log_pump = threading.Thread(target=self._pump_log, args=(self._process, handle),
                                              name="triton-log", daemon=True)
            self._log_pump.start()

    def _pump_log(self, process: subprocess.Popen[bytes], handle: TextIO | None) -> None:
        """Copy ``process``'s output to stdout (tagged), to ``handle`` and to the in-memory tail."""
        if process.stdout is None:
            raise ServerError("log_stdout: the server's stdout is not a pipe")
        out = sys.stdout
        for raw in process.stdout:
            text = raw.decode("utf-8", errors="replace")
            out.write(LOG_TAG + text if text.endswith("\n") else LOG_TAG + text + "\n")
            out.flush()
            if handle is not None:
                handle.write(text)
                handle.flush()
            else:
                with self._log_memory_lock:
                    self._log_memory.append(raw)
                    self._log_memory_bytes += len(raw)
                    while self._log_memory_bytes > _LOG_MEMORY_BYTES:
                        self._log_memory_bytes -= len(self._log_memory.popleft())
        process.stdout.close()
        if handle is not None:
            handle.close()

    def _stop_front(self) -> None:
        """Stop the client-facing endpoints first: no new request reaches a server that is stopping."""
        if self._openai is not None:
            self._openai.stop()
            self._openai = None
        if self._gateway is not None:
            self._gateway.stop()
            self._gateway = None

    def _start_gateway(self) -> None:
        cfg = self.config
        self._stop_front()
        try:
            # The keys file is read here: a missing or malformed one fails the start.
            self._gateway = Gateway(GatewayConfig(
                upstream=f"{_INTERNAL_HOST}:{cfg.internal_grpc_port}", secret=self._secret, host=cfg.host,
                port=cfg.grpc_port, public_models=cfg.public_models, security=cfg.gateway_security))
            self._gateway.start()
        except GatewayError as err:
            raise ServerStartError(f"gateway on {cfg.host}:{cfg.grpc_port}: {err}") from err
        if cfg.openai_port is not None:
            try:
                self._openai = OpenAIServer(self._gateway, OpenAIConfig(
                    host=cfg.host, port=cfg.openai_port, models=cfg.public_models, security=cfg.gateway_security))
                self._openai.start()
            except OpenAIServerError as err:
                raise ServerStartError(f"OpenAI-compatible endpoint on {cfg.host}:{cfg.openai_port}: {err}") from err

    def wait_ready(self, models: Sequence[str] | None = None, timeout_s: float | None = None) -> None:
        """Block until the server and ``models`` are ready.

        If ports were picked automatically and the server could not bind one
        (taken by another process since it was probed), the server is restarted
        on fresh ports, at most ``_BIND_RETRIES`` times.

        Parameters
        ----------
        models : Sequence[str], optional
            Models to wait for (default: ``config.models``).
        timeout_s : float, optional
            Overall limit (default: ``config.ready_timeout_s``).

        Raises
        ------
        ServerStartError
            If the process exits first; the message holds the log tail.
        ServerTimeoutError
            If the limit passes first (the server is left running; call stop()).
        """
        wanted = tuple(self.config.models if models is None else models)
        limit = self.config.ready_timeout_s if timeout_s is None else timeout_s
        if not limit > 0:
            raise ValueError(f"timeout_s: must be > 0, got {limit}")
        deadline = time.monotonic() + limit
        auto_ports = 0 in (self._requested.grpc_port, self._requested.http_port, self._requested.metrics_port)
        for attempt in range(_BIND_RETRIES + 1):
            try:
                self._wait_once(wanted, deadline)
                return
            except ServerStartError as err:
                if isinstance(err, ServerTimeoutError) or not auto_ports or attempt == _BIND_RETRIES:
                    raise
                if _BIND_FAILURE_MARKER not in str(err):
                    raise
                self.start()

    def _wait_once(self, models: tuple[str, ...], deadline: float) -> None:
        # Imported here: tritonclient.grpc pulls in grpc (a slow import) and the module
        # must stay importable for `--help` and path helpers without it.
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        if self._process is None:
            raise ServerError("wait_ready() called before start()")
        pending = list(models)
        last_error = "no answer yet"
        cfg = self.config
        client = grpcclient.InferenceServerClient(self.internal_grpc_url)
        try:
            while True:
                code = self._process.poll()
                if code is not None:
                    if self._log_pump is not None:
                        # Its last lines (the reason) may still be in the pipe.
                        self._log_pump.join(timeout=5.0)
                    reasons = "".join(f"model load failed: {r}\n" for r in load_failures(self.log_tail(1 << 20)))
                    raise ServerStartError(
                        f"tritonserver exited with status {code} before it was ready "
                        f"(log {self._log_path}):\n{reasons}{self.log_tail()}"
                    )
                # Triton binds gRPC, then HTTP, then metrics, and exits if any
                # bind fails, so a ready gRPC endpoint alone does not mean the
                # server will stay up: require all three sockets to be ours.
                triton_grpc = cfg.internal_grpc_port if cfg.gateway else cfg.grpc_port
                endpoints = {triton_grpc, cfg.http_port, cfg.metrics_port}
                try:
                    bound = endpoints <= listening_ports(self._process.pid)
                except ProcessLookupError:
                    bound = False  # exited meanwhile: poll() reports it on the next pass
                try:
                    if not bound:
                        last_error = f"ports {sorted(endpoints)} not all bound yet"
                    elif client.is_server_live() and client.is_server_ready():
                        pending = [m for m in pending if not client.is_model_ready(m)]
                        if not pending:
                            return
                        last_error = f"models not ready: {', '.join(pending)}"
                    else:
                        last_error = "server not ready"
                except InferenceServerException as err:
                    last_error = str(err)
                if time.monotonic() >= deadline:
                    raise ServerTimeoutError(
                        f"tritonserver at {self.grpc_url} not ready in time ({last_error}); "
                        f"log {self._log_path}:\n{self.log_tail()}"
                    )
                time.sleep(_POLL_S)
        finally:
            client.close()

    def stop(self) -> int | None:
        """Stop the server: SIGTERM, then SIGKILL after ``stop_grace_s``.

        The signals go to the server's process group, which holds the Python
        backend stubs too, so no stub outlives its server.  Idempotent.

        Returns
        -------
        int or None
            The exit status (None if never started).
        """
        with self._lock:
            process = self._process
            if process is None:
                return None
            self._stop_front()
            self._terminate(process, graceful=True)
            self._close_log()
            return process.returncode

    def _terminate(self, process: subprocess.Popen[bytes], *, graceful: bool) -> None:
        """SIGTERM (if graceful) then SIGKILL after ``stop_grace_s``; reaps the process."""
        if process.poll() is None and graceful:
            self._signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=self.config.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Stubs exit when their server does; a stub that survived a SIGKILLed
        # server would still be in the group.
        self._signal_group(process, signal.SIGKILL)
        process.wait()

    @staticmethod
    def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass  # the group is already empty: nothing left to signal

    def _close_log(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

