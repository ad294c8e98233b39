"""Exception types of the grammar engine.

They derive from :class:`contract.errors.ServingError` (the one root, whose
``status`` is a gRPC status name mapped to Triton codes in one place,
:func:`contract.errors.triton_code_name`); the root, ``InvalidArgument``,
``ConfigError`` and the mapping are re-exported here for the engine's callers.
"""

from __future__ import annotations

from contract.errors import (
    ALREADY_EXISTS,
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    TRITON_CODE_NAMES,
    UNAVAILABLE,
    ConfigError,
    InvalidArgument,
    ServingError,
    status_of,
    triton_code_name,
)

__all__ = [
    "ALREADY_EXISTS", "DEADLINE_EXCEEDED", "INTERNAL", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED",
    "TRITON_CODE_NAMES", "UNAVAILABLE", "BackendFailed", "CapacityExceeded", "CompileError", "CompileQueueFull", "CompileTimeout",
    "ConfigError", "ConstraintError", "DuplicateSequence", "GrammarError", "InvalidArgument", "MatcherFailed",
    "RemoteGrammarError", "SequenceError",
    "ServingError", "TokenRejected", "TokenizerError", "UnknownSequence", "status_of", "triton_code_name",
]


class GrammarError(ServingError):
    """Base class of the errors of the grammar engine (:mod:`grammar_backend`)."""

    status: str = INTERNAL


class RemoteGrammarError(GrammarError):
    """An error answered by the ``grammar`` model to another process (over BLS or the step channel), its status kept."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


class ConstraintError(InvalidArgument, GrammarError):
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


class MatcherFailed(GrammarError):
    """A matcher cannot go on (llguidance past one of its parser or lexer limits); raised by the matcher,
    reported by :meth:`~grammar_service.engine.GrammarEngine.step` as the row's :class:`BackendFailed`."""

    status = RESOURCE_EXHAUSTED


class BackendFailed(SequenceError):
    """The sequence's matcher failed (:class:`MatcherFailed`): the row ends with its reason."""

    status = RESOURCE_EXHAUSTED


class CapacityExceeded(GrammarError):
    """The sequence table is full."""

    status = RESOURCE_EXHAUSTED


class TokenizerError(GrammarError):
    """A tokenizer could not be loaded or does not fit the model."""

    status = INVALID_ARGUMENT
