"""What a hostile or careless client can do over real gRPC, and what it gets.

One served ensemble (real tritonserver 2.51 behind the gateway, SmolLM2-135M,
xgrammar) for the module.  Raw ``tritonclient`` streams bypass the SDK on
purpose: they send the ``triton_grpc_error`` header, call internal models,
cancel mid-stream, and die without closing.  Every bad request must get its
exact status, the server must stay up and ready, and every sequence and batch
slot must be freed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client import Client, Constraint
from client.errors import InvalidConstraint
from deploy.server import TritonServer
from tests.integration.served import (
    NEVER_ENDS,
    OUTPUTS,
    REPO,
    assert_cancelled,
    counter_sum,
    gateway_ready,
    grammar_active,
    sequences_freed,
)
from tests.support.poll import wait_for
from tests.support.procs import group_processes

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

Event = tuple[grpcclient.InferResult | None, InferenceServerException | None]


def _tensor(name: str, datatype: str, values: Any) -> grpcclient.InferInput:
    array = np.asarray(values, dtype=np.object_ if datatype == "BYTES" else None)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _prompt(text: bytes = b"Say hi.") -> grpcclient.InferInput:
    return _tensor("PROMPT", "BYTES", [text])


def _ints(name: str, value: int) -> grpcclient.InferInput:
    return _tensor(name, "INT32", np.array([value], np.int32))


def raw_call(url: str, model: str, inputs: list[grpcclient.InferInput], *, header: bool = True,
             timeout_s: float = 60.0) -> tuple[dict[str, Any] | None, str | None]:
    """One request on its own raw stream (with ``triton_grpc_error`` unless told), closed afterwards.

    Returns ``(RESULT, None)`` for a final RESULT or ``(None, error message)`` for an error.
    """
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)),
                        headers={"triton_grpc_error": "true"} if header else None)
    try:
        try:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        except InferenceServerException:
            pass  # the stream failed before the request went out (e.g. refused at open): its error is in the callback
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = events.get(timeout=max(0.0, deadline - time.monotonic()))
            if error is not None:
                return None, error.message()
            assert result is not None
            text = result.as_numpy("RESULT")
            if text is not None and text.reshape(-1)[0]:
                return json.loads(text.reshape(-1)[0]), None
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None, "final response without RESULT"
    finally:
        client.stop_stream()
        client.close()


GRAMMAR_START = [
    _tensor("OP", "BYTES", [b"start"]),
    _tensor("SEQUENCE_ID", "UINT64", np.array([12345], np.uint64)),
    _tensor("GRAMMAR_TYPE", "BYTES", [b"regex"]),
    _tensor("GRAMMAR", "BYTES", [b"(a"]),
]
CONSTRAINED_LLM = "constrained_llm"


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """Two busy processes: the 2.51 race shows under CPU load (0 crashes in 800 on an idle machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: sum(i * i for i in range(10_000))"])
             for _ in range(2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_rejected_requests_on_error_header_streams_do_not_crash_the_server(
    server: TritonServer, cpu_load: None
) -> None:
    """Regression: without the gateway this cycle killed tritonserver 2.51 after 59 requests (signal 11,
    after `HandleCancellation called even when the context was not cancelled`), under the same load."""
    url = server.grpc_url
    for _ in range(40):
        result, error = raw_call(url, CONSTRAINED_LLM, [_prompt(), _ints("MAX_TOKENS", 0)])
        assert error is None and result is not None
        assert (result["finish_reason"], result["status"], result["error"]) == (
            "error", "INVALID_ARGUMENT", "max_tokens: must be in 1..1024, got 0")
        result, error = raw_call(url, CONSTRAINED_LLM, [
            _prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"regex"]), _tensor("GRAMMAR", "BYTES", [b"(a"]),
            _ints("MAX_TOKENS", 5)])
        assert result is not None and (result["finish_reason"], result["status"]) == ("error", "INVALID_ARGUMENT")
        assert result["error"].startswith("grammar: xgrammar cannot compile this regex")
        result, error = raw_call(url, "grammar", GRAMMAR_START)
        assert result is None and error == (
            "PERMISSION_DENIED: model 'grammar' is not served to clients; call constrained_llm")
        assert server.is_running()
    assert "Signal (11)" not in server.log_tail(200_000)
    assert "HandleCancellation called even when" not in server.log_tail(200_000)


DEEP = ("[" * 10_000 + "]" * 10_000).encode()

BAD_INPUTS = [
    # (inputs, exact status, exact message or prefix)
    ([_prompt(), _ints("MAX_TOKENS", 0)], "INVALID_ARGUMENT", "max_tokens: must be in 1..1024, got 0"),
    ([_prompt(), _tensor("TEMPERATURE", "FP32", np.array([5.0], np.float32))], "INVALID_ARGUMENT",
     "temperature: must be a number in 0..2, got 5.0"),
    ([_prompt(), _tensor("REPETITION_PENALTY", "FP32", np.array([0.0], np.float32))], "INVALID_ARGUMENT",
     "repetition_penalty: must be a number in (0, 2] (1 = off), got 0.0"),
    ([_prompt(), _tensor("MIN_P", "FP32", np.array([-1.0], np.float32))], "INVALID_ARGUMENT",
     "min_p: must be a number in 0..1 (0 = off), got -1.0"),
    ([_prompt(), _ints("DRAFT_TOKENS", 17)], "INVALID_ARGUMENT",
     "draft_tokens: must be null (the server's default) or an integer in 0..16, got 17"),
    ([_prompt(), _ints("DRAFT_TOKENS", 4), _tensor("FREQUENCY_PENALTY", "FP32", np.array([0.5], np.float32))],
     "INVALID_ARGUMENT", ("draft_tokens: prompt-lookup speculation cannot be combined with a repetition, frequency "
                          "or presence penalty")),
    ([_prompt(b"\xff\xfe")], "INVALID_ARGUMENT", "prompt: not valid UTF-8 at byte 0"),
    ([_prompt(b"   ")], "INVALID_ARGUMENT", "prompt: is empty"),
    ([_tensor("MESSAGES", "BYTES", [b'[{"role":"user","content":"\\ud800"}]'])], "INVALID_ARGUMENT",
     "messages[0].content: contains an unpaired surrogate (\\ud800) at character 0"),
    ([_tensor("MESSAGES", "BYTES", [DEEP])], "INVALID_ARGUMENT",
     "messages: nested too deeply (expected an array of {role, content})"),
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"cobol"]), _tensor("GRAMMAR", "BYTES", [b"x"])],
     "INVALID_ARGUMENT", "grammar_type: "),
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"json_schema"]), _tensor("GRAMMAR", "BYTES", [b"{nope"])],
     "INVALID_ARGUMENT", "grammar: invalid JSON at line 1 column 2"),
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"json_schema"]),
      _tensor("GRAMMAR", "BYTES", [b'{"type":"string","const":"\\ud800"}'])],
     "INVALID_ARGUMENT", "grammar: contains an unpaired surrogate escape (\\ud800)"),
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"json_schema"]),
      _tensor("GRAMMAR", "BYTES", [json.dumps({"type": "object", "properties": {
          "a": {"$ref": "https://example.com/remote.json"}}}).encode()])],
     "INVALID_ARGUMENT", "grammar#/properties/a/$ref: cannot resolve 'https://example.com/remote.json'"),
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"json_schema"]),
      _tensor("GRAMMAR_OPTIONS", "BYTES", [b'{"colour":"red"}']), _tensor("GRAMMAR", "BYTES", [b"{}"])],
     "INVALID_ARGUMENT", "grammar_options.colour: "),
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"regex"]), _tensor("GRAMMAR", "BYTES", [b"(a"])],
     "INVALID_ARGUMENT", "grammar: xgrammar cannot compile this regex"),
    # Killed the grammar stub before keys were bounded (xgrammar's recursive key trie; 60,000 characters did too).
    ([_prompt(), _tensor("GRAMMAR_TYPE", "BYTES", [b"json_schema"]), _tensor("GRAMMAR", "BYTES", [json.dumps(
        {"type": "object", "properties": {"k" * 70_000: {"type": "string"}}}).encode()])],
     "INVALID_ARGUMENT", "grammar#/properties/" + "k" * 40 + ": key is 70000 characters; the limit is 1024"),
]


@pytest.mark.parametrize(("inputs", "status", "message"), BAD_INPUTS)
def test_bad_input_gets_its_exact_status_as_data(server: TritonServer, inputs: list[grpcclient.InferInput],
                                                 status: str, message: str) -> None:
    result, error = raw_call(server.grpc_url, CONSTRAINED_LLM, inputs)
    assert error is None and result is not None
    assert (result["finish_reason"], result["complete"], result["status"]) == ("error", False, status)
    assert result["error"].startswith(message), result["error"]


@pytest.mark.parametrize(
    ("model", "inputs", "message"),
    [
        # Checked by the gateway against the model's config (tritonserver's own answers carry no status).
        (CONSTRAINED_LLM, [_prompt(), _tensor("MAX_TOKENS", "FP32", np.array([3.0], np.float32))],
         "INVALID_ARGUMENT: input 'MAX_TOKENS': datatype FP32, expected INT32"),
        (CONSTRAINED_LLM, [_prompt(), _ints("NOT_AN_INPUT", 1)],
         ("INVALID_ARGUMENT: input 'NOT_AN_INPUT': not an input of constrained_llm; expected one of "
          "DRAFT_TOKENS, FREQUENCY_PENALTY, GRAMMAR, ")),
        (CONSTRAINED_LLM, [_tensor("PROMPT", "BYTES", [[b"a", b"b"]])],
         "INVALID_ARGUMENT: input 'PROMPT': shape [1, 2], expected [1] (-1: any size)"),
        (CONSTRAINED_LLM, [_prompt(), _prompt()], "INVALID_ARGUMENT: input 'PROMPT': given more than once"),
        ("grammar", GRAMMAR_START, "PERMISSION_DENIED: model 'grammar' is not served to clients"),
        ("llm", [_tensor("CANCEL", "BYTES", [b"req-1"])], "PERMISSION_DENIED: model 'llm' is not served to clients"),
        ("preprocessing", [_prompt()], "PERMISSION_DENIED: model 'preprocessing' is not served to clients"),
    ],
)
def test_malformed_and_internal_calls_get_in_band_errors(server: TritonServer, model: str,
                                                         inputs: list[grpcclient.InferInput], message: str) -> None:
    result, error = raw_call(server.grpc_url, model, inputs)
    assert result is None and error is not None and message in error, error


def test_internal_models_and_control_apis_are_not_reachable(server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for call in (lambda: client.is_model_ready("grammar"), lambda: client.get_model_config("llm"),
                     lambda: client.load_model("grammar"), lambda: client.get_log_settings()):
            with pytest.raises(InferenceServerException) as info:
                call()
            assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        assert client.is_server_ready() and client.is_model_ready(CONSTRAINED_LLM)
    finally:
        client.close()
    # tritonserver's own endpoint (loopback, behind the gateway) refuses inference without the secret.
    result, error = raw_call(server.internal_grpc_url, "grammar", GRAMMAR_START, header=False)
    assert result is None and error is not None and "This protocol is restricted" in error
    # HTTP inference (generate_stream included) is restricted the same way; health stays open.
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{CONSTRAINED_LLM}/generate_stream",
                                     data=b'{"PROMPT":"hi"}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as http_info:
        urllib.request.urlopen(request, timeout=10)
    assert http_info.value.code == 403
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=10) as resp:
        assert resp.status == 200


def test_sdk_raises_typed_errors_from_data(server: TritonServer) -> None:
    with Client(server.grpc_url) as sdk:
        with pytest.raises(InvalidConstraint, match=r"^grammar#/properties/a/\$ref: cannot resolve") as info:
            sdk.generate("x", constraint=Constraint.json_schema(
                {"type": "object", "properties": {"a": {"$ref": "https://example.com/x.json"}}}), max_tokens=5)
        assert info.value.status == "INVALID_ARGUMENT"


# ------------------------------------------------------------------ leaving frees everything
# A stream that cannot end on its own within max_tokens (NEVER_ENDS): only a cancel ends it early.
LONG = {"prompt": "Write one letter per line.", "regex": NEVER_ENDS, "max_tokens": 1000,
        "options": '{"on_repeat": "continue"}'}

# A client in its own process: starts a long constrained stream, reports the first
# token, then waits to be killed (or cancels / times out itself, by mode).  Its
# deadline (8 s) must pass after its first token and before its 1,000th: the one
# window here, a first token in well under a second and ~70 ms per token after.
CHILD = textwrap.dedent("""
    import sys, time, queue, numpy as np, tritonclient.grpc as g
    url, mode = sys.argv[1], sys.argv[2]
    q = queue.SimpleQueue()
    c = g.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: q.put((result, error)),
                   stream_timeout=8.0 if mode == "deadline" else None)
    def t(n, d, v):
        x = g.InferInput(n, [1], d); x.set_data_from_numpy(np.array([v], dtype=object if d == "BYTES" else "int32"))
        return x
    c.async_stream_infer("constrained_llm", [t("PROMPT", "BYTES", {prompt!r}.encode()),
        t("GRAMMAR_TYPE", "BYTES", b"regex"), t("GRAMMAR", "BYTES", {regex!r}.encode()),
        t("GRAMMAR_OPTIONS", "BYTES", {options!r}.encode()), t("MAX_TOKENS", "INT32", {max_tokens})],
        enable_empty_final_response=True)
    result, error = q.get(timeout=120)
    print("streaming" if error is None else f"error {{error}}", flush=True)
    if mode == "cancel":
        sys.stdin.readline()  # the parent has seen the sequence live; cancelling earlier races its check
        c.stop_stream(cancel_requests=True)
        print("cancelled", flush=True)
    if mode == "deadline":  # the deadline ends the stream: an error, or a final response had it ended first
        while error is None and not result.get_response().parameters["triton_final_response"].bool_param:
            result, error = q.get(timeout=120)
        print("ended: " + ("a final response" if error is None else str(error)), flush=True)
    time.sleep(600)
""").format(**LONG)


@pytest.mark.parametrize("mode", ["cancel", "deadline", "sigkill", "sigterm"])
def test_every_way_of_leaving_frees_the_sequence(server: TritonServer, mode: str) -> None:
    """A departed client's sequence is cancelled inside the server (the gateway sends CANCEL to `llm`),
    not decoded to max_tokens (its constraint cannot end before)."""
    outputs_before = counter_sum(server.metrics_url, OUTPUTS)
    child = subprocess.Popen([sys.executable, "-c", CHILD, server.grpc_url, mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "streaming"
        if mode == "deadline":
            # The deadline, not the parent, decides when it ends: a live check here could come after it.
            assert "[StatusCode.DEADLINE_EXCEEDED]" in child.stdout.readline()
        else:
            assert grammar_active(server) == 1
        if mode == "cancel":
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "cancelled"
        elif mode == "sigkill":
            child.send_signal(signal.SIGKILL)
        elif mode == "sigterm":
            child.send_signal(signal.SIGTERM)
        assert_cancelled(server, outputs_before)
    finally:
        child.kill()
        child.wait(10)
    assert server.is_running()


# ------------------------------------------------------------------ the mix
def _group_rss_mib(pgid: int) -> float:
    total = 0
    for proc in group_processes(pgid):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since the listing
            total += proc.memory_info().rss
    return total / 2**20


def _early_close(url: str) -> str:
    """A raw client that cancels its stream right after the first token (no SDK, header on)."""
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    client.async_stream_infer(CONSTRAINED_LLM, [_prompt(b"Count to a hundred."), _ints("MAX_TOKENS", 200)],
                              enable_empty_final_response=True)
    events.get(timeout=120)
    client.stop_stream(cancel_requests=True)
    client.close()
    return "closed"


SOAK_REQUESTS = int(os.environ.get("ABUSE_REQUESTS", "2000"))
# Bound on the growth of the server's resident memory (tritonserver + 4 stubs,
# about 2.3 GB at rest here) over the mix, after a warm-up round.
RSS_GROWTH_MIB = 200.0


def test_abuse_mix_keeps_the_server_up_and_clean(server: TritonServer) -> None:
    """SOAK_REQUESTS bad requests of every kind, raw early closes and valid streams, concurrently.

    Valid streams and early closes take fixed slots of the mix (so their counts are exact).

    Every bad request gets its exact answer, every valid one completes validly,
    and afterwards no sequence, batch slot or memory is left behind.
    """
    from concurrent.futures import ThreadPoolExecutor

    url = server.grpc_url
    bad = [(CONSTRAINED_LLM, inputs, status, message) for inputs, status, message in BAD_INPUTS]
    internal = [(model, inputs, None, message) for model, inputs, message in [
        ("grammar", GRAMMAR_START, "PERMISSION_DENIED: model 'grammar' is not served to clients"),
        ("llm", [_tensor("CANCEL", "BYTES", [b"req-1"])], "PERMISSION_DENIED: model 'llm' is not served"),
        (CONSTRAINED_LLM, [_prompt(), _tensor("MAX_TOKENS", "FP32", np.array([3.0], np.float32))],
         "INVALID_ARGUMENT: input 'MAX_TOKENS': datatype FP32, expected INT32"),
    ]]
    table = bad + internal
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    sdk = Client(url)

    def one(i: int) -> str:
        if i % 50 == 49:
            return _early_close(url)
        if i % 50 == 24:
            answer = sdk.generate("Is the sky blue? Answer as JSON.", constraint=Constraint.json_schema(schema),
                                  max_tokens=16)
            assert answer.complete and answer.json is not None and answer.json.valid, (i, answer)
            return "valid"
        model, inputs, status, message = table[i % len(table)]
        result, error = raw_call(url, model, inputs, header=i % 2 == 0)
        if status is None:
            assert result is None and error is not None and message in error, (i, error)
        else:
            assert error is None and result is not None, (i, error)
            assert (result["finish_reason"], result["status"]) == ("error", status), (i, result)
            assert result["error"].startswith(message), (i, result["error"])
        return "ok"

    with sdk, ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(50)))  # warm-up: every path once (an early close and a valid stream included)
        assert server.pid is not None
        rss_before = _group_rss_mib(server.pid)
        started = time.monotonic()
        outcomes = list(pool.map(one, range(SOAK_REQUESTS)))
        elapsed = time.monotonic() - started
    slots = [i % 50 for i in range(SOAK_REQUESTS)]
    assert (outcomes.count("valid"), outcomes.count("closed"), outcomes.count("ok")) == (
        slots.count(24), slots.count(49), SOAK_REQUESTS - slots.count(24) - slots.count(49))
    assert server.is_running() and gateway_ready(server)
    wait_for(lambda: sequences_freed(server), 60, "sequences freed after the mix")
    rss_after = _group_rss_mib(server.pid)
    print(f"abuse mix: {SOAK_REQUESTS} requests in {elapsed:.0f} s, {slots.count(24)} valid streams completed, "
          f"server RSS {rss_before:.0f} -> {rss_after:.0f} MiB")
    assert rss_after - rss_before < RSS_GROWTH_MIB


def test_sigterm_shutdown_is_clean(server: TritonServer) -> None:
    """Runs last in this module: stopping the server must not segfault any stub (MetricFamily teardown)."""
    assert server.stop() == 0
    log = server.log_tail(500_000)
    assert "Segfault encountered" not in log and "Signal (11)" not in log
