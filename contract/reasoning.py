"""The ``reasoning`` request option: the model thinks first, then answers under the constraint.

A reasoning model (DeepSeek-R1, Qwen3, ...) writes a thinking section before
its answer, ended by a marker (``</think>``).  With ``reasoning`` on, the
output is two parts:

* the thinking section: every character before the first occurrence of the
  ``end`` marker (a leading ``start`` marker, when the output begins with
  it, is left out); free text, where only the request's stop tokens are
  refused;
* the answer: everything after that occurrence, where the request's
  constraint applies exactly as it does without ``reasoning``.

An output that never writes the end marker is all thinking (its answer is
empty).  The server ends the thinking itself, by forcing the end marker, at
``max_reasoning_tokens`` and when what is left of ``max_tokens`` would no
longer hold a valid answer (``grammar_backend.reasoning``).

This module is the one home of the option's rules (client and server both
check with :func:`check_reasoning`) and of the one definition of where the
thinking ends (:func:`split_reasoning`, and :class:`ReasoningSplitter` for a
stream of text deltas: both give the same parts for every output, however
it is cut into deltas).  Standard library only, like the rest of
:mod:`contract`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from contract import MAX_MAX_TOKENS, ContractError

__all__ = [
    "MAX_MARKER_CHARS",
    "REASONING_FIELDS",
    "Reasoning",
    "ReasoningSplitter",
    "check_markers",
    "check_reasoning",
    "reasoning_from_json",
    "reasoning_wire",
    "split_reasoning",
]

#: The fields of a ``reasoning`` object (the ``REASONING`` tensor's JSON, the SDK's and the OpenAI extension's).
REASONING_FIELDS: Final = ("start", "end", "max_reasoning_tokens")
#: Longest marker, in characters (``<think>`` is 7; gpt-oss's channel header about 30).
MAX_MARKER_CHARS: Final = 64


@dataclass(frozen=True)
class Reasoning:
    """A request's thinking section: its markers and its bound.

    Attributes
    ----------
    end : str
        The marker that ends the thinking (non-empty); the constraint applies after it.
    start : str
        The marker the thinking may begin with ("" = none), left out of the reasoning text.
    max_reasoning_tokens : int or None
        Most tokens of the thinking section, its end marker included (None: bounded by
        ``max_tokens`` only); the server forces the end marker there.
    """

    end: str
    start: str = ""
    max_reasoning_tokens: int | None = None

    def as_dict(self) -> dict[str, object]:
        """The JSON object of this option (:func:`reasoning_from_json` reads it back)."""
        out: dict[str, object] = {"start": self.start, "end": self.end}
        if self.max_reasoning_tokens is not None:
            out["max_reasoning_tokens"] = self.max_reasoning_tokens
        return out

    def to_json(self) -> str:
        """:meth:`as_dict` as compact JSON text."""
        return json.dumps(self.as_dict(), ensure_ascii=False, separators=(",", ":"))


def check_markers(start: object, end: object, field: str = "reasoning") -> tuple[str, str]:
    """Check a pair of markers; return them.

    Rules: ``end`` is a non-empty string, ``start`` a string (may be empty),
    each at most :data:`MAX_MARKER_CHARS` characters of valid Unicode, and the
    two do not overlap: ``end`` does not occur in ``start`` and no suffix of
    ``start`` begins ``end``.  Then the end marker can never start inside a
    leading start marker, so "the first ``end`` in the output" and "the first
    ``end`` after a leading ``start``" are the same place: the grammar side
    (which watches the output's bytes for ``end`` alone), a stream of deltas
    and the final text agree on it.

    Raises
    ------
    ContractError
        Naming ``<field>.start`` or ``<field>.end``.
    """
    for name, value in (("end", end), ("start", start)):
        if not isinstance(value, str):
            raise ContractError(f"{field}.{name}", f"must be a string, got {type(value).__name__}")
        if len(value) > MAX_MARKER_CHARS:
            raise ContractError(f"{field}.{name}", f"is {len(value)} characters; at most {MAX_MARKER_CHARS}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ContractError(f"{field}.{name}", f"contains an unpaired surrogate at character {err.start}") from err
    assert isinstance(start, str) and isinstance(end, str)  # checked above (narrows for mypy)
    if not end:
        raise ContractError(f"{field}.end", "must not be empty")
    for i in range(len(start)):
        if start.startswith(end, i) or end.startswith(start[i:]):
            raise ContractError(f"{field}.end", f"{end!r} overlaps the start marker {start!r} (it would end the "
                                                "thinking inside it)")
    return start, end


def check_reasoning(value: object, default: Reasoning | None = None, field: str = "reasoning") -> Reasoning | None:
    """The reasoning option of a request, checked, with the server's default markers filled in.

    Parameters
    ----------
    value : object
        The request's value: None (absent: ``default``, so a server whose
        model reasons has it on unless a request says ``false``), ``False``
        (off), ``True`` (on, with ``default``'s markers), or a mapping with
        some of :data:`REASONING_FIELDS`.  Markers come as a pair: a mapping
        that gives ``start`` or ``end`` gives the thinking's own markers
        (``start`` defaults to ""), one that gives neither takes ``default``'s.
    default : Reasoning or None
        The server's markers (``REASONING_START``/``REASONING_END`` at render
        time); None: a request must name its own ``end``.

    Returns
    -------
    Reasoning or None
        None: no thinking section (the constraint applies from the first token).

    Raises
    ------
    ContractError
        Naming ``reasoning``, ``reasoning.<field>``: a wrong type, an unknown
        field, markers that break :func:`check_markers`, ``max_reasoning_tokens``
        outside ``1..MAX_MAX_TOKENS``, or no end marker at all.
    """
    if value is None:
        return default
    if value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise ContractError(field, f"must be true, false or an object of {', '.join(REASONING_FIELDS)}, "
                                   f"got {type(value).__name__}")
    for name in value:
        if name not in REASONING_FIELDS:
            raise ContractError(f"{field}.{name}", f"unknown field; expected one of {', '.join(REASONING_FIELDS)}")
    limit = value.get("max_reasoning_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_MAX_TOKENS):
        raise ContractError(f"{field}.max_reasoning_tokens", f"must be an integer in 1..{MAX_MAX_TOKENS}, "
                                                             f"got {limit!r}")
    if "start" in value or "end" in value:
        if value.get("end") is None:
            raise ContractError(f"{field}.end", "is required with start")
        start, end = check_markers(value.get("start", ""), value["end"], field)
    elif default is not None:
        start, end = default.start, default.end
    else:
        raise ContractError(f"{field}.end", "is required: this server has no default reasoning markers")
    return Reasoning(end=end, start=start, max_reasoning_tokens=limit)


def reasoning_from_json(text: str | bytes, default: Reasoning | None = None) -> Reasoning | None:
    """:func:`check_reasoning` of the ``REASONING`` tensor's JSON text ("" = absent).

    Raises
    ------
    ContractError
        ``reasoning``: not JSON, or the checks of :func:`check_reasoning`.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ContractError("reasoning", f"not valid UTF-8 at byte {err.start}") from err
    if not text.strip():
        return default
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ContractError("reasoning", f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from err
    except RecursionError as err:
        raise ContractError("reasoning", "nested too deeply") from err
    return check_reasoning(value, default)


def split_reasoning(text: str, reasoning: Reasoning) -> tuple[str, str, bool]:
    """Split a whole output into ``(thinking, answer, ended)``.

    ``ended``: the output wrote the end marker (else it is all thinking and
    the answer is "").  The thinking leaves out a leading start marker and
    the end marker itself.
    """
    at = text.find(reasoning.end)
    thinking = text if at < 0 else text[:at]
    if reasoning.start and thinking.startswith(reasoning.start):
        thinking = thinking[len(reasoning.start):]
    if at < 0:
        return thinking, "", False
    return thinking, text[at + len(reasoning.end):], True


class ReasoningSplitter:
    """Splits a stream of text deltas into thinking and answer deltas, as :func:`split_reasoning` splits the whole.

    Text that may still turn out to be a marker (a prefix of the start marker
    at the very beginning, a suffix that begins the end marker) is held back
    until it is decided, so no marker character ever reaches either part; the
    rest of the thinking goes out as it comes.  The thinking deltas joined
    (with :meth:`finish`) equal ``split_reasoning(text)[0]`` and the answer
    deltas its ``[1]``.

    Parameters
    ----------
    reasoning : Reasoning
    """

    __slots__ = ("_answering", "_end", "_held", "_start", "_started")

    def __init__(self, reasoning: Reasoning) -> None:
        self._start = reasoning.start
        self._end = reasoning.end
        self._held = ""  # thinking text not sent yet (it may begin a marker)
        self._started = not reasoning.start  # the leading start marker is decided (present or not)
        self._answering = False

    @property
    def answering(self) -> bool:
        """Whether the end marker was seen (every later delta is answer)."""
        return self._answering

    def push(self, delta: str) -> tuple[str, str]:
        """Add a delta; return ``(thinking, answer)`` text to send now (either may be "")."""
        if self._answering:
            return "", delta
        buf = self._held + delta
        if not self._started:
            if len(buf) < len(self._start) and self._start.startswith(buf):
                self._held = buf
                return "", ""
            self._started = True
            buf = buf.removeprefix(self._start)
        at = buf.find(self._end)
        if at >= 0:
            self._answering = True
            self._held = ""
            return buf[:at], buf[at + len(self._end):]
        keep = _marker_tail(buf, self._end)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], ""

    def finish(self) -> str:
        """The thinking text still held at the end of the output (an unfinished marker is thinking)."""
        held, self._held = self._held, ""
        return held


def _marker_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


#: Stands for the server's default markers where a client checks a request without knowing them.
_SERVER_DEFAULT: Final = Reasoning(end="\x00")


def reasoning_wire(value: object, field: str = "reasoning") -> str | None:
    """The ``REASONING`` tensor's JSON text for a client's value (None: send no tensor).

    Checks all that a client can know (types, fields, markers, the bound) with
    :func:`check_reasoning`'s rules; whether the server has default markers
    for ``True`` or a mapping without markers is the server's to say.

    Parameters
    ----------
    value : Reasoning, bool, mapping or None
        None: the server's default; ``False``: no thinking section; ``True``:
        the server's markers; a mapping of :data:`REASONING_FIELDS`; a
        :class:`Reasoning`.

    Raises
    ------
    ContractError
        Naming the field.
    """
    if value is None:
        return None
    if isinstance(value, Reasoning):
        value = value.as_dict()
    if not isinstance(value, (bool, Mapping)):
        raise ContractError(field, f"must be a Reasoning, true, false or an object of {', '.join(REASONING_FIELDS)}, "
                                   f"got {type(value).__name__}")
    check_reasoning(value, _SERVER_DEFAULT, field)
    return json.dumps(value if isinstance(value, bool) else dict(value), ensure_ascii=False, separators=(",", ":"))
