"""The grammar step after the forward, served: the torch engine in ``grammar_mode: processor`` over gRPC.

The call order of an engine's logits processor (TensorRT-LLM's): each step's
one grammar request runs after the forward instead of beside it
(:mod:`llm_runtime.grammar_phase`), masks fetched from the ``grammar`` model,
inside the real served ensemble, driven by the real SmolLM2 model.  The llm
model's step stats (logged at shutdown) show one grammar request per step
that had a constrained row.
"""

from __future__ import annotations

import json
import math
import re
import threading
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

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def processor_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, Path]]:
    tmp = tmp_path_factory.mktemp("processor")
    srv = start_ensemble(tmp, values={"GRAMMAR_MODE": "processor"})
    try:
        yield srv, tmp / "tritonserver.log"
    finally:
        srv.stop()


def test_processor_mode_serves_valid_outputs_with_one_grammar_request_per_step(
    processor_server: tuple[TritonServer, Path],
) -> None:
    server, log = processor_server
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str, constraint: Constraint | None, prompt: str) -> None:
        try:
            with Client(server.grpc_url) as c:
                results[name] = c.generate(prompt, constraint=constraint, max_tokens=48, temperature=0.0,
                                           require_complete=False)
        except BaseException as err:  # noqa: BLE001 -- re-raised by the main thread below
            errors.append(err)

    jobs = [
        ("person", Constraint.json_schema(PERSON), f"Invent a person as JSON matching {json.dumps(PERSON)}"),
        ("regex", Constraint.regex(r"[0-9]{3}-[a-z]{2,6}"), "Give a code."),
        ("choice", Constraint.choice(["red", "green", "blue"]), "Pick a colour."),
        ("free", None, "Say hello."),
    ]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    person = results["person"]
    assert person.complete or person.closed_early, person
    jsonschema.Draft202012Validator(PERSON).validate(json.loads(person.text))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", results["regex"].text)
    assert results["choice"].text in ("red", "green", "blue")
    assert results["free"].usage.completion_tokens >= 1
    assert wait_active_zero(server) == 0  # every grammar sequence was ended

    server.stop()  # the llm model logs its step stats when it finalizes
    (stats,) = parse_step_stats(log.read_text(encoding="utf-8", errors="replace"))
    assert stats["steps_constrained"] >= 1
    assert stats["grammar_requests"] == stats["steps_constrained"], stats
    # The grammar model's own time per step comes back over the grammar channel only (not over BLS).
    assert math.isfinite(stats["grammar_service_s_p50"]) and stats["grammar_service_s_p50"] > 0, stats
