"""deploy.health: the probe endpoints follow the supervisor's verdict, over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from deploy.health import HealthServer, may_drain


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_probes_follow_the_ready_check_and_the_stop() -> None:
    state = {"ready": (True, "")}
    server = HealthServer("127.0.0.1", 0, lambda: state["ready"])
    server.start()
    try:
        assert get(server.port, "/v2/health/live") == (200, "ok")
        assert get(server.port, "/v2/health/ready") == (200, "ok")
        state["ready"] = (False, "probe of model 'llm' failed 2 times")
        assert get(server.port, "/v2/health/ready") == (503, "not ready: probe of model 'llm' failed 2 times")
        assert get(server.port, "/v2/health/live") == (200, "ok")  # recovering is not dead
        assert get(server.port, "/v2/models/llm/infer")[0] == 404
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        get(server.port, "/v2/health/live")


@pytest.mark.parametrize(
    ("peer", "allowed"),
    [
        ("127.0.0.1", True),
        ("127.0.0.53", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.3.7", False),        # Prometheus or the kubelet: may scrape and probe, never drain
        ("::ffff:10.0.3.7", False),
        ("fe80::1", False),
        ("0.0.0.0", False),
        ("localhost", False),       # a name, not an address
        ("", False),
    ],
)
def test_only_loopback_may_drain(peer: str, allowed: bool) -> None:
    assert may_drain(peer) is allowed


def test_drain_post_from_loopback_starts_the_drain() -> None:
    calls: list[int] = []
    server = HealthServer("127.0.0.1", 0, lambda: (True, ""), on_drain=lambda: calls.append(1))
    server.start()
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v2/drain", method="POST")
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert (resp.status, resp.read()) == (200, b"draining")
        assert calls == [1]
    finally:
        server.stop()


def _outside_address() -> str | None:
    """One of this machine's non-loopback IPv4 addresses, or None (a route lookup; nothing is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if may_drain(address) or address == "0.0.0.0" else address


def test_drain_post_from_another_address_is_refused_and_probes_still_answer() -> None:
    address = _outside_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    calls: list[int] = []
    server = HealthServer("0.0.0.0", 0, lambda: (True, ""), on_drain=lambda: calls.append(1))
    server.start()
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # not through an http_proxy
    try:
        request = urllib.request.Request(f"http://{address}:{server.port}/v2/drain", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            direct.open(request, timeout=5)
        assert (refused.value.code, refused.value.read()) == (403, b"drain: only from inside the pod (loopback)")
        with direct.open(f"http://{address}:{server.port}/v2/health/ready", timeout=5) as resp:
            assert resp.status == 200
        assert calls == []
    finally:
        server.stop()
