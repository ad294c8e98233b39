"""CI smoke run of the load test: locust over real gRPC against the served ensemble, ended by counts, not time.

Every kind of task (constrained JSON from the project's schemas and a MaskBench
sample, unconstrained, regex, choice, cold schemas, bad inputs, and strict JSON
through the OpenAI-compatible endpoint with the ``openai`` package) under a
spike shape; zero unexpected failures (every output is checked by
``loadtest.workload.judge`` / ``judge_chat``), the server and its endpoint ready
afterwards, and its ``grammar_active_sequences`` and ``llm_live_requests``
gauges back to 0.

The run ends once every kind has ended a request (``--min-per-kind``), at
the earliest after the spike's 20 s (its burst included), so a loaded host
runs longer instead of leaving kinds out; ``loadtest.run.DEADLINE`` (15
minutes) only bounds a hang.  About 20 s of locust on an idle 2-core host,
7.5 minutes on one with a load average of 6.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.server import TritonServer
from loadtest.run import DEADLINE, exit_deadline, locust_command, run
from tests.integration.served import start_ensemble

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

#: Every task of the locustfile, by the kind its entries are named after.
KINDS = ("constrained", "unconstrained", "regex", "choice", "cold", "bad", "openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """The served ensemble with its OpenAI-compatible endpoint on a free port."""
    srv = start_ensemble(tmp_path_factory.mktemp("served"), openai_port=0)
    try:
        yield srv
    finally:
        srv.stop()


def test_loadtest_smoke(server: TritonServer, tmp_path: Path) -> None:
    assert server.openai is not None
    url = server.openai.url
    cmd = locust_command(server.grpc_url, tmp_path, users=4, run_time="20s", shape="spike", max_tokens=64,
                         sample=4, openai_url=url, min_per_kind=1, deadline=DEADLINE)
    assert run(server.grpc_url, server.metrics_url, tmp_path, cmd, exit_deadline(DEADLINE), url) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    kinds = summary["kinds"]
    # The run ended on counts: every kind ran, however slow the host.
    ran = {kind for kind, figures in kinds.items() if figures["requests"] > 0}
    assert ran == set(KINDS), kinds
    assert all(figures.get("failures", 0) == 0 for figures in kinds.values()), kinds
    assert (tmp_path / "report.html").is_file() and (tmp_path / "summary.png").stat().st_size > 0
