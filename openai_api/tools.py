"""Tool calls: the prompt that offers the tools, the structural tag that constrains a call, and the parser of calls.

One call format, whatever the checkpoint: the Hermes form that Qwen2.5/3,
Hermes and SmolLM3 are trained on, written on one line::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

The grammar forces ``<tool_call>{"name": "<name>", "arguments": `` once the
model writes ``<tool_call>`` (the trigger), constrains the arguments to the
function's ``parameters`` and forces ``}</tool_call>`` after them, so every
call the server returns parses and matches its schema.  ``tool_choice``
picks the structural tag (xgrammar's format, ``grammar_backend.spec``):

* ``auto``: ``triggered_tags``: free text, calls wherever the model starts one;
* ``required``: ``tags_with_separator``: one call or more (one when
  ``parallel_tool_calls`` is false), nothing else;
* a named function: one ``tag``: exactly that call.

The tools reach the model as a system message (:func:`tools_prompt`) rather
than through the checkpoint's chat template: templates differ in whether and
how they take tools, and the call format must be the one the grammar
enforces.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from client.constraints import Constraint

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "ArgsDelta",
    "CallStart",
    "Event",
    "TextDelta",
    "Tool",
    "ToolCallParser",
    "call_prefix",
    "new_call_id",
    "tool_constraint",
    "tools_prompt",
]

CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"
#: What follows a call's arguments (the call object's closing brace and the close tag).
CALL_SUFFIX: Final = "}" + CALL_CLOSE
#: Separator between calls under ``tool_choice: required``.
CALL_SEPARATOR: Final = "\n"
ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """One function the model may call.

    Attributes
    ----------
    name : str
        ``function.name``.
    description : str
        ``function.description`` ("" when absent).
    parameters : dict
        ``function.parameters``: a JSON Schema of the arguments object.
    strict : bool
        ``function.strict``: the schema was checked against OpenAI's strict rules.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool


def call_prefix(name: str) -> str:
    """The text the grammar forces at the start of a call of ``name`` (up to its arguments)."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def new_call_id() -> str:
    """A fresh tool call id (``call_`` + 96 random bits), unique per call as OpenAI's are."""
    return "call_" + secrets.token_hex(12)


def tools_prompt(tools: Sequence[Tool], mode: ToolMode, *, answer_schema: Mapping[str, Any] | None = None) -> str:
    """The system text that offers ``tools`` and states the one call format the grammar enforces
    (and, with ``answer_schema`` under ``auto``, the one answer format: :func:`tool_constraint`)."""
    lines = ["You can call functions. The functions, with a JSON Schema of their arguments:"]
    for tool in tools:
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description:
            entry["description"] = tool.description
        entry["parameters"] = tool.parameters
        lines.append(json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
    lines.append(f'To call a function, write {CALL_OPEN}{{"name": "<function name>", "arguments": '
                 f'<the arguments as a JSON object>}}{CALL_CLOSE}')
    if mode == "required":
        lines.append("Answer with function calls only.")
    elif mode == "named":
        lines.append(f"Call {tools[0].name} now.")
    elif answer_schema is not None:
        lines.append("Call a function only when it helps; otherwise answer with one JSON document of this JSON "
                     f"Schema: {json.dumps(answer_schema, ensure_ascii=False, separators=(',', ':'))}")
    else:
        lines.append("Call a function only when it helps; otherwise answer in text.")
    return "\n".join(lines)


def _tag(tool: Tool) -> dict[str, Any]:
    return {"type": "tag", "begin": call_prefix(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters},
            "end": CALL_SUFFIX}


def tool_constraint(tools: Sequence[Tool], mode: ToolMode, *, parallel: bool,
                    answer_schema: Mapping[str, Any] | None = None) -> Constraint:
    """The structural tag for ``tools`` under ``mode`` (``named``: ``tools`` holds the named function only).

    Parameters
    ----------
    tools : sequence of Tool
        The callable functions (non-empty).
    mode : {"auto", "required", "named"}
        ``tool_choice``.
    parallel : bool
        ``parallel_tool_calls``: more than one call per response.
    answer_schema : mapping, optional
        The schema of the answer when the request also constrains the text (``response_format``,
        ``text.format``: an agent with tools and a structured final output).  Under ``auto`` the output
        is then either calls or one JSON document of this schema; under ``required`` and a named
        function it is calls, and the schema waits for the turn that answers.

    Returns
    -------
    Constraint
        Kind ``structural_tag`` in xgrammar's form.
    """
    tags = [_tag(tool) for tool in tools]
    fmt: dict[str, Any]
    if mode == "named":
        fmt = tags[0]
    elif mode == "required" or answer_schema is not None:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": CALL_SEPARATOR,
               "at_least_one": True, "stop_after_first": not parallel}
        if mode == "auto":
            fmt = {"type": "or", "elements": [fmt, {"type": "json_schema", "json_schema": answer_schema}]}
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
               "at_least_one": False, "stop_after_first": not parallel}
    return Constraint.structural_tag_raw({"type": "structural_tag", "format": fmt})


@dataclass(frozen=True)
class TextDelta:
    """Free text outside any call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call of ``name`` begins (its index counts calls from 0)."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    """More of call ``index``'s arguments text."""

    index: int
    text: str


Event = TextDelta | CallStart | ArgsDelta


class ToolCallParser:
    """Split an output, fed in deltas, into free text and calls (:class:`CallStart`, :class:`ArgsDelta`).

    The arguments end where their JSON value ends (a small scanner follows
    strings and nesting), not at the first ``}</tool_call>``, which a string
    argument may contain.  Text that may still turn out to open a call is
    held back until it cannot.  A call that does not have the enforced form
    (only when the output was not constrained to it) stays text.

    Parameters
    ----------
    names : sequence of str
        The functions that may be called.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._prefixes: Mapping[str, str] = {call_prefix(n): n for n in names}
        self._buffer = ""
        self._state: Literal["text", "head", "args", "tail"] = "text"
        self.calls: list[tuple[str, str]] = []  # (name, arguments text) of every call begun
        self.complete_calls = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> list[Event]:
        """Consume the next delta; return the events it completes."""
        self._buffer += text
        events: list[Event] = []
        progress = True
        while progress and self._buffer:
            progress = self._step(events)
        return events

    def finish(self) -> list[Event]:
        """The output ended: whatever is held back is text (or the rest of an unfinished call)."""
        events: list[Event] = []
        if self._buffer:
            if self._state == "args":
                self._args(events, self._buffer)
            else:
                events.append(TextDelta(self._buffer))
            self._buffer = ""
        return events

    def _step(self, events: list[Event]) -> bool:
        if self._state == "text":
            at = self._buffer.find(CALL_OPEN)
            if at < 0:
                keep = _held(self._buffer, CALL_OPEN)
                if len(self._buffer) > keep:
                    events.append(TextDelta(self._buffer[:len(self._buffer) - keep]))
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                return False
            if at:
                events.append(TextDelta(self._buffer[:at]))
                self._buffer = self._buffer[at:]
            self._state = "head"
            return True
        if self._state == "head":
            for prefix, name in self._prefixes.items():
                if self._buffer.startswith(prefix):
                    self._buffer = self._buffer[len(prefix):]
                    self.calls.append((name, ""))
                    events.append(CallStart(len(self.calls) - 1, name))
                    self._state, self._depth, self._in_string, self._escape = "args", 0, False, False
                    return True
            if any(prefix.startswith(self._buffer) for prefix in self._prefixes):
                return False  # more of the head to come
            # Not a call of a known function: the tag is text.
            events.append(TextDelta(CALL_OPEN))
            self._buffer = self._buffer[len(CALL_OPEN):]
            self._state = "text"
            return True
        if self._state == "args":
            end = self._scan(self._buffer)
            if end is None:
                self._args(events, self._buffer)
                self._buffer = ""
                return False
            self._args(events, self._buffer[:end])
            self._buffer = self._buffer[end:]
            self._state = "tail"
            return True
        # tail: the call's closing brace and tag
        if self._buffer.startswith(CALL_SUFFIX):
            self._buffer = self._buffer[len(CALL_SUFFIX):]
            self.complete_calls += 1
            self._state = "text"
            return True
        if CALL_SUFFIX.startswith(self._buffer):
            return False
        self._state = "text"  # a malformed end (unconstrained output): the rest is text
        return True

    def _args(self, events: list[Event], text: str) -> None:
        if not text:
            return
        name, so_far = self.calls[-1]
        self.calls[-1] = (name, so_far + text)
        events.append(ArgsDelta(len(self.calls) - 1, text))

    def _scan(self, text: str) -> int | None:
        """Where the arguments object ends in ``text`` (the index after it), or None when it goes on.

        ``parameters`` is an object schema (OpenAI's rule), so the value ends
        where the nesting returns to 0; the state carries over between deltas.
        """
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def _held(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
