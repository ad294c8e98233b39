"""Slow compiles run in bounded worker processes, and large schemas are checked in preprocessing's heavy lane:
neither holds other requests or the server.

The module's server has small compile limits (10 s of CPU per compile, a
queue of one), so the slow constraints here end within seconds instead of
holding the workers for the rest of the run, and one ``preprocessing``
instance, so its heavy lane is the only place a large schema is checked.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import pytest

from client import Client, Constraint
from client.errors import ClientError, InvalidConstraint, ServerBusy
from deploy.server import TritonServer
from tests.integration.served import (
    gateway_ready,
    grammar_stats,
    start_ensemble,
    wait_active_zero,
)
from tests.support.poll import wait_for

pytestmark = [pytest.mark.triton, pytest.mark.e2e, pytest.mark.slow]

LIMITS = {"GRAMMAR_COMPILE_CPU_S": "10", "GRAMMAR_COMPILE_QUEUE": "1", "GRAMMAR_COMPILE_TIMEOUT_S": "120",
          "PREPROCESSING_INSTANCES": "1"}
SMALL = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                "additionalProperties": False})
#: Killed at the compile limit: with xgrammar's compiler cache on (as in the
#: workers) a 100k-item enum takes minutes.
KILLED = r"^grammar: compiling this json_schema (used more than 10 s of CPU|ran past 20 s)"


def _slow(n: int) -> Constraint:
    # On xgrammar, whose compiles are the ones that run in worker processes (auto would serve JSON with llguidance).
    return Constraint.json_schema({"description": f"slow-{n}", "enum": [f"value-{i}" for i in range(100_000)]}
                                  ).with_policies(backend="xgrammar")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    srv = start_ensemble(tmp_path_factory.mktemp("isolation"), values=LIMITS)
    try:
        yield srv
    finally:
        srv.stop()


def _wait_in_flight(server: TritonServer, count: int, timeout_s: float = 60) -> None:
    wait_for(lambda: grammar_stats(server)["in_flight"] >= count, timeout_s, f"{count} compiles in flight")


def test_slow_compiles_are_bounded_and_others_go_on(server: TritonServer) -> None:
    outcomes: dict[int, BaseException | None] = {}

    def send(n: int) -> None:
        with Client(server.grpc_url, timeout_s=300) as c:
            try:
                c.generate("x", constraint=_slow(n), max_tokens=1, require_complete=False)
                outcomes[n] = None
            except ClientError as err:
                outcomes[n] = err

    with Client(server.grpc_url) as client:
        client.generate("A number:", constraint=SMALL, max_tokens=12, require_complete=False)  # cached before the storm
        senders = [threading.Thread(target=send, args=(n,)) for n in range(3)]
        for t in senders:
            t.start()
        _wait_in_flight(server, 3)  # two compiling, one queued: the bound

        with pytest.raises(ServerBusy, match=r"grammar: 3 compiles are running or queued \(2 workers, queue of 1\); "
                                             r"retry later$") as busy:
            client.generate("x", constraint=_slow(99), max_tokens=1, require_complete=False)
        assert busy.value.status == "RESOURCE_EXHAUSTED"

        result = client.generate("A number:", constraint=SMALL, max_tokens=12, require_complete=False)
        assert result.json is not None and result.json.valid  # finished by the model or closed early
        assert grammar_stats(server)["in_flight"] > 0  # it did not wait for the slow compiles

        for t in senders:
            t.join(300)
        assert sorted(outcomes) == [0, 1, 2]
        for err in outcomes.values():
            assert isinstance(err, InvalidConstraint) and err.status == "INVALID_ARGUMENT", err
            assert err.field == "grammar"
            assert re.match(KILLED, str(err)), str(err)

        negative_hits = grammar_stats(server)["negative_hits"]
        with pytest.raises(InvalidConstraint, match=KILLED):  # remembered: no second compile
            client.generate("x", constraint=_slow(0), max_tokens=1, require_complete=False)
        assert grammar_stats(server)["negative_hits"] == negative_hits + 1

        result = client.generate("A number:", constraint=SMALL, max_tokens=12, require_complete=False)
        assert result.json is not None and result.json.valid
    stats = grammar_stats(server)
    assert stats["workers"]["cpu_kills"] + stats["workers"]["wall_kills"] == 3
    assert (stats["refused"], stats["in_flight"]) == (1, 0)
    assert wait_active_zero(server) == 0
    assert gateway_ready(server)



def _wide_and_wrong(n: int) -> Constraint:
    """A 1.9 MB schema whose last property is not a schema: refused only after the whole meta-schema check.

    Built without the SDK's own check (which would refuse it before sending).
    """
    props: dict[str, object] = {f"property_{i}": {"type": "string", "description": f"property number {i} of "
                                                  f"wide-{n}, a described field of a wide record"}
                                for i in range(16_000)}
    props["property_15999"] = {"type": 1}
    return Constraint("json_schema", json.dumps({"type": "object", "properties": props}))


def test_large_schemas_in_checks_hold_no_request_behind_them(server: TritonServer) -> None:
    """Four 1.9 MB schemas wait in the one instance's heavy lane (seconds of checks each); a small request
    sent behind them is answered before the lane is through: it never queues behind their checks."""
    refused_at: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def send(n: int) -> None:
        with Client(server.grpc_url, timeout_s=600) as c:
            try:
                c.generate("x", constraint=_wide_and_wrong(n), max_tokens=1, require_complete=False)
            except InvalidConstraint as err:
                with lock:
                    errors.append(err)
                    refused_at.append(time.monotonic())

    heavy = [threading.Thread(target=send, args=(n,)) for n in range(4)]
    for t in heavy:
        t.start()
    # The first refusal ends one whole check: by then all four arrived (2 MB each, over loopback).
    wait_for(lambda: len(refused_at) >= 1, 600, "the heavy lane's first refusal")
    with Client(server.grpc_url) as client:
        result = client.generate("A number:", constraint=SMALL, max_tokens=4, require_complete=False)
        done_at = time.monotonic()
    assert result.finish_reason in ("stop", "length")
    for t in heavy:
        t.join(600)
    assert len(errors) == 4
    for err in errors:
        assert isinstance(err, InvalidConstraint) and err.status == "INVALID_ARGUMENT"
        assert err.field == "grammar#/properties/property_15999/type", err
    # Before: the small request waited in the instance's queue behind every one of them.
    assert sum(t < done_at for t in refused_at) < 3, (refused_at, done_at)
    assert gateway_ready(server)
