"""Ensemble results -> OpenAI response bodies and stream chunks.

One :class:`Renderer` per request turns the text deltas and the final
:class:`client.sdk.Result` into OpenAI's shapes, for a whole response
(:meth:`Renderer.body`) and for a stream (:meth:`Renderer.chunks`,
:meth:`Renderer.final_chunks`), so both paths carry the same content,
calls and finish reason.

``finish_reason`` maps from RESULT: ``stop`` -> ``"stop"``, or
``"tool_calls"`` when the output holds at least one complete call;
``length`` -> ``"length"`` (also when the server closed the output at the
budget: it parses, and :data:`~openai_api.request.EXTENSION` says
``closed_early``); ``content_filter`` is never sent.

The report that OpenAI's shapes have no field for travels in the top-level
extension member :data:`~openai_api.request.EXTENSION` of the response (of
the last chunk, when streaming)::

    {"complete", "closed_early", "close_reason", "stop_string", "backend",
     "value_retries", "json": RESULT's json report or null,
     "tool_calls": [{"valid", "violations"}] or null}

plus, for a request with a thinking section, ``reasoning_cut`` and
``reasoning_ended``.  The thinking itself is ``message.reasoning_content``
(streamed as ``delta.reasoning_content``), as vLLM and SGLang send it, and
its token count ``usage.completion_tokens_details.reasoning_tokens`` (where
counted: a constrained request), as OpenAI's reasoning models do; tool calls
and ``content`` come from the answer alone.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

from client.sdk import Result
from grammar_backend.fidelity import validator_for
from openai_api.request import EXTENSION, Plan
from openai_api.tools import CallStart, Event, TextDelta, ToolCallParser, new_call_id

__all__ = ["Renderer", "finish_reason", "usage"]

_OBJECTS: Final = {"chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
                   "completions": ("text_completion", "text_completion", "cmpl-")}


def finish_reason(result: Result, calls: int) -> str:
    """OpenAI's ``finish_reason`` for ``result`` with ``calls`` complete tool calls."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


class Renderer:
    """The OpenAI form of one request's output.

    Parameters
    ----------
    plan : Plan
        The request.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        kind, self._chunk_object, prefix = _OBJECTS[plan.endpoint]
        self._object = kind
        self.id = prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self._parser = ToolCallParser([t.name for t in plan.tools]) if plan.tools else None
        self._ids: list[str] = []
        self._content: list[str] = []
        self._role_sent = False

    # ------------------------------------------------------------------ pieces
    def _events(self, text: str, *, last: bool) -> list[Event]:
        if self._parser is None:
            return [TextDelta(text)] if text else []
        events = self._parser.feed(text)
        if last:
            events += self._parser.finish()
        if self.plan.tool_mode != "auto":
            # Under required or a named function the grammar admits only calls and the
            # separator between them: there is no text to hand out.
            return [e for e in events if not isinstance(e, TextDelta)]
        return events

    def _delta(self, event: Event) -> dict[str, Any]:
        if isinstance(event, TextDelta):
            self._content.append(event.text)
            return {"content": event.text}
        if isinstance(event, CallStart):
            self._ids.append(new_call_id())
            return {"tool_calls": [{"index": event.index, "id": self._ids[event.index], "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self._chunk_object, "created": self.created,
                                 "model": self.plan.model, "system_fingerprint": None, "choices": [choice]}
        if self.plan.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return chunk

    def _choice(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        if self.plan.endpoint == "completions":
            return {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    # ------------------------------------------------------------------ stream
    def chunks(self, text: str, reasoning: str = "") -> list[dict[str, Any]]:
        """The chunks for one text delta of the stream (the first also carries the role), after one for the
        thinking's delta (``reasoning_content``: chat only; a completion streams the answer alone)."""
        out = []
        if not self._role_sent and self.plan.endpoint == "chat":
            self._role_sent = True
            out.append(self._chunk(self._choice({"role": "assistant", "content": ""}, None)))
        if reasoning and self.plan.endpoint == "chat":
            out.append(self._chunk(self._choice({"reasoning_content": reasoning}, None)))
        for event in self._events(text, last=False):
            out.append(self._chunk(self._choice(self._delta(event), None)))
        return out

    def final_chunks(self, tail: str, result: Result, reasoning_tail: str = "") -> list[dict[str, Any]]:
        """The chunks after the last delta: the rest of the thinking and of the text, the finish reason (with
        the extension report), and the usage chunk when ``stream_options.include_usage``."""
        out = self.chunks("") if not self._role_sent else []
        if reasoning_tail and self.plan.endpoint == "chat":
            out.append(self._chunk(self._choice({"reasoning_content": reasoning_tail}, None)))
        for event in self._events(tail, last=True):
            out.append(self._chunk(self._choice(self._delta(event), None)))
        calls = self._complete_calls()
        out.append(self._chunk(self._choice({}, finish_reason(result, calls)), **{EXTENSION: self.report(result)}))
        if self.plan.include_usage:
            out.append({"id": self.id, "object": self._chunk_object, "created": self.created,
                        "model": self.plan.model, "system_fingerprint": None, "choices": [],
                        "usage": usage(result)})
        return out

    # ------------------------------------------------------------------ whole
    def body(self, result: Result) -> dict[str, Any]:
        """The whole response for ``result`` (``stream: false``)."""
        for event in self._events(result.text, last=True):
            self._delta(event)
        calls = self._complete_calls()
        reason = finish_reason(result, calls)
        content = "".join(self._content)
        choice: dict[str, Any]
        if self.plan.endpoint == "completions":
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}
        else:
            # OpenAI sends null content beside tool calls when there is no text.
            message: dict[str, Any] = {"role": "assistant", "content": (content or None) if self._ids else content,
                                       "refusal": None}
            if result.reasoning is not None:
                message["reasoning_content"] = result.reasoning
            if self._ids:
                message["tool_calls"] = self.tool_calls()
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        return {"id": self.id, "object": self._object, "created": self.created, "model": self.plan.model,
                "system_fingerprint": None, "choices": [choice], "usage": usage(result),
                EXTENSION: self.report(result)}

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls of the output, OpenAI's ``message.tool_calls``."""
        if self._parser is None:
            return []
        return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                for call_id, (name, arguments) in zip(self._ids, self._parser.calls, strict=True)]

    def _complete_calls(self) -> int:
        return 0 if self._parser is None else self._parser.complete_calls

    def report(self, result: Result) -> dict[str, Any]:
        """The extension report of ``result`` (see the module docstring)."""
        calls = None
        if self._parser is not None:
            schemas = {t.name: t.parameters for t in self.plan.tools}
            calls = []
            for name, arguments in self._parser.calls:
                checked = validator_for(schemas[name], checked=True).validate_text(arguments).to_dict()
                calls.append({"valid": checked["valid"], "violations": checked["violations"]})
        report = {"complete": result.complete, "closed_early": result.closed_early,
                  "close_reason": result.close_reason, "stop_string": result.stop_string, "backend": result.backend,
                  "value_retries": result.value_retries, "json": result.raw.get("json"), "tool_calls": calls}
        if result.reasoning is not None:
            report.update(reasoning_cut=result.reasoning_cut, reasoning_ended=result.reasoning_ended)
        return report


def usage(result: Result) -> dict[str, Any]:
    """OpenAI's ``usage`` of ``result``."""
    prompt, completion = result.usage.prompt_tokens, result.usage.completion_tokens
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if result.reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": result.reasoning_tokens}
    return out
