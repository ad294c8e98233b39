"""The gateway's configuration, the tritonserver restrictions it relies on, and its own checks over
real gRPC (keys, per-key limits, message bounds, health, drain, TLS; against an in-process gRPC upstream:
request-id renaming, the in-flight cap, the refusal of the internal models); the forwarded traffic is
tested against a real tritonserver in tests/integration/test_abuse.py and test_gateway_tls.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc._cython import cygrpc  # ExecuteBatchError: what a write to an ended call raises
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

import contract
from deploy.gateway import (
    GRPC_SECRET_METADATA,
    MAX_MESSAGE_BYTES,
    SECRET_HEADER,
    SERVICE,
    Gateway,
    GatewayConfig,
    GatewayError,
    GatewaySecurity,
    KeyFileError,
    KeyRing,
    TlsFiles,
    bearer_key,
    input_error,
    new_secret,
    parse_keys,
    restriction_args,
)
from deploy.gateway import _StreamSession as StreamSession
from tests.support.poll import HANG_S, wait_for
from tests.tls_certs import Pki, SecretVolume, der, make_pki, openssl_missing, served_cert

SECRET = "s" * 32


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"upstream": "nohost"}, r"^upstream: must be host:port, got 'nohost'$"),
        ({"secret": "short"}, r"^secret: must be at least 16 characters$"),
        ({"port": 70000}, r"^port: must be in \[0, 65535\], got 70000$"),
        ({"public_models": ()}, r"^public_models: must not be empty$"),
        ({"max_in_flight_per_stream": 0}, r"^max_in_flight_per_stream: must be >= 1, got 0$"),
        ({"drain_timeout_s": 0}, r"^drain_timeout_s: must be > 0, got 0$"),
    ],
)
def test_config_rejects(fields: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"upstream": "127.0.0.1:1", "secret": SECRET}
    with pytest.raises(GatewayError, match=match):
        GatewayConfig(**{**base, **fields})  # type: ignore[arg-type]


def _restricted(flag: str, option: str) -> tuple[set[str], str]:
    """The API groups and the ``header=value`` of one tritonserver restriction flag (``--<option>=<apis>:<h>=<v>``)."""
    name, _, value = flag.partition("=")
    assert name == f"--{option}"
    apis, _, header = value.partition(":")
    return set(apis.split(",")), header


def test_restrictions_cover_inference_and_control_but_not_health() -> None:
    grpc_flag, http_flag = restriction_args(SECRET)
    restricted = {"inference", "model-repository", "shared-memory", "trace", "logging", "statistics", "model-config"}
    # Read back from the flags themselves: health and metadata stay open (the launcher's readiness loop and
    # probes have no secret); every other group tritonserver can restrict needs the header.
    for flag, option in ((grpc_flag, "grpc-restricted-protocol"), (http_flag, "http-restricted-api")):
        apis, header = _restricted(flag, option)
        assert (apis, header) == (restricted, f"{SECRET_HEADER}={SECRET}")
        assert not apis & {"health", "metadata"}
    # Triton 2.51 reads the gRPC key with this prefix (measured: "expecting header 'triton-grpc-protocol-...'").
    assert GRPC_SECRET_METADATA == f"triton-grpc-protocol-{SECRET_HEADER}"


def test_secrets_are_fresh_and_long() -> None:
    secrets = {new_secret() for _ in range(100)}
    assert len(secrets) == 100 and all(len(s) >= 43 for s in secrets)


def test_start_binds_and_stop_is_idempotent() -> None:
    gateway = Gateway(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET))
    gateway.start()
    try:
        assert gateway.port > 0 and gateway.health == (True, "")
        gateway.set_health(False, "grammar probe failed")
        assert gateway.health == (False, "grammar probe failed")
    finally:
        gateway.stop()
    gateway.stop()


def _config(max_batch_size: int = 0) -> object:
    from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig, ModelInput

    return ModelConfig(name="m", max_batch_size=max_batch_size, input=[
        ModelInput(name="TEXT", data_type=DataType.TYPE_STRING, dims=[1]),
        ModelInput(name="IDS", data_type=DataType.TYPE_INT32, dims=[-1], optional=True),
    ])


def _request(*tensors: tuple[str, str, list[int]]) -> object:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


@pytest.mark.parametrize(
    ("tensors", "batch", "problem"),
    [
        ([("TEXT", "BYTES", [1])], 0, None),
        ([("TEXT", "BYTES", [1]), ("IDS", "INT32", [7])], 0, None),
        ([("TEXT", "BYTES", [4, 1]), ("IDS", "INT32", [4, 7])], 8, None),
        ([("TEXT", "INT32", [1])], 0, "input 'TEXT': datatype INT32, expected BYTES"),
        ([("TEXT", "", [1])], 0, "input 'TEXT': datatype (none), expected BYTES"),
        ([("TEXT", "BYTES", [2])], 0, "input 'TEXT': shape [2], expected [1] (-1: any size)"),
        ([("TEXT", "BYTES", [1])], 8, "input 'TEXT': shape [1], expected [-1, 1] (-1: any size)"),
        ([("IDS", "INT32", [3])], 0, "input 'TEXT': is required"),
        ([("TEXT", "BYTES", [1]), ("X", "BYTES", [1])], 0, "input 'X': not an input of m; expected one of IDS, TEXT"),
        ([("TEXT", "BYTES", [1]), ("TEXT", "BYTES", [1])], 0, "input 'TEXT': given more than once"),
    ],
)
def test_input_error_names_the_input_and_the_reason(tensors: list[tuple[str, str, list[int]]], batch: int,
                                                     problem: str | None) -> None:
    assert input_error(_request(*tensors), _config(batch)) == problem  # type: ignore[arg-type]


# ---------------------------------------------------------------------- keys, limits, health, drain (real gRPC)
# The gateway's upstream here is a closed port: authentication, the per-key
# stream limit, message bounds, health and drain all act before anything is
# forwarded, so these run without a tritonserver; the forwarded traffic is
# covered with a real one in tests/integration/test_gateway_tls.py.

H1 = hashlib.sha256(b"key-one").hexdigest()
H2 = hashlib.sha256(b"key-two").hexdigest()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("nope", r"^f: not JSON: "),
        ("[]", r'^f: must be an object \{"keys": \[\.\.\.\]\} and nothing else$'),
        ('{"keys": [], "x": 1}', r'^f: must be an object \{"keys": \[\.\.\.\]\} and nothing else$'),
        ('{"keys": [1]}', r"^f: keys\[0\]: must be an object$"),
        (f'{{"keys": [{{"id": "a", "sha256": "{H1}", "key": "x"}}]}}',
         r"^f: keys\[0\]: unknown field 'key' \(fields: id, sha256, max_streams\)$"),
        (f'{{"keys": [{{"id": "", "sha256": "{H1}"}}]}}', r"^f: keys\[0\]\.id: must be 1-64 characters"),
        (f'{{"keys": [{{"id": "a b", "sha256": "{H1}"}}]}}', r"^f: keys\[0\]\.id: must be 1-64 characters"),
        ('{"keys": [{"id": "a", "sha256": "abc"}]}', r"^f: keys\[0\]\.sha256: must be 64 lower-case hex digits"),
        (f'{{"keys": [{{"id": "a", "sha256": "{H1.upper()}"}}]}}', r"^f: keys\[0\]\.sha256: must be 64 lower-case"),
        (f'{{"keys": [{{"id": "a", "sha256": "{H1}", "max_streams": 0}}]}}',
         r"^f: keys\[0\]\.max_streams: must be an integer >= 1, got 0$"),
        (f'{{"keys": [{{"id": "a", "sha256": "{H1}", "max_streams": true}}]}}',
         r"^f: keys\[0\]\.max_streams: must be an integer >= 1, got True$"),
        (f'{{"keys": [{{"id": "a", "sha256": "{H1}"}}, {{"id": "a", "sha256": "{H2}"}}]}}',
         r"^f: keys\[1\]\.id: 'a' is given more than once$"),
        (f'{{"keys": [{{"id": "a", "sha256": "{H1}"}}, {{"id": "b", "sha256": "{H1}"}}]}}',
         r"^f: keys\[1\]\.sha256: the same key as an earlier entry$"),
    ],
)
def test_parse_keys_rejects(text: str, match: str) -> None:
    with pytest.raises(KeyFileError, match=match):
        parse_keys(text, "f")


def test_parse_keys_reads_ids_digests_and_limits() -> None:
    keys = parse_keys(json.dumps({"keys": [{"id": "team-a", "sha256": H1, "max_streams": 8},
                                           {"id": "team.b_2", "sha256": H2}]}))
    assert [(k.id, k.sha256.hex(), k.max_streams) for k in keys] == [("team-a", H1, 8), ("team.b_2", H2, None)]
    assert parse_keys('{"keys": []}') == ()
    assert "sha256" not in repr(keys[0])  # digests stay out of logs and reprs


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("authorization", "bearer  abc "),), "abc"),
        ((("x-other", "1"), ("authorization", "Bearer k2")), "k2"),
        ((("authorization", "Basic abc"),), None),
        ((("authorization", "Bearer "),), None),
        ((("authorization-x", "Bearer abc"),), None),
        ((), None),
        (None, None),
    ],
)
def test_bearer_key(metadata: object, key: str | None) -> None:
    assert bearer_key(metadata) == key


def _write_keys(path: Path, *entries: tuple[str, bytes, int | None]) -> None:
    doc = {"keys": [{"id": i, "sha256": hashlib.sha256(k).hexdigest(), **({} if m is None else {"max_streams": m})}
                    for i, k, m in entries]}
    # Like the kubelet's atomic writer: a new file renamed over the old one (a new inode).
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def test_key_ring_reloads_on_change_and_keeps_keys_on_a_broken_update(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    _write_keys(path, ("a", b"old", None))
    now = [0.0]
    ring = KeyRing(path, check_interval_s=1.0, clock=lambda: now[0])
    assert ring.authenticate("old") is not None and ring.authenticate("new") is None
    _write_keys(path, ("a", b"new", 2))
    assert ring.authenticate("new") is None  # not checked again within the interval
    now[0] = 1.5
    key = ring.authenticate("new")
    assert key is not None and (key.id, key.max_streams) == ("a", 2)
    assert ring.authenticate("old") is None
    path.write_text("{broken")
    now[0] = 3.0
    assert ring.authenticate("new") is not None and ring.reload_failures == 1
    assert ring.authenticate(None) is None and ring.authenticate("") is None


def test_key_ring_follows_a_symlink_swap(tmp_path: Path) -> None:
    # The layout of a Kubernetes Secret volume: keys -> ..data/keys, ..data -> ..<timestamp>.
    for gen, raw in (("..v1", b"first"), ("..v2", b"second")):
        (tmp_path / gen).mkdir()
        _write_keys(tmp_path / gen / "keys", ("k", raw, None))
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "keys").symlink_to("..data/keys")
    now = [0.0]
    ring = KeyRing(tmp_path / "keys", clock=lambda: now[0])
    assert ring.authenticate("first") is not None
    (tmp_path / "..data_tmp").symlink_to("..v2")
    (tmp_path / "..data_tmp").replace(tmp_path / "..data")
    now[0] = 2.0
    assert ring.authenticate("second") is not None and ring.authenticate("first") is None


def test_key_ring_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"^api keys file .*/absent: cannot read: "):
        KeyRing(tmp_path / "absent")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tls_cert": Path("c")}, r"^tls_key: required with tls_cert \(give both or neither\)$"),
        ({"tls_key": Path("k")}, r"^tls_cert: required with tls_key \(give both or neither\)$"),
        ({"tls_client_ca": Path("ca")}, r"^tls_client_ca: mutual TLS needs tls_cert and tls_key$"),
    ],
)
def test_security_rejects(fields: dict[str, Path], match: str) -> None:
    with pytest.raises(GatewayError, match=match):
        GatewaySecurity(**fields)


def test_security_names_an_unreadable_or_non_pem_file(tmp_path: Path) -> None:
    (tmp_path / "cert").write_text("not pem")
    (tmp_path / "key").write_text("not pem")
    with pytest.raises(GatewayError, match=r"^tls_cert: .*/cert is not PEM \(no '-----BEGIN' line\)$"):
        GatewaySecurity(tls_cert=tmp_path / "cert", tls_key=tmp_path / "key").tls_files()
    with pytest.raises(GatewayError, match=r"^tls: cannot read .*/absent: No such file or directory$"):
        GatewaySecurity(tls_cert=tmp_path / "absent", tls_key=tmp_path / "key").tls_files()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"keepalive_time_s": 0}, r"^keepalive_time_s: must be > 0, got 0$"),
        ({"max_connection_age_s": -1}, r"^max_connection_age_s: must be > 0, got -1$"),
        ({"max_connection_age_grace_s": 0}, r"^max_connection_age_grace_s: must be > 0, got 0$"),
        ({"drain_grace_s": 0}, r"^drain_grace_s: must be > 0, got 0$"),
        ({"min_client_ping_interval_s": 90}, r"^min_client_ping_interval_s: must be <= keepalive_time_s=60\.0, got 90$"),
    ],
)
def test_config_rejects_connection_settings(fields: dict[str, float], match: str) -> None:
    with pytest.raises(GatewayError, match=match):
        GatewayConfig(upstream="127.0.0.1:1", secret=SECRET, **fields)  # type: ignore[arg-type]


def test_server_options_follow_the_config_and_the_payload_limit() -> None:
    options = dict(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET).server_options())
    assert MAX_MESSAGE_BYTES == contract.MAX_MESSAGE_BYTES == 2 * contract.MAX_CONSTRAINT_BYTES
    assert options == {
        "grpc.max_receive_message_length": 4 * 1024 * 1024, "grpc.max_send_message_length": 4 * 1024 * 1024,
        "grpc.keepalive_time_ms": 60_000, "grpc.keepalive_timeout_ms": 20_000,
        "grpc.keepalive_permit_without_calls": 1, "grpc.http2.min_ping_interval_without_data_ms": 10_000,
        "grpc.http2.max_ping_strikes": 2,
        "grpc.max_connection_age_ms": 300_000, "grpc.max_connection_age_grace_ms": 420_000,
    }


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[Gateway, Path]]:
    path = tmp_path / "keys"
    _write_keys(path, ("one", b"key-one", 1), ("two", b"key-two", None))
    gateway = Gateway(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET, drain_grace_s=30,
                                    security=GatewaySecurity(api_keys_file=path)))
    gateway.start()
    try:
        yield gateway, path
    finally:
        gateway.stop()


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _stream(channel: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    return channel.stream_stream(f"/{SERVICE}/ModelStreamInfer",
                                 request_serializer=pb.ModelInferRequest.SerializeToString,
                                 response_deserializer=pb.ModelStreamInferResponse.FromString)


def _live(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/{SERVICE}/ServerLive", request_serializer=pb.ServerLiveRequest.SerializeToString,
                               response_deserializer=pb.ServerLiveResponse.FromString)


def _health(channel: grpc.Channel, service: str = "") -> int:
    return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=HANG_S).status)


class _OpenStream:
    """A client stream that stays open until :meth:`close` (no request sent: nothing is forwarded)."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._requests: queue.SimpleQueue[pb.ModelInferRequest | None] = queue.SimpleQueue()
        self.call = _stream(channel)(iter(self._requests.get, None), metadata=metadata, timeout=HANG_S)

    def send(self, request: pb.ModelInferRequest) -> None:
        self._requests.put(request)

    def close(self) -> grpc.StatusCode:
        self._requests.put(None)
        try:
            self.responses = list(self.call)
        except grpc.RpcError:
            self.responses = []
        return self.call.code()  # type: ignore[no-any-return]


def _wait(predicate: Callable[[], bool], timeout_s: float = HANG_S) -> None:
    wait_for(predicate, timeout_s, "condition not reached", interval_s=0.02)


@pytest.mark.parametrize(
    ("metadata", "code", "details"),
    [
        ((), grpc.StatusCode.UNAUTHENTICATED, "no API key: send metadata 'authorization: Bearer <key>'"),
        (_auth("wrong"), grpc.StatusCode.UNAUTHENTICATED,
         "unknown API key: send metadata 'authorization: Bearer <key>'"),
        ((("authorization", "key-one"),), grpc.StatusCode.UNAUTHENTICATED,
         "no API key: send metadata 'authorization: Bearer <key>'"),
        # A good key passes; the call then reaches the (closed) upstream port.
        (_auth("key-one"), grpc.StatusCode.UNAVAILABLE, None),
    ],
)
def test_unary_calls_need_a_key(keyed: tuple[Gateway, Path], metadata: tuple[tuple[str, str], ...],
                                code: grpc.StatusCode, details: str | None) -> None:
    gateway, _ = keyed
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel, pytest.raises(grpc.RpcError) as info:
        _live(channel)(pb.ServerLiveRequest(), metadata=metadata, timeout=HANG_S)
    assert info.value.code() == code
    if details is not None:
        assert info.value.details() == details


def test_streams_need_a_key_and_keep_to_the_per_key_limit(keyed: tuple[Gateway, Path]) -> None:
    gateway, _ = keyed
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        anonymous = _OpenStream(channel, ())
        assert anonymous.close() == grpc.StatusCode.UNAUTHENTICATED
        first = _OpenStream(channel, _auth("key-one"))
        _wait(lambda: gateway.streams_open == 1)
        over = _OpenStream(channel, _auth("key-one"))
        assert over.close() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert over.call.details() == "API key 'one' already has 1 streams open (limit 1)"
        other = _OpenStream(channel, _auth("key-two"))  # another key has its own budget
        _wait(lambda: gateway.streams_open == 2)
        assert other.close() == grpc.StatusCode.OK
        assert first.close() == grpc.StatusCode.OK
        again = _OpenStream(channel, _auth("key-one"))  # the slot is free again
        assert again.close() == grpc.StatusCode.OK
    text = gateway.metrics_text()
    assert 'gateway_refusals_total{code="UNAUTHENTICATED"} 1\n' in text
    assert 'gateway_refusals_total{code="RESOURCE_EXHAUSTED"} 1\n' in text
    assert "gateway_streams_open 0\n" in text


def test_rotated_key_file_applies_without_restart(keyed: tuple[Gateway, Path]) -> None:
    gateway, path = keyed
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        assert _OpenStream(channel, _auth("key-one")).close() == grpc.StatusCode.OK
        _write_keys(path, ("one", b"rotated", 1))
        time.sleep(1.1)  # KeyRing's check interval
        assert _OpenStream(channel, _auth("key-one")).close() == grpc.StatusCode.UNAUTHENTICATED
        assert _OpenStream(channel, _auth("rotated")).close() == grpc.StatusCode.OK


def test_health_service_is_open_and_follows_health_and_drain(keyed: tuple[Gateway, Path]) -> None:
    gateway, _ = keyed
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        assert (_health(channel), _health(channel, SERVICE)) == (serving, serving)  # no key needed
        gateway.set_health(False, "grammar probe failed")
        _wait(lambda: _health(channel) == not_serving)
        assert _health(channel, SERVICE) == not_serving
        gateway.set_health(True)
        _wait(lambda: _health(channel) == serving)
        with pytest.raises(grpc.RpcError) as info:
            _health(channel, "no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_drain_sends_goaway_refuses_new_streams_and_lets_open_ones_finish(keyed: tuple[Gateway, Path]) -> None:
    gateway, _ = keyed
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        in_flight = _OpenStream(channel, _auth("key-two"))
        _wait(lambda: gateway.streams_open == 1)
        gateway.begin_drain()
        assert gateway.health == (False, "draining")
        _wait(lambda: "gateway_draining 1\n" in gateway.metrics_text())
        # A new stream on the same (already connected) channel is refused, once the gateway's loop has run the
        # drain (begin_drain only schedules it) and the GOAWAY reached the client: waited for, not slept on.
        _wait(lambda: _OpenStream(channel, _auth("key-two")).close() == grpc.StatusCode.UNAVAILABLE)
        # The stream in flight still works and ends normally.
        assert in_flight.close() == grpc.StatusCode.OK
        assert gateway.streams_open == 0


def test_oversize_message_is_refused_and_the_gateway_stays_up(keyed: tuple[Gateway, Path]) -> None:
    gateway, _ = keyed
    big = pb.ModelInferRequest(model_name="constrained_llm", id="big")
    big.raw_input_contents.append(b"x" * (MAX_MESSAGE_BYTES + 1))
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stream = _OpenStream(channel, _auth("key-two"))
        stream.send(big)
        assert stream.close() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        # A request that fits is read and answered (in-band: the upstream port is closed).
        small = pb.ModelInferRequest(model_name="grammar", id="small")
        ok = _OpenStream(channel, _auth("key-two"))
        ok.send(small)
        assert ok.close() == grpc.StatusCode.OK
        responses = ok.responses
        assert [r.error_message for r in responses] == [
            "PERMISSION_DENIED: model 'grammar' is not served to clients; call constrained_llm"]
    text = gateway.metrics_text()
    assert 'gateway_refusals_total{code="PERMISSION_DENIED"} 1\n' in text
    received = int(next(line.split()[1] for line in text.splitlines() if line.startswith("gateway_received_bytes")))
    sent = int(next(line.split()[1] for line in text.splitlines() if line.startswith("gateway_sent_bytes")))
    assert received == small.ByteSize() and sent == responses[0].ByteSize()


# ---------------------------------------------------------------------- forwarding (a real gRPC upstream)
# The part under test is the gateway, so its upstream is an in-process gRPC server that implements the two
# GRPCInferenceService methods the gateway calls for a stream (ModelConfig, ModelStreamInfer): it records
# every request and its metadata as received, and answers each with one FINAL response that echoes the id it
# saw, after ``release`` is set (cleared: requests stay in flight).

PUBLIC = "constrained_llm"
INTERNAL_MODELS = ("grammar", "llm", "preprocessing", "postprocessing")


class _Upstream:
    """A KServe GRPCInferenceService on a free loopback port: ModelConfig and a decoupled ModelStreamInfer."""

    def __init__(self) -> None:
        self.seen: queue.SimpleQueue[tuple[pb.ModelInferRequest, dict[str, str]]] = queue.SimpleQueue()
        self.release = threading.Event()
        self.release.set()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        handlers = {
            "ModelConfig": grpc.unary_unary_rpc_method_handler(
                self._model_config, request_deserializer=pb.ModelConfigRequest.FromString,
                response_serializer=pb.ModelConfigResponse.SerializeToString),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                self._stream, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelStreamInferResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _model_config(self, request: pb.ModelConfigRequest, context: grpc.ServicerContext) -> pb.ModelConfigResponse:
        from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig, ModelInput

        return pb.ModelConfigResponse(config=ModelConfig(name=request.name, input=[
            ModelInput(name="TEXT", data_type=DataType.TYPE_STRING, dims=[1])]))

    def _stream(self, requests: Iterator[pb.ModelInferRequest],
                context: grpc.ServicerContext) -> Iterator[pb.ModelStreamInferResponse]:
        metadata = dict(context.invocation_metadata())
        out: queue.SimpleQueue[pb.ModelStreamInferResponse | None] = queue.SimpleQueue()

        def answer(request: pb.ModelInferRequest) -> None:
            self.release.wait(HANG_S)
            response = pb.ModelStreamInferResponse()
            infer = response.infer_response
            infer.model_name, infer.id = request.model_name, request.id
            infer.outputs.add(name="SEEN_ID", datatype="BYTES", shape=[1])
            infer.raw_output_contents.append(len(request.id).to_bytes(4, "little") + request.id.encode())
            infer.parameters["triton_final_response"].bool_param = True
            out.put(response)

        def read() -> None:
            answering = []
            for request in requests:
                self.seen.put((request, metadata))
                answering.append(threading.Thread(target=answer, args=(request,)))
                answering[-1].start()
            for thread in answering:
                thread.join()
            out.put(None)

        threading.Thread(target=read, daemon=True).start()
        yield from iter(out.get, None)

    def stop(self) -> None:
        self.release.set()
        self.server.stop(0)


@pytest.fixture
def forwarding() -> Iterator[tuple[Gateway, _Upstream]]:
    upstream = _Upstream()
    gateway = Gateway(GatewayConfig(upstream=f"127.0.0.1:{upstream.port}", secret=SECRET, max_in_flight_per_stream=2))
    gateway.start()
    try:
        yield gateway, upstream
    finally:
        gateway.stop()
        upstream.stop()


def _infer(request_id: str, model: str = PUBLIC) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(b"hi").to_bytes(4, "little") + b"hi")
    return request


def _seen_id(response: pb.ModelStreamInferResponse) -> str:
    """The request id the upstream received, as it echoed it (one BYTES element: 4-byte length + bytes)."""
    raw = response.infer_response.raw_output_contents[0]
    return raw[4:4 + int.from_bytes(raw[:4], "little")].decode()


def test_request_ids_are_renamed_upstream_and_restored_for_the_client(forwarding: tuple[Gateway, _Upstream]) -> None:
    gateway, upstream = forwarding
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stream = _OpenStream(channel, ())
        for _ in range(2):  # a client may reuse its own id (two requests in flight as "req-1")
            stream.send(_infer("req-1"))
        assert stream.close() == grpc.StatusCode.OK
    seen = [upstream.seen.get(timeout=HANG_S) for _ in range(2)]
    internal = [request.id for request, _ in seen]
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in internal), internal  # 128 random bits
    assert len(set(internal)) == 2 and "req-1" not in internal
    # The gateway holds the secret and presents it upstream; the client never sent it.
    assert [metadata.get(GRPC_SECRET_METADATA) for _, metadata in seen] == [SECRET] * 2
    responses = stream.responses
    assert [r.infer_response.id for r in responses] == ["req-1", "req-1"]
    assert {_seen_id(r) for r in responses} == set(internal)  # each answer is the renamed request's
    assert all(r.error_message == "" for r in responses)
    # The client asked for no empty FINAL response, so the gateway's own FINAL marker is taken off again.
    assert all("triton_final_response" not in r.infer_response.parameters for r in responses)


@pytest.mark.parametrize(
    "failure",
    [asyncio.InvalidStateError("the call is done"), RuntimeError("closed"),
     cygrpc.ExecuteBatchError('Failed "execute_batch": (<SendMessageOperation>,)')],
    ids=["invalid-state", "runtime", "execute-batch"],
)
def test_a_write_to_a_departed_client_marks_it_gone(failure: Exception) -> None:
    """A response written after the client's call ended (its deadline passed, say) fails there; the pump must
    go on, so that the departure still finds the pending requests to cancel upstream."""
    sent: list[pb.ModelStreamInferResponse] = []

    async def send(response: pb.ModelStreamInferResponse) -> None:
        sent.append(response)
        raise failure

    session = StreamSession(Gateway(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET)), send)
    asyncio.run(session._write(pb.ModelStreamInferResponse()))
    asyncio.run(session._write(pb.ModelStreamInferResponse()))  # gone: not written again
    assert session.client_gone and len(sent) == 1


def test_requests_beyond_the_in_flight_cap_are_refused_in_band(forwarding: tuple[Gateway, _Upstream]) -> None:
    gateway, upstream = forwarding
    upstream.release.clear()  # the upstream holds every answer: both first requests stay in flight
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stream = _OpenStream(channel, ())
        for rid in ("a", "b", "c"):
            stream.send(_infer(rid))
        refusal = next(stream.call)
        assert refusal.error_message == "RESOURCE_EXHAUSTED: 2 requests already in flight on this stream (limit 2)"
        assert (refusal.infer_response.id, refusal.infer_response.model_name) == ("c", PUBLIC)
        held = [upstream.seen.get(timeout=HANG_S)[0].id for _ in range(2)]  # a and b, renamed, in flight upstream
        assert len(held) == 2 and not set(held) & {"a", "b", "c"}
        assert upstream.seen.empty()  # the refused request never reached the upstream
        upstream.release.set()
        answered = [next(stream.call), next(stream.call)]
        assert sorted(r.infer_response.id for r in answered) == ["a", "b"]
        stream.send(_infer("d"))  # the cap counts requests in flight, not requests sent: a slot is free again
        assert stream.close() == grpc.StatusCode.OK
    assert [r.infer_response.id for r in stream.responses] == ["d"]
    assert stream.responses[0].error_message == ""
    assert 'gateway_refusals_total{code="RESOURCE_EXHAUSTED"} 1\n' in gateway.metrics_text()


@pytest.mark.parametrize("model", INTERNAL_MODELS)
def test_each_internal_model_is_refused_by_name(forwarding: tuple[Gateway, _Upstream], model: str) -> None:
    gateway, upstream = forwarding
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stream = _OpenStream(channel, ())
        stream.send(_infer("x", model))
        stream.send(_infer("y"))  # the stream goes on: the refusal is in-band, for that request only
        assert stream.close() == grpc.StatusCode.OK
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(f"/{SERVICE}/ModelConfig", request_serializer=pb.ModelConfigRequest.SerializeToString,
                                response_deserializer=pb.ModelConfigResponse.FromString)(
                pb.ModelConfigRequest(name=model), timeout=HANG_S)
    refusal, answer = stream.responses
    assert refusal.error_message == f"PERMISSION_DENIED: model {model!r} is not served to clients; call {PUBLIC}"
    assert (refusal.infer_response.id, refusal.infer_response.model_name) == ("x", model)
    assert (answer.infer_response.id, answer.error_message) == ("y", "")
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.PERMISSION_DENIED, f"model {model!r} is not served to clients")
    assert [upstream.seen.get(timeout=HANG_S)[0].model_name] == [PUBLIC] and upstream.seen.empty()
    assert 'gateway_refusals_total{code="PERMISSION_DENIED"} 2\n' in gateway.metrics_text()


@pytest.mark.skipif(openssl_missing(), reason="no openssl binary to make a test CA")
def test_tls_and_mutual_tls_handshakes(tmp_path: Path) -> None:
    pki, other = make_pki(tmp_path, "ca"), make_pki(tmp_path, "other")
    security = GatewaySecurity(tls_cert=pki.cert, tls_key=pki.key, tls_client_ca=pki.ca)
    gateway = Gateway(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET, security=security))
    gateway.start()
    try:
        target = f"127.0.0.1:{gateway.port}"

        def check(ca: Path, client: bool) -> int | grpc.StatusCode:
            creds = grpc.ssl_channel_credentials(
                ca.read_bytes(), pki.client_key.read_bytes() if client else None,
                pki.client_cert.read_bytes() if client else None)
            with grpc.secure_channel(target, creds) as channel:
                try:
                    return _health(channel)
                except grpc.RpcError as err:
                    return err.code()  # type: ignore[no-any-return]

        assert check(pki.ca, client=True) == health_pb2.HealthCheckResponse.SERVING
        assert check(other.ca, client=True) == grpc.StatusCode.UNAVAILABLE  # the server's CA is not trusted
        assert check(pki.ca, client=False) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        with grpc.insecure_channel(target) as plain:
            with pytest.raises(grpc.RpcError) as info:
                _health(plain)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gateway.stop()


@pytest.mark.skipif(openssl_missing(), reason="no openssl binary to make a test CA")
def test_tls_files_reload_a_swapped_secret_and_keep_the_pair_on_a_broken_one(tmp_path: Path) -> None:
    first, second = make_pki(tmp_path, "first"), make_pki(tmp_path, "second")
    volume = SecretVolume(tmp_path / "tls", first)
    cert, key, _ = volume.files()
    now = [0.0]
    files = TlsFiles(GatewaySecurity(tls_cert=cert, tls_key=key), check_interval_s=1.0, clock=lambda: now[0])
    assert (files.pem.cert, files.refresh()) == (first.cert.read_bytes(), False)
    volume.put(second)
    assert files.refresh() is False  # checked at most once a second
    now[0] = 1.0
    assert (files.refresh(), files.pem.cert, files.pem.key, files.reloads) == (
        True, second.cert.read_bytes(), second.key.read_bytes(), 1)
    volume.put(first, key=second.key)  # a key that is not the certificate's: the previous pair stays
    now[0] = 2.0
    assert (files.refresh(), files.pem.cert, files.reload_failures) == (False, second.cert.read_bytes(), 1)
    now[0] = 3.0
    assert (files.refresh(), files.reload_failures) == (False, 1)  # the same broken files: not again
    volume.put(first)  # fixed: loaded at the next check
    now[0] = 4.0
    assert (files.refresh(), files.pem.cert, files.reloads, files.reload_failures, files.generation) == (
        True, first.cert.read_bytes(), 2, 1, 2)


@pytest.mark.skipif(openssl_missing(), reason="no openssl binary to make a test CA")
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual_tls"])
def test_gateway_serves_a_renewed_certificate_to_new_connections_without_restart(tmp_path: Path,
                                                                                 mutual: bool) -> None:
    """A real gRPC client that trusts only the new CA is refused before the renewal and served after it."""
    first, second = make_pki(tmp_path, "first"), make_pki(tmp_path, "second")
    volume = SecretVolume(tmp_path / "tls", first)
    cert, key, ca = volume.files()
    security = GatewaySecurity(tls_cert=cert, tls_key=key, tls_client_ca=ca if mutual else None)
    gateway = Gateway(GatewayConfig(upstream="127.0.0.1:1", secret=SECRET, security=security))
    gateway.start()
    target = f"127.0.0.1:{gateway.port}"

    def check(trusted: Pki, client: Pki) -> int | grpc.StatusCode:
        creds = grpc.ssl_channel_credentials(trusted.ca.read_bytes(), client.client_key.read_bytes(),
                                             client.client_cert.read_bytes())
        with grpc.secure_channel(target, creds) as channel:
            try:
                return _health(channel)
            except grpc.RpcError as err:
                return err.code()  # type: ignore[no-any-return]

    try:
        assert check(first, first) == health_pb2.HealthCheckResponse.SERVING
        assert check(second, second) == grpc.StatusCode.UNAVAILABLE
        assert served_cert(gateway.port) == der(first.cert)
        volume.put(second)
        tls = gateway.tls
        assert tls is not None
        # The OpenAI port shares these files: its handshake may be the one that reloads them.
        wait_for(lambda: tls.refresh() or tls.generation == 1, HANG_S, "the files reloaded")
        wait_for(lambda: served_cert(gateway.port) == der(second.cert), HANG_S, "the renewed certificate")
        assert check(second, second) == health_pb2.HealthCheckResponse.SERVING
        assert check(first, first) == grpc.StatusCode.UNAVAILABLE  # the old CA no longer signs what is served
        text = gateway.metrics_text()
        assert "gateway_tls_reloads_total 1\n" in text and "gateway_tls_reload_failures_total 0\n" in text
    finally:
        gateway.stop()


def test_launcher_health_port_serves_gateway_metrics_and_starts_the_drain(keyed: tuple[Gateway, Path]) -> None:
    import urllib.request

    from deploy.drain import drain
    from deploy.health import HealthServer

    gateway, _ = keyed
    health = HealthServer("127.0.0.1", 0, lambda: gateway.health, metrics=gateway.metrics_text,
                          on_drain=gateway.begin_drain)
    health.start()
    base = f"http://127.0.0.1:{health.port}"
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=HANG_S) as resp:
            body = resp.read().decode()
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "gateway_streams_open 0\n" in body and "gateway_draining 0\n" in body
        logs: list[str] = []
        # deploy.drain's preStop sequence: settle, POST the drain, then wait on the live gauge
        # (read here from the gateway's own metrics: 0 requests in flight).
        code = drain(f"{base}/metrics", settle_s=0, timeout_s=5, poll_s=0.1, sleep=lambda s: None, log=logs.append,
                     gateway_drain_url=f"{base}/v2/drain")
        assert code == 0 and logs[0] == "drain: gateway draining (GOAWAY sent)"
        assert gateway.draining and gateway.health == (False, "draining")
        with urllib.request.urlopen(f"{base}/metrics", timeout=HANG_S) as resp:
            assert "gateway_draining 1\n" in resp.read().decode()
    finally:
        health.stop()


def test_drain_logs_a_gateway_that_cannot_be_asked() -> None:
    from deploy.drain import drain

    logs: list[str] = []
    drain("http://127.0.0.1:1/metrics", settle_s=0, timeout_s=0, sleep=lambda s: None, log=logs.append,
          gateway_drain_url="http://127.0.0.1:1/v2/drain")
    assert logs[0].startswith("drain: cannot start the gateway's drain at http://127.0.0.1:1/v2/drain: ")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, GatewaySecurity()),
        (["--tls-cert", "c", "--tls-key", "k"], {}, GatewaySecurity(tls_cert=Path("c"), tls_key=Path("k"))),
        ([], {"GATEWAY_TLS_CERT": "/s/tls.crt", "GATEWAY_TLS_KEY": "/s/tls.key", "GATEWAY_TLS_CLIENT_CA": "",
              "GATEWAY_API_KEYS_FILE": "/k/keys"},
         GatewaySecurity(tls_cert=Path("/s/tls.crt"), tls_key=Path("/s/tls.key"), api_keys_file=Path("/k/keys"))),
        (["--tls-client-ca", "ca"], {"GATEWAY_TLS_CERT": "c", "GATEWAY_TLS_KEY": "k"},
         GatewaySecurity(tls_cert=Path("c"), tls_key=Path("k"), tls_client_ca=Path("ca"))),
        (["--api-keys-file", "flag"], {"GATEWAY_API_KEYS_FILE": "env"}, GatewaySecurity(api_keys_file=Path("flag"))),
    ],
)
def test_launcher_gateway_flags_and_env(argv: list[str], env: dict[str, str], expected: GatewaySecurity,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.launch import _parse_args, gateway_security

    for name in ("GATEWAY_TLS_CERT", "GATEWAY_TLS_KEY", "GATEWAY_TLS_CLIENT_CA", "GATEWAY_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert gateway_security(_parse_args(["--model-repository", "r", *argv])) == expected


def test_launcher_refuses_a_certificate_without_its_key(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.launch import main

    monkeypatch.delenv("GATEWAY_TLS_KEY", raising=False)
    assert main(["--model-repository", "r", "--tls-cert", "c"]) == 2
    assert capsys.readouterr().err == "server: error: tls_key: required with tls_cert (give both or neither)\n"
