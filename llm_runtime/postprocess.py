"""The final RESULT of a generation (the logic of the ``postprocessing`` model).

Intermediate responses pass their text delta through.  The last one gets a
RESULT JSON: finish reason, completeness, usage and, for JSON constraints,
whether the output parses, its validation against the *full* schema
(``jsonschema`` Draft 2020-12 with format checking) and the keywords that
decoding did not enforce (the fidelity report).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from grammar_backend.fidelity import (
    UnenforcedKeyword,
    result_json,
    unenforced_keywords,
    validate_output,
)

FINISH_REASONS = ("stop", "length", "error")


@dataclass(frozen=True)
class FinalState:
    """What ``llm`` reports on its last response."""

    finish_reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@functools.lru_cache(maxsize=256)
def _schema_of(kind: str, payload: str) -> Any:
    """Parsed schema per constraint (``{}`` for any-JSON); cached across requests."""
    return json.loads(payload) if kind == "json_schema" else {}


@functools.lru_cache(maxsize=256)
def _unenforced(kind: str, payload: str, strict: bool) -> tuple[UnenforcedKeyword, ...]:
    return unenforced_keywords(_schema_of(kind, payload), strict_mode=strict)


def json_report(constraint: dict[str, str], text: str) -> dict[str, Any]:
    """Parse + validate ``text`` against the constraint's full schema, with the fidelity report."""
    kind, payload = constraint["kind"], constraint["payload"]
    strict = bool(json.loads(constraint["options"] or "{}").get("strict", False))
    return result_json(validate_output(_schema_of(kind, payload), text), _unenforced(kind, payload, strict))


def build_result(final: FinalState, constraint: dict[str, str] | None) -> dict[str, Any]:
    """The RESULT object of the ensemble's last response (see the client contract)."""
    if final.finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {final.finish_reason!r}")
    # Truncation is never a success: only a clean stop is complete.
    complete = final.finish_reason == "stop"
    result: dict[str, Any] = {
        "finish_reason": final.finish_reason,
        "complete": complete,
        "text": final.text,
        "usage": {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens},
        "error": final.error,
        "json": None,
    }
    if constraint is not None and constraint["kind"] in ("json_schema", "json_object") and final.error is None:
        result["json"] = json_report(constraint, final.text)
    return result
