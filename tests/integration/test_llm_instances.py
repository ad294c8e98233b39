"""Deployment knobs of the ``llm`` model, served: two instances (LLM_INSTANCES=2) and STREAM_INTERVAL_MS=400.

Two ``llm`` instances share one ``grammar`` model: their sequence ids never clash.

Each instance is its own stub process with its own scheduler, and each
scheduler draws random 64-bit grammar sequence ids, so both can start, step
and end sequences in the one grammar table concurrently.  A clash would fail
a request with ALREADY_EXISTS (``sequence N: already started``).

STREAM_INTERVAL_MS=400: after the first, a stream gets at most one response
per 400 ms (the last one carries what is left), and the deltas still add up
to the output.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bench.e2e_bench import parse_step_stats
from client import Client, Constraint
from deploy.server import TritonServer
from tests.integration.served import start_ensemble, wait_active_zero

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

INTERVAL_MS = 400
RECORD = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["code", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, Path]]:
    tmp = tmp_path_factory.mktemp("instances")
    srv = start_ensemble(tmp, values={"LLM_INSTANCES": "2", "TORCH_THREADS": "1",
                                      "STREAM_INTERVAL_MS": str(INTERVAL_MS)})
    try:
        yield srv, tmp / "tritonserver.log"
    finally:
        srv.stop()


def test_stream_interval_coalesces_deltas_by_time(two_instances: tuple[TritonServer, Path]) -> None:
    server, _ = two_instances
    with Client(server.grpc_url) as c:
        t0 = time.monotonic()
        chunks = list(c.stream("Count from one to twenty.", max_tokens=40, temperature=0.0, require_complete=False))
        elapsed = time.monotonic() - t0
    result = chunks[-1].result
    assert result is not None
    tokens = result.usage.completion_tokens
    deltas = [ch.text for ch in chunks if ch.text]
    assert "".join(deltas) == result.text
    assert tokens >= 12
    # The first delta at once, then at most one per interval, and what is left on the last one.  The bound
    # grows with the time the stream took, so a slower machine only loosens it; where the tokens outnumber
    # it (~70 ms per token here: 40 tokens, ~9 responses) the deltas are coalesced.
    assert len(deltas) <= min(tokens, math.floor(elapsed * 1000 / INTERVAL_MS) + 2)


def test_two_llm_instances_share_the_grammar_model(two_instances: tuple[TritonServer, Path]) -> None:
    server, log = two_instances
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            with Client(server.grpc_url) as c:
                for k in range(2):
                    out = c.generate(f"Record number {i * 2 + k} as JSON.", constraint=Constraint.json_schema(RECORD),
                                     max_tokens=32, temperature=0.8, seed=i * 2 + k, require_complete=False)
                    with lock:
                        results.append(out)
        except BaseException as err:  # noqa: BLE001 -- re-raised by the main thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == 12
    for out in results:
        assert out.finish_reason in ("stop", "length") and out.error is None, out
        jsonschema.Draft202012Validator(RECORD).validate(json.loads(out.text))
    assert wait_active_zero(server) == 0  # every sequence of both instances was ended

    server.stop()  # each llm instance logs its step stats when it finalizes
    stats = parse_step_stats(log.read_text(encoding="utf-8", errors="replace"))
    assert len(stats) == 2
    assert all(st["steps"] > 0 for st in stats), stats  # both instances decoded
