"""OpenAI request bodies -> one ensemble request (:class:`Plan`), every field honoured or refused by name.

The checks of the request itself (ranges, stop strings, constraint options)
are the SDK's (:func:`client.sdk.build_inputs`, :class:`client.Constraint`),
which are the server's own rules (:mod:`contract`); this module checks only
what is OpenAI's: the body's shape, which fields exist, and strict mode
(:mod:`openai_api.strict`).  Each error is a :class:`~openai_api.errors.BadRequest`
whose ``param`` is the field's path in the body.

Fields of ``POST /v1/chat/completions`` (OpenAI's reference, 2026):

* honoured: ``model``, ``messages`` (every field of OpenAI's message
  reference: :data:`MESSAGE_FIELDS`, rendered by :mod:`openai_api.history`;
  content a string or parts of type ``text``), ``max_tokens``,
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed`` (without
  one the server draws one and reports it), ``stop``, ``frequency_penalty``,
  ``presence_penalty`` (the output's tokens, after the grammar mask:
  :data:`contract.PENALTY_FIELDS`), ``n`` (1 to :data:`contract.MAX_CHOICES`
  independent sequences; a seeded request's choice ``i`` uses ``seed + i``),
  ``logprobs`` and ``top_logprobs`` (after the grammar mask:
  :func:`contract.check_logprobs`), ``stream``,
  ``stream_options.include_usage``, ``response_format``, ``tools``,
  ``tool_choice``, ``parallel_tool_calls`` (tools and ``response_format``
  together: calls, or the answer in that format); ``user``,
  ``safety_identifier`` and ``prompt_cache_key`` are opaque identifiers
  (checked as strings; the server keeps no per-user state); vLLM's top-level
  ``top_k``, ``min_p`` and ``repetition_penalty`` (aliases of the
  extension's);
* accepted only at the value that asks for nothing (:data:`NEUTRAL`):
  ``logit_bias`` empty, ``modalities`` ``["text"]``, ``store`` false,
  ``metadata`` empty, ``service_tier`` ``auto``/``default``; anything else is
  a 400 naming the field;
* refused whenever set: ``audio``, ``prediction``, ``reasoning_effort``,
  ``verbosity``, ``web_search_options``, ``prompt_cache_retention``, the
  deprecated ``functions``/``function_call`` (use ``tools``);
* any other field is a 400 (OpenAI's "Unrecognized request argument").

``POST /v1/completions`` takes the same sampling fields, ``n``,
``logprobs`` (an integer: alternatives per token) and, as vLLM does,
``response_format``.

The extension key :data:`EXTENSION` (``extra_body={"constrained_llm": {...}}``
in the ``openai`` client) takes the project's other constraint kinds and
options: exactly one of ``regex``, ``choice``, ``ebnf`` (alias ``grammar``),
``lark``, ``structural_tag``; ``options`` (``contract.OPTION_NAMES``: applied
to whichever constraint the request has); the sampling fields OpenAI lacks:
``top_k``, ``repetition_penalty``, ``min_p`` (:data:`EXTENSION_SAMPLING`);
``reasoning`` (the request's thinking section, :mod:`contract.reasoning`:
``true``, ``false`` or ``{start, end, max_reasoning_tokens}``; a server whose
model reasons has it on by default); ``draft_tokens`` (prompt-lookup
speculation, :func:`contract.check_draft_tokens`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, overload

import tritonclient.grpc as grpcclient
from tritonclient.grpc import _utils as triton_utils
from tritonclient.grpc import service_pb2 as pb

import contract
from client.constraints import Constraint
from client.errors import ClientError, InvalidRequest
from client.sdk import build_inputs
from openai_api.errors import BadRequest
from openai_api.history import Turn, assistant_turn, check_arguments, text_turn, tool_result_turn, with_system
from openai_api.strict import check_strict, pointer_path
from openai_api.tools import Tool, ToolMode, tool_constraint, tools_prompt

__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "EXTENSION", "NEUTRAL", "REFUSED", "Plan", "client_error_param",
           "parse_chat", "parse_completion"]

#: The request (and response) key of the project's extensions.
EXTENSION: Final = "constrained_llm"
#: OpenAI's default ``max_tokens`` of ``/v1/completions`` (16); chat uses the SDK's default.
COMPLETION_DEFAULT_MAX_TOKENS: Final = 16
#: Fields accepted only at these values, and why any other value is refused.
NEUTRAL: Final[Mapping[str, tuple[tuple[Any, ...], str]]] = {
    "logit_bias": (({},), "not supported (the grammar mask decides which tokens are allowed)"),
    "modalities": ((["text"],), "only text output is supported"),
    "store": ((False,), "stored completions are not supported"),
    "metadata": (({},), "stored completions are not supported (metadata goes with store)"),
    "service_tier": (("auto", "default"), "this server has one service tier"),
    "best_of": ((1,), "only 1 candidate per request is supported"),
    "echo": ((False,), "the prompt is not echoed"),
    "suffix": (("",), "insertion (suffix) is not supported"),
}
#: Fields refused whenever set (not null), with the reason.
REFUSED: Final[Mapping[str, str]] = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning controls are not supported by this model",
    "verbosity": "not supported by this model",
    "web_search_options": "web search is not supported",
    "prompt_cache_retention": "prompt caching is not configurable",
    "functions": "deprecated by OpenAI and not supported: use tools",
    "function_call": "deprecated by OpenAI and not supported: use tool_choice",
}
_IDENTIFIERS: Final = ("user", "safety_identifier", "prompt_cache_key")
_PENALTIES: Final = ("frequency_penalty", "presence_penalty")
#: The SDK's sampling fields the extension takes (OpenAI has no such field), and their JSON type; vLLM's
#: top-level fields of the same names are their aliases.
EXTENSION_SAMPLING: Final[Mapping[str, type]] = {"top_k": int, "repetition_penalty": float, "min_p": float}
_CHAT_HONOURED: Final = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                         *_PENALTIES, "seed", "stop", "stream", "stream_options", "response_format", "tools", "tool_choice",
                         "parallel_tool_calls", "n", "logprobs", "top_logprobs", *_IDENTIFIERS, *EXTENSION_SAMPLING,
                         EXTENSION)
_CHAT_NEUTRAL: Final = ("logit_bias", "modalities", "store", "metadata", "service_tier")
#: Every field ``/v1/chat/completions`` knows (honoured, neutral-only, refused).
CHAT_FIELDS: Final = frozenset((*_CHAT_HONOURED, *_CHAT_NEUTRAL, *REFUSED))
_COMPLETION_HONOURED: Final = ("model", "prompt", "max_tokens", "temperature", "top_p", *_PENALTIES, "seed", "stop",
                               "stream", "stream_options", "user", "response_format", "n", "logprobs",
                               *EXTENSION_SAMPLING, EXTENSION)
_COMPLETION_NEUTRAL: Final = ("logit_bias", "best_of", "echo", "suffix")
#: Every field ``/v1/completions`` knows.
COMPLETION_FIELDS: Final = frozenset((*_COMPLETION_HONOURED, *_COMPLETION_NEUTRAL))
_EXTENSION_KINDS: Final[Mapping[str, str]] = {"regex": "regex", "choice": "choice", "ebnf": "ebnf",
                                             "grammar": "ebnf", "lark": "lark",
                                             "structural_tag": "structural_tag"}
_EXTENSION_FIELDS: Final = (*_EXTENSION_KINDS, "options", *EXTENSION_SAMPLING, "reasoning", "draft_tokens")
# The SDK's names for a constraint's payload itself (its errors are about the field as a whole).
_PAYLOAD_FIELDS: Final = ("grammar", "schema", "regex", "ebnf", "lark", "choices", "structural_tag")
_SCHEMA_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The fields of each message role in OpenAI's chat reference (2026), and on an assistant message also
#: what a client appends back of a response: the openai SDK's ``parsed`` (after ``.parse()``), web
#: search ``annotations``, and this server's ``reasoning_content``.
MESSAGE_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "refusal", "tool_calls", "function_call", "audio", "annotations",
                  "parsed", "reasoning_content"),
    "tool": ("role", "content", "tool_call_id"),
    "function": ("role", "content", "name"),
}
Endpoint = Literal["chat", "completions", "responses"]


@dataclass(frozen=True)
class Plan:
    """One OpenAI request, checked and translated.

    Attributes
    ----------
    endpoint : {"chat", "completions", "responses"}
    model : str
        The ``model`` asked for (a served model: checked by the server module).
    inputs : list of tritonclient.grpc.InferInput
        The ensemble's input tensors (:func:`client.sdk.build_inputs`) of the first choice.
    kind : str or None
        The constraint kind (None: unconstrained).
    constraint_param : str or None
        Where the constraint came from in the body (the ``param`` of a
        constraint the server refuses).
    max_tokens_param : str
        ``max_tokens`` or ``max_completion_tokens``: the field the budget came from.
    stream, include_usage : bool
    tools : tuple of Tool
        The callable functions (empty without tools or under ``tool_choice: none``).
    tool_mode : {"auto", "required", "named"} or None
    more_inputs : tuple of list of InferInput
        The input tensors of choices 2 to ``n`` (``n``: each choice is one sequence of its own, with its
        own grammar row; a seeded request's choice ``i`` draws with seed ``seed + i``).
    logprobs : int or None
        Alternatives reported per output token (``top_logprobs``); None: no log probabilities.
    max_tokens : int
        The budget (the Responses API echoes it).
    """

    endpoint: Endpoint
    model: str
    inputs: list[grpcclient.InferInput]
    kind: str | None
    constraint_param: str | None
    max_tokens_param: str
    stream: bool
    include_usage: bool
    tools: tuple[Tool, ...] = ()
    tool_mode: ToolMode | None = None
    more_inputs: tuple[list[grpcclient.InferInput], ...] = ()
    logprobs: int | None = None
    max_tokens: int = 0

    @property
    def n(self) -> int:
        """The number of choices."""
        return 1 + len(self.more_inputs)

    def infer_request(self, model_name: str, choice: int = 0) -> pb.ModelInferRequest:
        """The ``ModelInferRequest`` of this plan's choice ``choice`` for the ensemble ``model_name``."""
        inputs = self.inputs if choice == 0 else self.more_inputs[choice - 1]
        return triton_utils._get_inference_request(
            model_name=model_name, inputs=inputs, model_version="", request_id="", outputs=None,
            sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None)

    def param_of(self, field: str | None) -> str | None:
        """The body path of a field the server names (``grammar#/properties/a``, ``max_tokens``, ``messages[0]``)."""
        if field is None:
            return None
        head, _, pointer = field.partition("#")
        if head == "grammar_options":
            return f"{EXTENSION}.options"
        if head.startswith("grammar_options."):
            return f"{EXTENSION}.options.{head.removeprefix('grammar_options.')}"
        if head in ("grammar", "grammar_type"):
            if self.constraint_param == "tools":
                # The pointer is into the structural tag built from the tools, not into the body.
                return "tools"
            return pointer_path(self.constraint_param or EXTENSION, pointer)
        if head == "max_tokens":
            return self.max_tokens_param
        if head.partition(".")[0] == "reasoning":
            return f"{EXTENSION}.{head}"
        return head


# --------------------------------------------------------------------------- helpers
def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(param, f"must be an object, got {_type(value)}")
    return value


def _type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _string(value: Any, param: str, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRequest(param, f"must be a string, got {_type(value)}")
    if not empty and not value:
        raise BadRequest(param, "must not be empty")
    return value


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(param, f"must be a boolean, got {_type(value)}")
    return value


def _fields(body: dict[str, Any], known: frozenset[str], neutral: Sequence[str]) -> None:
    for name in body:
        if name not in known:
            raise BadRequest(name, "unrecognized request argument", code="unknown_parameter")
    for name in neutral:
        value = body.get(name)
        accepted, reason = NEUTRAL[name]
        if value is not None and not any(type(value) is type(a) and value == a for a in accepted):
            raise BadRequest(name, f"{reason}; got {json.dumps(value)}", code="unsupported_parameter")
    for name, reason in REFUSED.items():
        if name in known and body.get(name) is not None:
            raise BadRequest(name, reason, code="unsupported_parameter")
    for name in _IDENTIFIERS:
        if name in known and body.get(name) is not None:
            _string(body[name], name, empty=True)


def _max_tokens(body: dict[str, Any], default: int) -> tuple[int, str]:
    given = [name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise BadRequest("max_tokens", "differs from max_completion_tokens; give one of them")
    if not given:
        return default, "max_tokens"
    value = body[given[0]]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(given[0], f"must be an integer, got {_type(value)}")
    return value, given[0]


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    stream = False if stream is None else _bool(stream, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    options = _object(options, "stream_options")
    if not stream:
        raise BadRequest("stream_options", "only allowed when stream is true")
    for name in options:
        if name not in ("include_usage", "include_obfuscation"):
            raise BadRequest(f"stream_options.{name}", "unrecognized stream option")
    if options.get("include_obfuscation") not in (None, False):
        raise BadRequest("stream_options.include_obfuscation", "obfuscation padding is not sent by this server")
    usage = options.get("include_usage")
    return stream, False if usage is None else _bool(usage, "stream_options.include_usage")


@overload
def _number(body: dict[str, Any], name: str, default: float) -> float: ...
@overload
def _number(body: dict[str, Any], name: str, default: None) -> float | None: ...
def _number(body: dict[str, Any], name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(name, f"must be a number, got {_type(value)}")
    return float(value)


def _extension(body: dict[str, Any]) -> tuple[Constraint | None, str | None, dict[str, Any], dict[str, Any]]:
    """The extension's constraint (and its param), options and sampling fields (:data:`EXTENSION_SAMPLING`)."""
    raw = body.get(EXTENSION)
    if raw is None:
        return None, None, {}, {}
    ext = _object(raw, EXTENSION)
    for name in ext:
        if name not in _EXTENSION_FIELDS:
            raise BadRequest(f"{EXTENSION}.{name}", f"unknown field; expected one of {', '.join(_EXTENSION_FIELDS)}")
    kinds = [name for name in _EXTENSION_KINDS if ext.get(name) is not None]
    if len(kinds) > 1:
        raise BadRequest(f"{EXTENSION}.{kinds[1]}", f"give one constraint, not {' and '.join(kinds)}")
    options = _object(ext.get("options", {}), f"{EXTENSION}.options")
    sampling: dict[str, Any] = {}
    for name in EXTENSION_SAMPLING:
        if ext.get(name) is not None:
            sampling[name] = _sampling_value(ext[name], name, f"{EXTENSION}.{name}")
    if ext.get("reasoning") is not None:
        sampling["reasoning"] = ext["reasoning"]  # checked with the SDK's request (contract.reasoning)
    if ext.get("draft_tokens") is not None:
        sampling["draft_tokens"] = ext["draft_tokens"]  # checked with the SDK's request (contract.check_draft_tokens)
    if not kinds:
        return None, None, options, sampling
    name = kinds[0]
    param = f"{EXTENSION}.{name}"
    value = ext[name]
    with _as_bad_request(param):
        kind = _EXTENSION_KINDS[name]
        if kind == "choice":
            constraint = Constraint.choice(value)
        elif kind == "structural_tag":
            constraint = Constraint.structural_tag_raw(_object(value, param))
        elif kind == "regex":
            constraint = Constraint.regex(_string(value, param))
        elif kind == "ebnf":
            constraint = Constraint.ebnf(_string(value, param))
        else:
            constraint = Constraint.lark(_string(value, param))
    return constraint, param, options, sampling


def _sampling_value(value: Any, name: str, param: str) -> Any:
    want = EXTENSION_SAMPLING[name]
    if isinstance(value, bool) or not isinstance(value, (int, float) if want is float else int):
        raise BadRequest(param, f"must be {'a number' if want is float else 'an integer'}, got {_type(value)}")
    return want(value)


def _top_level_sampling(body: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """``sampling`` with vLLM's top-level ``top_k``, ``min_p`` and ``repetition_penalty`` (aliases of the
    extension's fields: clients moving from vLLM, SGLang or llama.cpp send them there)."""
    out = dict(sampling)
    for name in EXTENSION_SAMPLING:
        if body.get(name) is None:
            continue
        value = _sampling_value(body[name], name, name)
        if name in out and out[name] != value:
            raise BadRequest(name, f"differs from {EXTENSION}.{name}; give one of them")
        out[name] = value
    return out


def _backend(options: Mapping[str, Any]) -> str:
    """The ``backend`` option of a request (a bad value is refused with the options, later)."""
    value = options.get("backend", "auto")
    return value if isinstance(value, str) and value in contract.POLICIES["backend"] else "auto"


@contextmanager
def _as_bad_request(param: str) -> Iterator[None]:
    """Turn the SDK's :class:`InvalidRequest` into a :class:`BadRequest` under ``param``."""
    try:
        yield
    except InvalidRequest as err:
        raise BadRequest(_sdk_path(param, err.field), err.reason) from err


def _sdk_path(param: str, field: str | None) -> str:
    """The body path of a field the SDK names under the constraint at ``param``.

    The SDK names the payload itself (``schema``, ``choices``, ...) and then
    a JSON pointer (``schema#/properties/a``), a key (``structural_tag.type``)
    or an index (``choices[1]``) inside it; the payload is ``param`` here.
    """
    if not field:
        return param
    for name in _PAYLOAD_FIELDS:
        if field == name:
            return param
        rest = field.removeprefix(name)
        if rest != field and rest[0] in "#.[":
            return pointer_path(param, rest[1:]) if rest[0] == "#" else param + rest
    return f"{param}.{field}"


#: Schema keywords whose value is an array: a pointer's number after one is an index (``anyOf[1]``).
def _response_format(body: dict[str, Any], backend: str) -> tuple[Constraint | None, str | None]:
    raw = body.get("response_format")
    if raw is None:
        return None, None
    fmt = _object(raw, "response_format")
    kind = fmt.get("type")
    allowed = {"text": (), "json_object": (), "json_schema": ("json_schema",)}
    if kind not in allowed:
        raise BadRequest("response_format.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    for name in fmt:
        if name != "type" and name not in allowed[kind]:
            raise BadRequest(f"response_format.{name}", f"unknown field for type {kind}")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return Constraint.json_object(), "response_format"
    spec = _object(fmt.get("json_schema"), "response_format.json_schema")
    return schema_format(spec, "response_format.json_schema", backend)


def _named(spec: dict[str, Any], where: str, known: Sequence[str]) -> tuple[str, str]:
    """The ``name`` and ``description`` of a schema format or a function, its keys checked against ``known``."""
    for key in spec:
        if key not in known:
            raise BadRequest(f"{where}.{key}", f"unknown field; expected {', '.join(known)}")
    name = _string(spec.get("name"), f"{where}.name")
    if not _SCHEMA_NAME.match(name):
        raise BadRequest(f"{where}.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    description = spec.get("description")
    return name, "" if description is None else _string(description, f"{where}.description", empty=True)


def schema_format(spec: dict[str, Any], where: str, backend: str) -> tuple[Constraint, str]:
    """A ``json_schema`` text format (chat's ``response_format.json_schema``, the Responses API's
    ``text.format``): its constraint and the body path of its schema (``strict`` defaults to false in both).
    """
    _named(spec, where, ("name", "description", "schema", "strict"))
    strict = spec.get("strict")
    strict = False if strict is None else _bool(strict, f"{where}.strict")
    param = f"{where}.schema"
    if spec.get("schema") is None:
        return Constraint.json_object(), param
    schema = _object(spec["schema"], param)
    with _as_bad_request(param):
        constraint = Constraint.json_schema(schema)
    if strict and (chosen := check_strict(schema, param, backend)) != backend:
        constraint = Constraint(constraint.kind, constraint.payload, {**constraint.options, "backend": chosen})
    return constraint, param


def function_tool(fn: dict[str, Any], where: str, backend: str, *, strict_default: bool,
                  taken: Sequence[Tool]) -> Tool:
    """A function definition (chat's ``tools[i].function``, the Responses API's ``tools[i]`` less its type).

    ``strict_default`` is false in chat, true in the Responses API (OpenAI's defaults); ``taken`` the
    functions defined before it (names are unique).
    """
    name, description = _named(fn, where, ("name", "description", "parameters", "strict"))
    if any(t.name == name for t in taken):
        raise BadRequest(f"{where}.name", f"{name!r} is defined twice")
    strict = fn.get("strict")
    strict = strict_default if strict is None else _bool(strict, f"{where}.strict")
    param = f"{where}.parameters"
    parameters = fn.get("parameters")
    if parameters is None:  # OpenAI: no parameters = a function that takes none
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    parameters = _object(parameters, param)
    if parameters.get("type") != "object":
        raise BadRequest(f"{param}.type", 'must be "object" (function arguments are a JSON object)')
    with _as_bad_request(param):
        Constraint.json_schema(parameters)  # the meta-schema check, named under this tool
    if strict:  # the calls' structural tag is xgrammar's under auto
        check_strict(parameters, param, "xgrammar" if backend == "auto" else backend)
    return Tool(name, description, parameters, strict)


def _tools(body: dict[str, Any], backend: str) -> tuple[tuple[Tool, ...], ToolMode | None, bool]:
    """The callable tools, the tool mode, and ``parallel_tool_calls`` (``backend``: for strict tools)."""
    raw_tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else _bool(parallel, "parallel_tool_calls")
    if raw_tools is None:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice", "needs tools")
        return (), None, parallel
    if not isinstance(raw_tools, list) or not raw_tools:
        raise BadRequest("tools", "must be a non-empty array of function tools")
    tools: list[Tool] = []
    for i, raw in enumerate(raw_tools):
        where = f"tools[{i}]"
        entry = _object(raw, where)
        if entry.get("type") != "function":
            raise BadRequest(f"{where}.type", f"only function tools are supported, got {entry.get('type')!r}")
        for name in entry:
            if name not in ("type", "function"):
                raise BadRequest(f"{where}.{name}", "unknown field; expected type, function")
        fn = _object(entry.get("function"), f"{where}.function")
        tools.append(function_tool(fn, f"{where}.function", backend, strict_default=False, taken=tools))
    if choice is None or choice == "auto":
        return tuple(tools), "auto", parallel
    if choice == "none":
        return (), None, parallel
    if choice == "required":
        return tuple(tools), "required", parallel
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise BadRequest("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                        '{"name": ...}}')
    wanted = _string(_object(choice.get("function"), "tool_choice.function").get("name"), "tool_choice.function.name")
    return named_tool(tools, wanted, "tool_choice.function.name"), "named", parallel


def named_tool(tools: Sequence[Tool], wanted: str, param: str) -> tuple[Tool]:
    """The one tool ``tool_choice`` names."""
    for tool in tools:
        if tool.name == wanted:
            return (tool,)
    raise BadRequest(param, f"{wanted!r} is not one of the tools")


#: Text content parts of chat messages: each part type and the key that holds its text.
TEXT_PARTS: Final[Mapping[str, str]] = {"text": "text"}
_ASSISTANT_PARTS: Final[Mapping[str, str]] = {"text": "text", "refusal": "refusal"}


def content_text(value: Any, param: str, parts: Mapping[str, str] = TEXT_PARTS) -> str:
    """A message's content: a string, or an array of parts whose type is a key of ``parts`` (the value: the
    key that holds the part's text); other parts (images, audio, files) are refused by name."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(param, f"must be a string or an array of content parts, got {_type(value)}")
    texts = []
    for i, part in enumerate(value):
        part = _object(part, f"{param}[{i}]")
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in parts:
            raise BadRequest(f"{param}[{i}].type", f"must be one of {', '.join(parts)} (this model reads text "
                                                   f"only), got {kind!r}")
        texts.append(_string(part.get(parts[kind]), f"{param}[{i}].{parts[kind]}", empty=True))
    return "".join(texts)


def _optional_string(msg: dict[str, Any], name: str, where: str) -> str | None:
    value = msg.get(name)
    return None if value is None else _string(value, f"{where}.{name}", empty=True)


def _assistant_calls(msg: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """The earlier calls of an assistant message: ``tool_calls`` and the deprecated ``function_call``."""
    calls: list[tuple[str, str]] = []
    raw_calls = msg.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise BadRequest(f"{where}.tool_calls", f"must be an array, got {_type(raw_calls)}")
    for j, call in enumerate(raw_calls or []):
        at = f"{where}.tool_calls[{j}]"
        call = _object(call, at)
        if call.get("type", "function") != "function":
            raise BadRequest(f"{at}.type", f"only function calls are supported, got {call.get('type')!r}")
        _string(call.get("id"), f"{at}.id")
        fn = _object(call.get("function"), f"{at}.function")
        calls.append((_string(fn.get("name"), f"{at}.function.name"),
                      check_arguments(_string(fn.get("arguments"), f"{at}.function.arguments", empty=True),
                                      f"{at}.function.arguments")))
    if msg.get("function_call") is not None:
        fn = _object(msg["function_call"], f"{where}.function_call")
        calls.append((_string(fn.get("name"), f"{where}.function_call.name"),
                      check_arguments(_string(fn.get("arguments"), f"{where}.function_call.arguments", empty=True),
                                      f"{where}.function_call.arguments")))
    return calls


def _messages(raw: Any, system_extra: str | None) -> list[Turn]:
    """OpenAI messages -> the ensemble's messages (see the module docstring for the roles)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages", "must be a non-empty array")
    out: list[Turn] = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        msg = _object(item, where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in MESSAGE_FIELDS:
            raise BadRequest(f"{where}.role", f"must be one of {', '.join(MESSAGE_FIELDS)}, got {role!r}")
        for field in msg:
            if field not in MESSAGE_FIELDS[role]:
                raise BadRequest(f"{where}.{field}", f"not a field of a {role} message; expected "
                                                     f"{', '.join(MESSAGE_FIELDS[role])}")
        name = _optional_string(msg, "name", where) if role != "function" else None
        if role == "assistant":
            if msg.get("audio") is not None:
                raise BadRequest(f"{where}.audio", "audio output is not supported, so no earlier audio can be "
                                                   "referenced")
            # annotations (citations of web search), reasoning_content (the thinking, which chat templates
            # drop from earlier turns) and parsed (the openai SDK's own copy of the content) are the
            # server's output read back: checked for their type, nothing to render.
            _optional_string(msg, "reasoning_content", where)
            if msg.get("annotations") is not None and not isinstance(msg["annotations"], list):
                raise BadRequest(f"{where}.annotations", f"must be an array, got {_type(msg['annotations'])}")
            text = "" if msg.get("content") is None else content_text(msg["content"], f"{where}.content",
                                                                       _ASSISTANT_PARTS)
            refusal = _optional_string(msg, "refusal", where)
            out.append(assistant_turn(text or refusal or "", _assistant_calls(msg, where), name))
        elif role in ("tool", "function"):
            if role == "tool":
                _string(msg.get("tool_call_id"), f"{where}.tool_call_id")
            else:
                _string(msg.get("name"), f"{where}.name")
            text = "" if msg.get("content") is None and role == "function" else content_text(msg.get("content"),
                                                                                         f"{where}.content")
            out.append(tool_result_turn(text))
        else:
            out.append(text_turn(role, content_text(msg.get("content"), f"{where}.content"), name))
    return with_system(out, system_extra)


def _with_options(constraint: Constraint | None, options: dict[str, Any], param: str | None) -> Constraint | None:
    if not options:
        return constraint
    if constraint is None:
        raise BadRequest(f"{EXTENSION}.options", "needs a constraint (response_format, tools or a kind of "
                                                 f"{EXTENSION})")
    try:
        return Constraint(constraint.kind, constraint.payload, {**constraint.options, **options})
    except InvalidRequest as err:
        field = err.field or "options"
        raise BadRequest(f"{EXTENSION}.options.{field.removeprefix('grammar_options.')}", err.reason) from err


def _choices(body: dict[str, Any]) -> int:
    """``n``: 1 to :data:`contract.MAX_CHOICES` choices."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= contract.MAX_CHOICES:
        raise BadRequest("n", f"must be an integer in [1, {contract.MAX_CHOICES}], got {json.dumps(n)}")
    return n


def _top_logprobs(value: Any, param: str) -> int:
    """A count of alternatives per token, 0 to :data:`contract.MAX_TOP_LOGPROBS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= contract.MAX_TOP_LOGPROBS:
        raise BadRequest(param, f"must be an integer in [0, {contract.MAX_TOP_LOGPROBS}], got {json.dumps(value)}")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (which needs it)."""
    wanted = body.get("logprobs")
    wanted = False if wanted is None else _bool(wanted, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    top = _top_logprobs(top, "top_logprobs")
    if not wanted and top:
        raise BadRequest("top_logprobs", "needs logprobs set to true")
    return top if wanted else None


def _build(endpoint: Endpoint, body: dict[str, Any], *, prompt: str | None, messages: list[dict[str, str]] | None,
           constraint: Constraint | None, constraint_param: str | None, default_max_tokens: int,
           sampling: Mapping[str, Any], tools: tuple[Tool, ...] = (), tool_mode: ToolMode | None = None,
           logprobs: int | None = None, n: int = 1, max_tokens_field: str | None = None) -> Plan:
    if max_tokens_field is None:
        max_tokens, max_param = _max_tokens(body, default_max_tokens)
    else:  # the Responses API's max_output_tokens
        max_tokens, max_param = _max_tokens({"max_tokens": body.get(max_tokens_field)}, default_max_tokens)
        max_param = max_tokens_field
    stream, include_usage = _stream(body)
    sampling = _top_level_sampling(body, dict(sampling))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed", f"must be an integer, got {_type(seed)}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise BadRequest("stop", f"must be a string or an array of strings, got {_type(stop)}")
    choices: list[list[grpcclient.InferInput]] = []
    try:
        for i in range(n):
            # A seeded request's choices draw with seed, seed + 1, ...: each can be replayed alone.
            choice_seed = seed if seed is None or i == 0 else (seed + i) % contract.SEED_LIMIT
            choices.append(build_inputs(
                prompt, messages=messages, constraint=constraint, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", None),
                seed=choice_seed, stop=stop, frequency_penalty=_number(body, "frequency_penalty", None),
                presence_penalty=_number(body, "presence_penalty", None), top_k=sampling.get("top_k"),
                repetition_penalty=sampling.get("repetition_penalty"), min_p=sampling.get("min_p"),
                reasoning=sampling.get("reasoning"), logprobs=logprobs, draft_tokens=sampling.get("draft_tokens")))
    except InvalidRequest as err:
        field = err.field or "request"
        head = field.partition(".")[0]
        where = (max_param if field == "max_tokens" else
                 field if head in EXTENSION_SAMPLING and body.get(head) is not None else
                 f"{EXTENSION}.{field}" if head in sampling else field)
        raise BadRequest(where, err.reason) from err
    return Plan(endpoint=endpoint, model=_string(body.get("model"), "model"), inputs=choices[0],
                kind=None if constraint is None else constraint.kind, constraint_param=constraint_param,
                max_tokens_param=max_param, stream=stream, include_usage=include_usage, tools=tools,
                tool_mode=tool_mode, more_inputs=tuple(choices[1:]), logprobs=logprobs, max_tokens=max_tokens)


# --------------------------------------------------------------------------- entry points
def parse_chat(body: Any, default_max_tokens: int) -> Plan:
    """Check and translate a ``/v1/chat/completions`` body.

    Parameters
    ----------
    body : Any
        The parsed JSON body.
    default_max_tokens : int
        The budget when the request gives none.

    Returns
    -------
    Plan

    Raises
    ------
    BadRequest
        A field is unknown, malformed, refused, or breaks the server's rules.
    """
    body = _object(body, "body")
    _fields(body, CHAT_FIELDS, _CHAT_NEUTRAL)
    if "model" not in body:
        raise BadRequest("model", "is required")
    ext, ext_param, options, sampling = _extension(body)
    tools, mode, parallel = _tools(body, _backend(options))
    fmt, fmt_param = _response_format(body, _format_backend(options, tools))
    constraint, param, system_extra = _constraint(fmt, fmt_param, ext, ext_param, tools, mode, parallel,
                                                  format_field="response_format")
    constraint = _with_options(constraint, options, param)
    messages = _messages(body.get("messages"), system_extra)
    return _build("chat", body, prompt=None, messages=messages, constraint=constraint, constraint_param=param,
                  default_max_tokens=default_max_tokens, sampling=sampling, tools=tools, tool_mode=mode,
                  logprobs=_chat_logprobs(body), n=_choices(body))


def _format_backend(options: Mapping[str, Any], tools: tuple[Tool, ...]) -> str:
    """The backend a strict text format is checked for: with tools, the calls' structural tag (xgrammar's
    under auto) carries the answer's schema too."""
    backend = _backend(options)
    return "xgrammar" if tools and backend == "auto" else backend


def _constraint(fmt: Constraint | None, fmt_param: str | None, ext: Constraint | None, ext_param: str | None,
                tools: tuple[Tool, ...], mode: ToolMode | None, parallel: bool, *,
                format_field: str) -> tuple[Constraint | None, str | None, str | None]:
    """The request's one constraint, its param, and the system text the tools add (None without tools).

    A text format (``format_field``) and tools together are an agent's turn: calls, or the answer in that
    format (:func:`~openai_api.tools.tool_constraint`).  The extension's constraints stand alone.
    """
    if fmt is not None and ext is not None:
        raise BadRequest(ext_param or EXTENSION, f"give one constraint: {format_field} or the extension's, not both")
    if not tools or mode is None:
        return (fmt, fmt_param, None) if fmt is not None else (ext, ext_param, None)
    if ext is not None:
        raise BadRequest(ext_param or EXTENSION, "the extension's constraints cannot be combined with tool calls; "
                                                 'set tool_choice to "none" to use one')
    answer = None if fmt is None else json.loads(fmt.payload or contract.JSON_OBJECT_SCHEMA)
    return (tool_constraint(tools, mode, parallel=parallel, answer_schema=answer), "tools",
            tools_prompt(tools, mode, answer_schema=answer))


def parse_completion(body: Any) -> Plan:
    """Check and translate a ``/v1/completions`` body (one prompt; token-id prompts are refused).

    Raises
    ------
    BadRequest
        As :func:`parse_chat`.
    """
    body = _object(body, "body")
    _fields(body, COMPLETION_FIELDS, _COMPLETION_NEUTRAL)
    if "model" not in body:
        raise BadRequest("model", "is required")
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise BadRequest("prompt", "must be a string or an array of one string (batches and token ids are "
                                       "not supported)")
        prompt = prompt[0]
    prompt = _string(prompt, "prompt", empty=True)
    ext, ext_param, options, sampling = _extension(body)
    fmt, fmt_param = _response_format(body, _backend(options))
    if fmt is not None and ext is not None:
        raise BadRequest(ext_param or EXTENSION, "give one constraint: response_format or the extension's, not both")
    constraint, param = (fmt, fmt_param) if fmt is not None else (ext, ext_param)
    constraint = _with_options(constraint, options, param)
    logprobs = body.get("logprobs")
    return _build("completions", body, prompt=prompt, messages=None, constraint=constraint, constraint_param=param,
                  default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, sampling=sampling,
                  logprobs=None if logprobs is None else _top_logprobs(logprobs, "logprobs"), n=_choices(body))


def client_error_param(plan: Plan, err: ClientError) -> str | None:
    """The body path of the field a server error names (an :class:`InvalidRequest`'s ``field``), if any."""
    return plan.param_of(err.field) if isinstance(err, InvalidRequest) else None


