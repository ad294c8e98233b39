"""Exception types of the client SDK.

Every failure that :class:`client.Client` reports is a :class:`ClientError`.
Server errors arrive as :class:`tritonclient.utils.InferenceServerException`
and are translated in exactly one place, :func:`from_server_error`, by their
gRPC status name.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from tritonclient.utils import InferenceServerException

    from client.sdk import Result

__all__ = [
    "ClientError",
    "ClosedEarly",
    "DeadlineExceeded",
    "GenerationError",
    "InvalidConstraint",
    "InvalidRequest",
    "ServerBusy",
    "ServerUnavailable",
    "TruncatedOutput",
    "error_for_status",
    "from_server_error",
    "status_name",
]


class ClientError(Exception):
    """Base class of every error raised by :mod:`client`.

    Parameters
    ----------
    message : str
        Human-readable description.
    status : str or None
        The gRPC status name (``"INVALID_ARGUMENT"``, ...) when the error came
        from the server, else ``None``.
    """

    def __init__(self, message: str, *, status: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class InvalidRequest(ClientError, ValueError):
    """A request is malformed: rejected locally, or by the server.

    Parameters
    ----------
    field : str or None
        The request field at fault (``"max_tokens"``, ``"grammar_options.indent"``),
        or ``None`` when a server message names none.
    reason : str
        Why the value is rejected.
    status : str or None
        ``"INVALID_ARGUMENT"`` when the server rejected the request.
    """

    def __init__(self, field: str | None, reason: str, *, status: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason, status=status)
        self.field = field
        self.reason = reason


class InvalidConstraint(InvalidRequest):
    """A constraint or one of its options is invalid.

    Raised locally by the :class:`client.Constraint` builders, and for every
    server ``INVALID_ARGUMENT`` (the server cannot tell the client which part
    of the request was at fault other than by the field named in the message,
    which is kept in :attr:`field`).
    """


class TruncatedOutput(ClientError):
    """Generation stopped before the constraint was complete.

    At ``max_tokens`` (with ``on_budget: "truncate"``, or when no completion
    fitted), or at a stop string under a constraint.

    Parameters
    ----------
    result : client.sdk.Result
        The partial result (``complete`` is false).
    """

    def __init__(self, result: Result) -> None:
        where = "cut at a stop string" if result.stop_string else f"truncated at {result.usage.completion_tokens} tokens"
        super().__init__(
            f"output {where} (finish_reason={result.finish_reason!r}); the constraint is not complete"
        )
        self.result = result


class ClosedEarly(TruncatedOutput):
    """The server ended the output early with the shortest valid completion (``on_budget``/``on_repeat``).

    The output parses and matches the constraint (``result.parsed`` is set
    for JSON), but values may be cut short, so it is not ``complete``.

    Parameters
    ----------
    result : client.sdk.Result
        The result (``closed_early`` is true; ``close_reason`` says why).
    """

    def __init__(self, result: Result) -> None:
        ClientError.__init__(
            self,
            f"output closed early ({result.close_reason}) at {result.usage.completion_tokens} tokens: "
            "it matches the constraint but values may be cut short",
        )
        self.result = result


class ServerUnavailable(ClientError):
    """The server cannot be reached or is not serving (gRPC ``UNAVAILABLE``)."""


class ServerBusy(ServerUnavailable):
    """The server refused the request for lack of capacity (gRPC ``RESOURCE_EXHAUSTED``): retry later.

    Full request queue, sequence table or compile queue; nothing of the
    request was kept.
    """


class DeadlineExceeded(ClientError):
    """The call ran past its deadline (gRPC ``DEADLINE_EXCEEDED`` or the local timeout)."""


class GenerationError(ClientError):
    """Generation failed on the server, or the server broke the response contract.

    Parameters
    ----------
    message : str
        What went wrong.
    status : str or None
        The gRPC status name when known.
    result : client.sdk.Result or None
        The final result when the server sent one (``finish_reason == "error"``).
    """

    def __init__(self, message: str, *, status: str | None = None, result: Result | None = None) -> None:
        super().__init__(message, status=status)
        self.result = result


# Triton's ensemble scheduler prefixes a step's error with "in ensemble 'NAME', ".
_ENSEMBLE_PREFIX: Final = re.compile(r"^in ensemble '[^']*', ")
# The server's INVALID_ARGUMENT messages read "field: reason"; a field is a dotted
# path with optional index or JSON-pointer suffix, never containing spaces.
_FIELD_MESSAGE: Final = re.compile(r"^(?P<field>[A-Za-z_][\w.\[\]#/~-]*): (?P<reason>.+)$", re.DOTALL)


def status_name(status: str | None) -> str | None:
    """Normalise a tritonclient status string to the bare gRPC status name.

    Parameters
    ----------
    status : str or None
        ``InferenceServerException.status()``: ``"StatusCode.INVALID_ARGUMENT"``
        from gRPC errors, or ``None`` for errors reported in-band on a stream
        (no status) and for client-side errors.

    Returns
    -------
    str or None
        ``"INVALID_ARGUMENT"`` and so on, or ``None``.
    """
    if status is None:
        return None
    name = status.strip()
    name = name.removeprefix("StatusCode.")
    return name or None


# The gateway's own in-band refusals read "STATUS_NAME: message" (deploy/gateway.py).
_IN_BAND_STATUS: Final = re.compile(
    r"^(?P<status>INVALID_ARGUMENT|PERMISSION_DENIED|RESOURCE_EXHAUSTED|UNAVAILABLE|NOT_FOUND): (?P<message>.+)$",
    re.DOTALL,
)


def error_for_status(status: str | None, message: str, *, result: Result | None = None) -> ClientError:
    """The :class:`ClientError` for a gRPC status name: the SDK's one status mapping.

    ===================  ==========================
    gRPC status          raised
    ===================  ==========================
    INVALID_ARGUMENT     :class:`InvalidConstraint`
    UNAVAILABLE          :class:`ServerUnavailable`
    RESOURCE_EXHAUSTED   :class:`ServerBusy` (a :class:`ServerUnavailable`)
    DEADLINE_EXCEEDED    :class:`DeadlineExceeded`
    anything else, none  :class:`GenerationError`
    ===================  ==========================

    Used for gRPC statuses and for the ``status`` of an error ``RESULT``
    (errors as data, see :mod:`client.sdk`).

    Parameters
    ----------
    status : str or None
        Bare gRPC status name (``"INVALID_ARGUMENT"``), or None when unknown.
    message : str
        The server's message (``"field: reason"`` for INVALID_ARGUMENT).
    result : client.sdk.Result, optional
        The final result that carried the error (kept on :class:`GenerationError`).

    Returns
    -------
    ClientError
    """
    if status == "INVALID_ARGUMENT":
        match = _FIELD_MESSAGE.match(message)
        if match is not None:
            return InvalidConstraint(match["field"], match["reason"], status=status)
        return InvalidConstraint(None, message, status=status)
    if status == "UNAVAILABLE":
        return ServerUnavailable(f"server unavailable: {message}", status=status)
    if status == "RESOURCE_EXHAUSTED":
        return ServerBusy(f"server busy: {message}", status=status)
    if status == "DEADLINE_EXCEEDED":
        return DeadlineExceeded(f"deadline exceeded: {message}", status=status)
    label = status if status is not None else "server error"
    return GenerationError(f"{label}: {message}", status=status, result=result)


def from_server_error(err: InferenceServerException) -> ClientError:
    """Translate a tritonclient exception into the matching :class:`ClientError`.

    The status is the gRPC status of the call, or for an in-band stream error
    from the gateway the ``STATUS_NAME:`` prefix of its message; the mapping is
    :func:`error_for_status`.

    Parameters
    ----------
    err : tritonclient.utils.InferenceServerException
        The exception raised by, or passed to a stream callback by, tritonclient.

    Returns
    -------
    ClientError
        The exception to raise (``raise from_server_error(err) from err``).
    """
    status = status_name(err.status())
    raw = err.message()
    message = _ENSEMBLE_PREFIX.sub("", raw if raw is not None else str(err)).strip()
    if status is None:
        match = _IN_BAND_STATUS.match(message)
        if match is not None:
            status, message = match["status"], match["message"]
    return error_for_status(status, message)
