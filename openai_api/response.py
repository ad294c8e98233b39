"""Ensemble results -> OpenAI response bodies and stream chunks.

One :class:`Renderer` per request turns the text deltas and the final
:class:`client.sdk.Result` into OpenAI's shapes, for a whole response
(:meth:`Renderer.body`) and for a stream (:meth:`Renderer.chunks`,
:meth:`Renderer.final_chunks`), so both paths carry the same content,
calls and finish reason.

``finish_reason`` maps from RESULT: ``stop`` -> ``"stop"``, or
``"tool_calls"`` when the output holds at least one complete call;
``length`` -> ``"length"``, except for an output the server closed at the
budget that is complete under its constraint (:func:`closed_complete`):
that is ``"stop"``/``"tool_calls"``, and :data:`~openai_api.request.EXTENSION`
says ``closed_early`` and why; ``content_filter`` is never sent.

The report that OpenAI's shapes have no field for travels in the top-level
extension member :data:`~openai_api.request.EXTENSION` of the response (of
the last chunk, when streaming)::

    {"complete", "closed_early", "close_reason", "stop_string", "backend",
     "value_retries", "json": RESULT's json report or null,
     "tool_calls": [{"valid", "violations"}] or null,
     "seed": the seed the output's draws used (send it to replay)}

plus, for a request with a thinking section, ``reasoning_cut`` and
``reasoning_ended``.  The thinking itself is ``message.reasoning_content``
(streamed as ``delta.reasoning_content``), as vLLM and SGLang send it, and
its token count ``usage.completion_tokens_details.reasoning_tokens`` (where
counted: a constrained request), as OpenAI's reasoning models do; tool calls
and ``content`` come from the answer alone.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Final

from client.sdk import Chunk, Result, TokenLogprob
from grammar_backend.fidelity import validator_for
from openai_api.request import EXTENSION, Plan
from openai_api.tools import CallStart, Event, TextDelta, ToolCallParser, new_call_id

__all__ = ["ChatOutput", "Logprobs", "Renderer", "body", "closed_complete", "finish_reason", "usage"]

_OBJECTS: Final = {"chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
                   "completions": ("text_completion", "text_completion", "cmpl-"),
                   # the Responses API's output splits text and calls with a Renderer too
                   "responses": ("response", "response", "resp_")}


def closed_complete(result: Result) -> bool:
    """``result`` was closed by the server and is complete under its constraint.

    Closing ends an output only where its grammar reaches an end, so what it
    closed is a sentence of the constraint; it must also have begun its answer
    (a thinking section that never ended has none) and, for JSON, validate
    against the full schema (a keyword no backend enforces may still fail).
    """
    return (result.closed_early and result.reasoning_ended
            and (result.json is None or result.json.valid is not False))


def finish_reason(result: Result, calls: int) -> str:
    """OpenAI's ``finish_reason`` for ``result`` with ``calls`` complete tool calls.

    It tells what the output is, not how it ended: an output the server closed at the budget that is
    complete under its constraint (:func:`closed_complete`) ends with ``stop`` (or ``tool_calls``), as
    the clients that keep only such outputs (the openai SDK's ``.parse()``, instructor) need;
    ``length`` is an output cut short.  The extension report still says ``closed_early`` and why.
    """
    if result.finish_reason == "length" and not closed_complete(result):
        return "length"
    return "tool_calls" if calls else "stop"


class Logprobs:
    """A choice's log probabilities in OpenAI's shape for its endpoint, streamed piece by piece.

    Chat: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``.  Completions (the
    legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``,
    offsets in characters of the choice's text, continued across the stream's chunks.
    """

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._offset = 0

    def render(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` member for ``entries`` (the next tokens of the choice)."""
        if self._endpoint != "completions":
            return {"content": [e.to_openai() for e in entries], "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}


class Renderer:
    """The OpenAI form of one choice of a request's output.

    Parameters
    ----------
    plan : Plan
        The request.
    index : int
        The choice (0 to ``plan.n - 1``).
    first : Renderer, optional
        Choice 0's renderer, whose ``id`` and ``created`` every choice of the request shares.
    """

    def __init__(self, plan: Plan, index: int = 0, first: Renderer | None = None) -> None:
        self.plan = plan
        self.index = index
        kind, self._chunk_object, prefix = _OBJECTS[plan.endpoint]
        self._object = kind
        self.id: str = prefix + secrets.token_hex(12) if first is None else first.id
        self.created: int = int(time.time()) if first is None else first.created
        self._parser = ToolCallParser([t.name for t in plan.tools]) if plan.tools else None
        self._ids: list[str] = []
        self._content: list[str] = []
        self._role_sent = False
        self._logprobs = Logprobs(plan.endpoint)
        self._pending: list[TokenLogprob] = []  # entries not yet sent: their chunk had no text to hand out

    # ------------------------------------------------------------------ pieces
    def events(self, text: str, *, last: bool) -> list[Event]:
        """The text and call events of the output's next delta (``last``: the output ended), as the request's
        tool mode hands them out (the Responses API's output builds its items from them)."""
        if self._parser is None:
            return [TextDelta(text)] if text else []
        events = self._parser.feed(text)
        if last:
            events += self._parser.finish()
        if self.plan.tool_mode != "auto":
            # Under required or a named function the grammar admits only calls and the
            # separator between them: there is no text to hand out.
            return [e for e in events if not isinstance(e, TextDelta)]
        # Under auto, whitespace once calls began is the separator between them (or what follows the
        # last): no text for the client (OpenAI sends null content beside calls).
        return [e for e in events if not (isinstance(e, TextDelta) and self._parser.calls and not e.text.strip())]

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

    def _choice(self, delta: dict[str, Any], finish: str | None,
                logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        rendered = None if logprobs is None else self._logprobs.render(logprobs)
        if self.plan.endpoint == "completions":
            return {"index": self.index, "text": delta.get("content", ""), "logprobs": rendered,
                    "finish_reason": finish}
        return {"index": self.index, "delta": delta, "logprobs": rendered, "finish_reason": finish}

    def _take(self, entries: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """The entries to send now (held ones first), or None where none were asked for."""
        if self.plan.logprobs is None:
            return None
        taken, self._pending = self._pending + (entries or []), []
        return taken

    # ------------------------------------------------------------------ stream
    def chunks(self, text: str, reasoning: str = "", logprobs: list[TokenLogprob] | None = None,
               ) -> list[dict[str, Any]]:
        """The chunks for one text delta of the stream (the first also carries the role), after one for the
        thinking's delta (``reasoning_content``: chat only; a completion streams the answer alone).

        ``logprobs`` (the piece's entries) ride on its first text chunk; where the piece hands out no text
        (the tool-call parser holds it), they wait for the next one.
        """
        out = []
        if not self._role_sent and self.plan.endpoint == "chat":
            self._role_sent = True
            out.append(self._chunk(self._choice({"role": "assistant", "content": ""}, None)))
        if reasoning and self.plan.endpoint == "chat":
            out.append(self._chunk(self._choice({"reasoning_content": reasoning}, None)))
        entries = self._take(logprobs)
        for event in self.events(text, last=False):
            out.append(self._chunk(self._choice(self._delta(event), None, entries)))
            entries = [] if entries is not None else None
        if entries:
            self._pending = entries
        return out

    def final_chunks(self, tail: str, result: Result, reasoning_tail: str = "",
                     logprobs: list[TokenLogprob] | None = None) -> list[dict[str, Any]]:
        """The chunks after the last delta: the rest of the thinking and of the text, the finish reason (with
        the extension report and any log probabilities not sent yet), and the usage chunk when
        ``stream_options.include_usage`` (:meth:`usage_chunk`; with ``n`` > 1 the server sends one for the
        whole request)."""
        out = self.chunks("") if not self._role_sent else []
        if reasoning_tail and self.plan.endpoint == "chat":
            out.append(self._chunk(self._choice({"reasoning_content": reasoning_tail}, None)))
        entries = self._take(logprobs)
        for event in self.events(tail, last=True):
            out.append(self._chunk(self._choice(self._delta(event), None, entries)))
            entries = [] if entries is not None else None
        calls = self.complete_calls()
        out.append(self._chunk(self._choice({}, finish_reason(result, calls), entries or None),
                               **{EXTENSION: self.report(result)}))
        if self.plan.include_usage and self.plan.n == 1:
            out.append(self.usage_chunk([result]))
        return out

    def usage_chunk(self, results: list[Result]) -> dict[str, Any]:
        """The stream's last chunk under ``stream_options.include_usage``: the usage of every choice."""
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.plan.model,
                "system_fingerprint": None, "choices": [], "usage": usage(*results)}

    # ------------------------------------------------------------------ whole
    def body(self, result: Result) -> dict[str, Any]:
        """The whole response for ``result`` (``stream: false``; :func:`body` joins the choices of ``n``)."""
        for event in self.events(result.text, last=True):
            self._delta(event)
        calls = self.complete_calls()
        reason = finish_reason(result, calls)
        content = "".join(self._content)
        logprobs = None if self.plan.logprobs is None else self._logprobs.render(result.logprobs or [])
        choice: dict[str, Any]
        if self.plan.endpoint == "completions":
            choice = {"index": self.index, "text": content, "logprobs": logprobs, "finish_reason": reason}
        else:
            # OpenAI sends null content beside tool calls when there is no text.
            message: dict[str, Any] = {"role": "assistant", "content": (content or None) if self._ids else content,
                                       "refusal": None}
            if result.reasoning is not None:
                message["reasoning_content"] = result.reasoning
            if self._ids:
                message["tool_calls"] = self.tool_calls()
            choice = {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {"id": self.id, "object": self._object, "created": self.created, "model": self.plan.model,
                "system_fingerprint": None, "choices": [choice], "usage": usage(result),
                EXTENSION: self.report(result)}

    def call(self, index: int) -> tuple[str, str]:
        """Call ``index``'s function name and arguments text so far."""
        if self._parser is None:
            raise IndexError(f"call {index}: the request has no tools")
        return self._parser.calls[index]

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls of the output, OpenAI's ``message.tool_calls``."""
        if self._parser is None:
            return []
        return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                for call_id, (name, arguments) in zip(self._ids, self._parser.calls, strict=True)]

    def complete_calls(self) -> int:
        """How many calls of the output are complete so far."""
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
                  "value_retries": result.value_retries, "json": result.raw.get("json"), "tool_calls": calls,
                  "seed": result.seed}
        if result.reasoning is not None:
            report.update(reasoning_cut=result.reasoning_cut, reasoning_ended=result.reasoning_ended)
        return report


def body(renderers: list[Renderer], results: list[Result]) -> dict[str, Any]:
    """The whole response of a request's choices (``n``): each choice's, the usage of all.

    With one choice it is :meth:`Renderer.body`.  With more, every choice also carries its own
    extension report under :data:`~openai_api.request.EXTENSION`; the top-level one is the first's.
    """
    bodies = [r.body(res) for r, res in zip(renderers, results, strict=True)]
    out = bodies[0]
    if len(bodies) > 1:
        out["choices"] = [{**b["choices"][0], EXTENSION: b[EXTENSION]} for b in bodies]
        out["usage"] = usage(*results)
    return out


def usage(*results: Result) -> dict[str, Any]:
    """OpenAI's ``usage`` of a request's choices: the prompt once (as OpenAI counts it), every completion."""
    prompt = results[0].usage.prompt_tokens
    completion = sum(r.usage.completion_tokens for r in results)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    reasoning = [r.reasoning_tokens for r in results if r.reasoning_tokens is not None]
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return out


class ChatOutput:
    """What the server sends for a chat or completions request: its choices' renderers, as
    :class:`~openai_api.server.OpenAIServer` drives every endpoint (the Responses API's is
    :class:`openai_api.responses.ResponsesOutput`)."""

    #: The stream's last line (OpenAI's chat and completions streams end with it).
    done: bytes = b"data: [DONE]\n\n"

    def __init__(self, plan: Plan) -> None:
        first = Renderer(plan)
        self.plan = plan
        self.renderers = [first, *(Renderer(plan, i, first) for i in range(1, plan.n))]

    def start(self) -> list[dict[str, Any]]:
        """The events before any choice's first piece (none: the first chunk carries the role)."""
        return []

    def piece(self, choice: int, chunk: Chunk) -> list[dict[str, Any]]:
        """The events of one streamed piece of choice ``choice``."""
        return self.renderers[choice].chunks(chunk.text, chunk.reasoning, chunk.logprobs)

    def finish(self, choice: int, result: Result, last: Chunk) -> list[dict[str, Any]]:
        """The events when choice ``choice`` ends (``last``: its final piece)."""
        return self.renderers[choice].final_chunks(last.text, result, last.reasoning, last.logprobs)

    def end(self, results: list[Result]) -> list[dict[str, Any]]:
        """The events after every choice ended: the usage of them all, when asked and ``n`` > 1."""
        return [self.renderers[0].usage_chunk(results)] if self.plan.include_usage and self.plan.n > 1 else []

    def body(self, results: list[Result]) -> dict[str, Any]:
        """The whole response (``stream: false``)."""
        return body(self.renderers, results)

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that end a stream that failed after its first piece: OpenAI's error object."""
        return [error]

    @staticmethod
    def frame(event: dict[str, Any]) -> bytes:
        """One Server-Sent Event."""
        return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"
