"""Helpers for integration tests against the served ensemble (a real tritonserver behind the gateway)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from deploy.drain import scrape
from deploy.render import load_values, render_repository
from deploy.server import ServerConfig, TritonServer
from loadtest.run import ready
from tests.support import assets

REPO = Path(__file__).resolve().parents[2]


def start_ensemble(tmp: Path, values: dict[str, str] | None = None, **fields: Any) -> TritonServer:
    """Render the repository for the default model and start a ready server (gateway included).

    ``values`` override entries of ``deploy/values.json``; ``fields`` go to :class:`ServerConfig`.
    Without a ``MODEL_DIR`` among ``values`` it serves SmolLM2 (:func:`tests.support.assets.smollm2_dir`:
    the calling test skips where it is missing, or fails under ``REQUIRE_ASSETS=1``).
    """
    rendered = load_values(REPO / "deploy" / "values.json")
    values = values or {}
    if "MODEL_DIR" not in values:
        rendered["MODEL_DIR"] = str(assets.smollm2_dir())
    rendered.update(values)
    render_repository(REPO / "model_repository", tmp / "repo", rendered)
    fields.setdefault("log_file", tmp / "tritonserver.log")
    server = TritonServer(ServerConfig(model_repository=tmp / "repo", models=("constrained_llm", "grammar"),
                                       **fields))
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def grammar_stats(server: TritonServer) -> dict[str, Any]:
    """The grammar model's counters (its `stats` op, over gRPC streaming).

    `grammar` is internal: only tritonserver's own endpoint behind the gateway,
    with the secret, reaches it.
    """
    results: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        results.append(error if error is not None else result)
        done.set()

    c = grpcclient.InferenceServerClient(server.internal_grpc_url)
    op = grpcclient.InferInput("OP", [1], "BYTES")
    op.set_data_from_numpy(np.array([b"stats"], np.object_))
    ids = grpcclient.InferInput("SEQUENCE_ID", [0], "UINT64")
    ids.set_data_from_numpy(np.zeros(0, np.uint64))
    c.start_stream(callback, headers=server.internal_headers)
    try:
        c.async_stream_infer("grammar", [op, ids])
        assert done.wait(30)
    finally:
        c.stop_stream()
        c.close()
    return json.loads(results[0].as_numpy("STATS")[0])  # type: ignore[no-any-return]


def grammar_active(server: TritonServer) -> int:
    """The grammar model's active-sequence count."""
    return int(grammar_stats(server)["active"])


def metric(server: TritonServer, name: str) -> float:
    """An unlabelled gauge or counter from Triton's Prometheus endpoint."""
    series = [v for (n, _), v in scrape(server.metrics_url).items() if n == name]
    assert len(series) == 1, f"{name} not exported once: {series}"
    return series[0]


def wait_freed(server: TritonServer, timeout_s: float = 20.0) -> tuple[int, float]:
    """``grammar_active_sequences`` and ``llm_live_requests`` once both are 0, or as they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        active, live = grammar_active(server), metric(server, "llm_live_requests")
        if (active == 0 and live == 0) or time.monotonic() > deadline:
            return active, live
        time.sleep(0.2)


def wait_active_zero(server: TritonServer, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    active = grammar_active(server)
    while active and time.monotonic() < deadline:
        time.sleep(0.2)
        active = grammar_active(server)
    return active


def gateway_ready(server: TritonServer) -> bool:
    """Readiness as clients see it: the gateway's ServerReady and ModelReady of the ensemble."""
    return ready(server.grpc_url)
