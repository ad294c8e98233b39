"""Slow compiles run in bounded worker processes: they cannot starve other requests or the server.

The module's server has small compile limits (10 s of CPU per compile, a
queue of one), so the slow constraints here end within seconds instead of
holding the workers for the rest of the run.
"""

from __future__ import annotations

import re
import threading
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

LIMITS = {"GRAMMAR_COMPILE_CPU_S": "10", "GRAMMAR_COMPILE_QUEUE": "1", "GRAMMAR_COMPILE_TIMEOUT_S": "120"}
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

