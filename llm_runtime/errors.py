"""Exception types of the decode side.

They derive from :class:`DecodeError`, a :class:`contract.errors.ServingError`
(the one error root, whose ``status`` is a gRPC status name), so the Triton
adapters map them with the same :func:`contract.errors.triton_code_name` as
grammar errors without either passing for the other; :class:`RequestError`
is a :class:`contract.errors.InvalidArgument` (``field: reason`` message).
"""

from __future__ import annotations

from typing import Final

from contract import errors as cerrors

CANCELLED: Final = "CANCELLED"

__all__ = [
    "CANCELLED",
    "DecodeError",
    "EngineError",
    "EngineStalled",
    "Overloaded",
    "RequestError",
    "SchedulerClosed",
    "config_error",
    "status_of",
]


class DecodeError(cerrors.ServingError):
    """Base class of every error raised by :mod:`llm_runtime`."""

    status: str = cerrors.INTERNAL


class RequestError(cerrors.InvalidArgument, DecodeError):
    """A generation request has a field that is missing, out of range or malformed.

    Parameters
    ----------
    field : str
        The request field at fault, e.g. ``"max_tokens"`` or ``"prompt_token_ids"``.
    reason : str
        Why the value is rejected.
    """

    status = cerrors.INVALID_ARGUMENT


class EngineError(DecodeError):
    """The engine was used against its contract (unknown sequence, no free slot, ...)."""

    status = cerrors.INTERNAL


class EngineStalled(DecodeError):
    """The engine gave a request no output within its bound (an executor that stopped answering)."""

    status = cerrors.UNAVAILABLE


class Overloaded(DecodeError):
    """The scheduler holds as many requests as it is configured to queue."""

    status = cerrors.RESOURCE_EXHAUSTED


class SchedulerClosed(DecodeError):
    """The scheduler is shut down and accepts no more requests."""

    status = cerrors.UNAVAILABLE


def config_error(field: str, reason: str) -> cerrors.ConfigError:
    """A :class:`contract.errors.ConfigError` whose message is ``"field: reason"``."""
    return cerrors.ConfigError(f"{field}: {reason}")


#: The one status mapping (re-exported for the decode side's callers).
status_of = cerrors.status_of
