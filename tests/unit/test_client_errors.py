"""Unit tests of client.errors: the server-error mapping table and the error types."""

from __future__ import annotations

import dataclasses

import pytest
from tritonclient.utils import InferenceServerException

from client.errors import (
    ClientError,
    DeadlineExceeded,
    GenerationError,
    InvalidConstraint,
    InvalidRequest,
    ServerBusy,
    ServerUnavailable,
    TruncatedOutput,
    from_server_error,
    status_name,
)
from client.sdk import Result, Usage


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("StatusCode.INVALID_ARGUMENT", "INVALID_ARGUMENT"),
        ("StatusCode.UNAVAILABLE", "UNAVAILABLE"),
        ("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"),
        (" StatusCode.INTERNAL ", "INTERNAL"),
        ("", None),
        (None, None),
    ],
)
def test_status_name(status: str | None, expected: str | None) -> None:
    assert status_name(status) == expected


# (status, server message) -> (type, field, str(error), status attribute)
MAPPING = [
    (
        "StatusCode.INVALID_ARGUMENT",
        "in ensemble 'constrained_llm', grammar: invalid JSON at line 1 column 9: Expecting value",
        InvalidConstraint,
        "grammar",
        "grammar: invalid JSON at line 1 column 9: Expecting value",
        "INVALID_ARGUMENT",
    ),
    (
        "StatusCode.INVALID_ARGUMENT",
        "grammar_options.indent: must be a non-negative integer",
        InvalidConstraint,
        "grammar_options.indent",
        "grammar_options.indent: must be a non-negative integer",
        "INVALID_ARGUMENT",
    ),
    (
        "StatusCode.INVALID_ARGUMENT",
        "grammar#/properties/tags/items: keyword 'contains' is not supported",
        InvalidConstraint,
        "grammar#/properties/tags/items",
        "grammar#/properties/tags/items: keyword 'contains' is not supported",
        "INVALID_ARGUMENT",
    ),
    (
        "StatusCode.INVALID_ARGUMENT",
        "stop[1]: must not be empty",
        InvalidConstraint,
        "stop[1]",
        "stop[1]: must not be empty",
        "INVALID_ARGUMENT",
    ),
    (
        "INVALID_ARGUMENT",
        "request is too large",
        InvalidConstraint,
        None,
        "request is too large",
        "INVALID_ARGUMENT",
    ),
    (
        "StatusCode.UNAVAILABLE",
        "failed to connect to all addresses",
        ServerUnavailable,
        None,
        "server unavailable: failed to connect to all addresses",
        "UNAVAILABLE",
    ),
    (
        "StatusCode.DEADLINE_EXCEEDED",
        "Stream removed (Deadline Exceeded)",
        DeadlineExceeded,
        None,
        "deadline exceeded: Stream removed (Deadline Exceeded)",
        "DEADLINE_EXCEEDED",
    ),
    ("StatusCode.INTERNAL", "boom", GenerationError, None, "INTERNAL: boom", "INTERNAL"),
    ("StatusCode.CANCELLED", "Locally cancelled by application!", GenerationError, None,
     "CANCELLED: Locally cancelled by application!", "CANCELLED"),
    ("StatusCode.RESOURCE_EXHAUSTED", "sequence table is full", ServerBusy, None,
     "server busy: sequence table is full", "RESOURCE_EXHAUSTED"),
    ("RESOURCE_EXHAUSTED", "grammar: 10 compiles are running or queued", ServerBusy, None,
     "server busy: grammar: 10 compiles are running or queued", "RESOURCE_EXHAUSTED"),
    # In-band stream errors (and Triton's unknown-model error) carry no status.
    (None, "Request for unknown model: 'nope' is not found", GenerationError, None,
     "server error: Request for unknown model: 'nope' is not found", None),
]


@pytest.mark.parametrize(("status", "message", "kind", "field", "text", "status_attr"), MAPPING)
def test_from_server_error_table(
    status: str | None, message: str, kind: type[ClientError], field: str | None, text: str, status_attr: str | None
) -> None:
    error = from_server_error(InferenceServerException(msg=message, status=status))
    assert type(error) is kind
    assert str(error) == text
    assert error.status == status_attr
    assert getattr(error, "field", None) == field


def test_hierarchy() -> None:
    assert issubclass(InvalidConstraint, InvalidRequest)
    assert issubclass(InvalidRequest, ValueError)
    for kind in (InvalidRequest, TruncatedOutput, ServerUnavailable, DeadlineExceeded, GenerationError):
        assert issubclass(kind, ClientError)
    assert issubclass(ServerBusy, ServerUnavailable)


def _result(finish_reason: str, complete: bool) -> Result:
    return Result(
        text='{"a": ',
        finish_reason=finish_reason,
        complete=complete,
        usage=Usage(prompt_tokens=7, completion_tokens=16),
        parsed=None,
        json=None,
        error=None,
        raw={},
    )


def test_truncated_output_carries_the_partial_result() -> None:
    result = _result("length", False)
    error = TruncatedOutput(result)
    assert error.result is result
    assert str(error) == "output truncated at 16 tokens (finish_reason='length'); the constraint is not complete"


def test_a_stop_string_is_named_as_the_cut() -> None:
    result = dataclasses.replace(_result("stop", False), stop_string=True)
    assert str(TruncatedOutput(result)) == (
        "output cut at a stop string (finish_reason='stop'); the constraint is not complete"
    )


def test_generation_error_carries_optional_result() -> None:
    result = _result("error", False)
    assert GenerationError("x", result=result).result is result
    assert GenerationError("x").result is None
