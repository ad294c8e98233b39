"""TLS and API keys on the public port, against a real tritonserver behind the gateway (``pytest -k tls``).

One server for the module (a start costs ~20 s here), serving TLS from a
throwaway CA (tests/tls_certs.py, the ``openssl`` binary) and API keys from a
file that the tests rewrite to rotate keys without a restart.  The last test
drains the gateway, so it runs last.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from client import Client, Constraint, GenerationError, ServerBusy, ServerUnavailable
from client.__main__ import EXIT_OK
from client.__main__ import main as client_main
from client.sdk import API_KEY_ENV
from deploy.gateway import GatewaySecurity
from deploy.server import TritonServer
from tests.integration.served import start_ensemble
from tests.support.poll import wait_for
from tests.tls_certs import Pki, SecretVolume, der, make_pki, openssl_missing, served_cert

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

CHOICES = ["red", "blue"]


def _write_keys(path: Path, keys: dict[str, tuple[str, int | None]]) -> None:
    doc = {"keys": [{"id": key_id, "sha256": hashlib.sha256(raw.encode()).hexdigest(),
                     **({} if limit is None else {"max_streams": limit})}
                    for key_id, (raw, limit) in keys.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # a new inode, as the kubelet's symlink swap gives


@pytest.fixture(scope="module")
def tls_volume(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Pki, SecretVolume]:
    """The CA served, another CA, and the Secret volume (kubelet layout) the server's certificate is mounted from."""
    if openssl_missing():
        pytest.skip("no openssl binary to make a test CA")
    tmp = tmp_path_factory.mktemp("pki")
    pki, other = make_pki(tmp, "ca"), make_pki(tmp, "other")
    return pki, other, SecretVolume(tmp / "tls", pki)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory,
               tls_volume: tuple[Pki, Pki, SecretVolume]) -> Iterator[tuple[TritonServer, Pki, Pki, Path]]:
    pki, other, volume = tls_volume
    tmp = tmp_path_factory.mktemp("tls")
    keys = tmp / "keys"
    _write_keys(keys, {"team-a": ("key-a", None), "team-one": ("key-one", 1)})
    cert, key, _ = volume.files()
    security = GatewaySecurity(tls_cert=cert, tls_key=key, api_keys_file=keys)
    server = start_ensemble(tmp, gateway_security=security, openai_port=0)
    try:
        yield server, pki, other, keys
    finally:
        server.stop()


def _client(server: TritonServer, ca: Path, key: str | None, timeout_s: float = 120) -> Client:
    return Client(server.grpc_url, ca_file=ca, api_key=key, timeout_s=timeout_s)


def _refused(llm: Client) -> bool:
    """Whether a new request is refused as the server unavailable (a draining gateway's answer)."""
    try:
        llm.generate("hi", max_tokens=4)
    except ServerUnavailable:
        return True
    return False


def test_tls_good_key_gets_a_constrained_result(tls_server: tuple[TritonServer, Pki, Pki, Path]) -> None:
    server, pki, _, _ = tls_server
    gateway = server.gateway
    assert gateway is not None
    before = gateway.requests["constrained_llm"]
    with _client(server, pki.ca, "key-a") as llm:
        assert llm.is_ready() is True
        result = llm.generate("Name a colour.", constraint=Constraint.choice(CHOICES), max_tokens=8)
    assert result.text in CHOICES and result.finish_reason == "stop"
    assert gateway.requests["constrained_llm"] == before + 1
    assert gateway.bytes_in > 0 and gateway.bytes_out > 0


def test_tls_cli_with_ca_file_and_key_from_env(tls_server: tuple[TritonServer, Pki, Pki, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    server, pki, _, _ = tls_server
    monkeypatch.setenv(API_KEY_ENV, "key-a")
    out, err = io.StringIO(), io.StringIO()
    code = client_main(["--url", server.grpc_url, "--ca-file", str(pki.ca), "--max-tokens", "8",
                        "--choice", "red", "--choice", "blue", "Name a colour."], stdout=out, stderr=err)
    assert (code, err.getvalue()) == (EXIT_OK, "")
    assert out.getvalue().strip() in CHOICES


@pytest.mark.parametrize(("key", "message"), [(None, "no API key"), ("not-a-key", "unknown API key")])
def test_tls_without_a_valid_key_is_unauthenticated(tls_server: tuple[TritonServer, Pki, Pki, Path],
                                                    key: str | None, message: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    server, pki, _, _ = tls_server
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with _client(server, pki.ca, key) as llm:
        for call in (llm.is_ready, lambda: llm.generate("hi", max_tokens=4)):
            with pytest.raises(GenerationError, match=rf"^UNAUTHENTICATED: {message}: ") as info:
                call()
            assert info.value.status == "UNAUTHENTICATED"


def test_tls_wrong_ca_is_unavailable(tls_server: tuple[TritonServer, Pki, Pki, Path]) -> None:
    server, _, other, _ = tls_server
    with _client(server, other.ca, "key-a", timeout_s=10) as llm:
        assert llm.is_ready() is False
        with pytest.raises(ServerUnavailable) as info:
            llm.generate("hi", max_tokens=4)
        assert info.value.status == "UNAVAILABLE"


def test_tls_key_over_its_stream_limit_is_resource_exhausted(tls_server: tuple[TritonServer, Pki, Pki, Path]) -> None:
    server, pki, _, _ = tls_server
    gateway = server.gateway
    assert gateway is not None
    holder = _client(server, pki.ca, "key-one")
    stream = holder.stream("Count from 1 to 100.", max_tokens=64, require_complete=False)
    next(stream)  # the first delta: the key's one stream is open
    try:
        with _client(server, pki.ca, "key-one") as llm:
            with pytest.raises(ServerBusy, match=r"^server busy: API key 'team-one' already has 1 streams open "
                                                 r"\(limit 1\)$") as info:
                llm.generate("hi", max_tokens=4)
            assert info.value.status == "RESOURCE_EXHAUSTED"
        with _client(server, pki.ca, "key-a") as llm:  # other keys are not affected
            assert llm.generate("Name a colour.", constraint=Constraint.choice(CHOICES), max_tokens=8).text in CHOICES
    finally:
        stream.close()  # cancels the request inside the server
        holder.close()
    wait_for(lambda: not gateway.streams_open, 30, "the gateway's streams closed", interval_s=0.05)
    with _client(server, pki.ca, "key-one") as llm:  # the slot is free again
        assert llm.generate("Name a colour.", constraint=Constraint.choice(CHOICES), max_tokens=8).text in CHOICES


def test_tls_rotated_key_applies_without_restart(tls_server: tuple[TritonServer, Pki, Pki, Path]) -> None:
    server, pki, _, keys = tls_server
    _write_keys(keys, {"team-a": ("key-a-2", None), "team-one": ("key-one", 1)})
    time.sleep(1.2)  # KeyRing checks the file at most once a second
    with _client(server, pki.ca, "key-a") as llm, pytest.raises(GenerationError, match=r"^UNAUTHENTICATED: "):
        llm.is_ready()
    with _client(server, pki.ca, "key-a-2") as llm:
        assert llm.generate("Name a colour.", constraint=Constraint.choice(CHOICES), max_tokens=8).text in CHOICES


def test_tls_renewed_certificate_serves_new_connections_without_restart(
        tls_server: tuple[TritonServer, Pki, Pki, Path], tls_volume: tuple[Pki, Pki, SecretVolume]) -> None:
    """cert-manager renews the Secret; the kubelet swaps the mounted files: real clients of both public
    ports that trust only the new CA get served, with no restart, and then the old certificate comes back."""
    server, pki, other, _ = tls_server
    volume = tls_volume[2]
    assert server.openai is not None
    grpc_port, openai_port = server.config.grpc_port, server.openai.config.port
    def serves(cert: bytes) -> bool:
        return served_cert(grpc_port) == cert and served_cert(openai_port) == cert

    for renewed, stale in ((other, pki), (pki, other)):
        volume.put(renewed)
        wait_for(functools.partial(serves, der(renewed.cert)), 60, "the renewed certificate on both ports")
        with _client(server, renewed.ca, "key-a-2") as llm:  # the key of the rotation test above
            assert llm.generate("Name a colour.", constraint=Constraint.choice(CHOICES), max_tokens=8).text in CHOICES
        with _client(server, stale.ca, "key-a-2", timeout_s=10) as llm:
            assert llm.is_ready() is False
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=renewed.ca))
        with openai.OpenAI(base_url=server.openai.url, api_key="key-a-2", max_retries=0, http_client=http) as api:
            assert [m.id for m in api.models.list()] == ["constrained_llm"]
    gateway = server.gateway
    assert gateway is not None and gateway.tls is not None
    assert (gateway.tls.reloads, gateway.tls.reload_failures) == (2, 0)


def test_tls_drain_lets_the_stream_in_flight_finish_and_refuses_new_ones(
        tls_server: tuple[TritonServer, Pki, Pki, Path]) -> None:
    # Last in the module: the gateway stays draining.
    server, pki, _, _ = tls_server
    gateway = server.gateway
    assert gateway is not None
    results: list[object] = []
    with _client(server, pki.ca, "key-a-2") as llm:
        assert llm.is_ready() is True  # the channel (and its connection) exists before the drain
        stream = llm.stream("Count from 1 to 100.", max_tokens=48, require_complete=False)
        first = next(stream)

        def finish() -> None:
            results.extend(chunk.result for chunk in stream if chunk.result is not None)

        rest = threading.Thread(target=finish)
        rest.start()
        gateway.begin_drain()
        # begin_drain only schedules the drain on the gateway's loop: a new request is refused once it ran.
        wait_for(functools.partial(_refused, llm), 60, "a new request refused while draining", interval_s=0.05)
        rest.join(120)
    assert first.text
    assert len(results) == 1 and results[0].finish_reason in ("length", "stop")  # type: ignore[attr-defined]
    assert gateway.health == (False, "draining")
