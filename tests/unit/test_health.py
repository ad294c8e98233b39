"""deploy.health: the probe endpoints follow the supervisor's verdict, over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from deploy.health import HealthServer


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
