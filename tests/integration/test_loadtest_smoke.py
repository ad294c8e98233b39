"""CI smoke run of the load test: locust over real gRPC against the served ensemble, bounded to ~1.5 minutes.

Every kind of task (constrained JSON from the project's schemas and a MaskBench
sample, unconstrained, regex, choice, cold schemas, bad inputs) under a spike
shape; zero unexpected failures (every output is checked by
``loadtest.workload.judge``), the server ready afterwards, and its
``grammar_active_sequences`` and ``llm_live_requests`` gauges back to 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.server import TritonServer
from loadtest.run import exit_deadline, locust_command, run

pytestmark = [pytest.mark.triton, pytest.mark.e2e]


def test_loadtest_smoke(server: TritonServer, tmp_path: Path) -> None:
    cmd = locust_command(server.grpc_url, tmp_path, users=4, run_time="45s", shape="spike", max_tokens=64,
                         sample=4, max_requests=60)
    assert run(server.grpc_url, server.metrics_url, tmp_path, cmd, exit_deadline("45s")) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    kinds = summary["kinds"]
    assert kinds["constrained"]["requests"] > 0 and kinds["unconstrained"]["requests"] > 0
    assert all(figures.get("failures", 0) == 0 for figures in kinds.values()), kinds
    assert (tmp_path / "report.html").is_file() and (tmp_path / "summary.png").stat().st_size > 0
