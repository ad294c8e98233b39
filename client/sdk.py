"""Python SDK for the ``constrained_llm`` Triton ensemble.

One call is one gRPC bidirectional stream (``start_stream`` +
``async_stream_infer``) to the server's gateway (``deploy/gateway.py``): the
server streams a text delta per response and a final ``RESULT`` JSON on the
last one (see the ensemble tensor contract).  A refused request is data too:
its ``RESULT`` has ``finish_reason: "error"`` and a gRPC ``status`` name,
which :func:`check_result` turns into the same typed errors as a gRPC status
(``INVALID_ARGUMENT`` -> :class:`~client.errors.InvalidConstraint`, ...).
Streams never send the ``triton_grpc_error`` header: on Triton 2.51 error
responses on such streams crash the server (the gateway strips it anyway).

Example
-------
>>> from client import Client, Constraint
>>> with Client("127.0.0.1:8001") as llm:                      # doctest: +SKIP
...     result = llm.generate("Name a colour.", constraint=Constraint.choice(["red", "blue"]))
...     result.text
'red'
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Self, TypedDict, Unpack

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import contract
from client.constraints import Constraint
from client.errors import (
    ClientError,
    ClosedEarly,
    DeadlineExceeded,
    GenerationError,
    InvalidRequest,
    ServerUnavailable,
    TruncatedOutput,
    error_for_status,
    from_server_error,
)
from contract.reasoning import Reasoning, reasoning_wire

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "REQUEST_FIELDS",
    "Chunk",
    "Client",
    "GenerateRequest",
    "JsonReport",
    "Reasoning",
    "RequestFields",
    "Result",
    "TokenLogprob",
    "TopLogprob",
    "Unenforced",
    "Usage",
    "Violation",
    "as_request",
    "build_inputs",
    "parse_logprobs",
    "parse_result",
]

DEFAULT_URL: Final = "127.0.0.1:8001"
DEFAULT_MODEL: Final = "constrained_llm"
DEFAULT_MAX_TOKENS: Final = 256
DEFAULT_TIMEOUT_S: Final = 300.0
#: Environment variable the SDK and CLI read the API key from when none is given.
API_KEY_ENV: Final = "CONSTRAINED_LLM_API_KEY"
FINISH_REASONS: Final = frozenset(contract.FINISH_REASONS)
#: ``RESULT.close_reason`` values (the request contract's).
CLOSE_REASONS: Final = frozenset(contract.CLOSE_REASONS)
#: Kinds whose RESULT carries a JSON report.
_JSON_KINDS: Final = frozenset(contract.JSON_KINDS)
# Safety net behind the gRPC stream deadline: the deadline normally ends a late
# call first (as DEADLINE_EXCEEDED); the local wait only catches a stream that
# neither answers nor fails.
_LOCAL_GRACE_S: Final = 5.0
# How long to wait for the stream thread's error after async_stream_infer fails.
_STREAM_ERROR_WAIT_S: Final = 1.0


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Usage:
    """Token counts of one request.

    Attributes
    ----------
    prompt_tokens : int
        Tokens in the templated prompt.
    completion_tokens : int
        Tokens generated.
    """

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Violation:
    """A JSON Schema violation found by the server's full validator.

    Attributes
    ----------
    pointer : str
        JSON pointer into the output.
    message : str
        The validator's message.
    """

    pointer: str
    message: str


@dataclass(frozen=True)
class Unenforced:
    """A schema keyword the decoder could not enforce (it is still validated afterwards).

    Attributes
    ----------
    pointer : str
        JSON pointer into the schema.
    keyword : str
        The keyword, e.g. ``"uniqueItems"``.
    """

    pointer: str
    keyword: str


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at an output position (:attr:`TokenLogprob.top_logprobs`).

    Attributes
    ----------
    token : str
        Its text: its UTF-8 ``bytes`` decoded, U+FFFD where they hold part of a character.
    bytes : list of int
        Its UTF-8 bytes (a byte-level token may hold part of a character).
    logprob : float
        Its log probability (<= 0).
    """

    token: str
    bytes: list[int]
    logprob: float

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``top_logprobs`` entry: ``{"token", "logprob", "bytes"}``."""
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability and its most likely alternatives (request field ``logprobs``).

    Taken after the grammar mask and the penalties, before temperature and
    ``top_k``/``top_p``/``min_p`` (:func:`contract.check_logprobs`): the
    alternatives are tokens the grammar allowed, most likely first, at most
    the request's ``logprobs`` of them; a token the server appended without
    sampling (jump-forward) or the grammar forced has ``logprob`` 0.0.

    Attributes
    ----------
    token : str
        Its text: its UTF-8 ``bytes`` decoded, U+FFFD where they hold part of
        a character (the ``bytes`` of all entries, joined, are the output's).
    bytes : list of int
        Its UTF-8 bytes.
    logprob : float
        Its log probability (<= 0).
    top_logprobs : tuple of TopLogprob
        The most likely tokens at its position, most likely first.
    """

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: tuple[TopLogprob, ...]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's chat ``logprobs.content`` entry: ``{"token", "logprob", "bytes", "top_logprobs"}``."""
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes),
                "top_logprobs": [top.to_openai() for top in self.top_logprobs]}


@dataclass(frozen=True)
class JsonReport:
    """The server's report on a JSON output (``json`` member of ``RESULT``).

    Attributes
    ----------
    parsed : bool
        The output parsed as JSON.
    parse_error : str or None
        Why it did not.
    valid : bool or None
        Valid under the schema (``None`` when there is no schema or it did not parse).
    violations : tuple of Violation
        Every schema violation.
    unenforced : tuple of Unenforced
        Schema keywords that decoding did not enforce.
    """

    parsed: bool
    parse_error: str | None
    valid: bool | None
    violations: tuple[Violation, ...]
    unenforced: tuple[Unenforced, ...]


@dataclass(frozen=True)
class Result:
    """The outcome of one request.

    Attributes
    ----------
    text : str
        The full output text.
    finish_reason : str
        ``"stop"``, ``"length"`` or ``"error"``.
    complete : bool
        The model finished the output on its own (a complete sentence of the
        constraint's language): false when it was truncated at
        ``max_tokens``, cut by a stop string under a constraint, or closed
        early by the server.
    usage : Usage
        Token counts.
    parsed : Any
        For ``json_schema``/``json_object`` constraints and a complete or
        closed-early output, the parsed Python object; else ``None``.
    json : JsonReport or None
        The server's JSON report, present for JSON constraints.
    error : str or None
        The server's error text when ``finish_reason`` is ``"error"``.
    status : str or None
        The gRPC status name of that error (``"INVALID_ARGUMENT"``, ``"UNAVAILABLE"``, ...).
    closed_early : bool
        The server forced the shortest completion of the constraint to end
        the output (option ``on_budget``/``on_repeat`` ``"close"``): it parses
        and matches the constraint, but values may be cut short, so
        ``complete`` is false.
    close_reason : str or None
        Why: one of :data:`CLOSE_REASONS` (``"budget"``: ``max_tokens`` was
        about to run out, ``finish_reason`` is ``"length"``; ``"repetition"``:
        the output kept repeating itself).
    stop_string : bool
        The output ended at one of the request's stop strings.
    backend : str or None
        The grammar engine that served the constraint (one of
        ``contract.BACKENDS``; option ``backend``); None without a constraint.
    value_retries : int
        Times a completed value broke the schema and was generated again
        (option ``value_retries``).
    value_dropped_tokens : int
        Tokens those retries dropped (generated, so paid for, but not part of
        the text nor of ``usage.completion_tokens``).
    reasoning : str or None
        With a thinking section (request field ``reasoning``): its text,
        markers left out; ``text`` is then the answer alone.  None without one.
    reasoning_tokens : int or None
        Tokens of the thinking section, its end marker included (part of
        ``usage.completion_tokens``); None where the server does not count
        them (no thinking section, or no constraint).
    reasoning_cut : bool
        The server ended the thinking by forcing its end marker
        (``max_reasoning_tokens``, or to leave room for the answer).
    reasoning_ended : bool
        The end marker was written, so the answer began (true without a thinking section).
    seed : int or None
        The seed the output's draws used: the request's, or the one the server
        drew for a request without one (send it as ``seed`` to replay the
        output); None for a request refused before generation.
    logprobs : list of TokenLogprob or None
        With the request field ``logprobs``: one entry per output token, in
        order (the end token that ended the output has none), joined from the
        streamed chunks' (:attr:`Chunk.logprobs`); None when not asked for.
    raw : Mapping[str, Any]
        The ``RESULT`` object as received.
    """

    text: str
    finish_reason: str
    complete: bool
    usage: Usage
    parsed: Any
    json: JsonReport | None
    error: str | None
    status: str | None = None
    closed_early: bool = False
    close_reason: str | None = None
    stop_string: bool = False
    backend: str | None = None
    value_retries: int = 0
    value_dropped_tokens: int = 0
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    reasoning_cut: bool = False
    reasoning_ended: bool = True
    seed: int | None = None
    logprobs: list[TokenLogprob] | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Chunk:
    """One piece of a streamed response.

    Attributes
    ----------
    text : str
        The text delta: with a thinking section, the answer's (both deltas
        may be empty only on the final chunk).
    result : Result or None
        Set on the final chunk only.
    reasoning : str
        The thinking section's delta ("" without one, or when this piece is
        all answer).  The deltas of each part, joined, are the result's
        ``reasoning`` and ``text``.
    logprobs : list of TokenLogprob or None
        With the request field ``logprobs``: the entries of the tokens the
        server delivered with this piece (None when not asked for).  They
        follow the text closely, not exactly: a token whose text the server
        holds back (part of a UTF-8 character, or text that may begin a stop
        string) can have its entry in an earlier chunk than its text.  The
        chunks' entries, joined, are :attr:`Result.logprobs`.
    """

    text: str
    result: Result | None = None
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None


def _malformed(path: str, reason: str) -> GenerationError:
    return GenerationError(f"malformed RESULT from server: {path}: {reason}")


def _get(obj: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], path: str, *, nullable: bool = False) -> Any:
    if key not in obj:
        raise _malformed(f"{path}.{key}", "missing")
    value = obj[key]
    if value is None and nullable:
        return None
    # bool is an int subclass: an int field must not accept true/false.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise _malformed(f"{path}.{key}", f"expected {_names(kinds)}, got {type(value).__name__}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _names(kinds: type | tuple[type, ...]) -> str:
    return " or ".join(kind.__name__ for kind in _as_tuple(kinds))


def _parse_json_report(obj: Any) -> JsonReport:
    if not isinstance(obj, dict):
        raise _malformed("RESULT.json", f"expected object or null, got {type(obj).__name__}")
    violations = []
    for index, item in enumerate(_get(obj, "violations", list, "RESULT.json")):
        path = f"RESULT.json.violations[{index}]"
        if not isinstance(item, dict):
            raise _malformed(path, f"expected object, got {type(item).__name__}")
        violations.append(Violation(_get(item, "pointer", str, path), _get(item, "message", str, path)))
    unenforced = []
    for index, item in enumerate(_get(obj, "unenforced", list, "RESULT.json")):
        path = f"RESULT.json.unenforced[{index}]"
        if not isinstance(item, dict):
            raise _malformed(path, f"expected object, got {type(item).__name__}")
        unenforced.append(Unenforced(_get(item, "pointer", str, path), _get(item, "keyword", str, path)))
    return JsonReport(
        parsed=_get(obj, "parsed", bool, "RESULT.json"),
        parse_error=_get(obj, "parse_error", str, "RESULT.json", nullable=True),
        valid=_get(obj, "valid", bool, "RESULT.json", nullable=True),
        violations=tuple(violations),
        unenforced=tuple(unenforced),
    )


def parse_result(text: str, kind: str | None) -> Result:
    """Parse the final ``RESULT`` tensor into a :class:`Result`.

    Parameters
    ----------
    text : str
        The ``RESULT`` JSON text.
    kind : str or None
        The request's constraint kind; for ``json_schema`` and ``json_object``
        a complete output is parsed into :attr:`Result.parsed`.

    Returns
    -------
    Result

    Raises
    ------
    GenerationError
        ``RESULT`` breaks the contract (bad JSON, a missing or ill-typed
        member, ``complete`` with ``finish_reason == "length"``), or a complete
        JSON-constrained output does not parse (the error carries the result).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise _malformed("RESULT", f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from err
    if not isinstance(obj, dict):
        raise _malformed("RESULT", f"expected object, got {type(obj).__name__}")
    finish_reason = _get(obj, "finish_reason", str, "RESULT")
    if finish_reason not in FINISH_REASONS:
        raise _malformed("RESULT.finish_reason", f"expected one of {sorted(FINISH_REASONS)}, got {finish_reason!r}")
    complete = _get(obj, "complete", bool, "RESULT")
    closed_early = _get(obj, "closed_early", bool, "RESULT") if "closed_early" in obj else False
    close_reason = _get(obj, "close_reason", str, "RESULT", nullable=True) if "close_reason" in obj else None
    if closed_early != (close_reason is not None) or close_reason not in (None, *CLOSE_REASONS):
        raise _malformed("RESULT.close_reason", f"{close_reason!r} with closed_early {closed_early}")
    backend = _get(obj, "backend", str, "RESULT", nullable=True) if "backend" in obj else None
    if backend not in (None, *contract.BACKENDS):
        raise _malformed("RESULT.backend", f"expected one of {list(contract.BACKENDS)} or null, got {backend!r}")
    if complete and (finish_reason != "stop" or closed_early):
        reason = "closed_early" if closed_early else f"finish_reason {finish_reason!r}"
        raise _malformed("RESULT.complete", f"true with {reason}")
    usage_obj = _get(obj, "usage", dict, "RESULT")
    usage = Usage(
        prompt_tokens=_get(usage_obj, "prompt_tokens", int, "RESULT.usage"),
        completion_tokens=_get(usage_obj, "completion_tokens", int, "RESULT.usage"),
    )
    output = _get(obj, "text", str, "RESULT")
    report_obj = obj.get("json")
    result = Result(
        text=output,
        finish_reason=finish_reason,
        complete=complete,
        usage=usage,
        parsed=None,
        json=None if report_obj is None else _parse_json_report(report_obj),
        error=_get(obj, "error", str, "RESULT", nullable=True) if "error" in obj else None,
        status=_get(obj, "status", str, "RESULT", nullable=True) if "status" in obj else None,
        closed_early=closed_early,
        close_reason=close_reason,
        stop_string=_get(obj, "stop_string", bool, "RESULT") if "stop_string" in obj else False,
        backend=backend,
        value_retries=_get(obj, "value_retries", int, "RESULT") if "value_retries" in obj else 0,
        value_dropped_tokens=_get(obj, "value_dropped_tokens", int, "RESULT") if "value_dropped_tokens" in obj else 0,
        seed=_get(obj, "seed", int, "RESULT", nullable=True) if "seed" in obj else None,
        raw=MappingProxyType(obj),
        **_reasoning_fields(obj),
    )
    if kind in _JSON_KINDS and (complete or closed_early):
        try:
            parsed = json.loads(output)
        except json.JSONDecodeError as err:
            state = "complete" if complete else "closed early"
            raise GenerationError(
                f"output is {state} under a {kind} constraint but is not JSON "
                f"(line {err.lineno} column {err.colno}: {err.msg})",
                result=result,
            ) from err
        if kind == "json_object" and not isinstance(parsed, dict):
            raise GenerationError(f"output is {'complete' if complete else 'closed early'} under a json_object "
                                  f"constraint but is a JSON {type(parsed).__name__}, not an object", result=result)
        result = dataclasses.replace(result, parsed=parsed)
    return result


def _bad_logprobs(path: str, reason: str) -> GenerationError:
    return GenerationError(f"malformed response from server: {path}: {reason}")


def _logprob_entry(obj: object, path: str) -> tuple[str, list[int], float]:
    """``token``, ``bytes`` and ``logprob`` of one entry of a ``TOKEN_LOGPROBS`` tensor."""
    if not isinstance(obj, dict):
        raise _bad_logprobs(path, f"expected an object, got {type(obj).__name__}")
    token, raw, logprob = obj.get("token"), obj.get("bytes"), obj.get("logprob")
    if not isinstance(token, str):
        raise _bad_logprobs(f"{path}.token", f"expected a string, got {type(token).__name__}")
    if not isinstance(raw, list) or not all(type(b) is int and 0 <= b <= 255 for b in raw):
        raise _bad_logprobs(f"{path}.bytes", "expected a list of byte values")
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not logprob <= 0.0:  # NaN fails too
        raise _bad_logprobs(f"{path}.logprob", f"expected a number <= 0, got {logprob!r}")
    return token, raw, float(logprob)


def parse_logprobs(data: bytes) -> list[TokenLogprob]:
    """Parse one response's ``TOKEN_LOGPROBS`` (a JSON array of OpenAI chat ``logprobs.content`` entries).

    Raises
    ------
    GenerationError
        It is not UTF-8 JSON of that shape.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad_logprobs("TOKEN_LOGPROBS", f"not a UTF-8 JSON array: {err}") from err
    if not isinstance(doc, list):
        raise _bad_logprobs("TOKEN_LOGPROBS", f"expected an array, got {type(doc).__name__}")
    out = []
    for i, item in enumerate(doc):
        path = f"TOKEN_LOGPROBS[{i}]"
        token, raw, logprob = _logprob_entry(item, path)
        tops = item.get("top_logprobs")
        if not isinstance(tops, list):
            raise _bad_logprobs(f"{path}.top_logprobs", f"expected an array, got {type(tops).__name__}")
        out.append(TokenLogprob(token, raw, logprob, tuple(
            TopLogprob(*_logprob_entry(top, f"{path}.top_logprobs[{j}]")) for j, top in enumerate(tops))))
    return out


def _reasoning_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The thinking members of a RESULT (present only for a request with a thinking section)."""
    if "reasoning" not in obj:
        return {}
    return {"reasoning": _get(obj, "reasoning", str, "RESULT"),
            "reasoning_tokens": _get(obj, "reasoning_tokens", int, "RESULT", nullable=True),
            "reasoning_cut": _get(obj, "reasoning_cut", bool, "RESULT"),
            "reasoning_ended": _get(obj, "reasoning_ended", bool, "RESULT")}


# --------------------------------------------------------------------------- requests
def _check_int(value: object, field_name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidRequest(field_name, f"must be an integer, got {type(value).__name__}")
    number = int(value)
    if number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(field_name, f"must be {bound}, got {number}")
    return number


def _check_float(value: object, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidRequest(field_name, f"must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(field_name, f"must be finite, got {number}")
    return number


def _messages_json(messages: object) -> str:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidRequest("messages", f"must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise InvalidRequest("messages", "must not be empty")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(where, f"must be a mapping with role and content, got {type(message).__name__}")
        unknown = sorted(set(message) - set(contract.MESSAGE_KEYS))
        if unknown:
            raise InvalidRequest(f"{where}.{unknown[0]}", f"unknown key; expected {', '.join(contract.MESSAGE_KEYS)}")
        for key in contract.MESSAGE_KEYS:
            if key not in message:
                if key == "name":
                    continue
                raise InvalidRequest(f"{where}.{key}", "is required")
            if not isinstance(message[key], str):
                raise InvalidRequest(f"{where}.{key}", f"must be a string, got {type(message[key]).__name__}")
        if not message["role"]:
            raise InvalidRequest(f"{where}.role", "must not be empty")
        out.append({key: message[key] for key in contract.MESSAGE_KEYS if key in message})
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def _stop_list(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, Sequence):
        raise InvalidRequest("stop", f"must be a string or a list of strings, got {type(stop).__name__}")
    for index, item in enumerate(stop):
        if not isinstance(item, str):
            raise InvalidRequest(f"stop[{index}]", f"must be a string, got {type(item).__name__}")
        if not item:
            raise InvalidRequest(f"stop[{index}]", "must not be empty")
    return list(stop)


class RequestFields(TypedDict, total=False):
    """The fields of :class:`GenerateRequest`, as keyword arguments (for ``**fields`` typing).

    One list: ``tests/unit/test_client_sdk.py`` checks that these keys and
    types are exactly the dataclass's fields.
    """

    prompt: str | None
    messages: Sequence[Mapping[str, str]] | None
    constraint: Constraint | None
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | Sequence[str] | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    min_p: float | None
    logprobs: int | None
    draft_tokens: int | None
    reasoning: Reasoning | bool | Mapping[str, Any] | None
    require_complete: bool


# A request tensor before it becomes an InferInput: (name, datatype, values).
# Kept as plain immutable values so a request can be sent any number of times,
# from any thread, each call getting fresh InferInput objects.
_Wire = tuple[str, str, tuple[bytes, ...] | tuple[int, ...] | tuple[float, ...]]
_DTYPES: Final[Mapping[str, type[np.generic]]] = MappingProxyType(
    {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64})


def _utf8(name: str, values: Sequence[str]) -> _Wire:
    encoded = []
    for i, value in enumerate(values):
        try:
            encoded.append(value.encode("utf-8"))
        except UnicodeEncodeError as err:
            where = name.lower() if len(values) == 1 else f"{name.lower()}[{i}]"
            raise InvalidRequest(
                where, f"is not valid Unicode: {err.reason} at character {err.start} ({value[err.start]!r})"
            ) from err
    return name, "BYTES", tuple(encoded)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, validated once when it is made.

    The single list of request fields: :meth:`Client.generate`,
    :meth:`Client.stream`, :func:`build_inputs` and the CLI all take these
    fields (as a ``GenerateRequest`` or as keyword arguments, typed by
    :class:`RequestFields`).  Construction checks every field with the
    server's own rules (``contract.check_sampling``), so a request that
    exists is one the server takes; :func:`dataclasses.replace` checks again.

    Parameters
    ----------
    prompt : str, optional
        User text; the server applies the chat template.  Exactly one of
        ``prompt`` and ``messages``.
    messages : sequence of {"role": str, "content": str}, optional
        A chat history.
    constraint : Constraint, optional
        ``None`` generates unconstrained text.
    max_tokens : int
        Generation budget, >= 1 (the server enforces its own upper bound).
    temperature : float
        >= 0; 0 is greedy.
    top_p : float, optional
        Nucleus mass in (0, 1].
    top_k : int, optional
        >= 1.
    seed : int, optional
        In [0, 2**64 - 1].
    stop : str or sequence of str, optional
        Stop strings (non-empty).
    repetition_penalty : float, optional
        In (0, 2]; 1 is off.  Tokens already in the prompt or the output get
        their logit divided (positive) or multiplied (negative) by it.
    frequency_penalty, presence_penalty : float, optional
        In [-2, 2]; 0 is off.  Subtracted from a token's logit once per time
        it occurs in the output (frequency) or once if it occurs (presence).
    min_p : float, optional
        In [0, 1]; 0 is off.  Sample only tokens at least ``min_p`` times as
        likely as the most likely one.
    logprobs : int, optional
        In [0, 20] (``contract.MAX_TOP_LOGPROBS``): report each output
        token's log probability and this many most likely alternatives
        (:attr:`Chunk.logprobs`, :attr:`Result.logprobs`, see
        :class:`TokenLogprob`); None (default) reports none.
    draft_tokens : int, optional
        In [0, 16] (``contract.MAX_DRAFT_TOKENS``): prompt-lookup speculation,
        the most tokens copied from earlier in the prompt and output that one
        forward may verify (0 turns it off; None, the default, takes the
        server's ``DRAFT_TOKENS``).  The output is the same with and without
        it (greedy); it pays where the output copies from the input.  Not
        with a penalty or ``logprobs`` (:func:`contract.check_draft_tokens`).
    reasoning : Reasoning, bool or mapping, optional
        The model thinks first (:mod:`contract.reasoning`): the constraint
        applies after the thinking's end marker, and the result carries the
        thinking apart from the answer.  ``Reasoning(end="</think>",
        start="<think>", max_reasoning_tokens=256)`` names the markers;
        ``True`` (or ``{"max_reasoning_tokens": 256}``) takes the server's
        markers; ``False`` turns it off where the server's model reasons by
        default; None (default) leaves it to the server.
    require_complete : bool
        Raise :class:`TruncatedOutput` (:class:`ClosedEarly`) when the output
        is incomplete (not sent to the server; the client checks the result).

    All four penalties apply after the grammar mask (see :data:`contract.PENALTY_FIELDS`).

    Raises
    ------
    InvalidRequest
        A field has the wrong type or is out of range (the message names it).

    Examples
    --------
    >>> request = GenerateRequest("Name a colour.", constraint=Constraint.choice(["red", "blue"]), max_tokens=8)
    >>> [tensor.name() for tensor in request.inputs()]
    ['PROMPT', 'GRAMMAR_TYPE', 'GRAMMAR', 'MAX_TOKENS', 'TEMPERATURE']
    """

    prompt: str | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    constraint: Constraint | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    draft_tokens: int | None = None
    reasoning: Reasoning | bool | Mapping[str, Any] | None = None
    require_complete: bool = True
    # The checked tensors, computed once by __post_init__ (not a request field).
    _wire: tuple[_Wire, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_wire", tuple(self._check()))

    def _check(self) -> list[_Wire]:
        # The order of the checks is the order of the tensors, so the first
        # bad field (in that order) is the one reported.
        prompt, messages, constraint = self.prompt, self.messages, self.constraint
        if (prompt is None) == (messages is None):
            raise InvalidRequest("prompt", "exactly one of prompt and messages is required")
        wire: list[_Wire] = []
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequest("prompt", f"must be a string, got {type(prompt).__name__}")
            wire.append(_utf8("PROMPT", [prompt]))
        else:
            wire.append(_utf8("MESSAGES", [_messages_json(messages)]))
        if constraint is not None:
            if not isinstance(constraint, Constraint):
                raise InvalidRequest("constraint", f"must be a Constraint, got {type(constraint).__name__}")
            wire.append(_utf8("GRAMMAR_TYPE", [constraint.kind]))
            wire.append(_utf8("GRAMMAR", [constraint.payload]))
            if constraint.options:
                wire.append(_utf8("GRAMMAR_OPTIONS", [constraint.options_json]))
        wire.append(("MAX_TOKENS", "INT32", (_check_int(self.max_tokens, "max_tokens", 1, contract.MAX_MAX_TOKENS),)))
        temp = _check_float(self.temperature, "temperature")
        mass = None if self.top_p is None else _check_float(self.top_p, "top_p")
        k = None if self.top_k is None else _check_int(self.top_k, "top_k", 0, contract.MAX_TOP_K)
        s = None if self.seed is None else _check_int(self.seed, "seed", 0, contract.SEED_LIMIT - 1)
        stops = _stop_list(self.stop)
        given = {name: getattr(self, name) for name in contract.PENALTY_FIELDS if getattr(self, name) is not None}
        penalties = {name: _check_float(value, name) for name, value in given.items()}
        try:  # the server's own rule (contract), so a request the client sends is one the server takes
            contract.check_sampling(temperature=temp, top_p=1.0 if mass is None else mass, top_k=k or 0, seed=s,
                                    stop=stops, **penalties)
        except contract.ContractError as err:
            raise InvalidRequest(err.field, err.reason) from err
        wire.append(("TEMPERATURE", "FP32", (temp,)))
        if mass is not None:
            wire.append(("TOP_P", "FP32", (mass,)))
        if k is not None:
            wire.append(("TOP_K", "INT32", (k,)))
        if s is not None:
            wire.append(("SEED", "UINT64", (s,)))
        for name in contract.PENALTY_FIELDS:  # the tensor is the field's name in capitals
            if name in penalties:
                wire.append((name.upper(), "FP32", (penalties[name],)))
        if stops:
            wire.append(_utf8("STOP", stops))
        try:
            thinking = reasoning_wire(self.reasoning)
        except contract.ContractError as err:
            raise InvalidRequest(err.field, err.reason) from err
        if thinking is not None:
            wire.append(_utf8("REASONING", [thinking]))
        try:  # the server's own checks, as for the sampling fields
            logprobs = contract.check_logprobs(self.logprobs)
            drafts = contract.check_draft_tokens(self.draft_tokens, penalties=penalties, logprobs=logprobs)
        except contract.ContractError as err:
            raise InvalidRequest(err.field, err.reason) from err
        if logprobs is not None:
            wire.append(("LOGPROBS", "INT32", (logprobs,)))
        if drafts is not None:
            wire.append(("DRAFT_TOKENS", "INT32", (drafts,)))
        return wire

    @property
    def kind(self) -> str | None:
        """The constraint's kind (``None`` without a constraint)."""
        return None if self.constraint is None else self.constraint.kind

    def inputs(self) -> list[grpcclient.InferInput]:
        """Build the input tensors of this request (fresh objects on every call).

        Tensors, in this order (``[1]`` shapes unless said; optional ones only when set):
        ``PROMPT`` or ``MESSAGES`` (BYTES); ``GRAMMAR_TYPE``, ``GRAMMAR`` (BYTES,
        when a constraint is given; ``GRAMMAR`` is empty for ``json_object``);
        ``GRAMMAR_OPTIONS`` (BYTES, when the constraint sets options);
        ``MAX_TOKENS`` (INT32); ``TEMPERATURE`` (FP32); ``TOP_P`` (FP32);
        ``TOP_K`` (INT32); ``SEED`` (UINT64); ``REPETITION_PENALTY``,
        ``FREQUENCY_PENALTY``, ``PRESENCE_PENALTY``, ``MIN_P`` (FP32); ``STOP`` (BYTES ``[n]``);
        ``REASONING`` (BYTES, JSON: ``contract.reasoning.reasoning_wire``);
        ``LOGPROBS`` (INT32); ``DRAFT_TOKENS`` (INT32).

        Returns
        -------
        list of tritonclient.grpc.InferInput
        """
        out = []
        for name, datatype, values in self._wire:
            tensor = grpcclient.InferInput(name, [len(values)], datatype)
            tensor.set_data_from_numpy(np.array(values, dtype=_DTYPES[datatype]))
            out.append(tensor)
        return out


#: The names of :class:`GenerateRequest`'s fields, in order (the keys of :class:`RequestFields`).
REQUEST_FIELDS: Final[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(GenerateRequest) if f.init)


def as_request(request: GenerateRequest | str | None = None, /, **fields: Unpack[RequestFields]) -> GenerateRequest:
    """Make a :class:`GenerateRequest` from what :meth:`Client.generate` accepts.

    Parameters
    ----------
    request : GenerateRequest or str, optional
        A ready request (``fields`` then replace some of its fields, checked
        again), or the prompt.
    **fields
        The request's fields (:class:`RequestFields`).

    Returns
    -------
    GenerateRequest

    Raises
    ------
    InvalidRequest
        A field is rejected.
    TypeError
        A field is unknown, or the prompt is given both positionally and as ``prompt``.
    """
    if isinstance(request, GenerateRequest):
        return dataclasses.replace(request, **fields) if fields else request
    if request is not None:
        if "prompt" in fields:
            raise TypeError("prompt given twice: positionally and as prompt=")
        fields["prompt"] = request  # a fresh dict of this call's keyword arguments
    return GenerateRequest(**fields)


def build_inputs(prompt: str | None = None, /, **fields: Unpack[RequestFields]) -> list[grpcclient.InferInput]:
    """Build and validate the input tensors of one request.

    Shorthand for ``GenerateRequest(prompt, **fields).inputs()``; kept for
    callers that need tensors only (``openai_api``).

    Parameters
    ----------
    prompt : str, optional
        As for :class:`GenerateRequest`.
    **fields
        The other fields of :class:`GenerateRequest` (:class:`RequestFields`).

    Returns
    -------
    list of tritonclient.grpc.InferInput
        As :meth:`GenerateRequest.inputs`.

    Raises
    ------
    InvalidRequest
        A parameter has the wrong type or is out of range (the message names it).
    """
    return as_request(prompt, **fields).inputs()


# --------------------------------------------------------------------------- responses
def _first_str(result: grpcclient.InferResult, name: str) -> bytes | None:
    array = result.as_numpy(name)
    if array is None:
        return None
    if array.size != 1:
        raise GenerationError(f"malformed response from server: {name}: expected 1 element, got {array.size}")
    value = array.reshape(-1)[0]
    if not isinstance(value, bytes):
        raise GenerationError(f"malformed response from server: {name}: expected BYTES, got {type(value).__name__}")
    return value


def _is_final(result: grpcclient.InferResult) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and bool(params["triton_final_response"].bool_param)


class StreamAssembler:
    """Turn the responses of one request into :class:`Chunk` objects.

    Feed every ``InferResult`` of the stream in order to :meth:`feed`; it
    returns the text chunk to hand out (or ``None``).  The request is over
    when :attr:`done` is true (Triton's ``triton_final_response`` flag); then
    :meth:`finish` returns the final chunk carrying the :class:`Result`.

    Parameters
    ----------
    kind : str or None
        The request's constraint kind (for :func:`parse_result`).
    """

    def __init__(self, kind: str | None) -> None:
        self._kind = kind
        # Deltas may split a UTF-8 sequence; the incremental decoders join them.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        self._thinking_decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        self._result_text: str | None = None
        self._finish_reason: str | None = None
        self._tail = ""
        self._thinking_tail = ""
        # With log probabilities (TOKEN_LOGPROBS on each response of a request that asked): all entries so far,
        # and those of the responses since the last chunk handed out.
        self._logprobs: list[TokenLogprob] | None = None
        self._tail_logprobs: list[TokenLogprob] | None = None
        self.done = False

    def feed(self, response: grpcclient.InferResult) -> Chunk | None:
        """Consume one response.

        Parameters
        ----------
        response : tritonclient.grpc.InferResult
            The next response of the stream.

        Returns
        -------
        Chunk or None
            A text chunk to hand out now; ``None`` when the response carries no
            new text, or when it carries the ``RESULT`` (its text goes into the
            final chunk).

        Raises
        ------
        GenerationError
            A response after the final one, invalid UTF-8, or a second ``RESULT``.
        """
        if self.done:
            raise GenerationError("malformed response stream: a response arrived after the final one")
        final = _is_final(response)
        raw_text = _first_str(response, "TEXT")
        raw_result = _first_str(response, "RESULT")
        raw_finish = _first_str(response, "FINISH_REASON")
        raw_thinking = _first_str(response, "REASONING_TEXT")  # sent only when the thinking has a delta
        raw_logprobs = _first_str(response, "TOKEN_LOGPROBS")  # sent only to a request that asked for them
        if raw_logprobs is not None:
            entries = parse_logprobs(raw_logprobs)
            if self._logprobs is None or self._tail_logprobs is None:
                self._logprobs, self._tail_logprobs = [], []
            self._logprobs.extend(entries)
            self._tail_logprobs.extend(entries)
        try:
            delta = self._decoder.decode(raw_text or b"", final=final)
        except UnicodeDecodeError as err:
            raise GenerationError(f"malformed response from server: TEXT is not UTF-8: {err}") from err
        try:
            thinking = self._thinking_decoder.decode(raw_thinking or b"", final=final)
        except UnicodeDecodeError as err:
            raise GenerationError(f"malformed response from server: REASONING_TEXT is not UTF-8: {err}") from err
        if raw_finish:
            self._finish_reason = raw_finish.decode("utf-8", errors="replace")
        if raw_result:
            if self._result_text is not None:
                raise GenerationError("malformed response stream: RESULT sent twice")
            try:
                self._result_text = raw_result.decode("utf-8")
            except UnicodeDecodeError as err:
                raise GenerationError(f"malformed response from server: RESULT is not UTF-8: {err}") from err
        self.done = final
        if self._result_text is not None or final:
            self._tail += delta
            self._thinking_tail += thinking
            return None
        if not (delta or thinking):
            return None  # its entries (if any) wait for the next chunk
        logprobs, self._tail_logprobs = self._tail_logprobs, None if self._tail_logprobs is None else []
        return Chunk(delta, reasoning=thinking, logprobs=logprobs)

    def finish(self) -> Chunk:
        """Return the final chunk once :attr:`done` is true.

        Returns
        -------
        Chunk
            The remaining text delta and the :class:`Result`.

        Raises
        ------
        GenerationError
            The stream ended without a ``RESULT``, ``FINISH_REASON`` disagrees
            with it, or ``RESULT`` is malformed.
        """
        if not self.done:
            raise GenerationError("response stream is not finished")
        if self._result_text is None:
            raise GenerationError("malformed response stream: the final response carried no RESULT")
        result = parse_result(self._result_text, self._kind)
        if self._finish_reason is not None and self._finish_reason != result.finish_reason:
            raise _malformed(
                "RESULT.finish_reason",
                f"{result.finish_reason!r} disagrees with FINISH_REASON {self._finish_reason!r}",
            )
        if self._logprobs is not None:
            result = dataclasses.replace(result, logprobs=self._logprobs)
        return Chunk(self._tail, result, self._thinking_tail, self._tail_logprobs)


def check_result(result: Result, *, require_complete: bool) -> None:
    """Raise for a result that is not a success.

    Parameters
    ----------
    result : Result
        A final result.
    require_complete : bool
        Treat ``complete == False`` as an error.

    Raises
    ------
    ClientError
        ``finish_reason`` is ``"error"``: the type follows ``result.status``
        (:func:`client.errors.error_for_status`: ``INVALID_ARGUMENT`` ->
        :class:`~client.errors.InvalidConstraint`, ``UNAVAILABLE`` ->
        :class:`~client.errors.ServerUnavailable`, others ->
        :class:`~client.errors.GenerationError`, carrying the result).
    TruncatedOutput
        The output is incomplete and ``require_complete`` is true
        (:class:`~client.errors.ClosedEarly` when the server closed it early).
    """
    if result.finish_reason == "error":
        raise error_for_status(result.status, result.error or "no reason given", result=result)
    if require_complete and not result.complete:
        raise ClosedEarly(result) if result.closed_early else TruncatedOutput(result)


# --------------------------------------------------------------------------- client
class Client:
    """Client of the ``constrained_llm`` ensemble over gRPC.

    Thread-safe: each call borrows a gRPC client from a small pool (one
    tritonclient ``InferenceServerClient`` holds at most one stream), so
    concurrent calls from several threads each get their own stream.

    Parameters
    ----------
    url : str
        ``host:port`` of Triton's gRPC endpoint.
    model : str
        The ensemble name.
    timeout_s : float or None
        Deadline of one whole call in seconds (the gRPC stream deadline);
        ``None`` waits without bound.
    verbose : bool
        tritonclient's verbose logging.
    tls : bool
        Connect with TLS (implied by ``ca_file``); without ``ca_file`` the
        system's root certificates verify the server.
    ca_file : str or Path, optional
        PEM CA bundle that signed the server's certificate.
    cert_file, key_file : str or Path, optional
        Client certificate and key for mutual TLS (both or neither).
    api_key : str, optional
        Sent as ``authorization: Bearer <key>`` on every call; default: the
        :data:`API_KEY_ENV` environment variable, if set.  Send keys over TLS only.

    Raises
    ------
    InvalidRequest
        ``timeout_s`` is not a positive number, ``url``/``model`` is empty, a
        TLS file cannot be read, or only one of ``cert_file``/``key_file`` is given.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        model: str = DEFAULT_MODEL,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        *,
        verbose: bool = False,
        tls: bool = False,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise InvalidRequest("url", "must be a non-empty host:port string")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model", "must be a non-empty string")
        if timeout_s is not None and not _check_float(timeout_s, "timeout_s") > 0.0:
            raise InvalidRequest("timeout_s", f"must be > 0 or None, got {timeout_s}")
        self.url = url
        self.model = model
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._verbose = verbose
        if (cert_file is None) != (key_file is None):
            raise InvalidRequest("cert_file" if cert_file is None else "key_file",
                                 "mutual TLS needs both cert_file and key_file")
        for name, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
            if path is not None and not os.access(path, os.R_OK):
                raise InvalidRequest(name, f"cannot read {os.fspath(path)!r}")
        self._tls = tls or ca_file is not None or cert_file is not None
        self._ca_file = None if ca_file is None else os.fspath(ca_file)
        self._cert_file = None if cert_file is None else os.fspath(cert_file)
        self._key_file = None if key_file is None else os.fspath(key_file)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        if key is not None and (not isinstance(key, str) or not key.strip() or any(c in key for c in "\r\n")):
            raise InvalidRequest("api_key", "must be a non-empty single-line string")
        self._headers: dict[str, str] | None = None if key is None else {"authorization": f"Bearer {key.strip()}"}
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ pool
    def _acquire(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            if self._closed:
                raise ClientError("client is closed")
            if self._idle:
                return self._idle.pop()
        return grpcclient.InferenceServerClient(
            self.url, verbose=self._verbose, ssl=self._tls, root_certificates=self._ca_file,
            private_key=self._key_file, certificate_chain=self._cert_file)

    def _release(self, conn: grpcclient.InferenceServerClient, *, healthy: bool) -> None:
        # A channel that saw UNAVAILABLE sits in gRPC reconnect backoff (up to
        # 120 s); dropping it lets the next call connect as soon as the server is back.
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close every pooled connection; later calls raise :class:`ClientError`."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls
    def is_ready(self) -> bool:
        """Whether the server is live and the model is ready.

        Returns
        -------
        bool
            ``False`` when the server is unreachable or the model is not ready.

        Raises
        ------
        ClientError
            Any other server error (mapped by :func:`client.errors.from_server_error`).
        """
        conn = self._acquire()
        healthy = True
        try:
            return bool(
                conn.is_server_ready(headers=self._headers, client_timeout=self.timeout_s)
                and conn.is_model_ready(self.model, headers=self._headers, client_timeout=self.timeout_s)
            )
        except InferenceServerException as err:
            mapped = from_server_error(err)
            healthy = False
            if isinstance(mapped, ServerUnavailable):
                return False
            raise mapped from err
        finally:
            self._release(conn, healthy=healthy)

    def generate(self, request: GenerateRequest | str | None = None, /, **fields: Unpack[RequestFields]) -> Result:
        """Generate a whole response.

        Parameters
        ----------
        request : GenerateRequest or str, optional
            A ready :class:`GenerateRequest` (``fields`` then replace some of
            its fields), or the prompt.
        **fields
            The fields of :class:`GenerateRequest` (:class:`RequestFields`):
            ``prompt``, ``messages``, ``constraint``, ``max_tokens``,
            ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
            ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``,
            ``min_p``, and ``require_complete`` (raise :class:`TruncatedOutput`
            when the output is incomplete).

        Returns
        -------
        Result

        Raises
        ------
        InvalidRequest
            A parameter is rejected locally.
        InvalidConstraint
            The server rejected the request (``INVALID_ARGUMENT``).
        TruncatedOutput
            ``finish_reason == "length"`` and ``require_complete``.
        ServerUnavailable, DeadlineExceeded, GenerationError
            Transport or server failures.
        """
        chunks = self.stream(as_request(request, **fields))
        result: Result | None = None
        # The stream raises (truncation, error) on the step after the final
        # chunk, so a loop that ends normally has seen a successful result.
        for chunk in chunks:
            if chunk.result is not None:
                result = chunk.result
        if result is None:
            raise GenerationError("response stream ended without a final result")
        return result

    def stream(
        self, request: GenerateRequest | str | None = None, /, **fields: Unpack[RequestFields]
    ) -> Generator[Chunk, None, None]:
        """Stream a response as text deltas.

        The request is validated before this returns.  The iterator yields a
        :class:`Chunk` per non-empty delta and always ends with a chunk whose
        ``result`` is set.  If that result is an error (``finish_reason ==
        "error"``) or incomplete while ``require_complete``, the exception is
        raised on the step after the final chunk, so a consumer has already
        seen all text.  Stopping early (``break``, ``close()``, garbage
        collection) cancels the request on the server.

        Parameters
        ----------
        request : GenerateRequest or str, optional
            As for :meth:`generate`.
        **fields
            As for :meth:`generate`; with ``require_complete``, the error is
            raised after the final chunk of an incomplete output.

        Returns
        -------
        Iterator[Chunk]

        Raises
        ------
        InvalidRequest
            Immediately, for a parameter rejected locally.
        InvalidConstraint, TruncatedOutput, ServerUnavailable, DeadlineExceeded, GenerationError
            While iterating, as for :meth:`generate`.
        """
        req = as_request(request, **fields)
        return self._run(req.inputs(), req.kind, req.require_complete)

    def _run(
        self, inputs: list[grpcclient.InferInput], kind: str | None, require_complete: bool
    ) -> Generator[Chunk, None, None]:
        events: queue.SimpleQueue[tuple[grpcclient.InferResult | None, InferenceServerException | None]]
        events = queue.SimpleQueue()

        def on_response(result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
            events.put((result, error))

        conn = self._acquire()
        stopped = False
        healthy = True
        request_id = uuid.uuid4().hex
        assembler = StreamAssembler(kind)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s + _LOCAL_GRACE_S
        try:
            try:
                conn.start_stream(callback=on_response, stream_timeout=self.timeout_s, headers=self._headers)
                conn.async_stream_infer(
                    self.model, inputs, request_id=request_id, enable_empty_final_response=True
                )
            except InferenceServerException as err:
                # When the connection fails at once (server down), tritonclient's
                # stream thread marks the stream dead and only then hands the real
                # error (UNAVAILABLE) to the callback; async_stream_infer meanwhile
                # raises a generic "stream is no longer in valid state" without a
                # status.  Prefer the callback's error; it follows within microseconds.
                try:
                    _, stream_error = events.get(timeout=_STREAM_ERROR_WAIT_S)
                except queue.Empty:
                    stream_error = None
                cause = stream_error if stream_error is not None else err
                mapped = from_server_error(cause)
                healthy = not isinstance(mapped, ServerUnavailable)
                raise mapped from cause
            while not assembler.done:
                try:
                    if deadline is None:
                        response, error = events.get()
                    else:
                        response, error = events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty as err:
                    raise DeadlineExceeded(f"no response within timeout_s={self.timeout_s} s") from err
                if error is not None:
                    mapped = from_server_error(error)
                    healthy = not isinstance(mapped, ServerUnavailable)
                    raise mapped from error
                if response is None:
                    raise GenerationError("stream callback delivered neither a result nor an error")
                chunk = assembler.feed(response)
                if chunk is not None:
                    yield chunk
            final = assembler.finish()
            final_result = final.result
            if final_result is None:
                raise GenerationError("response stream ended without a final result")
            conn.stop_stream(cancel_requests=False)
            stopped = True
        finally:
            if not stopped:
                # Consumer stopped early or an error ended the call: cancel the
                # gRPC call.  The gateway sees the departure, cancels the request
                # inside the server (CANCEL to `llm`) and drains it; the client
                # never needs to know the server's internals.
                conn.stop_stream(cancel_requests=True)
            self._release(conn, healthy=healthy)
        yield final
        check_result(final_result, require_complete=require_complete)
