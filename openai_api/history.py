"""A conversation, as chat completions and the Responses API send it, -> the ensemble's ``MESSAGES``.

The ensemble takes ``{role, content}`` messages with an optional ``name``
(:data:`contract.MESSAGE_KEYS`), roles ``system``, ``user`` and
``assistant``; the chat template renders them.  Both OpenAI endpoints put
the same things into a conversation (text turns, the model's earlier tool
calls, the results of those calls), so they share the rendering here:

- ``developer`` turns are system turns (OpenAI's rename of ``system`` for
  reasoning models);
- an earlier call is rendered in the one call format the tool grammar
  enforces (:func:`openai_api.tools.call_prefix`), inside the assistant
  turn, so the model sees its own calls as it made them;
- a call's result is a user turn in Hermes' ``<tool_response>`` form (chat
  templates know no ``tool`` role);
- a call's ``arguments`` must be one JSON object, as the model's own calls
  are: a malformed history (``"{"``) is refused, not passed on to a model
  that would learn from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from openai_api.errors import BadRequest
from openai_api.tools import CALL_SUFFIX, call_prefix

__all__ = ["Turn", "assistant_turn", "check_arguments", "text_turn", "tool_result_turn", "with_system"]

#: One ensemble message: ``role``, ``content`` and optionally ``name``.
Turn = dict[str, str]


def text_turn(role: str, text: str, name: str | None = None) -> Turn:
    """A ``system``, ``developer`` (as system) or ``user`` turn, with the speaker's ``name`` if given."""
    turn = {"role": "system" if role == "developer" else role, "content": text}
    if name is not None:
        turn["name"] = name
    return turn


def check_arguments(arguments: str, param: str) -> str:
    """``arguments`` of an earlier call, checked to be one JSON object (``param`` names it in the error)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise BadRequest(param, f"is not JSON ({err.msg} at column {err.colno}): a call's arguments are one "
                                "JSON object") from err
    if not isinstance(value, dict):
        raise BadRequest(param, "must be a JSON object (a call's arguments are one JSON object)")
    return arguments


def assistant_turn(text: str, calls: Sequence[tuple[str, str]], name: str | None = None) -> Turn:
    """The model's earlier turn: its text, then its calls ``(name, arguments)`` in the enforced call format."""
    content = text + "".join(f"{call_prefix(fn)}{arguments}{CALL_SUFFIX}" for fn, arguments in calls)
    return text_turn("assistant", content, name)


def tool_result_turn(text: str) -> Turn:
    """The result of a call, as the user turn Hermes-style templates expect."""
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def with_system(turns: list[Turn], extra: str | None) -> list[Turn]:
    """``turns`` with ``extra`` (the tools' instructions) appended to the first system turn, or first."""
    if extra is None:
        return turns
    if turns and turns[0]["role"] == "system":
        return [{**turns[0], "content": turns[0]["content"] + "\n\n" + extra}, *turns[1:]]
    return [{"role": "system", "content": extra}, *turns]
