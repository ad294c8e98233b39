"""Exception types of the grammar engine.

Every error that a request can cause is one of these types.  Each carries a
``status`` (a gRPC status name) so that the Triton adapters map them to
``pb_utils.TritonError`` codes in exactly one place
(:func:`grammar_backend.errors.status_of`), and a message that names the
offending field and the reason.
"""

from __future__ import annotations

from typing import Final

INVALID_ARGUMENT: Final = "INVALID_ARGUMENT"
NOT_FOUND: Final = "NOT_FOUND"
ALREADY_EXISTS: Final = "ALREADY_EXISTS"
RESOURCE_EXHAUSTED: Final = "RESOURCE_EXHAUSTED"
DEADLINE_EXCEEDED: Final = "DEADLINE_EXCEEDED"
UNAVAILABLE: Final = "UNAVAILABLE"
INTERNAL: Final = "INTERNAL"


class GrammarError(Exception):
    """Base class of every error raised by :mod:`grammar_backend`."""

    status: str = INTERNAL


class InvalidArgument(GrammarError):
    """A request field is malformed or out of range.

    Parameters
    ----------
    field : str
        The request field at fault, e.g. ``"grammar"``, ``"grammar_options.indent"``,
        or a JSON pointer inside the schema such as ``"grammar#/properties/a"``.
    reason : str
        Why the value is rejected.
    """

    status = INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ConstraintError(InvalidArgument):
    """A constraint (or one of its options) is malformed or not allowed."""


class CompileError(ConstraintError):
    """xgrammar refused to compile a constraint that passed validation."""


class CompileTimeout(GrammarError):
    """A compile did not finish within the configured limit."""

    status = DEADLINE_EXCEEDED


class CompileQueueFull(GrammarError):
    """Every compile worker is busy and the queue of waiting compiles is full."""

    status = RESOURCE_EXHAUSTED


class SequenceError(GrammarError):
    """An operation on the sequence table is not valid for that sequence."""

    status = INVALID_ARGUMENT

    def __init__(self, seq_id: int, reason: str) -> None:
        super().__init__(f"sequence {seq_id}: {reason}")
        self.seq_id = seq_id
        self.reason = reason


class UnknownSequence(SequenceError):
    """The sequence id was never started, already ended, or was evicted."""

    status = NOT_FOUND


class DuplicateSequence(SequenceError):
    """``start`` was called for a sequence id that is active."""

    status = ALREADY_EXISTS


class TokenRejected(SequenceError):
    """The grammar does not accept a token at the sequence's current state."""

    def __init__(self, seq_id: int, token_id: int, position: int) -> None:
        super().__init__(seq_id, f"token {token_id} at position {position} is rejected by the grammar")
        self.token_id = token_id
        self.position = position


class CapacityExceeded(GrammarError):
    """The sequence table is full."""

    status = RESOURCE_EXHAUSTED


class TokenizerError(GrammarError):
    """A tokenizer could not be loaded or does not fit the model."""

    status = INVALID_ARGUMENT


class ConfigError(GrammarError):
    """A model or engine configuration parameter is unknown, missing or invalid."""

    status = INVALID_ARGUMENT


def status_of(err: BaseException) -> str:
    """Return the gRPC status name for ``err`` (``INTERNAL`` for foreign exceptions)."""
    if isinstance(err, GrammarError):
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
