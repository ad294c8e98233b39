"""Helpers for integration tests against the served ensemble (a real tritonserver behind the gateway)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from client import Client, Constraint
from deploy.drain import scrape
from deploy.render import load_values, render_repository
from deploy.server import ServerConfig, TritonServer
from loadtest.run import ready
from tests.support import assets
from tests.support.poll import HANG_S, poll, wait_for

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


_TRITON_DTYPES = {np.dtype(np.uint64): "UINT64", np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL",
                  np.dtype(np.object_): "BYTES"}


def grammar_call(server: TritonServer, inputs: dict[str, np.ndarray], outputs: tuple[str, ...] = ()) -> Any:
    """One request to the grammar model over gRPC streaming (it is decoupled); its result, or its error raised.

    `grammar` is internal: only tritonserver's own endpoint behind the gateway,
    with the secret, reaches it.
    """
    results: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        results.append(error if error is not None else result)
        done.set()

    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), _TRITON_DTYPES[value.dtype])
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    c = grpcclient.InferenceServerClient(server.internal_grpc_url)
    c.start_stream(callback, headers=server.internal_headers)
    try:
        c.async_stream_infer("grammar", tensors,
                             outputs=[grpcclient.InferRequestedOutput(o) for o in outputs] or None)
        assert done.wait(HANG_S)
    finally:
        c.stop_stream()
        c.close()
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


def grammar_stats(server: TritonServer) -> dict[str, Any]:
    """The grammar model's counters (its `stats` op)."""
    result = grammar_call(server, {"OP": np.array([b"stats"], np.object_), "SEQUENCE_ID": np.zeros(0, np.uint64)})
    return json.loads(result.as_numpy("STATS")[0])  # type: ignore[no-any-return]


def grammar_active(server: TritonServer) -> int:
    """The grammar model's active-sequence count."""
    return int(grammar_stats(server)["active"])


def metric(server: TritonServer, name: str) -> float:
    """An unlabelled gauge or counter from Triton's Prometheus endpoint."""
    series = [v for (n, _), v in scrape(server.metrics_url).items() if n == name]
    assert len(series) == 1, f"{name} not exported once: {series}"
    return series[0]


def wait_freed(server: TritonServer, timeout_s: float = HANG_S) -> tuple[int, float]:
    """``grammar_active_sequences`` and ``llm_live_requests`` once both are 0, or as they are after ``timeout_s``."""
    return poll(lambda: (grammar_active(server), metric(server, "llm_live_requests")), lambda v: v == (0, 0.0),
                timeout_s)


def wait_active_zero(server: TritonServer, timeout_s: float = HANG_S) -> int:
    """The grammar model's active-sequence count once it is 0, or as it is after ``timeout_s``."""
    return poll(lambda: grammar_active(server), lambda active: active == 0, timeout_s)


#: Outputs that reached postprocessing, whatever their finish reason (a cancelled request never does).
OUTPUTS = "constrained_llm_outputs_total"
#: A regex SmolLM2-135M cannot finish within 1,000 tokens: no token of its vocabulary holds both a
#: letter and a newline, so 600 "letter, newline" pairs take 1,200 tokens.  Use it with
#: on_repeat "continue" (a loop on one letter is not closed either): only a cancel ends it early.
NEVER_ENDS = r"([a-z]\n){600}"


def counter_sum(metrics_url: str, name: str) -> float:
    """The sum of every series of ``name`` (all label sets) on a Prometheus endpoint; 0 when none is exported."""
    return sum(v for (n, _), v in scrape(metrics_url).items() if n == name)


def sequences_freed(server: TritonServer) -> bool:
    """No sequence left: the grammar model's own count and both per-sequence gauges read 0."""
    return (grammar_active(server), metric(server, "grammar_active_sequences"),
            metric(server, "llm_live_requests")) == (0, 0.0, 0.0)


def assert_cancelled(server: TritonServer, outputs_before: float) -> None:
    """A departed request was cancelled inside the server, not decoded to its end.

    ``outputs_before`` is :data:`OUTPUTS` read before the request started.  Once
    every sequence is freed, one short request runs to its end: the counter
    grows by exactly that one (a request that ended by itself, even at
    max_tokens, was counted before its sequence was freed, so before this one).
    """
    wait_for(lambda: sequences_freed(server), HANG_S, "sequences freed after the client left")
    with Client(server.grpc_url) as sdk:
        assert sdk.generate("Pick one.", constraint=Constraint.choice(["yes", "no"]), max_tokens=5).complete
    assert counter_sum(server.metrics_url, OUTPUTS) == outputs_before + 1


def gateway_ready(server: TritonServer) -> bool:
    """Readiness as clients see it: the gateway's ServerReady and ModelReady of the ensemble."""
    return ready(server.grpc_url)
