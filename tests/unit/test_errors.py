"""The one error hierarchy (contract.errors.ServingError) and its one status mapping."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError, InvalidArgument, ServingError, status_of, triton_code_name
from grammar_backend import errors as g
from llm_runtime import errors as r
from pipeline.preprocess import RejectedRequest


@pytest.mark.parametrize(
    ("err", "status", "code", "layer"),
    [
        (InvalidArgument("top_p", "must be in (0, 1]"), "INVALID_ARGUMENT", "INVALID_ARG", None),
        (ConfigError("llm: bad"), "INVALID_ARGUMENT", "INVALID_ARG", None),
        (g.ConstraintError("grammar", "bad"), "INVALID_ARGUMENT", "INVALID_ARG", g.GrammarError),
        (g.CompileError("grammar", "refused"), "INVALID_ARGUMENT", "INVALID_ARG", g.GrammarError),
        (g.CompileTimeout("slow"), "DEADLINE_EXCEEDED", "UNAVAILABLE", g.GrammarError),
        (g.CompileQueueFull("full"), "RESOURCE_EXHAUSTED", "UNAVAILABLE", g.GrammarError),
        (g.UnknownSequence(7, "never started"), "NOT_FOUND", "NOT_FOUND", g.GrammarError),
        (g.DuplicateSequence(7, "already started"), "ALREADY_EXISTS", "ALREADY_EXISTS", g.GrammarError),
        (g.TokenRejected(7, 5, 0), "INVALID_ARGUMENT", "INVALID_ARG", g.GrammarError),
        (g.CapacityExceeded("full"), "RESOURCE_EXHAUSTED", "UNAVAILABLE", g.GrammarError),
        (g.RemoteGrammarError("grammar failed", "UNAVAILABLE"), "UNAVAILABLE", "UNAVAILABLE", g.GrammarError),
        (r.RequestError("max_tokens", "too big"), "INVALID_ARGUMENT", "INVALID_ARG", r.DecodeError),
        (r.EngineError("no slot"), "INTERNAL", "INTERNAL", r.DecodeError),
        (r.Overloaded("queue full"), "RESOURCE_EXHAUSTED", "UNAVAILABLE", r.DecodeError),
        (r.SchedulerClosed("closed"), "UNAVAILABLE", "UNAVAILABLE", r.DecodeError),
        (RejectedRequest("refused", "INVALID_ARGUMENT"), "INVALID_ARGUMENT", "INVALID_ARG", None),
        (ValueError("a bug"), "INTERNAL", "INTERNAL", None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_every_error_maps_through_the_one_table(err: BaseException, status: str, code: str,
                                                layer: type[ServingError] | None) -> None:
    assert (status_of(err), triton_code_name(err)) == (status, code)
    assert isinstance(err, ServingError) is not isinstance(err, ValueError)
    # A layer's errors never pass for the other layer's.
    assert isinstance(err, g.GrammarError) is (layer is g.GrammarError)
    assert isinstance(err, r.DecodeError) is (layer is r.DecodeError)


def test_invalid_arguments_name_their_field() -> None:
    err = r.RequestError("max_tokens", "must be an integer in [1, 4096], got 0")
    assert (err.field, err.reason, str(err)) == ("max_tokens", "must be an integer in [1, 4096], got 0",
                                                 "max_tokens: must be an integer in [1, 4096], got 0")
    assert isinstance(err, InvalidArgument)
