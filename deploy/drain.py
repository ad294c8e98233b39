"""Drain before stop: wait until the server has no request in flight.

Kubernetes runs this as the container's ``preStop`` hook (deploy/k8s). A pod
that is being deleted leaves its Service's endpoints as the hook starts, so
no new connection arrives after a short propagation delay (``--settle``).
The hook then asks the launcher to start the gateway's drain (``POST
--gateway-drain-url``, deploy/health.py): GOAWAY on every connection, so
clients that hold one open their next streams on another pod, and new streams
on this pod's connections are refused.  It then waits until Triton's ``llm_live_requests`` gauge reads 0, so the
streams already running finish, or until ``--timeout`` (kept below the pod's
``terminationGracePeriodSeconds``). Only then does the kubelet send SIGTERM,
and ``deploy.server`` stops Triton. Run::

    python -m deploy.drain [--metrics-url http://127.0.0.1:8002/metrics] [--settle 5] [--timeout 300]
                           [--gateway-drain-url http://127.0.0.1:8003/v2/drain | --gateway-drain-url '']

Exit status 0: drained; 1: still busy at the deadline (the pod stops anyway);
2: the metrics endpoint could not be read at all.

:func:`scrape` is also the project's one parser of the metrics endpoint
(load tests and integration tests read it).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Final

__all__ = ["LIVE_GAUGE", "Series", "drain", "main", "scrape", "value"]

#: The gauge the drain waits on (declared in triton_support.metrics).
LIVE_GAUGE: Final = "llm_live_requests"

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# The hook talks only to this pod's own ports: never through an HTTP(S)_PROXY of
# the pod's environment (a proxy would reach the launcher from outside, and
# its POST /v2/drain is obeyed from loopback only: deploy/health.py).
_DIRECT: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))

_LINE: Final = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL: Final = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(metrics_url: str, timeout_s: float = 10.0) -> Series:
    """Every series of a Prometheus text endpoint: ``(name, sorted labels) -> value``.

    Raises
    ------
    OSError
        When the endpoint cannot be read (``urllib.error.URLError`` included).

    Notes
    -----
    A parser of its own, not ``prometheus_client.parser.text_string_to_metric_families``:
    prometheus_client is in none of the project's environments (not pinned in
    requirements*.txt, not installed in the venv or the images, where this runs
    as the preStop hook), and its parser differs where callers rely on this one:
    it raises ``ValueError`` on a line it cannot read, where a drain must go on
    reading the gauge (such lines are skipped here), and it unescapes label
    values (``a\\"b`` becomes ``a"b``; here they are kept as exposed).
    """
    with _DIRECT.open(metrics_url, timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8", "replace")
    out: Series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(series: Series, name: str, **labels: str) -> float:
    """One series' value (0 when absent: a counter or gauge not created yet)."""
    return series.get((name, tuple(sorted(labels.items()))), 0.0)


def drain(
    metrics_url: str,
    *,
    settle_s: float = 5.0,
    timeout_s: float = 300.0,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
    gateway_drain_url: str | None = None,
) -> int:
    """Wait ``settle_s``, start the gateway's drain, then wait until ``llm_live_requests`` is 0 or ``timeout_s``.

    ``gateway_drain_url`` (None: skipped) is POSTed once after the settle; a
    failure is logged and the wait goes on (the streams in flight still finish).

    Returns
    -------
    int
        The exit status (see the module docstring).
    """
    deadline = clock() + timeout_s
    sleep(min(settle_s, timeout_s))
    if gateway_drain_url:
        try:
            with _DIRECT.open(urllib.request.Request(gateway_drain_url, method="POST"), timeout=10):
                log("drain: gateway draining (GOAWAY sent)")
        except OSError as err:
            log(f"drain: cannot start the gateway's drain at {gateway_drain_url}: {err}")
    read_once = False
    live = -1.0
    while True:
        try:
            live = value(scrape(metrics_url), LIVE_GAUGE)
            read_once = True
        except OSError as err:
            log(f"drain: cannot read {metrics_url}: {err}")
        if read_once and live == 0:
            log("drain: no request in flight")
            return 0
        if clock() >= deadline:
            log(f"drain: {live:g} requests still in flight after {timeout_s:g} s" if read_once
                else f"drain: {metrics_url} never answered")
            return 1 if read_once else 2
        sleep(poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before the first check (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds in all (default %(default)s)")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between checks (default %(default)s)")
    parser.add_argument("--gateway-drain-url", default="http://127.0.0.1:8003/v2/drain",
                        help="POSTed after the settle to send GOAWAY (the launcher's --health-port; '' skips; "
                             "default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("settle", "timeout", "poll"):
        if getattr(args, name) < 0 or (name == "poll" and args.poll == 0):
            parser.error(f"--{name} must be positive")
    return drain(args.metrics_url, settle_s=args.settle, timeout_s=args.timeout, poll_s=args.poll,
                 gateway_drain_url=args.gateway_drain_url or None)


if __name__ == "__main__":
    sys.exit(main())
