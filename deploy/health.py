"""HTTP health endpoints for Kubernetes probes that know what the supervisor knows.

Triton's own ``/v2/health/ready`` keeps answering 200 after a Python-backend
stub died (Triton 2.51, see deploy/supervisor.py), and it is down while
the supervisor restarts tritonserver, so probing it would make the kubelet
restart a container that is already recovering.  The launcher (``python -m
deploy.server --health-port N``) therefore serves the same two paths itself:

``GET /v2/health/live``
    200 while the launcher runs (it restarts tritonserver on its own);
    503 once it is stopping.
``GET /v2/health/ready``
    200 when the gateway would answer ``ServerReady`` true: tritonserver is up,
    its models are ready and the supervisor's probes pass; 503 with the reason
    otherwise.

``GET /metrics``
    The gateway's own metrics (Prometheus text, deploy/gateway.py
    ``Gateway.metrics_text``), when the launcher passes ``metrics``.
``POST /v2/drain``
    Start the gateway's drain (GOAWAY, no new streams; deploy/drain.py calls it
    from the preStop hook), when the launcher passes ``on_drain``.  Only from
    loopback (403 otherwise): the port is open to Prometheus and the kubelet
    (deploy/k8s NetworkPolicy), and a drain takes the pod out of service.

Anything else is 404.  Bodies are one line of text; no request reaches Triton.
"""

from __future__ import annotations

import http.server
import ipaddress
import threading
from collections.abc import Callable

__all__ = ["HealthServer", "may_drain"]

#: Returns ``(ready, reason)``.
ReadyCheck = Callable[[], tuple[bool, str]]


def may_drain(peer: str) -> bool:
    """Whether a ``POST /v2/drain`` from address ``peer`` is obeyed: loopback only (the preStop hook runs in the pod).

    An IPv4-mapped IPv6 loopback (``::ffff:127.0.0.1``) counts; anything that
    does not parse as an address does not.
    """
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class HealthServer:
    """Serves ``/v2/health/live`` and ``/v2/health/ready`` on a thread.

    Parameters
    ----------
    host, port : str, int
        Where to listen (port 0 picks a free one: :attr:`port`).
    ready : callable
        ``() -> (ready, reason)``, called per readiness request.
    metrics : callable, optional
        ``() -> str``: the body of ``GET /metrics``.
    on_drain : callable, optional
        Called by ``POST /v2/drain``.
    """

    def __init__(self, host: str, port: int, ready: ReadyCheck, *, metrics: Callable[[], str] | None = None,
                 on_drain: Callable[[], None] | None = None) -> None:
        self._ready = ready
        self._stopping = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                if self.path != "/v2/drain" or on_drain is None:
                    self.send_error(404)
                    return
                if not may_drain(str(self.client_address[0])):
                    self._reply(403, b"drain: only from inside the pod (loopback)")
                    return
                on_drain()
                self._reply(200, b"draining")

            def do_GET(self) -> None:
                if self.path == "/metrics" and metrics is not None:
                    self._reply(200, metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
                    return
                if self.path == "/v2/health/live":
                    ok, reason = (not owner._stopping.is_set(), "stopping")
                elif self.path == "/v2/health/ready":
                    ok, reason = owner._ready() if not owner._stopping.is_set() else (False, "stopping")
                else:
                    self.send_error(404)
                    return
                body = ("ok" if ok else f"not ready: {reason}").encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # probes every few seconds: no access log
                return None

        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Answer 503 from now on, then close the socket."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
