"""The ``reasoning`` option's contract: its checks, the one split of an output, and the client's agreement."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from client.errors import InvalidRequest
from client.sdk import GenerateRequest
from contract import ContractError
from contract.reasoning import (
    MAX_MARKER_CHARS,
    Reasoning,
    ReasoningSplitter,
    check_markers,
    check_reasoning,
    reasoning_from_json,
    reasoning_wire,
    split_reasoning,
)
from llm_runtime.streaming import PartCoalescer

THINK = Reasoning(end="</think>", start="<think>")
SERVER = Reasoning(end="</r>", start="<r>")


@pytest.mark.parametrize(
    ("value", "default", "expected"),
    [
        (None, None, None),
        (None, SERVER, SERVER),
        (False, SERVER, None),
        (True, SERVER, SERVER),
        ({}, SERVER, SERVER),
        ({"max_reasoning_tokens": 7}, SERVER, Reasoning("</r>", "<r>", 7)),
        ({"end": "</think>"}, SERVER, Reasoning("</think>")),
        ({"end": "</think>", "start": "<think>"}, None, THINK),
        ({"end": "</think>", "start": "<think>", "max_reasoning_tokens": 1}, None, Reasoning("</think>", "<think>", 1)),
        ({"end": "x" * MAX_MARKER_CHARS}, None, Reasoning("x" * MAX_MARKER_CHARS)),
        ({"end": "</think>", "max_reasoning_tokens": None}, None, Reasoning("</think>")),
    ],
)
def test_check_reasoning_accepts(value: object, default: Reasoning | None, expected: Reasoning | None) -> None:
    assert check_reasoning(value, default) == expected


@pytest.mark.parametrize(
    ("value", "default", "field", "message"),
    [
        (True, None, "reasoning.end", "is required: this server has no default reasoning markers"),
        ({}, None, "reasoning.end", "is required: this server has no default reasoning markers"),
        ({"max_reasoning_tokens": 3}, None, "reasoning.end", "is required: this server has no default"),
        ("yes", None, "reasoning", "must be true, false or an object of start, end, max_reasoning_tokens, got str"),
        (1, SERVER, "reasoning", "must be true, false or an object"),
        ({"stop": "x"}, SERVER, "reasoning.stop", "unknown field; expected one of start, end, max_reasoning_tokens"),
        ({"start": "<think>"}, SERVER, "reasoning.end", "is required with start"),
        ({"end": ""}, None, "reasoning.end", "must not be empty"),
        ({"end": 5}, None, "reasoning.end", "must be a string, got int"),
        ({"end": "</t>", "start": None}, None, "reasoning.start", "must be a string, got NoneType"),
        ({"end": "x" * (MAX_MARKER_CHARS + 1)}, None, "reasoning.end", "is 65 characters; at most 64"),
        ({"end": "\ud800"}, None, "reasoning.end", "contains an unpaired surrogate at character 0"),
        ({"end": "</t>", "max_reasoning_tokens": 0}, None, "reasoning.max_reasoning_tokens",
         "must be an integer in 1..2147483647, got 0"),
        ({"end": "</t>", "max_reasoning_tokens": True}, None, "reasoning.max_reasoning_tokens",
         "must be an integer in 1..2147483647, got True"),
        ({"end": "</t>", "max_reasoning_tokens": 2.0}, None, "reasoning.max_reasoning_tokens", "got 2.0"),
        # Overlapping markers would let the end start inside a leading start marker.
        ({"start": "<think>", "end": "k>"}, None, "reasoning.end", "overlaps the start marker"),
        ({"start": "<a>", "end": ">b"}, None, "reasoning.end", "overlaps the start marker"),
        ({"start": "<", "end": "</think>"}, None, "reasoning.end", "overlaps the start marker"),
        ({"start": "ab", "end": "ab"}, None, "reasoning.end", "overlaps the start marker"),
    ],
)
def test_check_reasoning_refuses(value: object, default: Reasoning | None, field: str, message: str) -> None:
    with pytest.raises(ContractError, match=f"^{field}: ") as err:
        check_reasoning(value, default)
    assert err.value.field == field
    assert message in err.value.reason


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("{", "reasoning", "invalid JSON at line 1 column 2"),
        (b"\xff", "reasoning", "not valid UTF-8 at byte 0"),
        ('"on"', "reasoning", "must be true, false or an object"),
    ],
)
def test_reasoning_from_json_refuses(text: str | bytes, field: str, message: str) -> None:
    with pytest.raises(ContractError, match=f"^{field}: .*{message}"):
        reasoning_from_json(text, SERVER)


def test_reasoning_from_json_round_trips() -> None:
    limited = Reasoning("</think>", "<think>", 12)
    assert reasoning_from_json(limited.to_json()) == limited
    assert reasoning_from_json("", SERVER) == SERVER
    assert reasoning_from_json(b"false", SERVER) is None


@pytest.mark.parametrize(
    ("start", "end"),
    [("<think>", "</think>"), ("", "</think>"), ("<|channel|>analysis", "<|end|>"), ("[[", "]]"), ("ab", "cab")],
)
def test_check_markers_accepts(start: str, end: str) -> None:
    assert check_markers(start, end) == (start, end)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>plan</think>{\"a\":1}", ("plan", '{"a":1}', True)),
        ("plan</think>{}", ("plan", "{}", True)),
        ("</think>{}", ("", "{}", True)),
        ("<think>\n\n</think>\n\n{}", ("\n\n", "\n\n{}", True)),
        ("<think>a</think>b</think>c", ("a", "b</think>c", True)),  # the first end marker ends it
        ("<think>never ends", ("never ends", "", False)),
        ("<think>cut at </thi", ("cut at </thi", "", False)),
        ("<thi", ("<thi", "", False)),
        ("", ("", "", False)),
        ("x<think>y</think>z", ("x<think>y", "z", True)),  # a start marker later on is thinking text
    ],
)
def test_split_reasoning(text: str, expected: tuple[str, str, bool]) -> None:
    assert split_reasoning(text, THINK) == expected


OUTPUTS = [
    "<think>plan</think>{\"a\":1}",
    "<think>\n\n</think>\n\n{}",
    "<think>a </thin b </think>c",
    "<think><think></think></think>",
    "<think>never ends </th",
    "<th",
    "</think>",
    "plain answer first</think>x",
    "caf\u00e9 <think>\U0001f600</think>\u65e5\u672c",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_splitter_agrees_with_split_however_the_text_is_cut(text: str) -> None:
    """Every way of cutting the output into deltas (all two- and three-piece cuts, and random ones) gives the
    parts :func:`split_reasoning` gives, and no marker character ever reaches a part."""
    thinking, answer, _ = split_reasoning(text, THINK)
    n = len(text)
    cuts = [list(c) for k in (1, 2) for c in itertools.combinations(range(1, n), k)] if n < 40 else []
    rng = random.Random(n)
    cuts += [sorted(rng.sample(range(1, n), min(n - 1, 5))) for _ in range(20)] if n > 1 else []
    for cut in [*cuts, []]:
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cut, n])]
        splitter = ReasoningSplitter(THINK)
        got_thinking, got_answer = [], []
        for piece in pieces:
            t, a = splitter.push(piece)
            got_thinking.append(t)
            got_answer.append(a)
        got_thinking.append(splitter.finish())
        assert ("".join(got_thinking), "".join(got_answer)) == (thinking, answer), pieces


def test_splitter_holds_only_what_may_be_a_marker() -> None:
    splitter = ReasoningSplitter(THINK)
    assert splitter.push("<thi") == ("", "")  # may be the start marker
    assert splitter.push("nk>Let me") == ("Let me", "")
    assert splitter.push(" see </th") == (" see ", "")  # may be the end marker
    assert splitter.push("e") == ("</the", "")  # it was not
    assert splitter.push("</think>{") == ("", "{")
    assert splitter.answering
    assert splitter.push("</think>") == ("", "</think>")  # answer text now, whatever it is
    assert splitter.finish() == ""


def test_part_coalescer_sends_both_parts_in_one_response() -> None:
    now = [0.0]
    coalescer = PartCoalescer(0.05, ReasoningSplitter(THINK), clock=lambda: now[0])
    assert coalescer.push("<think>a") == ("a", "")  # the first goes out at once
    assert coalescer.push("b</thi") is None  # within the interval: held
    now[0] = 0.1
    assert coalescer.push("nk>{") == ("b", "{")
    assert coalescer.push("}") is None
    assert coalescer.finish() == ("", "}")


# -- the client checks with the same rules ---------------------------------------------------------------------
CLIENT_VALUES: list[Any] = [
    None, True, False, {}, {"max_reasoning_tokens": 5}, THINK, Reasoning("</think>", max_reasoning_tokens=9),
    {"end": "</think>", "start": "<think>"}, "yes", 3, {"bogus": 1}, {"end": ""}, {"start": "<think>"},
    {"end": "</t>", "max_reasoning_tokens": 0}, Reasoning("k>", "<think>"), {"end": "x" * 65},
]


@pytest.mark.parametrize("value", CLIENT_VALUES)
def test_client_and_server_agree(value: Any) -> None:
    """What the SDK sends, preprocessing's check takes (with the server's markers); what the SDK refuses, the
    server refuses naming the same field."""
    try:
        request = GenerateRequest("hi", reasoning=value)
    except InvalidRequest as err:
        sent = value.as_dict() if isinstance(value, Reasoning) else value
        with pytest.raises(ContractError) as server:
            check_reasoning(sent, SERVER)
        assert server.value.field == err.field
        return
    names = [t.name() for t in request.inputs()]
    if value is None:
        assert "REASONING" not in names
        return
    wire = reasoning_wire(value)
    assert wire is not None and "REASONING" in names
    expected = value if isinstance(value, Reasoning) else check_reasoning(value, SERVER)
    assert reasoning_from_json(wire, SERVER) == expected


def test_reasoning_wire_is_compact_json() -> None:
    assert reasoning_wire(THINK) == '{"start":"<think>","end":"</think>"}'
    assert json.loads(reasoning_wire({"max_reasoning_tokens": 3}) or "") == {"max_reasoning_tokens": 3}
    assert reasoning_wire(False) == "false"
    assert reasoning_wire(None) is None
