"""``make loadtest``: a bounded, headless locust run against the embedded server, then its checks and summary.

Uses the server already answering on ``--host`` when there is one; otherwise
starts the embedded default (the rendered ``build/model_repository``, as
``make serve`` does) on those ports and stops it afterwards.  With
``--openai-port`` the ``openai`` task runs too, against the OpenAI-compatible
endpoint on that port (the server in use must serve it; the embedded one is
started with it).  Writes under
``--out``: locust's CSV files and HTML report, ``outputs.json`` (valid,
closed-early and failed outputs per kind), ``summary.json`` and
``summary.png``.  The run ends at ``--time``; with ``--min-per-kind N`` on
counts instead, once every kind in the mix has ended N requests
(``--time`` is then the least run time, ``--deadline`` the most: only a
hang reaches it), so a slow host runs longer rather than fewer kinds.

Exit status: locust's (1 on any failure: every request is checked, see
``loadtest/locustfile.py``), or 1 when the server (or its OpenAI-compatible
endpoint) is not ready before or after the run, or its
``grammar_active_sequences`` / ``llm_live_requests`` gauges do not return to 0
(a leaked sequence or request).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.sdk import DEFAULT_MODEL
from deploy.drain import scrape
from deploy.server import ServerConfig, TritonServer
from loadtest import summary

GAUGES: Final = ("grammar_active_sequences", "llm_live_requests")
#: How long running streams may finish after the run time (a 1,000-token stream at 10 tokens/s).
STOP_TIMEOUT_S: Final = 120
#: Locust's own start (imports, schema checks) and exit on top of run time and stop timeout.
LOCUST_OVERHEAD_S: Final = 120
#: The most run time of a run that ends on counts (``--min-per-kind``): only a hang reaches it.
DEADLINE: Final = "15m"


def ready(url: str) -> bool:
    """Whether the ensemble answers and is ready on ``url`` (the gateway's gRPC port)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return bool(client.is_server_ready() and client.is_model_ready("constrained_llm"))
    except InferenceServerException:
        return False
    finally:
        client.close()


def openai_ready(base_url: str) -> bool:
    """Whether the OpenAI-compatible endpoint at ``base_url`` (``http://HOST:PORT/v1``) lists the ensemble."""
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=10) as response:
            models = json.loads(response.read())
    except (OSError, json.JSONDecodeError):  # urllib.error.URLError is an OSError
        return False
    return isinstance(models, dict) and any(
        isinstance(m, dict) and m.get("id") == DEFAULT_MODEL for m in models.get("data") or ())


def openai_endpoint(host: str, port: int) -> str:
    """The OpenAI-compatible endpoint's base URL on ``host:port`` (``""``: port 0, off)."""
    return f"http://{host}:{port}/v1" if port else ""


def gauges(metrics_url: str) -> dict[str, float]:
    """The leak gauges from Triton's Prometheus endpoint (summed over their series)."""
    values: dict[str, float] = {}
    for (name, _), v in scrape(metrics_url).items():
        if name in GAUGES:
            values[name] = values.get(name, 0.0) + v
    return values


def settle(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until every leak gauge reads 0 (or the timeout); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = gauges(metrics_url)
        if all(values.get(g, 0.0) == 0.0 for g in GAUGES) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def locust_command(host: str, out: Path, users: int, run_time: str, shape: str, *, tags: Sequence[str] = (),
                   max_tokens: int = 96, sample: int = 12, data_dir: str | None = None,
                   max_requests: int = 0, openai_url: str = "", min_per_kind: int = 0,
                   deadline: str = DEADLINE) -> list[str]:
    """The headless locust command line of one run (``openai_url``: also the ``openai`` task, against it).

    ``min_per_kind``: the run ends on counts, once every kind in the mix has
    ended that many requests (``run_time`` is then the least run time,
    ``deadline`` the most, which only a hang reaches; give :func:`run` the
    :func:`exit_deadline` of ``deadline``).  ``max_requests``: it stops after
    that many requests in all, whichever comes first.
    """
    cmd = [
        sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless",
        "--host", host, "-u", str(users), "-r", str(users), "-t", run_time, "--shape", shape,
        "--stop-timeout", str(STOP_TIMEOUT_S), "--only-summary",
        "--csv", str(out / "run"), "--csv-full-history", "--html", str(out / "report.html"),
        "--json-file", str(out / "run"),
        "--outputs-json", str(out / "outputs.json"), "--max-tokens", str(max_tokens), "--sample", str(sample),
        "--max-requests", str(max_requests),
    ]  # fmt: skip
    if data_dir is not None:
        cmd += ["--data-dir", data_dir]
    if openai_url:
        cmd += ["--openai-url", openai_url]
    if tags:
        cmd += ["--tags", *tags]
    if min_per_kind:
        cmd += ["--min-per-kind", str(min_per_kind), "--deadline", deadline]
    return cmd


def exit_deadline(run_time: str) -> float:
    """Seconds locust gets to exit: run time (``30s``, ``2m``, ``1h``) plus stop timeout plus overhead."""
    units = {"s": 1, "m": 60, "h": 3600}
    seconds = float(run_time[:-1]) * units[run_time[-1]] if run_time[-1] in units else float(run_time)
    return seconds + STOP_TIMEOUT_S + LOCUST_OVERHEAD_S


#: Seconds locust gets to exit once it has written its final report.
EXIT_AFTER_REPORT_S: Final = 20.0


def _run_locust(cmd: Sequence[str], report: Path, timeout_s: float) -> int:
    """Run locust; its exit status, or the verdict of its reports when it hangs at exit.

    Locust sometimes never exits after logging "Shutting down (exit code 0)"
    and writing every report (3 of 8 smoke runs on 2026-12-01, once before):
    interpreter teardown blocks on a gRPC stream thread.  Once the final
    report exists, it gets ``EXIT_AFTER_REPORT_S`` to exit; then it is killed
    and the run is judged from the report (any failed request fails it), so
    the hang costs seconds, not the whole deadline, and is said on stderr.
    """
    started = time.time()
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(cmd, cwd=REPO)
    written: float | None = None
    while (code := proc.poll()) is None:
        now = time.monotonic()
        if written is None and report.is_file() and report.stat().st_mtime >= started:
            written = now
        if now > deadline or (written is not None and now - written > EXIT_AFTER_REPORT_S):
            proc.kill()
            proc.wait()
            if written is None:
                print(f"loadtest: locust did not exit within {timeout_s:.0f} s; killed", file=sys.stderr)
                return 1
            failures = sum(int(entry["num_failures"]) for entry in json.loads(report.read_text()))
            print(f"loadtest: locust hung at exit {EXIT_AFTER_REPORT_S:.0f} s after writing its reports; killed, "
                  f"judged from {report.name}: {failures} failed requests", file=sys.stderr)
            return 1 if failures else 0
        time.sleep(0.5)
    return code


def run(host: str, metrics_url: str, out: Path, cmd: Sequence[str], timeout_s: float, openai_url: str = "") -> int:
    """Run locust, then the post-run checks and the summary; returns the exit status.

    Locust must exit within ``timeout_s`` (:func:`exit_deadline`): once it
    hung at exit after the server behind it died mid-stream; a load
    generator that hangs is killed and the run fails.  ``openai_url``: the
    OpenAI-compatible endpoint must answer before and after the run too.
    """
    out.mkdir(parents=True, exist_ok=True)
    if openai_url and not openai_ready(openai_url):
        print(f"loadtest: no OpenAI-compatible endpoint serving {DEFAULT_MODEL} on {openai_url} (start the server "
              "with --openai-port, or run without it)", file=sys.stderr)
        return 1
    status = _run_locust(cmd, out / "run.json", timeout_s)
    if not ready(host):
        print("loadtest: the server is not ready after the run", file=sys.stderr)
        status = status or 1
    if openai_url and not openai_ready(openai_url):
        print(f"loadtest: the OpenAI-compatible endpoint on {openai_url} is not ready after the run", file=sys.stderr)
        status = status or 1
    left = settle(metrics_url)
    if any(left.get(g, 0.0) for g in GAUGES):
        print(f"loadtest: leak gauges did not return to 0: {left}", file=sys.stderr)
        status = status or 1
    else:
        print(f"loadtest: server ready, {' and '.join(GAUGES)} back to 0")
    summary.main([str(out / "run"), "--outputs-json", str(out / "outputs.json"), "--json",
                  str(out / "summary.json"), "--png", str(out / "summary.png"), "--itl-bound-ms", "250"])
    print(f"loadtest: reports in {out} (report.html, summary.png); locust exit status {status}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """``make loadtest``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--openai-port", type=int, default=0,
                        help="also run the openai task against the OpenAI-compatible endpoint on this port; 0: off")
    parser.add_argument("--repository", type=Path, default=REPO / "build" / "model_repository")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "loadtest")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--time", default="60s")
    parser.add_argument("--shape", default="steady", choices=("steady", "ramp", "spike"))
    parser.add_argument("--tags", nargs="*", default=())
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--sample", type=int, default=12)
    parser.add_argument("--min-per-kind", type=int, default=0,
                        help="end on counts: run past --time (the least run time) until every kind in the mix has "
                             "ended this many requests, whatever their outcome; 0: end at --time")
    parser.add_argument("--deadline", default=DEADLINE,
                        help=f"with --min-per-kind: the most run time (30s, 15m, 1h; default {DEADLINE}), which "
                             "only a hang reaches")
    args = parser.parse_args(argv)
    host = f"{args.host}:{args.grpc_port}"
    metrics_url = f"http://{args.host}:{args.metrics_port}/metrics"
    url = openai_endpoint(args.host, args.openai_port)
    cmd = locust_command(host, args.out, args.users, args.time, args.shape, tags=args.tags,
                         max_tokens=args.max_tokens, sample=args.sample, openai_url=url,
                         min_per_kind=args.min_per_kind, deadline=args.deadline)
    timeout_s = exit_deadline(args.deadline if args.min_per_kind else args.time)
    if ready(host):
        print(f"loadtest: using the server on {host}")
        return run(host, metrics_url, args.out, cmd, timeout_s, url)
    print(f"loadtest: no server on {host}; starting the embedded default")
    server = TritonServer(ServerConfig(
        model_repository=args.repository, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
        metrics_port=args.metrics_port, models=(DEFAULT_MODEL,), log_file=args.out / "tritonserver.log",
        openai_port=args.openai_port or None))
    args.out.mkdir(parents=True, exist_ok=True)
    server.start()
    try:
        server.wait_ready()
        return run(host, metrics_url, args.out, cmd, timeout_s, url)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
