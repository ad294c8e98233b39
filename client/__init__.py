"""Client SDK and CLI for grammar-constrained generation on Triton.

>>> from client import Client, Constraint
"""

from client.constraints import Constraint
from client.errors import (
    ClientError,
    ClosedEarly,
    DeadlineExceeded,
    GenerationError,
    InvalidConstraint,
    InvalidRequest,
    ServerBusy,
    ServerUnavailable,
    TruncatedOutput,
)
from client.sdk import Chunk, Client, GenerateRequest, JsonReport, Reasoning, Result, Unenforced, Usage, Violation

__all__ = [
    "Chunk",
    "Client",
    "ClientError",
    "ClosedEarly",
    "Constraint",
    "DeadlineExceeded",
    "GenerateRequest",
    "GenerationError",
    "InvalidConstraint",
    "InvalidRequest",
    "JsonReport",
    "Reasoning",
    "Result",
    "ServerBusy",
    "ServerUnavailable",
    "TruncatedOutput",
    "Unenforced",
    "Usage",
    "Violation",
]
