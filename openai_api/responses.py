"""OpenAI's Responses API (``POST /v1/responses``) on the chat path: one request model, the same rules.

A Responses request becomes the same :class:`~openai_api.request.Plan` a chat
request does (the same gateway, API keys, limits, cancellation, constraint
rules and report); only the request's shape and the output's differ.

Request fields (OpenAI's reference, 2026):

* honoured: ``model``, ``input`` (a string, or items: messages of every role,
  ``developer`` and ``system`` as system turns, content a string or
  ``input_text``/``output_text``/``refusal`` parts; ``function_call`` and
  ``function_call_output``; ``reasoning`` items, whose thinking chat
  templates drop from earlier turns as they drop chat's), ``instructions``
  (the first system turn; not carried over from ``previous_response_id``, as
  OpenAI does), ``text.format`` (``text``, ``json_object``, ``json_schema``
  with ``strict``: :mod:`openai_api.strict`), function ``tools`` (``strict``
  defaults to true here, as in OpenAI's Responses API), ``tool_choice``
  (``auto``, ``none``, ``required``, a named function, ``allowed_tools``),
  ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
  ``top_p``, ``top_logprobs`` with ``include: ["message.output_text.logprobs"]``,
  ``metadata`` (echoed), ``store`` and ``previous_response_id``
  (:class:`ResponseStore`), ``stream``, ``user``, ``safety_identifier``,
  ``prompt_cache_key``; the server's own ``seed`` (OpenAI's Responses API has
  none: without it a seed is drawn and reported), vLLM's ``top_k``,
  ``min_p``, ``repetition_penalty`` and the extension
  :data:`~openai_api.request.EXTENSION`, as in chat;
* accepted at the value that asks for nothing: ``truncation`` ``disabled``,
  ``background`` false, ``service_tier`` ``auto``/``default``,
  ``text.verbosity`` ``medium``, ``reasoning`` without effort or summary;
* refused by name: built-in tools (web search, file search, computer use,
  code interpreter, image generation, MCP, shell, custom tools),
  ``conversation``, ``prompt`` (templates), ``max_tool_calls``, other
  ``include`` values, ``item_reference`` and tool-call items of built-in tools
  in ``input``, image, file and audio parts.

Output: a ``reasoning`` item (when the request has a thinking section), a
``message`` with one ``output_text`` part (when there is text), one
``function_call`` item per call.  ``status`` is ``incomplete`` (with
``incomplete_details.reason: max_output_tokens``) exactly where chat's
``finish_reason`` is ``length`` (:func:`~openai_api.response.finish_reason`:
an output closed at the budget that is complete under its constraint is
``completed``).  Streaming sends OpenAI's event sequence, every event with
its ``sequence_number``: ``response.created``, ``response.in_progress``,
then per item ``response.output_item.added``, its deltas
(``response.content_part.added``/``response.output_text.delta``/
``.done``/``response.content_part.done``,
``response.function_call_arguments.delta``/``.done``,
``response.reasoning_text.delta``/``.done``) and
``response.output_item.done``; last ``response.completed`` or
``response.incomplete`` with the whole response (or ``error`` and
``response.failed``).
"""

from __future__ import annotations

import collections
import json
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from client.constraints import Constraint
from client.sdk import Chunk, Result
from contract import errors as status
from openai_api.errors import BadRequest, OpenAIError
from openai_api.history import Turn, assistant_turn, check_arguments, text_turn, tool_result_turn, with_system
from openai_api.request import (
    EXTENSION,
    EXTENSION_SAMPLING,
    Plan,
    _backend,
    _bool,
    _build,
    _constraint,
    _extension,
    _fields,
    _object,
    _string,
    _top_logprobs,
    _type,
    _with_options,
    content_text,
    function_tool,
    named_tool,
    schema_format,
)
from openai_api.response import Renderer, finish_reason
from openai_api.tools import ArgsDelta, CallStart, TextDelta, Tool, ToolMode

__all__ = ["BUILTIN_TOOLS", "RESPONSES_FIELDS", "ResponseStore", "ResponsesOutput", "ResponsesPlan",
           "parse_responses"]

#: Tool types of OpenAI's Responses API that run on OpenAI's side: refused by name.
BUILTIN_TOOLS: Final = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "computer_use", "computer_use_preview", "code_interpreter", "image_generation", "mcp", "local_shell", "shell",
    "apply_patch", "custom"})
#: Every request field ``POST /v1/responses`` knows (OpenAI's, the server's ``seed``, vLLM's sampling fields,
#: the extension).
RESPONSES_FIELDS: Final = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs", "include",
    "text", "tools", "tool_choice", "parallel_tool_calls", "metadata", "store", "previous_response_id", "stream",
    "stream_options", "user", "safety_identifier", "prompt_cache_key", "truncation", "background", "service_tier",
    "reasoning", "conversation", "prompt", "max_tool_calls", "prompt_cache_retention", "seed",
    *EXTENSION_SAMPLING, EXTENSION})
#: Fields refused whenever set, and why.
_REFUSED: Final[Mapping[str, str]] = {
    "conversation": "conversations are not stored by this server: use previous_response_id, or send the "
                    "conversation as input",
    "prompt": "prompt templates are not supported: send the prompt as input",
    "max_tool_calls": "not supported: set parallel_tool_calls to false for one call per response",
    "prompt_cache_retention": "prompt caching is not configurable",
}
#: ``include`` values honoured.
_INCLUDE_LOGPROBS: Final = "message.output_text.logprobs"
#: ``metadata``: OpenAI's bounds.
_MAX_METADATA: Final = 16
_MAX_METADATA_KEY: Final = 64
_MAX_METADATA_VALUE: Final = 512
_MESSAGE_ROLES: Final = ("user", "system", "developer", "assistant")
#: A failed response's ``error.code`` by the error's type (OpenAI's codes for a response are a closed list).
_FAILED_CODES: Final[Mapping[str, str]] = {"rate_limit_error": "rate_limit_exceeded",
                                           "invalid_request_error": "invalid_prompt"}
#: Text content parts of input items: each part type and the key that holds its text.
_TEXT_PARTS: Final[Mapping[str, str]] = {"input_text": "text", "output_text": "text", "text": "text",
                                         "refusal": "refusal"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class ResponsesPlan:
    """A Responses request: its ensemble :class:`Plan` and what the response echoes and the store keeps.

    Attributes
    ----------
    plan : Plan
        The ensemble request (``endpoint`` ``"responses"``).
    echo : mapping
        The request's settings as the response object repeats them (``instructions``, ``tools``,
        ``tool_choice``, ``text``, ``metadata``, ...).
    items : tuple of dict
        The conversation this response continues, as input items: the stored one of
        ``previous_response_id`` and this request's ``input``.
    store : bool
        Keep the response for ``previous_response_id`` and ``GET /v1/responses/{id}``.
    """

    plan: Plan
    echo: Mapping[str, Any]
    items: tuple[dict[str, Any], ...]
    store: bool


# --------------------------------------------------------------------------- request
def _input_items(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input", f"must be a string or a non-empty array of items, got {_type(raw)}")
    return [_object(item, f"input[{i}]") for i, item in enumerate(raw)]


def _turns(items: Sequence[dict[str, Any]], offset: int) -> list[Turn]:
    """Input items -> ensemble turns; an assistant's message and the calls after it make one turn.

    ``offset``: the index of ``items[0]`` in the request's ``input`` (stored items come first, negative).
    """
    turns: list[Turn] = []
    text: str | None = None  # the assistant turn being built: its text and calls
    calls: list[tuple[str, str]] = []

    def flush() -> None:
        nonlocal text, calls
        if text is not None or calls:
            turns.append(assistant_turn(text or "", calls))
        text, calls = None, []

    for i, item in enumerate(items):
        where = f"input[{i + offset}]" if i + offset >= 0 else "previous_response_id"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise BadRequest(f"{where}.role", f"must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}")
            content = content_text(item.get("content"), f"{where}.content", _TEXT_PARTS)
            if role == "assistant":
                if calls:
                    flush()
                text = (text or "") + content
                continue
            flush()
            turns.append(text_turn(role, content))
        elif kind == "function_call":
            name = _string(item.get("name"), f"{where}.name")
            _string(item.get("call_id"), f"{where}.call_id")
            arguments = check_arguments(_string(item.get("arguments"), f"{where}.arguments", empty=True),
                                        f"{where}.arguments")
            calls.append((name, arguments))
        elif kind == "function_call_output":
            flush()
            _string(item.get("call_id"), f"{where}.call_id")
            turns.append(tool_result_turn(content_text(item.get("output"), f"{where}.output", _TEXT_PARTS)))
        elif kind == "reasoning":
            continue  # earlier thinking: chat templates drop it from earlier turns
        elif kind == "item_reference":
            raise BadRequest(f"{where}.type", "item references are not supported: send the item itself, or "
                                              "continue a stored response with previous_response_id")
        else:
            raise BadRequest(f"{where}.type", f"must be message, function_call, function_call_output or "
                                              f"reasoning (built-in tools are not supported), got {kind!r}")
    flush()
    return turns


def _text_format(body: dict[str, Any], backend: str) -> tuple[Constraint | None, str | None, dict[str, Any]]:
    """``text``: the format's constraint, its param, and the ``text`` the response echoes."""
    raw = body.get("text")
    if raw is None:
        return None, None, {"format": {"type": "text"}, "verbosity": "medium"}
    text = _object(raw, "text")
    for name in text:
        if name not in ("format", "verbosity"):
            raise BadRequest(f"text.{name}", "unknown field; expected format, verbosity")
    if text.get("verbosity") not in (None, "medium"):
        raise BadRequest("text.verbosity", f"only medium is supported by this model, got {text['verbosity']!r}")
    echo = {"format": {"type": "text"}, "verbosity": "medium"}
    if text.get("format") is None:
        return None, None, echo
    fmt = _object(text["format"], "text.format")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest("text.format.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    echo["format"] = fmt
    if kind != "json_schema":
        for name in fmt:
            if name != "type":
                raise BadRequest(f"text.format.{name}", f"unknown field for type {kind}")
        return (None if kind == "text" else Constraint.json_object()), "text.format", echo
    spec = {k: v for k, v in fmt.items() if k != "type"}
    constraint, param = schema_format(spec, "text.format", backend)
    return constraint, param, echo


def _tools(body: dict[str, Any], backend: str) -> tuple[tuple[Tool, ...], ToolMode | None, bool, list[Any]]:
    """The callable functions, the tool mode, ``parallel_tool_calls`` and the ``tools`` the response echoes."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else _bool(parallel, "parallel_tool_calls")
    tools: list[Tool] = []
    echo: list[Any] = []
    if raw is not None and not isinstance(raw, list):
        raise BadRequest("tools", f"must be an array, got {_type(raw)}")
    for i, entry in enumerate(raw or []):
        where = f"tools[{i}]"
        entry = _object(entry, where)
        kind = entry.get("type")
        if kind in BUILTIN_TOOLS:
            raise BadRequest(f"{where}.type", f"the built-in tool {kind!r} is not supported (it runs on OpenAI's "
                                              "side): only function tools")
        if kind != "function":
            raise BadRequest(f"{where}.type", f"only function tools are supported, got {kind!r}")
        fn = {k: v for k, v in entry.items() if k != "type"}
        tool = function_tool(fn, where, backend, strict_default=True, taken=tools)
        tools.append(tool)
        echo.append({"type": "function", "name": tool.name, "description": tool.description or None,
                     "parameters": tool.parameters, "strict": tool.strict})
    if choice is None or choice == "auto":
        return (tuple(tools), "auto" if tools else None, parallel, echo)
    if choice == "none":
        return (), None, parallel, echo
    if not tools:
        raise BadRequest("tool_choice", "needs function tools")
    if choice == "required":
        return tuple(tools), "required", parallel, echo
    choice = _object(choice, "tool_choice") if isinstance(choice, dict) else choice
    if not isinstance(choice, dict):
        raise BadRequest("tool_choice", 'must be "none", "auto", "required", {"type": "function", "name": ...} or '
                                        '{"type": "allowed_tools", ...}')
    kind = choice.get("type")
    if kind == "function":
        wanted = _string(choice.get("name"), "tool_choice.name")
        return named_tool(tools, wanted, "tool_choice.name"), "named", parallel, echo
    if kind == "allowed_tools":
        mode = choice.get("mode")
        if mode not in ("auto", "required"):
            raise BadRequest("tool_choice.mode", f"must be auto or required, got {mode!r}")
        listed = choice.get("tools")
        if not isinstance(listed, list) or not listed:
            raise BadRequest("tool_choice.tools", "must be a non-empty array of {type: function, name}")
        allowed: list[Tool] = []
        for j, ref in enumerate(listed):
            ref = _object(ref, f"tool_choice.tools[{j}]")
            if ref.get("type") != "function":
                raise BadRequest(f"tool_choice.tools[{j}].type", f"only function tools, got {ref.get('type')!r}")
            allowed += named_tool(tools, _string(ref.get("name"), f"tool_choice.tools[{j}].name"),
                                  f"tool_choice.tools[{j}].name")
        return tuple(allowed), mode, parallel, echo
    if kind in BUILTIN_TOOLS:
        raise BadRequest("tool_choice.type", f"the built-in tool {kind!r} is not supported")
    raise BadRequest("tool_choice.type", f"must be function or allowed_tools, got {kind!r}")


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    raw = body.get("metadata")
    if raw is None:
        return {}
    metadata = _object(raw, "metadata")
    if len(metadata) > _MAX_METADATA:
        raise BadRequest("metadata", f"at most {_MAX_METADATA} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY:
            raise BadRequest(f"metadata.{key}", f"keys are at most {_MAX_METADATA_KEY} characters")
        if not isinstance(value, str) or len(value) > _MAX_METADATA_VALUE:
            raise BadRequest(f"metadata.{key}", f"must be a string of at most {_MAX_METADATA_VALUE} characters")
    return dict(metadata)


def _neutral(body: dict[str, Any]) -> None:
    """The fields accepted only at the value that asks for nothing, and the ones refused."""
    for name, reason in _REFUSED.items():
        if body.get(name) is not None:
            raise BadRequest(name, reason, code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest("truncation", "only disabled is supported: a conversation longer than the context is "
                                       "refused, not cut", code="unsupported_parameter")
    if body.get("background") not in (None, False):
        raise BadRequest("background", "background responses are not supported", code="unsupported_parameter")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise BadRequest("service_tier", "this server has one service tier", code="unsupported_parameter")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        reasoning = _object(reasoning, "reasoning")
        for name, value in reasoning.items():
            if name not in ("effort", "summary", "generate_summary"):
                raise BadRequest(f"reasoning.{name}", "unknown field; expected effort, summary")
            if value is not None:
                raise BadRequest(f"reasoning.{name}", "reasoning controls are not supported by this model (its "
                                                      f"thinking section is {EXTENSION}.reasoning)",
                                 code="unsupported_parameter")
    options = body.get("stream_options")
    if options is not None:
        options = _object(options, "stream_options")
        if not body.get("stream"):
            raise BadRequest("stream_options", "only allowed when stream is true")
        for name, value in options.items():
            if name != "include_obfuscation":
                raise BadRequest(f"stream_options.{name}", "unrecognized stream option")
            if value not in (None, False):
                raise BadRequest("stream_options.include_obfuscation", "obfuscation padding is not sent by this "
                                                                       "server")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None:
            _string(body[name], name, empty=True)


def _logprobs(body: dict[str, Any]) -> int | None:
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise BadRequest("include", f"must be an array of strings, got {_type(include)}")
    wanted = False
    for i, value in enumerate(include or []):
        if value != _INCLUDE_LOGPROBS:
            raise BadRequest(f"include[{i}]", f"only {_INCLUDE_LOGPROBS!r} is supported, got {value!r}",
                             code="unsupported_parameter")
        wanted = True
    top = body.get("top_logprobs")
    top = None if top is None else _top_logprobs(top, "top_logprobs")
    if not wanted:
        return None
    return 0 if top is None else top


def parse_responses(body: Any, default_max_tokens: int,
                    previous: Sequence[dict[str, Any]] | None = None) -> ResponsesPlan:
    """Check and translate a ``/v1/responses`` body.

    Parameters
    ----------
    body : Any
        The parsed JSON body.
    default_max_tokens : int
        The budget when the request gives none.
    previous : sequence of dict, optional
        The stored conversation of ``previous_response_id`` (the server looks it up: :class:`ResponseStore`).

    Raises
    ------
    BadRequest
        A field is unknown, malformed, refused, or breaks the server's rules.
    """
    body = _object(body, "body")
    _fields(body, RESPONSES_FIELDS, ())
    if "model" not in body:
        raise BadRequest("model", "is required")
    _neutral(body)
    if body.get("input") is None:
        raise BadRequest("input", "is required")
    items = _input_items(body["input"])
    stored = list(previous or ())
    instructions = body.get("instructions")
    instructions = None if instructions is None else _string(instructions, "instructions", empty=True)
    ext, ext_param, options, sampling = _extension(body)
    tools, mode, parallel, tools_echo = _tools(body, _backend(options))
    backend = "xgrammar" if tools and mode == "auto" and _backend(options) == "auto" else _backend(options)
    fmt, fmt_param, text_echo = _text_format(body, backend)
    constraint, param, system_extra = _constraint(fmt, fmt_param, ext, ext_param, tools, mode, parallel,
                                                  format_field="text.format")
    constraint = _with_options(constraint, options, param)
    turns = _turns(stored, -len(stored)) + _turns(items, 0)
    if instructions:
        turns = [text_turn("system", instructions), *turns]
    turns = with_system(turns, system_extra)
    if not turns:
        raise BadRequest("input", "holds no message")
    store = body.get("store")
    store = True if store is None else _bool(store, "store")
    metadata = _metadata(body)
    build = {k: body[k] for k in ("model", "temperature", "top_p", "seed", "stream", "max_output_tokens",
                                  *EXTENSION_SAMPLING) if body.get(k) is not None}
    plan = _build("responses", build, prompt=None, messages=turns, constraint=constraint, constraint_param=param,
                  default_max_tokens=default_max_tokens, sampling=sampling, tools=tools, tool_mode=mode,
                  logprobs=_logprobs(body), max_tokens_field="max_output_tokens")
    tool_choice: Any = body.get("tool_choice", "auto")
    echo = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
        "metadata": metadata, "parallel_tool_calls": parallel,
        "previous_response_id": body.get("previous_response_id"), "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": None, "summary": None}, "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default", "store": store, "temperature": body.get("temperature", 1.0), "text": text_echo,
        "tool_choice": tool_choice, "tools": tools_echo, "top_logprobs": body.get("top_logprobs", 0),
        "top_p": body.get("top_p", 1.0), "truncation": "disabled", "user": body.get("user"), "background": False,
    }
    return ResponsesPlan(plan=plan, echo=echo, items=(*stored, *items), store=store)


# --------------------------------------------------------------------------- output
@dataclass
class _Item:
    """An output item being built: its object, its place in ``output``, and its text and log probabilities
    so far (a message's or a reasoning item's)."""

    body: dict[str, Any]
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponsesOutput:
    """The Responses API's form of a request's output: events while streaming, the response object at the end.

    Parameters
    ----------
    request : ResponsesPlan
    """

    done: bytes = b""  # the stream ends with response.completed, not a [DONE] line

    def __init__(self, request: ResponsesPlan) -> None:
        self.request = request
        self.plan = request.plan
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self._renderer = Renderer(self.plan)  # its tool-call parser splits text and calls
        self._sequence = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._call_items: dict[int, _Item] = {}
        self._pending: list[dict[str, Any]] = []  # log probabilities of text the tool-call parser holds back
        self.response: dict[str, Any] | None = None  # the final response object

    # ------------------------------------------------------------------ the response object
    def _response(self, status_: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status_,
                "error": None, "incomplete_details": None, "model": self.plan.model, "output": output,
                **self.request.echo, "usage": None, **extra}

    def _usage(self, result: Result) -> dict[str, Any]:
        prompt, completion = result.usage.prompt_tokens, result.usage.completion_tokens
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens or 0},
                "total_tokens": prompt + completion}

    def _final(self, result: Result) -> dict[str, Any]:
        calls = self._renderer.complete_calls()
        incomplete = finish_reason(result, calls) == "length"
        for item in self._items:
            if item.body["type"] == "message" and incomplete:
                item.body["status"] = "incomplete"
        response = self._response(
            "incomplete" if incomplete else "completed", [item.body for item in self._items],
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=self._usage(result), **{EXTENSION: self._renderer.report(result)})
        self.response = response
        return response

    # ------------------------------------------------------------------ items
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, **fields}

    def _add(self, body: dict[str, Any]) -> tuple[_Item, list[dict[str, Any]]]:
        item = _Item(body, len(self._items))
        self._items.append(item)
        events = [self._event("response.output_item.added", output_index=item.index,
                              item={**body, **({"content": []} if "content" in body else {})})]
        return item, events

    def _close(self) -> list[dict[str, Any]]:
        """Close the open text or reasoning item: its done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.text)
        base: dict[str, Any] = {"item_id": item.body["id"], "output_index": item.index, "content_index": 0}
        part: dict[str, Any]
        if item.body["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item.body["content"] = [part]
            return [self._event("response.reasoning_text.done", **base, text=text),
                    self._event("response.output_item.done", output_index=item.index, item=item.body)]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": item.logprobs}
        item.body["content"] = [part]
        item.body["status"] = "completed"
        return [self._event("response.output_text.done", **base, text=text, logprobs=item.logprobs),
                self._event("response.content_part.done", **base, part=part),
                self._event("response.output_item.done", output_index=item.index, item=item.body)]

    def _close_call(self, index: int) -> list[dict[str, Any]]:
        item = self._call_items.pop(index, None)
        if item is None:
            return []
        name, arguments = self._renderer.call(index)
        complete = self._renderer.complete_calls() > index
        item.body.update(arguments=arguments, status="completed" if complete else "incomplete")
        return [self._event("response.function_call_arguments.done", item_id=item.body["id"],
                            output_index=item.index, name=name, arguments=arguments),
                self._event("response.output_item.done", output_index=item.index, item=item.body)]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.body["type"] != "reasoning":
            events += self._close()
            self._open, added = self._add({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                           "content": []})
            events += added
        self._open.text.append(text)
        events.append(self._event("response.reasoning_text.delta", item_id=self._open.body["id"],
                                  output_index=self._open.index, content_index=0, delta=text))
        return events

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.body["type"] != "message":
            events += self._close()
            self._open, added = self._add({"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                           "role": "assistant", "content": []})
            events += added
            events.append(self._event("response.content_part.added", item_id=self._open.body["id"],
                                      output_index=self._open.index, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self._open.text.append(text)
        self._open.logprobs += logprobs
        events.append(self._event("response.output_text.delta", item_id=self._open.body["id"],
                                  output_index=self._open.index, content_index=0, delta=text, logprobs=logprobs))
        return events

    def _pieces(self, text: str, reasoning: str, entries: list[Any] | None, *, last: bool) -> list[dict[str, Any]]:
        events = self._reasoning(reasoning)
        logprobs, self._pending = self._pending + [e.to_openai() for e in entries or []], []
        for event in self._renderer.events(text, last=last):
            if isinstance(event, TextDelta):
                events += self._text(event.text, logprobs)
                logprobs = []
            elif isinstance(event, CallStart):
                logprobs = []  # the call's own tokens: output_text alone carries log probabilities
                events += self._close()
                events += self._close_call(event.index - 1)
                item, added = self._add({"type": "function_call", "id": _new_id("fc"), "call_id": _new_id("call"),
                                         "name": event.name, "arguments": "", "status": "in_progress"})
                self._call_items[event.index] = item
                events += added
            elif isinstance(event, ArgsDelta):
                item = self._call_items[event.index]
                events.append(self._event("response.function_call_arguments.delta", item_id=item.body["id"],
                                          output_index=item.index, delta=event.text))
        self._pending = logprobs  # a piece the parser held back: its entries go with its text
        return events

    # ------------------------------------------------------------------ the server's calls (Output)
    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        skeleton = self._response("in_progress", [])
        return [self._event("response.created", response=skeleton),
                self._event("response.in_progress", response=skeleton)]

    def piece(self, choice: int, chunk: Chunk) -> list[dict[str, Any]]:
        """The events of one streamed piece."""
        return self._pieces(chunk.text, chunk.reasoning, chunk.logprobs, last=False)

    def finish(self, choice: int, result: Result, last: Chunk) -> list[dict[str, Any]]:
        """The rest of the output, every open item closed, and ``response.completed``/``.incomplete``."""
        events = self._pieces(last.text, last.reasoning, last.logprobs, last=True)
        events += self._close()
        for index in sorted(self._call_items):
            events += self._close_call(index)
        response = self._final(result)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def end(self, results: list[Result]) -> list[dict[str, Any]]:
        """Nothing after ``response.completed``."""
        return []

    def body(self, results: list[Result]) -> dict[str, Any]:
        """The response object (``stream: false``)."""
        result = results[0]
        if result.reasoning:
            self._reasoning(result.reasoning)
        self._pieces(result.text, "", result.logprobs, last=True)
        self._close()
        for index in sorted(self._call_items):
            self._close_call(index)
        return self._final(result)

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """``error`` and ``response.failed``: a stream that failed after its first event."""
        detail = error["error"]
        # The response's error code is one of OpenAI's few; the error event keeps the precise one.
        code = _FAILED_CODES.get(detail["type"], "server_error")
        response = self._response("failed", [item.body for item in self._items],
                                  error={"code": code, "message": detail["message"]})
        return [self._event("error", code=detail["code"], message=detail["message"], param=detail["param"]),
                self._event("response.failed", response=response)]

    def frame(self, event: dict[str, Any]) -> bytes:
        """One Server-Sent Event: ``event:`` names its type, ``data:`` carries it with its ``sequence_number``."""
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return (f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode()
                + b"\n\n")


# --------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class _Stored:
    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]  # the conversation: input items and the response's output
    size: int


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

    In memory, per API key (a key sees only its own responses; without keys, one shared space), least
    recently used first out: at most ``max_per_key`` responses per key and ``max_bytes`` (their JSON) in
    all.  It is this replica's: behind a Service with several replicas, a ``previous_response_id`` that
    reaches another replica is not found (the error says so), so route a conversation to one replica
    (session affinity on the API key) or send the conversation as ``input`` with ``store: false``.
    Nothing survives a restart.

    Parameters
    ----------
    max_per_key : int
        Responses kept per key.
    max_bytes : int
        Bytes kept in all.
    """

    def __init__(self, max_per_key: int = 1000, max_bytes: int = 256 * 1024 * 1024) -> None:
        if max_per_key < 1 or max_bytes < 1:
            raise ValueError("ResponseStore: max_per_key and max_bytes must be positive")
        self.max_per_key = max_per_key
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[str | None, str], _Stored] = collections.OrderedDict()
        self._per_key: collections.Counter[str | None] = collections.Counter()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str | None, request: ResponsesPlan, response: dict[str, Any]) -> None:
        """Keep ``response`` (when its request asked to) with the conversation it ends."""
        if not request.store:
            return
        items = (*request.items, *(_as_input(item) for item in response["output"]))
        size = len(json.dumps(response)) + len(json.dumps(items))
        if size > self.max_bytes:
            return
        with self._lock:
            self._entries[(key, response["id"])] = _Stored(response, items, size)
            self._per_key[key] += 1
            self._bytes += size
            while self._bytes > self.max_bytes or self._per_key[key] > self.max_per_key:
                victim = next(k for k in self._entries if self._bytes > self.max_bytes or k[0] == key)
                self._drop(victim)

    def _drop(self, entry: tuple[str | None, str]) -> None:
        stored = self._entries.pop(entry)
        self._per_key[entry[0]] -= 1
        self._bytes -= stored.size

    def get(self, key: str | None, response_id: str) -> _Stored:
        """The stored response ``response_id`` of ``key``.

        Raises
        ------
        OpenAIError
            404: not stored here (never stored, evicted, deleted, another key's, or another replica's).
        """
        with self._lock:
            stored = self._entries.get((key, response_id))
            if stored is None:
                raise OpenAIError(status.NOT_FOUND, f"response {response_id!r} not found: this replica keeps "
                                                    f"the last {self.max_per_key} stored responses per API key in "
                                                    "memory (send the conversation as input instead)",
                                  param="previous_response_id", code="previous_response_not_found")
            self._entries.move_to_end((key, response_id))
            return stored

    def delete(self, key: str | None, response_id: str) -> None:
        """Forget ``response_id`` (404 as :meth:`get` where it is not stored)."""
        self.get(key, response_id)
        with self._lock:
            self._drop((key, response_id))


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that continues the conversation."""
    if item["type"] == "message":
        text = "".join(part.get("text", "") for part in item.get("content", []))
        return {"type": "message", "role": "assistant", "content": text}
    if item["type"] == "function_call":
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"]}
    return {"type": item["type"]}  # reasoning: dropped from earlier turns

