"""The one error hierarchy of the server and its one status mapping.

Every error a request can cause is a :class:`ServingError`; each carries a
``status``, a gRPC status name (the ``status`` field of ``RESULT``), and the
Triton adapters map it to a ``pb_utils.TritonError`` code with
:func:`triton_code_name` alone.  Each layer derives its own types from here
(:mod:`grammar_backend.errors` the grammar engine's, :mod:`llm_runtime.errors`
the decode runtime's), so no layer's errors pass for another's.
Standard library only, like the rest of :mod:`contract`.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALREADY_EXISTS",
    "DEADLINE_EXCEEDED",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "TRITON_CODE_NAMES",
    "UNAVAILABLE",
    "ConfigError",
    "InvalidArgument",
    "ServingError",
    "status_of",
    "triton_code_name",
]

INVALID_ARGUMENT: Final = "INVALID_ARGUMENT"
NOT_FOUND: Final = "NOT_FOUND"
ALREADY_EXISTS: Final = "ALREADY_EXISTS"
RESOURCE_EXHAUSTED: Final = "RESOURCE_EXHAUSTED"
DEADLINE_EXCEEDED: Final = "DEADLINE_EXCEEDED"
UNAVAILABLE: Final = "UNAVAILABLE"
INTERNAL: Final = "INTERNAL"


class ServingError(Exception):
    """Root of every error the server raises on purpose; ``status`` is its gRPC status name."""

    status: str = INTERNAL


class InvalidArgument(ServingError):
    """A request field is malformed or out of range.

    Parameters
    ----------
    field : str
        The request field at fault, e.g. ``"grammar"``, ``"grammar_options.indent"``,
        ``"max_tokens"``, or a JSON pointer inside the schema such as ``"grammar#/properties/a"``.
    reason : str
        Why the value is rejected.
    """

    status = INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ConfigError(ServingError):
    """A model or engine configuration parameter is unknown, missing or invalid."""

    status = INVALID_ARGUMENT


def status_of(err: BaseException) -> str:
    """Return the gRPC status name for ``err`` (``INTERNAL`` for foreign exceptions)."""
    if isinstance(err, ServingError):
        return err.status
    return INTERNAL


#: Our status names -> ``pb_utils.TritonError`` code names.  The Python
#: backend has no DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, so those become
#: UNAVAILABLE (the client may retry: a timed-out compile keeps running and
#: is cached when it finishes; a full table or compile queue frees up).  Triton's gRPC
#: frontend turns INVALID_ARG into INVALID_ARGUMENT.
TRITON_CODE_NAMES: Final = {
    INVALID_ARGUMENT: "INVALID_ARG",
    NOT_FOUND: "NOT_FOUND",
    ALREADY_EXISTS: "ALREADY_EXISTS",
    RESOURCE_EXHAUSTED: "UNAVAILABLE",
    DEADLINE_EXCEEDED: "UNAVAILABLE",
    UNAVAILABLE: "UNAVAILABLE",
    INTERNAL: "INTERNAL",
}


def triton_code_name(err: BaseException) -> str:
    """The ``pb_utils.TritonError`` code name for ``err`` (the one mapping of the project)."""
    return TRITON_CODE_NAMES[status_of(err)]
