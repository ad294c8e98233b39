"""deploy.drain: the metrics parser and the preStop drain, against a real local HTTP endpoint."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from deploy.drain import drain, main, scrape, value

TEXT = """# HELP llm_live_requests Requests not finished now
# TYPE llm_live_requests gauge
llm_live_requests {live}
constrained_llm_outputs_total{{finish_reason="stop",kind="regex"}} 7
constrained_llm_outputs_total{{kind="json_schema",finish_reason="length"}} 2 1700000000000
odd_label{{path="a\\"b,c"}} 1.5e3
"""


class Endpoint:
    """A metrics endpoint whose llm_live_requests follows a script of values."""

    def __init__(self, lives: list[int]) -> None:
        self.lives = lives
        self.reads = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                live = owner.lives[min(owner.reads, len(owner.lives) - 1)]
                owner.reads += 1
                body = TEXT.format(live=live).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    ep = Endpoint(request.param)
    yield ep
    ep.close()


@pytest.mark.parametrize("endpoint", [[3]], indirect=True)
def test_scrape_reads_every_series(endpoint: Endpoint) -> None:
    series = scrape(endpoint.url)
    assert series == {
        ("llm_live_requests", ()): 3.0,
        ("constrained_llm_outputs_total", (("finish_reason", "stop"), ("kind", "regex"))): 7.0,
        ("constrained_llm_outputs_total", (("finish_reason", "length"), ("kind", "json_schema"))): 2.0,
        ("odd_label", (("path", 'a\\"b,c'),)): 1500.0,
    }
    assert value(series, "constrained_llm_outputs_total", kind="regex", finish_reason="stop") == 7.0
    assert value(series, "absent_total") == 0.0


class FakeClock:
    """Drives the drain's deadline without waiting (the endpoint is real)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.mark.parametrize(
    ("endpoint", "timeout", "status", "reads"),
    [
        ([2, 1, 0], 60.0, 0, 3),  # drained after the streams finished
        ([0], 60.0, 0, 1),  # idle: at once
        ([5], 4.0, 1, 3),  # still busy at the deadline: the pod stops anyway
    ],
    indirect=["endpoint"],
)
def test_drain(endpoint: Endpoint, timeout: float, status: int, reads: int) -> None:
    clock = FakeClock()
    lines: list[str] = []
    assert drain(endpoint.url, settle_s=1.0, timeout_s=timeout, poll_s=1.5, clock=clock, sleep=clock.sleep,
                 log=lines.append) == status
    assert endpoint.reads == reads
    assert clock.sleeps[0] == 1.0  # the settle delay comes first
    assert lines[-1] == ("drain: no request in flight" if status == 0 else
                         "drain: 5 requests still in flight after 4 s")


def test_drain_of_an_endpoint_that_never_answers() -> None:
    clock = FakeClock()
    lines: list[str] = []
    status = drain("http://127.0.0.1:9/metrics", settle_s=0, timeout_s=2, poll_s=1, clock=clock, sleep=clock.sleep,
                   log=lines.append)
    assert status == 2
    assert lines[-1] == "drain: http://127.0.0.1:9/metrics never answered"


@pytest.mark.parametrize("args", [["--poll", "0"], ["--timeout", "-1"]])
def test_main_refuses_bad_arguments(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2


@pytest.mark.parametrize("endpoint", [[0]], indirect=True)
def test_drain_never_goes_through_the_pods_proxy(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTP(S)_PROXY in the pod's environment (common behind corporate egress) is not used for the pod's own ports."""
    import urllib.request

    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen would build its opener from this environment
    assert value(scrape(endpoint.url), "llm_live_requests") == 0
    lines: list[str] = []
    assert drain(endpoint.url, settle_s=0, timeout_s=5, sleep=lambda s: None, log=lines.append) == 0
