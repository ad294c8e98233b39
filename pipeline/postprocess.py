"""The final RESULT of a generation (the logic of the ``postprocessing`` model).

Intermediate responses pass their text delta through.  The last one gets a
RESULT JSON: finish reason, completeness, usage and, for JSON constraints,
whether the output parses, its validation against the *full* schema
(``jsonschema`` Draft 2020-12 with format checking) and the keywords that
decoding did not enforce (the fidelity report).

With a thinking section (:mod:`contract.reasoning`) RESULT's ``text`` is the
answer alone, and ``reasoning`` the thinking (markers left out), split by
:func:`contract.reasoning.split_reasoning`; every check (parse, validation,
``complete``) reads the answer alone.

Errors travel as data: a rejected request (bad constraint, out-of-range
field) or a failure ends with an ordinary final response whose RESULT has
``finish_reason: "error"``, ``status`` (a gRPC status name such as
``INVALID_ARGUMENT``) and ``error`` (``"field: reason"``).  No model of the
client-facing ensemble ever sends a Triton error response: on Triton 2.51
error responses on gRPC streams are what crashes the server (see
``deploy/gateway.py``), and as data they keep their status through the
ensemble and BLS on every Triton release (server#7804 resets BLS error codes).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import contract
from contract.finish import FinishEvent
from contract.reasoning import Reasoning, split_reasoning
from grammar_backend.errors import INTERNAL
from grammar_backend.fidelity import result_json, validator_for
from grammar_backend.spec import validated_constraint
from grammar_backend.values import unenforced_for
from pipeline.finish import cut_error, read_finish_reasoning

FINISH_REASONS = contract.FINISH_REASONS


def json_report(constraint: dict[str, str], text: str, backend: str | None = "xgrammar") -> dict[str, Any]:
    """Parse + validate ``text`` against the constraint's full schema, with the fidelity report.

    ``constraint`` is preprocessing's wire form, trusted: no meta-schema check
    is repeated, and the validator and its report of unenforced keywords are
    built once per schema (cached).  The unenforced keywords are those of the
    backend that served the output (``backend``).
    """
    spec = validated_constraint(constraint["kind"], constraint["payload"], constraint["options"])
    schema = spec.schema
    if schema is None:
        raise ValueError(f"no JSON report for a {spec.kind.value} constraint")
    return result_json(validator_for(schema, checked=True).validate_text(text), unenforced_for(spec, backend))


def build_result(final: FinishEvent, constraint: dict[str, str] | None,
                 reasoning: Reasoning | None = None) -> dict[str, Any]:
    """The RESULT object of the ensemble's last response (see the client contract).

    With ``reasoning``, ``text`` is the answer and four more members say
    how the thinking went: ``reasoning`` (its text), ``reasoning_tokens``
    (None where not counted), ``reasoning_cut`` (the server forced its end
    marker) and ``reasoning_ended`` (the end marker was written: the answer
    began).  Without it the RESULT is exactly as before the option existed.
    ``seed`` is the seed the draws used (None for a request refused before
    generation).  Log probabilities are not in RESULT: each response carries
    its tokens' entries (``TOKEN_LOGPROBS``), so the last message stays bounded.
    """
    if final.finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {final.finish_reason!r}")
    text, thinking, ended = final.text, "", True
    if reasoning is not None:
        thinking, text, ended = split_reasoning(final.text, reasoning)
    # Only a clean stop is complete.  Truncated is not; closed early is not
    # either (it parses and validates, but values may be cut short); a stop
    # string cuts a constrained output wherever it matched; an answer that
    # never began (the thinking never ended) is not.
    closed = final.close_reason is not None
    complete = (final.finish_reason == "stop" and not closed and not (constraint is not None and final.stop_string)
                and ended)
    result: dict[str, Any] = {
        "finish_reason": final.finish_reason,
        "complete": complete,
        "closed_early": closed,
        "close_reason": final.close_reason,
        "stop_string": final.stop_string,
        "backend": final.backend,
        "value_retries": final.value_retries,
        "value_dropped_tokens": final.value_dropped_tokens,
        "text": text,
        "usage": {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens},
        "error": cut_error(final.error),
        "status": final.status,
        "json": None,
        # The seed the output's draws used (drawn for an unseeded request): sent back as SEED, it replays them.
        "seed": final.seed,
    }
    if reasoning is not None:
        result.update(reasoning=thinking, reasoning_tokens=final.reasoning_tokens,
                      reasoning_cut=final.reasoning_cut, reasoning_ended=ended)
    if constraint is not None and constraint["kind"] in ("json_schema", "json_object") and final.error is None:
        result["json"] = json_report(constraint, text, final.backend)
    return result


_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedOutput:
    """A finished generation as postprocessing reports it.

    Attributes
    ----------
    finish_reason : str
    result : str
        The RESULT JSON.
    kind : str
        The constraint kind, ``"none"`` without one (a metric label).
    close_reason : str or None
    postvalidation_failed : bool
        A JSON output that ended cleanly or closed early (so it should be
        valid) fails to parse or validate: what decoding did not enforce.
    """

    finish_reason: str
    result: str
    kind: str
    close_reason: str | None
    postvalidation_failed: bool


def result_of_finish(finish: bytes) -> FinishedOutput:
    """The RESULT for ``llm``'s ``FINISH`` document; never raises.

    A ``FINISH`` that cannot be read or checked (a bug, never a client's
    input) becomes an ``INTERNAL`` error RESULT, logged, instead of an error
    response that would reach a 2.51 gRPC stream.
    """
    constraint: dict[str, str] | None = None
    try:
        final, constraint, reasoning = read_finish_reasoning(finish)
        result = build_result(final, constraint, reasoning)
    except Exception as err:  # noqa: BLE001 - turned into an INTERNAL result, see above
        _log.exception("postprocessing: cannot build RESULT")
        final = FinishEvent("error", "", 0, 0, error=f"internal error in postprocessing: {err!r}", status=INTERNAL)
        result = build_result(final, None)
        constraint = None
    report = result["json"]
    should_be_valid = final.finish_reason != "error" and (result["complete"] or result["closed_early"])
    return FinishedOutput(
        finish_reason=final.finish_reason,
        result=json.dumps(result, ensure_ascii=False),
        kind="none" if constraint is None else constraint["kind"],
        close_reason=final.close_reason,
        postvalidation_failed=bool(should_be_valid and report is not None and not report["valid"]),
    )
