"""``python -m deploy`` as the containers run it: probe endpoints, SIGTERM after a drain, Triton's log on stdout.

The container entrypoint (deploy/docker/entrypoint.sh) starts exactly this
command with ``--health-port 8003``; the Kubernetes probes read those paths
and the preStop hook runs ``python -m deploy.drain``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deploy.drain import drain
from deploy.render import load_values, render_repository
from tests.integration.served import REPO
from tests.support import assets

pytestmark = [pytest.mark.triton, pytest.mark.e2e]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_launcher_serves_probes_drains_and_stops_on_sigterm(tmp_path: Path) -> None:
    values = load_values(REPO / "deploy" / "values.json")
    values["MODEL_DIR"] = str(assets.smollm2_dir())
    render_repository(REPO / "model_repository", tmp_path / "repo", values)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy", "--model-repository", str(tmp_path / "repo"),
         "--model", "constrained_llm", "--health-port", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines: list[str] = []
        health = metrics = None
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        while (health is None or metrics is None) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "launcher exited: " + "".join(lines)
            lines.append(line)
            if m := re.search(r"metrics=(\S+)", line):
                metrics = m.group(1)
            if m := re.search(r"health: (http://\S+)/v2/health/ready", line):
                health = m.group(1)
        assert health is not None and metrics is not None, "".join(lines)
        # Keep reading: a full pipe would block the launcher's log copy, then Triton.
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        assert status(f"{health}/v2/health/live") == 200
        assert status(f"{health}/v2/health/ready") == 200
        assert drain(metrics, settle_s=0, timeout_s=10, log=lambda _: None) == 0  # the preStop hook
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        reader.join(30)
        # Triton's own log is on the launcher's stdout (a container's log), tagged,
        # with the launcher's lines; no file was asked for.
        output = "".join(lines)
        assert re.search(r'^triton: .*"Started GRPCInferenceService at 127\.0\.0\.1:\d+"$', output, re.MULTILINE), output
        assert re.search(r"^server: ready: grpc=", output, re.MULTILINE), output
        assert "log to stdout ('triton:' lines)\n" in output, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
