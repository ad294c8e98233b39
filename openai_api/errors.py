"""Errors of the OpenAI-compatible endpoint and their one mapping to HTTP and OpenAI's error JSON.

OpenAI answers an error with an HTTP status and the body
``{"error": {"message", "type", "param", "code"}}``; the ``openai`` Python
client raises a class per status (``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``NotFoundError`` for 404,
``RateLimitError`` for 429, ``InternalServerError`` for 5xx).  Every error
of this package is an :class:`OpenAIError` that carries those four fields;
:func:`from_status` maps the server's gRPC status names
(:mod:`contract.errors`, RESULT ``status``) onto them, the only place that
does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from contract import errors as status

__all__ = [
    "HTTP_STATUS",
    "BadRequest",
    "OpenAIError",
    "from_status",
]

#: gRPC status name (RESULT ``status``, the gateway's refusals) -> (HTTP status, OpenAI error ``type``).
#: The types are OpenAI's own (a bad key and an unknown model are ``invalid_request_error``
#: there too).  A compile deadline is 504, not 503: the request may succeed when retried
#: (the compile goes on and is cached), but the server is not down.
HTTP_STATUS: Final[Mapping[str, tuple[int, str]]] = {
    status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "invalid_request_error"),
    "PERMISSION_DENIED": (403, "invalid_request_error"),
    status.NOT_FOUND: (404, "invalid_request_error"),
    status.ALREADY_EXISTS: (409, "invalid_request_error"),
    status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    status.INTERNAL: (500, "server_error"),
    status.UNAVAILABLE: (503, "server_error"),
    status.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class OpenAIError(Exception):
    """An error answered as OpenAI's error JSON.

    Parameters
    ----------
    grpc_status : str
        A key of :data:`HTTP_STATUS`; sets ``http_status`` and ``type``.
    message : str
        ``error.message``.
    param : str or None
        ``error.param``: the request field at fault, as a dotted path into
        the request body (``"response_format.json_schema.schema.properties.a"``).
    code : str or None
        ``error.code``: a short machine-readable reason
        (``"invalid_api_key"``, ``"model_not_found"``, ...); default: the
        lower-cased gRPC status name.
    """

    def __init__(self, grpc_status: str, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        if grpc_status not in HTTP_STATUS:
            raise ValueError(f"grpc_status: unknown status {grpc_status!r}")
        super().__init__(message)
        self.grpc_status = grpc_status
        self.http_status, self.type = HTTP_STATUS[grpc_status]
        self.message = message
        self.param = param
        self.code = code if code is not None else grpc_status.lower()

    def body(self) -> dict[str, Any]:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(OpenAIError):
    """A request field is malformed, out of range, or not supported (HTTP 400).

    Parameters
    ----------
    param : str
        The field, as a dotted path into the request body.
    reason : str
        Why; the message is ``"param: reason"``.
    code : str, optional
        ``error.code`` (default ``"invalid_argument"``).
    """

    def __init__(self, param: str, reason: str, *, code: str | None = None) -> None:
        super().__init__(status.INVALID_ARGUMENT, f"{param}: {reason}", param=param, code=code)
        self.reason = reason


def from_status(grpc_status: str | None, message: str, *, param: str | None = None) -> OpenAIError:
    """The :class:`OpenAIError` for a server error (a RESULT or a refusal) with gRPC status ``grpc_status``.

    An unknown or missing status is ``INTERNAL`` (500): a server that
    answers without one has a bug, never the client.
    """
    name = grpc_status if grpc_status is not None and grpc_status in HTTP_STATUS else status.INTERNAL
    return OpenAIError(name, message, param=param)
