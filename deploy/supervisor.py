"""Keep a served ensemble alive: restart a dead ``tritonserver``, and one whose models are broken.

Triton 2.51 does not notice a Python-backend stub that died (``kill -9``, an
out-of-memory kill, a crash in native code): seen here, with the
``grammar`` stub gone ``/v2/health/ready`` and the model's ready endpoint kept
answering 200 while every request failed with ``Stub process 'grammar_0_0' is
not healthy``, and nothing recovered in 2 minutes; with the ``llm`` stub gone,
client streams hung with no final response.

So the supervisor probes the composing models themselves, through
tritonserver's own (restricted, loopback) endpoint:

* ``grammar``: the ``stats`` op (no state);
* ``llm``: ``CANCEL`` of a random id that is not in flight (an empty final
  response, answered by the model's own thread).

A probe that fails ``failures_to_restart`` times in a row, or a
``tritonserver`` process that exited, turns the gateway's readiness false
at once and restarts the process (same ports, same secret) with exponential
backoff; readiness returns when the restarted server and its models are ready.
In-flight streams of the old process end with UNAVAILABLE at the gateway.
Kubernetes does the same one level up with its probes on the gateway's readiness.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from deploy.server import ServerError, TritonServer

__all__ = ["Probe", "Supervisor", "SupervisorConfig", "default_probes"]

_log = logging.getLogger(__name__)

_EMPTY_IDS: Final = np.zeros(0, np.uint64)
#: After a failed probe, how long the server's process is watched for an exit before the probe's failure is
#: taken as the cause (the failure path only: a healthy round never waits).
EXIT_GRACE_S: Final = 1.0


@dataclass(frozen=True)
class Probe:
    """One functional check of a composing model: a request that must get a final answer.

    Attributes
    ----------
    model : str
        The model to call (over the internal endpoint, with the secret).
    build : callable
        Returns the request's inputs.
    """

    model: str
    build: Callable[[], list[grpcclient.InferInput]]


def _bytes_input(name: str, value: bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value], np.object_))
    return tensor


def _grammar_stats() -> list[grpcclient.InferInput]:
    ids = grpcclient.InferInput("SEQUENCE_ID", [0], "UINT64")
    ids.set_data_from_numpy(_EMPTY_IDS)
    return [_bytes_input("OP", b"stats"), ids]


def _llm_cancel_nothing() -> list[grpcclient.InferInput]:
    return [_bytes_input("CANCEL", f"probe-{secrets.token_hex(16)}".encode())]


def default_probes() -> tuple[Probe, ...]:
    """The probes of this project's ensemble (``grammar`` and ``llm``; the others are stateless)."""
    return (Probe("grammar", _grammar_stats), Probe("llm", _llm_cancel_nothing))


@dataclass(frozen=True)
class SupervisorConfig:
    """Settings of :class:`Supervisor`.

    Attributes
    ----------
    interval_s : float
        Time between probe rounds.
    probe_timeout_s : float
        How long one probe may take (a stub busy with a long compile answers
        ``stats`` inline, so seconds mean it is gone).
    failures_to_restart : int
        Consecutive failed rounds before a restart (one slow answer is not a death).
    backoff_s, max_backoff_s : float
        First wait after a failed restart, doubled up to the maximum.
    ready_timeout_s : float
        How long a restarted server may take to become ready.
    """

    interval_s: float = 5.0
    probe_timeout_s: float = 10.0
    failures_to_restart: int = 2
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    ready_timeout_s: float = 600.0


class Supervisor:
    """Probe and restart one :class:`deploy.server.TritonServer` (see the module docstring).

    Parameters
    ----------
    server : TritonServer
        A started server with its gateway.
    probes : tuple of Probe
        What "healthy" means beyond Triton's own readiness.
    config : SupervisorConfig
        Timings.
    """

    def __init__(self, server: TritonServer, probes: tuple[Probe, ...] = (),
                 config: SupervisorConfig | None = None) -> None:
        self.server = server
        self.probes = probes
        self.config = config if config is not None else SupervisorConfig()
        self.restarts = 0
        self.last_cause = ""
        self._stop = threading.Event()
        self._unanswered: list[grpcclient.InferenceServerClient] = []

    def stop(self) -> None:
        """Make :meth:`run` return after its current round."""
        self._stop.set()

    def check(self) -> str | None:
        """One round: ``None`` when healthy, else the cause."""
        code = self.server.returncode
        if code is not None:
            return f"tritonserver exited with status {code}"
        for probe in self.probes:
            error = self._probe(probe)
            if error is not None:
                # A killed server's streams break a moment before its exit status can be read: the exit,
                # where it follows, is the cause (a full `make test` once reported the probe's broken stream).
                deadline = time.monotonic() + EXIT_GRACE_S
                while (code := self.server.returncode) is None and time.monotonic() < deadline:
                    self._stop.wait(0.05)
                if code is not None:
                    return f"tritonserver exited with status {code}"
                return f"model {probe.model!r} failed its probe: {error}"
        return None

    def _probe(self, probe: Probe) -> str | None:
        events: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(self.server.internal_grpc_url)
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)),
                                headers=self.server.internal_headers)
            client.async_stream_infer(probe.model, probe.build(), enable_empty_final_response=True)
            deadline = time.monotonic() + self.config.probe_timeout_s
            while True:
                result, error = events.get(timeout=max(0.0, deadline - time.monotonic()))
                if error is not None:
                    failure: str | None = str(error.message())
                    break
                if result.get_response().parameters["triton_final_response"].bool_param:
                    failure = None
                    break
        except queue.Empty:
            # The probe is still in flight: its stream stays open (closing it
            # would cancel a request in flight, see deploy/gateway.py) until the
            # restart that follows ends it.
            self._unanswered.append(client)
            return f"no answer within {self.config.probe_timeout_s} s"
        except InferenceServerException as err:
            failure = f"transport error: {err}"
        client.stop_stream(cancel_requests=False)
        client.close()
        return failure

    def run(self) -> None:
        """Probe every ``interval_s`` until :meth:`stop`; restart on failure."""
        failures = 0
        while not self._stop.wait(self.config.interval_s):
            cause = self.check()
            if cause is None:
                failures = 0
                continue
            failures += 1
            exited = self.server.returncode is not None
            _log.error("supervisor: %s (%d in a row)", cause, failures)
            if exited or failures >= self.config.failures_to_restart:
                self.recover(cause)
                failures = 0

    def recover(self, cause: str) -> None:
        """Readiness off, restart with backoff until ready, readiness on."""
        gateway = self.server.gateway
        if gateway is not None:
            gateway.set_health(False, cause)
        self.last_cause = cause
        backoff = self.config.backoff_s
        while not self._stop.is_set():
            self.restarts += 1
            _log.error("supervisor: restarting tritonserver (restart %d): %s", self.restarts, cause)
            try:
                self.server.restart_process(graceful=False)
                self.server.wait_ready(timeout_s=self.config.ready_timeout_s)
            except ServerError as err:
                cause = f"restart failed: {err}"
                _log.error("supervisor: %s; next try in %.0f s", cause, backoff)
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.config.max_backoff_s)
                continue
            self._unanswered.clear()
            if gateway is not None:
                gateway.set_health(True)
            _log.warning("supervisor: tritonserver is ready again after: %s", self.last_cause)
            return
