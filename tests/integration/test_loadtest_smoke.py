"""CI smoke run of the load test: locust over real gRPC against the served ensemble, bounded to ~1.5 minutes.

Every kind of task (constrained JSON from the project's schemas and a MaskBench
sample, unconstrained, regex, choice, cold schemas, bad inputs, and strict JSON
through the OpenAI-compatible endpoint with the ``openai`` package) under a
spike shape; zero unexpected failures (every output is checked by
``loadtest.workload.judge`` / ``judge_chat``), the server and its endpoint ready
afterwards, and its ``grammar_active_sequences`` and ``llm_live_requests``
gauges back to 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.server import TritonServer
from loadtest.run import exit_deadline, locust_command, run
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
    cmd = locust_command(server.grpc_url, tmp_path, users=4, run_time="45s", shape="spike", max_tokens=64,
                         sample=4, max_requests=60, openai_url=url)
    assert run(server.grpc_url, server.metrics_url, tmp_path, cmd, exit_deadline("45s"), url) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    kinds = summary["kinds"]
    # The first user queues every kind, heaviest first, before the weighted draw: the three main kinds always run
    # (all seven do on an idle host; a loaded one may end the 45 s before the light ones).
    ran = {kind for kind, figures in kinds.items() if figures["requests"] > 0}
    assert {"constrained", "unconstrained", "openai"} <= ran <= set(KINDS), kinds
    assert all(figures.get("failures", 0) == 0 for figures in kinds.values()), kinds
    assert (tmp_path / "report.html").is_file() and (tmp_path / "summary.png").stat().st_size > 0
