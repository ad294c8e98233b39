"""Exception types of the decode side.

They derive from :class:`grammar_backend.errors.GrammarError` (the project's one
error root, whose ``status`` is a gRPC status name), so the Triton adapters map
them with the same :func:`grammar_backend.errors.status_of` /
``triton_code_name`` as grammar errors; :class:`RequestError` is an
:class:`grammar_backend.errors.InvalidArgument` (``field: reason`` message).
"""

from __future__ import annotations

from typing import Final

from grammar_backend import errors as gerrors

CANCELLED: Final = "CANCELLED"

__all__ = [
    "CANCELLED",
    "EngineError",
    "Overloaded",
    "RequestError",
    "RuntimeErrorBase",
    "SchedulerClosed",
    "config_error",
    "status_of",
]


class RuntimeErrorBase(gerrors.GrammarError):
    """Base class of every error raised by :mod:`llm_runtime`."""

    status: str = gerrors.INTERNAL


class RequestError(gerrors.InvalidArgument, RuntimeErrorBase):
    """A generation request has a field that is missing, out of range or malformed.

    Parameters
    ----------
    field : str
        The request field at fault, e.g. ``"max_tokens"`` or ``"prompt_token_ids"``.
    reason : str
        Why the value is rejected.
    """

    status = gerrors.INVALID_ARGUMENT


class EngineError(RuntimeErrorBase):
    """The engine was used against its contract (unknown sequence, no free slot, ...)."""

    status = gerrors.INTERNAL


class Overloaded(RuntimeErrorBase):
    """The scheduler holds as many requests as it is configured to queue."""

    status = gerrors.RESOURCE_EXHAUSTED


class SchedulerClosed(RuntimeErrorBase):
    """The scheduler is shut down and accepts no more requests."""

    status = gerrors.UNAVAILABLE


def config_error(field: str, reason: str) -> gerrors.ConfigError:
    """A :class:`grammar_backend.errors.ConfigError` whose message is ``"field: reason"``."""
    return gerrors.ConfigError(f"{field}: {reason}")


def status_of(err: BaseException) -> str:
    """Return the gRPC status name for ``err`` (``INTERNAL`` for foreign exceptions)."""
    return gerrors.status_of(err)
