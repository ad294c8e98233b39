"""The gRPC gateway: the only endpoint clients reach; ``tritonserver`` listens on loopback behind it.

Why it exists
-------------
Triton 2.51 (the newest server reachable here, bundled in ``nvidia-pytriton``)
segfaults on some client behaviour in its gRPC stream handler
(``src/grpc/stream_infer_handler.cc`` / ``infer_handler.h``):

1. **``triton_grpc_error: true`` streams.**  On an error response,
   ``StreamInferResponseComplete`` calls ``WriteGRPCErrorResponse``, which
   ``Finish``-es the stream and deletes the response payload even before the
   FINAL flag.  ``Context::IsCancelled`` consumes its one-shot error flag in
   ``Process`` so ``HandleCancellation`` later logs ``HandleCancellation called
   even when the context was not cancelled ... step COMPLETE`` and never cancels
   the in-flight requests; ``HandleCompletion`` then re-queues every state of
   the stream with an alarm, so one state gets two completion-queue tags: the
   first releases it (``context_ = nullptr``), the second dereferences it in
   ``ModelStreamInferHandler::Process``.  Whether the tags land in the crashing
   order depends on timing, so it shows under CPU load (seen here with two
   busy cores: docs/usage.md, docs/benchmarks.md).
   Fixed upstream in server PR 8708 (first in 2.68).
2. **Client cancellation / disconnect with responses in flight.**  The
   completion-queue loop marks the notification received before ``Process``
   takes ``step_mtx_``; a FINAL callback in that gap marks the state
   CANCELLED and re-queues it, ``HandleCancellation`` releases it while its
   alarm is still queued: a null dereference (server PRs 7840, 8078; 2.53+).
3. **Ensemble steps never see a client's cancellation** (server issue 6739,
   still open): a decoupled ``llm`` step keeps decoding a departed client's
   sequence to ``max_tokens``.

No server flag avoids these; only a client that never sends the header and
never cancels or drops a stream with requests in flight is safe.  The gateway
is that client, whatever the real client does:

* it **never forwards ``triton_grpc_error``** (errors reach clients as data
  in ``RESULT``, and Triton's own in-band ``error_message`` otherwise);
* it **never cancels or drops an upstream stream** with requests in flight:
  when a client cancels, times out, disconnects or is killed, the gateway sends
  ``CANCEL=<request id>`` to ``llm`` for each of that stream's requests,
  reads their remaining responses until every FINAL flag, and only then
  half-closes the upstream stream;
* it **renames every request id** to an unguessable one (128 random bits)
  and maps responses back, so no client can name another client's request;
* it **serves only the public models** (``constrained_llm``): ``grammar``,
  ``llm``, ``preprocessing`` and ``postprocessing`` are refused with
  ``PERMISSION_DENIED``, as are model-repository, shared-memory, trace and
  log-settings calls.  ``tritonserver`` itself binds loopback and restricts
  inference on its own endpoints to a header carrying a secret generated at
  start (``--grpc-restricted-protocol`` / ``--http-restricted-api``), which
  only the gateway holds;
* readiness (``ServerReady``, ``ModelReady``) also reflects the supervisor's
  health probe (:meth:`Gateway.set_health`), so a broken composing model turns
  readiness false even while Triton still reports ready.

On the public port (issue 24) the gateway also

* serves **TLS** from a mounted certificate and key (optionally mutual TLS:
  :attr:`GatewaySecurity.tls_client_ca`), and checks **API keys** sent as
  ``authorization: Bearer <key>`` metadata against a file of key hashes
  (:class:`KeyRing`; reloaded when the file changes, so a rotated Kubernetes
  Secret takes effect without a restart).  A missing or unknown key gets
  ``UNAUTHENTICATED`` on every RPC except ``grpc.health.v1`` (probes carry no
  metadata; it tells only up/down); a key over its ``max_streams`` gets
  ``RESOURCE_EXHAUSTED`` for that new stream only.  Keys are never logged;
  logs and metrics name the key's ``id``;
* bounds every message by :data:`contract.MAX_MESSAGE_BYTES` (gRPC answers a
  larger one with ``RESOURCE_EXHAUSTED`` and the server stays up);
* sends keepalive pings and ends every connection after
  :attr:`GatewayConfig.max_connection_age_s` (with a GOAWAY), so a ClusterIP
  Service, which balances connections, not streams, spreads long-lived
  clients over new pods; :meth:`Gateway.begin_drain` (the preStop drain, via
  the launcher's ``POST /v2/drain``) sends GOAWAY at once, refuses new streams
  on existing connections and lets the streams in flight finish;
* serves the standard ``grpc.health.v1.Health`` service and its own metrics
  (:meth:`Gateway.metrics_text`, served by the launcher at ``/metrics`` on its
  health port).

Cost: one more loopback hop and a protobuf parse + serialize per streamed
response, within the noise of a request's time end to end (no bench compares
with and without the gateway; the one comparison is in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import ssl
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # the asyncio servicer, by its public name
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

import contract

__all__ = [
    "GRPC_SECRET_METADATA", "SECRET_HEADER", "ApiKey", "Gateway", "GatewayConfig", "GatewayError",
    "GatewaySecurity", "KeyFileError", "KeyRing", "Refused", "bearer_key", "parse_keys",
]

_log = logging.getLogger(__name__)

SERVICE: Final = "inference.GRPCInferenceService"
#: Key of the internal secret in tritonserver's ``--grpc-restricted-protocol`` /
#: ``--http-restricted-api`` flags.  Triton 2.51 expects it in gRPC metadata as
#: ``triton-grpc-protocol-<key>`` (:data:`GRPC_SECRET_METADATA`) and in HTTP
#: headers as ``<key>``.
SECRET_HEADER: Final = "x-constrained-llm-internal"
GRPC_SECRET_METADATA: Final = f"triton-grpc-protocol-{SECRET_HEADER}"
_FINAL: Final = "triton_final_response"
# Beyond a stop's grace, how long :meth:`Gateway.stop` waits for its thread (the
# loop's own teardown); part of the pod's stop budget (deploy/k8s deployment).
STOP_JOIN_SLACK_S: Final = 10.0
_EMPTY_FINAL: Final = "triton_enable_empty_final_response"
# Bound on one message either way (contract.MAX_MESSAGE_BYTES: the payload
# limit plus room for the prompt and the protobuf envelope); also on the
# loopback channel to tritonserver, whose responses are smaller still.
MAX_MESSAGE_BYTES: Final = contract.MAX_MESSAGE_BYTES
#: Metadata key of the API key (``authorization: Bearer <key>``; gRPC metadata keys are lower case).
AUTH_METADATA: Final = "authorization"
_BEARER: Final = "bearer "
# Refusal codes the gateway itself answers (metrics start them at 0 so rate() works from the start).
_REFUSAL_CODES: Final = ("UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "INVALID_ARGUMENT",
                         "UNAVAILABLE")
_KEY_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SHA256_HEX: Final = re.compile(r"^[0-9a-f]{64}$")
_PER_MODEL: Final = ("ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
# Unary calls forwarded to tritonserver (the per-model ones for public models only).
_FORWARDED: Final = ("ServerLive", "ServerReady", "ServerMetadata", *_PER_MODEL)
_REFUSED: Final = (
    "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
    "TraceSetting", "LogSettings",
)


class GatewayError(RuntimeError):
    """The gateway could not start (bad config, port taken, upstream unreachable)."""


class Refused(GatewayError):
    """The gateway refuses a call of :meth:`Gateway.infer` before it starts.

    Parameters
    ----------
    code : str
        The gRPC status name a ``ModelStreamInfer`` call would get
        (``UNAUTHENTICATED``, ``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``).
    message : str
        Why (names no key, only a key's id).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class KeyFileError(GatewayError):
    """The API keys file cannot be read or does not follow the format of :func:`parse_keys`."""


@dataclass(frozen=True)
class ApiKey:
    """One accepted API key, as the keys file names it.

    Attributes
    ----------
    id : str
        A name for logs and metrics (never the key itself).
    sha256 : bytes
        SHA-256 digest of the key's UTF-8 bytes.
    max_streams : int or None
        Concurrent ``ModelStreamInfer`` calls this key may hold; None: only the
        gateway's own ``max_streams`` bounds it.
    """

    id: str
    sha256: bytes = field(repr=False)
    max_streams: int | None = None


def parse_keys(text: str, source: str = "keys file") -> tuple[ApiKey, ...]:
    """Parse an API keys file.

    The format is JSON, hashes only, so a copy of the file (a backup, a dump of
    the Secret's mount, an operator's terminal) holds no usable key::

        {"keys": [{"id": "team-a", "sha256": "<64 hex digits>", "max_streams": 8},
                  {"id": "team-b", "sha256": "<64 hex digits>"}]}

    ``sha256`` is the hex SHA-256 of the key (``printf %s "$KEY" | sha256sum``).
    An unsalted hash is enough because keys are random (``secrets.token_urlsafe(32)``:
    256 bits), not passwords: no dictionary covers them.  ``max_streams`` is
    optional (an integer >= 1).  An empty list is valid and refuses every client.

    Raises
    ------
    KeyFileError
        Not JSON, or an entry is malformed; the message names the entry and field.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise KeyFileError(f"{source}: not JSON: {err}") from err
    if not isinstance(doc, dict) or set(doc) != {"keys"} or not isinstance(doc["keys"], list):
        raise KeyFileError(f'{source}: must be an object {{"keys": [...]}} and nothing else')
    keys: list[ApiKey] = []
    ids: set[str] = set()
    digests: set[bytes] = set()
    for i, entry in enumerate(doc["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where}: must be an object")
        unknown = sorted(set(entry) - {"id", "sha256", "max_streams"})
        if unknown:
            raise KeyFileError(f"{where}: unknown field {unknown[0]!r} (fields: id, sha256, max_streams)")
        key_id = entry.get("id")
        if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
            raise KeyFileError(f"{where}.id: must be 1-64 characters of A-Z a-z 0-9 . _ -, got {key_id!r}")
        digest_hex = entry.get("sha256")
        if not isinstance(digest_hex, str) or not _SHA256_HEX.match(digest_hex):
            raise KeyFileError(f"{where}.sha256: must be 64 lower-case hex digits (the key's SHA-256)")
        limit = entry.get("max_streams")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise KeyFileError(f"{where}.max_streams: must be an integer >= 1, got {limit!r}")
        digest = bytes.fromhex(digest_hex)
        if key_id in ids:
            raise KeyFileError(f"{where}.id: {key_id!r} is given more than once")
        if digest in digests:
            raise KeyFileError(f"{where}.sha256: the same key as an earlier entry")
        ids.add(key_id)
        digests.add(digest)
        keys.append(ApiKey(key_id, digest, limit))
    return tuple(keys)


def bearer_key(metadata: Any) -> str | None:
    """The key of an ``authorization: Bearer <key>`` entry of gRPC metadata, or None."""
    for name, value in metadata or ():
        if name == AUTH_METADATA and isinstance(value, str) and value[:len(_BEARER)].lower() == _BEARER:
            key = value[len(_BEARER):].strip()
            return key or None
    return None


class KeyRing:
    """The accepted API keys, re-read when their file changes.

    A Kubernetes Secret volume updates in place by swapping a symlink
    (``..data``) to a new directory, so the file's path stays while the file
    behind it changes: the ring ``stat``-s the path (following links) at most
    every ``check_interval_s`` and reloads when device, inode, size or mtime
    differ.  A reload that fails keeps the previous keys and logs the reason
    (counted in ``gateway_key_reload_failures_total``): a half-written or
    broken update must not lock every client out.

    Parameters
    ----------
    path : Path
        The keys file (format: :func:`parse_keys`).
    check_interval_s : float
        Least time between two ``stat`` calls (an RPC start checks at most
        this often).
    clock : callable
        Monotonic seconds (tests pass their own).

    Raises
    ------
    KeyFileError
        The file cannot be read or parsed at construction.
    """

    def __init__(self, path: Path, check_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._interval = check_interval_s
        self._clock = clock
        self.reload_failures = 0
        self._identity, self._keys = self._load()
        self._checked = clock()

    def _stat(self) -> tuple[int, int, int, int]:
        st = os.stat(self.path)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _load(self) -> tuple[tuple[int, int, int, int], tuple[ApiKey, ...]]:
        try:
            identity = self._stat()
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise KeyFileError(f"api keys file {self.path}: cannot read: {err}") from err
        return identity, parse_keys(text, f"api keys file {self.path}")

    def refresh(self) -> None:
        """Reload the keys if the file changed (at most once per ``check_interval_s``)."""
        now = self._clock()
        if now - self._checked < self._interval:
            return
        self._checked = now
        try:
            if self._stat() == self._identity:
                return
            self._identity, self._keys = self._load()
        except (OSError, KeyFileError) as err:
            self.reload_failures += 1
            _log.error("gateway: api keys not reloaded, keeping the %d previous keys: %s", len(self._keys), err)
            return
        _log.info("gateway: api keys reloaded from %s: %d keys", self.path, len(self._keys))

    @property
    def keys(self) -> tuple[ApiKey, ...]:
        return self._keys

    def authenticate(self, presented: str | None) -> ApiKey | None:
        """The key entry that ``presented`` matches, or None.

        Every entry is compared (``hmac.compare_digest`` on the digests, no
        early exit), so the time taken does not tell which entry was close.
        """
        self.refresh()
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found: ApiKey | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.sha256) and found is None:
                found = key
        return found


@dataclass(frozen=True)
class GatewaySecurity:
    """TLS and API keys of the public port (all None: plaintext and keyless, ``make serve``'s loopback default).

    Attributes
    ----------
    tls_cert, tls_key : Path or None
        PEM certificate chain and private key (a ``kubernetes.io/tls``
        Secret's ``tls.crt`` / ``tls.key``); both or neither.  Reloaded when
        the files change (:class:`TlsFiles`): a renewed certificate serves
        new connections without a restart.
    tls_client_ca : Path or None
        PEM CA bundle: clients must present a certificate it signed (mutual TLS).
        Needs ``tls_cert``; reloaded with them.
    api_keys_file : Path or None
        Keys file (:func:`parse_keys`); None: no key is asked for.
    """

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    api_keys_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            raise GatewayError(f"{missing}: required with {given} (give both or neither)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise GatewayError("tls_client_ca: mutual TLS needs tls_cert and tls_key")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def tls_files(self, check_interval_s: float = 1.0) -> TlsFiles | None:
        """The port's certificate files, reloaded when they change (None without TLS).

        Raises
        ------
        GatewayError
            A file cannot be read, is not PEM, or the key is not the certificate's.
        """
        return None if self.tls_cert is None else TlsFiles(self, check_interval_s)


def _read_pem(name: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise GatewayError(f"{name}: cannot read {path}: {err}") from err
    if b"-----BEGIN " not in data:
        raise GatewayError(f"{name}: {path} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class TlsPem:
    """One loaded certificate chain, its key and the client CA bundle (PEM bytes)."""

    cert: bytes
    key: bytes
    ca: bytes | None


class TlsFiles:
    """The certificate, key and client CA of a TLS port, reloaded when their files change.

    cert-manager renews a certificate in its Secret, and the kubelet swaps a
    mounted Secret's files in place (one symlink, ``..data``, for the whole
    directory), so the paths stay while the files behind them change.  Every
    new connection's handshake calls :meth:`refresh` (the gRPC port's
    certificate fetcher, :meth:`grpc_credentials`; the OpenAI port's SNI
    callback, :meth:`ssl_context`), which ``stat``-s the files at most every
    ``check_interval_s`` and loads them again when device, inode, size or
    mtime differ.  Connections already open keep the certificate they were
    made with.  A reload that fails (a file half written, a key that is not
    the certificate's) keeps the previous pair, logged and counted in
    :attr:`reload_failures`, and is tried again at the next check: a broken
    update must not take the port down.

    Parameters
    ----------
    security : GatewaySecurity
        Names the files; ``tls_cert`` and ``tls_key`` must be set.
    check_interval_s : float
        Least time between two checks of the files.
    clock : callable
        Monotonic seconds (tests pass their own).

    Raises
    ------
    GatewayError
        The files cannot be loaded at construction.
    """

    def __init__(self, security: GatewaySecurity, check_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if security.tls_cert is None or security.tls_key is None:
            raise GatewayError("tls_cert: required for TLS")
        self._cert, self._key, self._ca = security.tls_cert, security.tls_key, security.tls_client_ca
        self._interval = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.reloads = 0
        self.reload_failures = 0
        self.generation = 0  # of the pair in :attr:`pem` and :attr:`context`: +1 at each reload
        self._identity, self.pem, self.context = self._load()
        self._failed: tuple[tuple[int, int, int, int], ...] | None = None  # files that did not load: not again
        self._checked = clock()

    def _paths(self) -> tuple[Path, ...]:
        return (self._cert, self._key) if self._ca is None else (self._cert, self._key, self._ca)

    def _stat(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, self._paths()))

    def _load(self) -> tuple[tuple[tuple[int, int, int, int], ...], TlsPem, ssl.SSLContext]:
        try:
            before = self._stat()
        except OSError as err:
            raise GatewayError(f"tls: cannot read {err.filename}: {err.strerror}") from err
        pem = TlsPem(_read_pem("tls_cert", self._cert), _read_pem("tls_key", self._key),
                     None if self._ca is None else _read_pem("tls_client_ca", self._ca))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self._cert, self._key)
            if self._ca is not None:
                context.load_verify_locations(cafile=self._ca)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as err:
            raise GatewayError(f"tls: {self._cert} and {self._key} are not a certificate chain and its key: "
                               f"{err}") from err
        try:
            unchanged = self._stat() == before
        except OSError as err:
            raise GatewayError(f"tls: cannot read {err.filename}: {err.strerror}") from err
        if not unchanged:
            # Read across a swap: the bytes may mix two generations; the next check loads the new one.
            raise GatewayError("tls: the files changed while they were read")
        return before, pem, context

    def refresh(self) -> bool:
        """Load the files again if they changed (at most once per ``check_interval_s``); True when it did.

        Called from gRPC's threads and from the event loop (the SNI callback,
        where the check is a ``stat`` per file at most once a second and a
        load only when they changed).  Files that failed to load are not
        tried again, nor counted again, until they change.
        """
        now = self._clock()
        with self._lock:
            if now - self._checked < self._interval:
                return False
            self._checked = now
            identity = None
            try:
                identity = self._stat()
                if identity in (self._identity, self._failed):
                    return False
                self._identity, self.pem, self.context = self._load()
            except (OSError, GatewayError) as err:
                self._failed = identity
                self.reload_failures += 1
                _log.error("tls: certificate not reloaded, serving the previous one: %s", err)
                return False
            self.reloads += 1
            self.generation += 1
        _log.info("tls: certificate reloaded from %s", self._cert)
        return True

    def _grpc_config(self) -> Any:
        pem = self.pem
        return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials whose certificate follows the files (checked at each new connection)."""
        handed = [self.generation]  # the pair gRPC serves (another port's handshake may have reloaded)

        def fetch() -> Any:
            # gRPC asks at every handshake; None keeps the certificate it has.
            self.refresh()
            if self.generation == handed[0]:
                return None
            handed[0] = self.generation
            return self._grpc_config()

        return grpc.dynamic_ssl_server_credentials(self._grpc_config(), fetch,
                                                   require_client_authentication=self._ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """A server ``SSLContext`` whose handshakes take the newest certificate (through its SNI callback,
        which OpenSSL calls for every ClientHello, with or without a server name)."""
        front = self.context

        def on_hello(conn: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _context: ssl.SSLContext) -> None:
            self.refresh()
            if conn.context is not self.context:
                conn.context = self.context

        front.sni_callback = on_hello
        return front


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of :class:`Gateway`.

    Attributes
    ----------
    upstream : str
        ``host:port`` of tritonserver's (loopback) gRPC endpoint.
    secret : str
        The value of :data:`SECRET_HEADER` that tritonserver requires for inference.
    host, port : str, int
        Where clients connect (port 0 picks a free one).
    public_models : tuple of str
        Models clients may call.
    cancel_model : str
        Model that takes ``CANCEL=<request id>`` (``llm``).
    max_in_flight_per_stream : int
        Requests one client stream may have running; more are refused with
        ``RESOURCE_EXHAUSTED`` in-band.
    max_streams : int
        Concurrent client RPCs; more are refused by gRPC with ``RESOURCE_EXHAUSTED``.
    drain_timeout_s : float
        After a client leaves, how long its cancelled requests may take to send
        their FINAL response before the gateway gives up on them (logged).
    keepalive_time_s, keepalive_timeout_s : float
        The gateway pings an idle connection every ``keepalive_time_s`` and
        closes it when no answer comes within ``keepalive_timeout_s``: a client
        whose node vanished (no FIN, no RST) is noticed within ~80 s, and its
        requests are cancelled instead of decoding to ``max_tokens``.  60 s is
        below the common 350 s idle timeout of cloud NATs and load balancers.
    min_client_ping_interval_s : float
        Clients' own keepalive pings are allowed this often (also without
        calls in flight); faster ones get GOAWAY (gRPC's "too many pings").
    max_connection_age_s : float
        Every connection gets a GOAWAY after this long (gRPC adds +-10 %
        jitter), and the client reconnects through the Service: a ClusterIP
        Service balances connections, not streams, so without it a long-lived
        client never reaches a pod added by the HPA.  The cost is one TLS
        handshake per client per 5 minutes.
    max_connection_age_grace_s : float
        How long streams in flight on such a connection may still run before
        it is closed; it must cover the longest stream: ``MAX_TOKENS_LIMIT``
        (1,024) tokens at 0.4 s each is 410 s, the same bound as the preStop
        drain (deploy/k8s).  0.4 s is about the CPU's inter-token p95 under
        ``make loadtest LOADTEST_TIME=180s`` (350-460 ms; its p99 490-630 ms
        at the default prefill bound: docs/benchmarks.md, chunked prefill).
    drain_grace_s : float
        After :meth:`Gateway.begin_drain`, how long streams in flight may run
        before they are cancelled (same bound as ``max_connection_age_grace_s``).
    security : GatewaySecurity
        TLS and API keys (default: neither).
    """

    upstream: str
    secret: str
    host: str = "127.0.0.1"
    port: int = 0
    public_models: tuple[str, ...] = ("constrained_llm",)
    cancel_model: str = "llm"
    max_in_flight_per_stream: int = 64
    max_streams: int = 4096
    drain_timeout_s: float = 600.0
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_client_ping_interval_s: float = 10.0
    max_connection_age_s: float = 300.0
    max_connection_age_grace_s: float = 420.0
    drain_grace_s: float = 420.0
    security: GatewaySecurity = GatewaySecurity()

    def __post_init__(self) -> None:
        if not self.upstream or ":" not in self.upstream:
            raise GatewayError(f"upstream: must be host:port, got {self.upstream!r}")
        if len(self.secret) < 16:
            raise GatewayError("secret: must be at least 16 characters")
        if not 0 <= self.port <= 65535:
            raise GatewayError(f"port: must be in [0, 65535], got {self.port}")
        if not self.public_models:
            raise GatewayError("public_models: must not be empty")
        for name in ("max_in_flight_per_stream", "max_streams"):
            if getattr(self, name) < 1:
                raise GatewayError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "keepalive_time_s", "keepalive_timeout_s", "min_client_ping_interval_s",
                     "max_connection_age_s", "max_connection_age_grace_s", "drain_grace_s"):
            if not getattr(self, name) > 0:
                raise GatewayError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.min_client_ping_interval_s > self.keepalive_time_s:
            raise GatewayError(f"min_client_ping_interval_s: must be <= keepalive_time_s={self.keepalive_time_s}, "
                               f"got {self.min_client_ping_interval_s}")

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC core options of the client-facing server (message bounds, keepalive, connection age)."""
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
        ]


def ms(seconds: float) -> int:
    """Seconds as the integer milliseconds of gRPC core options."""
    return int(seconds * 1000)


@dataclass
class _Pending:
    """One client request forwarded upstream and not finished yet."""

    client_id: str
    model: str
    wants_empty_final: bool


@dataclass(frozen=True)
class _Health:
    ready: bool = True
    reason: str = ""


def _in_band_error(request: pb.ModelInferRequest, status: str, message: str) -> pb.ModelStreamInferResponse:
    """An in-band error for one stream request (Triton's own form: ``error_message``), marked final."""
    response = pb.ModelStreamInferResponse(error_message=f"{status}: {message}")
    response.infer_response.model_name = request.model_name
    response.infer_response.id = request.id
    response.infer_response.parameters[_FINAL].bool_param = True
    return response


def is_final(response: pb.ModelStreamInferResponse) -> bool:
    """Whether ``response`` is its request's last.

    Triton marks every response of a decoupled model with the FINAL
    parameter (true/false); an error the frontend raises before the request
    starts (bad dtype, unknown input) carries none and is the only response
    that request gets.
    """
    param = response.infer_response.parameters.get(_FINAL)
    return param.bool_param if param is not None else bool(response.error_message)


def input_error(request: pb.ModelInferRequest, config: mc.ModelConfig) -> str | None:
    """Why ``request``'s tensors do not fit ``config``'s declared inputs, or None when they do.

    tritonserver 2.51 answers a wrong datatype, shape or tensor name on a
    stream with an in-band message that carries no status; checked here, the
    client gets ``INVALID_ARGUMENT`` naming the input.
    """
    declared = {spec.name: spec for spec in config.input}
    seen: set[str] = set()
    for tensor in request.inputs:
        spec = declared.get(tensor.name)
        where = f"input {tensor.name!r}"
        if spec is None:
            return f"{where}: not an input of {config.name}; expected one of {', '.join(sorted(declared))}"
        if tensor.name in seen:
            return f"{where}: given more than once"
        seen.add(tensor.name)
        expected = mc.DataType.Name(spec.data_type).removeprefix("TYPE_").replace("STRING", "BYTES")
        if tensor.datatype != expected:
            return f"{where}: datatype {tensor.datatype or '(none)'}, expected {expected}"
        dims = ([-1] if config.max_batch_size > 0 else []) + list(spec.dims)
        shape = list(tensor.shape)
        if len(shape) != len(dims) or any(d != -1 and d != n for d, n in zip(dims, shape, strict=True)):
            return f"{where}: shape {shape}, expected {dims} (-1: any size)"
    missing = sorted(name for name, spec in declared.items() if not spec.optional and name not in seen)
    if missing:
        return f"input {missing[0]!r}: is required"
    return None


def _unavailable(model: str, client_id: str, err: BaseException) -> pb.ModelStreamInferResponse:
    reason = err.details() if isinstance(err, grpc.aio.AioRpcError) else "upstream stream closed"
    return _in_band_error(pb.ModelInferRequest(model_name=model, id=client_id), "UNAVAILABLE",
                          f"tritonserver failed: {reason}")


class _StreamSession:
    """One client stream (a ``ModelStreamInfer`` call, or one :meth:`Gateway.infer` call) and its upstream stream.

    ``send`` delivers a response to the client: the gRPC call's ``write``,
    or a queue that :meth:`Gateway.infer` reads.
    """

    def __init__(self, gateway: Gateway, send: Callable[[pb.ModelStreamInferResponse], Awaitable[None]]) -> None:
        self.gw = gateway
        self.send = send
        self.pending: dict[str, _Pending] = {}
        self.upstream: Any = None
        self.pump: asyncio.Task[None] | None = None
        self.client_gone = False
        self.idle = asyncio.Event()  # set whenever nothing is pending
        self.idle.set()
        self.upstream_error: grpc.RpcError | None = None

    async def _open_upstream(self) -> None:
        self.upstream = self.gw.stream_stub(metadata=self.gw.upstream_metadata)
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def run(self, context: aio.ServicerContext) -> None:
        try:
            while True:
                request = await context.read()
                if request is aio.EOF:
                    break
                await self._forward(request)
            # Normal half-close: answer everything pending, then end.
            await self._finish_upstream()
        except BaseException:
            # The client cancelled, hit its deadline, disconnected or was killed
            # (CancelledError), or the handler failed: either way the upstream
            # stream is drained, never dropped (dropping it cancels it upstream).
            self.client_gone = True
            self.gw.spawn(self._after_departure())
            raise

    async def _forward(self, request: pb.ModelInferRequest) -> None:
        model = request.model_name
        if model not in self.gw.config.public_models:
            self.gw.refused("PERMISSION_DENIED")
            await self._write(_in_band_error(request, "PERMISSION_DENIED",
                                             f"model {model!r} is not served to clients; "
                                             f"call {', '.join(self.gw.config.public_models)}"))
            return
        if len(self.pending) >= self.gw.config.max_in_flight_per_stream:
            self.gw.refused("RESOURCE_EXHAUSTED")
            await self._write(_in_band_error(request, "RESOURCE_EXHAUSTED",
                                             f"{len(self.pending)} requests already in flight on this stream "
                                             f"(limit {self.gw.config.max_in_flight_per_stream})"))
            return
        self.gw.requests[model] += 1
        if self.upstream_error is not None:
            self.gw.refused("UNAVAILABLE")
            await self._write(_unavailable(model, request.id, self.upstream_error))
            return
        try:
            config = await self.gw.model_config(model)
        except grpc.RpcError as err:
            self.gw.refused("UNAVAILABLE")
            await self._write(_unavailable(model, request.id, err))
            return
        problem = input_error(request, config)
        if problem is not None:
            self.gw.refused("INVALID_ARGUMENT")
            await self._write(_in_band_error(request, "INVALID_ARGUMENT", problem))
            return
        param = request.parameters.get(_EMPTY_FINAL)
        wants_empty_final = bool(param is not None and param.bool_param)
        internal_id = secrets.token_hex(16)
        client_id = request.id
        self.pending[internal_id] = _Pending(client_id, model, wants_empty_final)
        self.idle.clear()
        request.id = internal_id
        # Always ask for the FINAL marker: it is how the gateway knows a request is over.
        request.parameters[_EMPTY_FINAL].bool_param = True
        if self.upstream is None:
            await self._open_upstream()
        try:
            await self.upstream.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError) as err:
            # tritonserver is down or restarting: this request ends now, in-band.
            entry = self.pending.pop(internal_id, None)
            if not self.pending:
                self.idle.set()
            if entry is not None:  # else the pump has already answered it
                await self._write(_unavailable(model, client_id, err))

    async def _write(self, response: pb.ModelStreamInferResponse) -> None:
        if self.client_gone:
            return
        try:
            await self.send(response)
        except (asyncio.InvalidStateError, RuntimeError, grpc.RpcError, aio.InternalError):
            # aio.InternalError: a write after the call ended (the client's deadline passed, say) fails in
            # gRPC Core's batch (ExecuteBatchError). Raised from the pump, it ended the pump, which
            # cleared the pending requests before the departure could cancel them: they decoded on to
            # max_tokens (seen once in test_every_way_of_leaving_frees_the_sequence[deadline]).
            self.client_gone = True

    async def _pump(self) -> None:
        """Upstream responses -> client, with ids mapped back; tracks FINAL flags."""
        try:
            async for response in self.upstream:
                infer = response.infer_response
                internal_id = infer.id
                entry = self.pending.get(internal_id)
                if entry is None:
                    _log.warning("gateway: response for unknown request id dropped")
                    continue
                final = is_final(response)
                infer.id = entry.client_id
                if response.error_message:
                    response.error_message = response.error_message.replace(internal_id, entry.client_id)
                if final:
                    del self.pending[internal_id]
                    if not self.pending:
                        self.idle.set()
                    if not entry.wants_empty_final:
                        del infer.parameters[_FINAL]
                        if not infer.outputs and not response.error_message:
                            continue
                await self._write(response)
        except grpc.RpcError as err:
            # tritonserver died or refused the stream: every pending request ends
            # now with UNAVAILABLE instead of hanging its client.
            self.upstream_error = err
            _log.error("gateway: upstream stream failed: %s", err)
            for entry in list(self.pending.values()):
                await self._write(_unavailable(entry.model, entry.client_id, err))
        finally:
            self.pending.clear()
            self.idle.set()

    async def _finish_upstream(self) -> None:
        if self.upstream is None or self.pump is None:
            return
        await self.idle.wait()
        if self.upstream_error is None:
            await self.upstream.done_writing()
        await self.pump

    async def _after_departure(self) -> None:
        """Cancel what the departed client left running, drain it, then close upstream."""
        targets = [rid for rid, p in self.pending.items() if p.model in self.gw.config.public_models]
        if targets:
            await self.gw.cancel_requests(targets)
        try:
            await asyncio.wait_for(self._finish_upstream(), self.gw.config.drain_timeout_s)
        except TimeoutError:
            _log.error("gateway: %d cancelled requests did not finish within %.0f s; the upstream stream "
                       "is kept open", len(self.pending), self.gw.config.drain_timeout_s)
            self.gw.keep_open(self.upstream)


class Gateway:
    """The client-facing gRPC endpoint (see the module docstring).

    Parameters
    ----------
    config : GatewayConfig
        Upstream, secret, bind address and limits.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.upstream_metadata = ((GRPC_SECRET_METADATA, config.secret),)
        self.port = config.port
        self._kept_open: list[Any] = []  # upstream calls that must not be garbage-collected (= cancelled)
        self._health = _Health()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: aio.Server | None = None
        self._channel: aio.Channel | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stream_stub: Any = None
        self._unary: dict[str, Any] = {}
        self._configs: dict[str, mc.ModelConfig] = {}
        self._stop = asyncio.Event()
        self._grace_s = 5.0
        self._draining = False
        self._health_service = health_aio.HealthServicer()
        self._keys = None if config.security.api_keys_file is None else KeyRing(config.security.api_keys_file)
        self.tls = config.security.tls_files()
        # Metrics (read by metrics_text from the launcher's HTTP thread; plain
        # ints and dicts written only on the gateway's event loop).
        self.streams_open = 0
        self.requests: collections.Counter[str] = collections.Counter({m: 0 for m in config.public_models})
        self.refusals: collections.Counter[str] = collections.Counter({c: 0 for c in _REFUSAL_CODES})
        self.bytes_in = 0
        self.bytes_out = 0
        self._key_streams: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 30.0) -> None:
        """Bind and serve on a thread of its own; returns once serving.

        Raises
        ------
        GatewayError
            The port could not be bound, or a TLS file cannot be read.
        KeyFileError
            The API keys file is missing or malformed (raised by the constructor).
        """
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._main(started))
            except BaseException as err:  # noqa: BLE001 - reported to start()'s caller
                failure.append(err)
                started.set()
            finally:
                # Whatever is left (drains of departed clients) ends with the loop.
                leftover = asyncio.all_tasks(loop)
                for task in leftover:
                    task.cancel()
                if leftover:
                    loop.run_until_complete(_gather(leftover))
                loop.close()

        self._thread = threading.Thread(target=run, name="grpc-gateway", daemon=True)
        self._thread.start()
        if not started.wait(timeout_s):
            raise GatewayError(f"gateway did not start within {timeout_s} s")
        if failure:
            raise GatewayError(f"gateway failed to start: {failure[0]}") from failure[0]

    async def _main(self, started: threading.Event) -> None:
        await self._serve(started)
        await self._stop.wait()
        if self._server is not None:
            await self._server.stop(self._grace_s)
        if self._channel is not None:
            await self._channel.close()

    async def _serve(self, started: threading.Event) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channel = aio.insecure_channel(self.config.upstream, options=options)
        ser = self._counting_serializer(pb.ModelStreamInferResponse.SerializeToString)
        self.stream_stub = self._channel.stream_stream(
            f"/{SERVICE}/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                self._model_stream_infer,
                request_deserializer=self._counting_deserializer(pb.ModelInferRequest.FromString),
                response_serializer=ser),
        }
        service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        for name in (*_FORWARDED, "ModelInfer", *_REFUSED):
            method = service.methods_by_name[name]
            req_cls = getattr(pb, method.input_type.name)
            resp_cls = getattr(pb, method.output_type.name)
            if name in _FORWARDED:
                self._unary[name] = self._channel.unary_unary(
                    f"/{SERVICE}/{name}", request_serializer=req_cls.SerializeToString,
                    response_deserializer=resp_cls.FromString)
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._unary_handler(name), request_deserializer=self._counting_deserializer(req_cls.FromString),
                response_serializer=self._counting_serializer(resp_cls.SerializeToString))
        credentials = None if self.tls is None else self.tls.grpc_credentials()
        self._server = aio.server(
            options=self.config.server_options(), maximum_concurrent_rpcs=self.config.max_streams,
        )
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        # grpc.health.v1 for "" (the whole server) and the inference service;
        # open without a key: the kubelet's gRPC probe sends no metadata.
        health_pb2_grpc.add_HealthServicer_to_server(self._health_service, self._server)
        await self._publish_health()
        address = f"{self.config.host}:{self.config.port}"
        if credentials is None:
            port = self._server.add_insecure_port(address)
        else:
            port = self._server.add_secure_port(address, credentials)
        if port == 0:
            raise GatewayError(f"cannot bind {address}")
        self.port = port
        await self._server.start()
        started.set()

    def _counting_serializer(self, serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
        def counted(message: Any) -> bytes:
            data = serialize(message)
            self.bytes_out += len(data)
            return data

        return counted

    def _counting_deserializer(self, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        def counted(data: bytes) -> Any:
            self.bytes_in += len(data)
            return parse(data)

        return counted

    def begin_drain(self) -> None:
        """Start draining: GOAWAY on every connection now, streams in flight run on; idempotent.

        gRPC's server shutdown (``aio.Server.stop(grace)``) sends GOAWAY, stops
        listening and refuses new calls on existing connections, so clients
        reconnect through the Service to another pod, while calls in flight
        get ``drain_grace_s`` to finish.  Health turns NOT_SERVING (gRPC and
        the launcher's ``/v2/health/ready``).  :meth:`stop` later ends
        whatever still runs (with its own, shorter grace).
        """
        loop = self._loop
        if loop is None or self._draining:
            return
        self._draining = True
        _log.info("gateway: draining: GOAWAY sent, new streams refused, %d streams in flight may run %.0f s",
                  self.streams_open, self.config.drain_grace_s)
        asyncio.run_coroutine_threadsafe(self._drain(), loop)

    async def _drain(self) -> None:
        await self._health_service.enter_graceful_shutdown()
        if self._server is not None:
            self.spawn(self._server.stop(self.config.drain_grace_s))

    @property
    def draining(self) -> bool:
        return self._draining

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving (in-flight RPCs get ``grace_s``); idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        self._grace_s = grace_s
        loop.call_soon_threadsafe(self._stop.set)
        thread.join(grace_s + STOP_JOIN_SLACK_S)

    # ------------------------------------------------------------------ health
    def set_health(self, ready: bool, reason: str = "") -> None:
        """Set by the supervisor's probe: while false, readiness RPCs answer not ready.

        ``grpc.health.v1`` follows: SERVING while ready, NOT_SERVING otherwise.
        """
        changed = self._health.ready != ready
        self._health = _Health(ready=ready, reason=reason)
        loop = self._loop
        if changed and loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._publish_health(), loop)

    async def _publish_health(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self._health.ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE):
            await self._health_service.set(service, status)

    @property
    def health(self) -> tuple[bool, str]:
        if self._draining:
            return False, "draining"
        return self._health.ready, self._health.reason

    # ------------------------------------------------------------------ metrics
    def refused(self, code: str) -> None:
        """Count one refusal the gateway itself answered (``code``: a gRPC status name)."""
        self.refusals[code] += 1

    def metrics_text(self) -> str:
        """The gateway's metrics in the Prometheus text format (served at the launcher's ``/metrics``).

        Refusals that gRPC answers before a handler runs (over ``max_streams``,
        a message over :data:`MAX_MESSAGE_BYTES`, a failed TLS handshake) are
        not seen by the gateway and not counted here.
        """
        lines = [
            "# HELP gateway_streams_open ModelStreamInfer calls open now.",
            "# TYPE gateway_streams_open gauge",
            f"gateway_streams_open {self.streams_open}",
            "# HELP gateway_requests_total Stream requests for public models accepted for checks.",
            "# TYPE gateway_requests_total counter",
            *(f'gateway_requests_total{{model="{m}"}} {n}' for m, n in sorted(self.requests.items())),
            "# HELP gateway_refusals_total Requests and calls the gateway refused, by gRPC status.",
            "# TYPE gateway_refusals_total counter",
            *(f'gateway_refusals_total{{code="{c}"}} {n}' for c, n in sorted(self.refusals.items())),
            "# HELP gateway_received_bytes_total Serialized client messages received.",
            "# TYPE gateway_received_bytes_total counter",
            f"gateway_received_bytes_total {self.bytes_in}",
            "# HELP gateway_sent_bytes_total Serialized messages sent to clients.",
            "# TYPE gateway_sent_bytes_total counter",
            f"gateway_sent_bytes_total {self.bytes_out}",
            "# HELP gateway_draining 1 once the drain has started (GOAWAY sent).",
            "# TYPE gateway_draining gauge",
            f"gateway_draining {int(self._draining)}",
        ]
        if self.tls is not None:
            lines += [
                "# HELP gateway_tls_reloads_total Changed certificate files loaded (new connections get them).",
                "# TYPE gateway_tls_reloads_total counter",
                f"gateway_tls_reloads_total {self.tls.reloads}",
                "# HELP gateway_tls_reload_failures_total Changed certificate files that could not be loaded.",
                "# TYPE gateway_tls_reload_failures_total counter",
                f"gateway_tls_reload_failures_total {self.tls.reload_failures}",
            ]
        if self._keys is not None:
            lines += [
                "# HELP gateway_key_reload_failures_total Changed API keys files that could not be loaded.",
                "# TYPE gateway_key_reload_failures_total counter",
                f"gateway_key_reload_failures_total {self._keys.reload_failures}",
            ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ keys
    async def _authenticate(self, context: aio.ServicerContext) -> ApiKey | None:
        """The caller's key (None when no keys are configured); aborts ``UNAUTHENTICATED`` otherwise."""
        if self._keys is None:
            return None
        presented = bearer_key(context.invocation_metadata())
        key = self._keys.authenticate(presented)
        if key is None:
            self.refused("UNAUTHENTICATED")
            reason = "no API key" if presented is None else "unknown API key"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{reason}: send metadata '{AUTH_METADATA}: Bearer <key>'")
        return key

    # ------------------------------------------------------------------ handlers
    def keep_open(self, call: Any) -> None:
        """Hold a reference to an upstream call that must stay open until the gateway stops."""
        self._kept_open.append(call)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` detached from the calling RPC (it outlives a cancelled client call)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The gateway's event loop (None before :meth:`start`); :meth:`infer` runs on it."""
        return self._loop

    def check_key(self, presented: str | None) -> ApiKey | None:
        """The key a non-gRPC front (the OpenAI-compatible endpoint) was given; None when no keys are configured.

        Raises
        ------
        Refused
            ``UNAUTHENTICATED``: keys are configured and ``presented`` is
            missing or unknown (counted as a refusal).
        """
        if self._keys is None:
            return None
        key = self._keys.authenticate(presented)
        if key is None:
            self.refused("UNAUTHENTICATED")
            raise Refused("UNAUTHENTICATED", "no API key" if presented is None else "unknown API key")
        return key

    async def infer(self, request: pb.ModelInferRequest,
                    key: ApiKey | None) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """Run one request the way a client stream's request runs; yield its responses up to the FINAL one.

        The request gets an unguessable id, the model and input checks of
        ``ModelStreamInfer``, errors as in-band data, and a departure that
        cancels: when the caller stops iterating or is cancelled before the
        FINAL response, the request is cancelled inside the server (``CANCEL``
        to ``llm``) and drained, exactly as for a departed gRPC client.  It
        counts against ``key``'s ``max_streams``.  Call it on :attr:`loop`.

        Raises
        ------
        Refused
            ``RESOURCE_EXHAUSTED``: ``key`` is at its ``max_streams``;
            ``UNAVAILABLE``: the gateway is draining.
        """
        if self._draining:
            self.refused("UNAVAILABLE")
            raise Refused("UNAVAILABLE", "the server is draining (shutting down); retry on another replica")
        if key is not None and key.max_streams is not None and self._key_streams[key.id] >= key.max_streams:
            self.refused("RESOURCE_EXHAUSTED")
            raise Refused("RESOURCE_EXHAUSTED", f"API key {key.id!r} already has {self._key_streams[key.id]} "
                                                f"streams open (limit {key.max_streams})")
        responses: asyncio.Queue[pb.ModelStreamInferResponse] = asyncio.Queue()

        async def deliver(response: pb.ModelStreamInferResponse) -> None:
            responses.put_nowait(response)

        session = _StreamSession(self, deliver)
        # Keep the FINAL marker on every response: it is how the caller knows the request is over.
        request.parameters[_EMPTY_FINAL].bool_param = True
        if key is not None:
            self._key_streams[key.id] += 1
        try:
            await session._forward(request)
            while True:
                response = await responses.get()
                yield response
                if is_final(response):
                    break
            await session._finish_upstream()
        except BaseException:
            # Cancelled (the HTTP client left) or closed early by the caller: the same path as a
            # departed gRPC client (cancel, drain, then close upstream).
            session.client_gone = True
            self.spawn(session._after_departure())
            raise
        finally:
            if key is not None:
                self._key_streams[key.id] -= 1

    async def _model_stream_infer(self, _request_iterator: AsyncIterator[Any], context: aio.ServicerContext) -> None:
        key = await self._authenticate(context)
        if key is not None and key.max_streams is not None and self._key_streams[key.id] >= key.max_streams:
            self.refused("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"API key {key.id!r} already has {self._key_streams[key.id]} streams open "
                                f"(limit {key.max_streams})")
        key_id = None if key is None else key.id
        if key_id is not None:
            self._key_streams[key_id] += 1
        self.streams_open += 1
        try:
            await _StreamSession(self, context.write).run(context)
        finally:
            self.streams_open -= 1
            if key_id is not None:
                self._key_streams[key_id] -= 1

    def _unary_handler(self, name: str) -> Any:
        async def handle(request: Any, context: aio.ServicerContext) -> Any:
            return await self._unary_call(name, request, context)

        return handle

    async def _unary_call(self, name: str, request: Any, context: aio.ServicerContext) -> Any:
        await self._authenticate(context)
        if name in _REFUSED:
            self.refused("PERMISSION_DENIED")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{name} is not available to clients")
        model = getattr(request, "name", "") or getattr(request, "model_name", "")
        if name in (*_PER_MODEL, "ModelInfer") and model not in self.config.public_models:
            self.refused("PERMISSION_DENIED")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"model {model!r} is not served to clients")
        if name == "ModelInfer":
            self.refused("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"model {model!r} streams its responses (decoupled): use ModelStreamInfer")
        # Shielded: a client that cancels must not cancel the upstream call (see the module docstring).
        call = self._unary[name](request, metadata=self.upstream_metadata)
        try:
            response = await asyncio.shield(_await(call))
        except grpc.RpcError as err:
            await context.abort(err.code(), err.details() or "")
        if name in ("ServerReady", "ModelReady") and not self.health[0]:
            response.ready = False
        return response

    async def model_config(self, model: str) -> mc.ModelConfig:
        """A public model's configuration, fetched from tritonserver once.

        Raises
        ------
        grpc.RpcError
            tritonserver cannot answer (not cached: the next request asks again).
        """
        config = self._configs.get(model)
        if config is None:
            call = self._unary["ModelConfig"](pb.ModelConfigRequest(name=model), metadata=self.upstream_metadata)
            config = (await asyncio.shield(_await(call))).config
            self._configs[model] = config
        return config

    async def cancel_requests(self, request_ids: list[str]) -> None:
        """Send ``CANCEL`` for each id to ``cancel_model`` on one upstream stream and wait for the answers."""
        call = self.stream_stub(metadata=self.upstream_metadata)
        for rid in request_ids:
            req = pb.ModelInferRequest(model_name=self.config.cancel_model, id=f"cancel-{secrets.token_hex(8)}")
            req.parameters[_EMPTY_FINAL].bool_param = True
            req.inputs.add(name="CANCEL", datatype="BYTES", shape=[1])
            encoded = rid.encode()
            # BYTES tensors travel as 4-byte little-endian length + bytes.
            req.raw_input_contents.append(len(encoded).to_bytes(4, "little") + encoded)
            await call.write(req)
        await call.done_writing()
        try:
            async for response in call:
                if response.error_message:
                    _log.error("gateway: CANCEL failed: %s", response.error_message)
        except grpc.RpcError as err:
            _log.error("gateway: CANCEL stream failed: %s", err)


async def _gather(tasks: set[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _await(call: Any) -> Any:
    return await call


def new_secret() -> str:
    """A fresh internal secret (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def restriction_args(secret: str) -> tuple[str, ...]:
    """tritonserver flags that restrict inference and control APIs to holders of ``secret``.

    Health and metadata stay open on tritonserver's own (loopback) endpoints
    so probes and the launcher's readiness loop work without the secret.
    """
    restricted_grpc = "inference,model-repository,shared-memory,trace,logging,statistics,model-config"
    restricted_http = "inference,model-repository,shared-memory,trace,logging,statistics,model-config"
    return (
        f"--grpc-restricted-protocol={restricted_grpc}:{SECRET_HEADER}={secret}",
        f"--http-restricted-api={restricted_http}:{SECRET_HEADER}={secret}",
    )
