"""The step protocol (grammar_backend.protocol): one answer, the same after the channel and after BLS tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_backend.protocol import (
    BITMASK_TENSOR,
    JUMP_TENSORS,
    STEP_FIELDS,
    STEP_TENSORS,
    MaskStep,
    Sent,
    answer_from_tensors,
    answer_tensors,
)
from grammar_service.transport.channel import _FIELD_BITS, _REPLY, NO_MASK, decode_reply, encode_reply

REPO = Path(__file__).resolve().parents[2]
#: Triton's type of each wire dtype (model_repository/grammar/config.pbtxt.in).
TRITON_TYPES = {np.bool_: "TYPE_BOOL", np.int8: "TYPE_INT8", np.int32: "TYPE_INT32", np.object_: "TYPE_STRING"}


@st.composite
def answers(draw: st.DrawFn) -> MaskStep:
    """Any answer the grammar side may send: every optional field there or not, as its rule allows."""
    rows = draw(st.integers(0, 5))
    width = draw(st.integers(0, 4))

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # the values; hypothesis draws the shapes

    def ints(dtype: type[np.generic], low: int, high: int, shape: tuple[int, ...]) -> np.ndarray:
        return rng.integers(low, high, shape, endpoint=True).astype(dtype)

    jump = draw(st.booleans())
    return MaskStep(
        bitmask=ints(np.int32, -(2**31), 2**31 - 1, (rows, 3)),
        terminated=ints(np.int8, 0, 1, (rows,)).astype(np.bool_),
        errors=tuple(draw(st.lists(st.one_of(st.none(), st.text(min_size=1, max_size=12)),
                                   min_size=rows, max_size=rows))),
        closing=ints(np.int8, 0, 2, (rows,)),
        dropped=ints(np.int32, 0, 9, (rows,)) if draw(st.booleans()) else None,
        hold=ints(np.int32, 0, 9, (rows,)) if draw(st.booleans()) else None,
        forced_tokens=ints(np.int32, 0, 2**31 - 1, (rows, width)) if jump else None,
        forced_counts=ints(np.int32, 0, width, (rows,)) if jump else None,
        forced_safe=ints(np.int32, 0, width, (rows,)) if jump else None,
        grammar_s=draw(st.floats(0, 1, width=32)),
        active=draw(st.integers(0, 1000)),
    )


def _same_fields(got: MaskStep, want: MaskStep) -> None:
    for f in STEP_FIELDS:
        have, value = getattr(got, f.name), getattr(want, f.name)
        if f.sent is Sent.ERRORS:
            assert have == value, f.name
        elif value is None:
            assert have is None, f.name
        else:
            assert have is not None and have.dtype == np.dtype(f.dtype), f.name
            assert have.shape == value.shape and have.tolist() == value.tolist(), f.name


# Health checks of generation speed off: they time the host (tests never depend on its speed).
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(answers(), st.integers(0, 2**32 - 1))
def test_the_channel_carries_every_field(answer: MaskStep, seq: int) -> None:
    got = decode_reply(memoryview(encode_reply(seq, answer)), seq)
    _same_fields(got, answer)
    assert (got.bitmask is NO_MASK, got.active, got.grammar_s) == (True, answer.active, answer.grammar_s)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(answers())
def test_bls_tensors_carry_every_field(answer: MaskStep) -> None:
    sent = dict(answer_tensors(answer, with_bitmask=True))
    rows = len(answer.terminated)
    got = answer_from_tensors(sent.get, rows, sent[BITMASK_TENSOR])
    _same_fields(got, answer)
    assert got.bitmask is answer.bitmask
    # Sent only where the rule says: row errors where a row failed, the rest where the answer holds them.
    assert ("ROW_ERROR" in sent) is any(e is not None for e in answer.errors)
    assert ("FORCED_TOKENS" in sent) is (answer.forced_tokens is not None)


def test_a_mask_buffer_keeps_the_bitmask_off_the_tensors() -> None:
    answer = MaskStep(bitmask=np.zeros((1, 3), np.int32), terminated=np.array([False]), errors=(None,),
                      closing=np.zeros(1, np.int8))
    assert [name for name, _ in answer_tensors(answer, with_bitmask=False)] == ["TERMINATED", "CLOSING"]


def test_what_a_step_asks_for() -> None:
    assert STEP_TENSORS == ("TERMINATED", "CLOSING", "DROPPED", "HOLD", "ROW_ERROR")
    assert JUMP_TENSORS == ("FORCED_COUNT", "FORCED_TOKENS", "FORCED_SAFE")


def test_the_channel_has_room_for_the_fields() -> None:
    """The row errors' JSON runs to the end of the message, so they come last; the flags are 16 bits."""
    assert STEP_FIELDS[-1].sent is Sent.ERRORS and [f for f in STEP_FIELDS if f.sent is Sent.ERRORS] == [STEP_FIELDS[-1]]
    assert len(_FIELD_BITS) <= 16 and _REPLY.format == "<BxHIIIif"


def _declared_outputs() -> dict[str, tuple[str, str]]:
    text = (REPO / "model_repository" / "grammar" / "config.pbtxt.in").read_text(encoding="utf-8")
    block = text[text.index("output ["):]
    block = block[: block.index("]\n")]
    return {m["name"]: (m["type"], m["dims"]) for m in re.finditer(
        r'\{ name: "(?P<name>\w+)", data_type: (?P<type>\w+), dims: \[ (?P<dims>[-\d, ]+) \] \}', block)}


@pytest.mark.parametrize("field", STEP_FIELDS, ids=[f.name for f in STEP_FIELDS])
def test_the_grammar_model_declares_each_field(field: Any) -> None:
    declared = _declared_outputs()
    assert declared[field.tensor] == (TRITON_TYPES[field.dtype], "-1, -1" if field.wide else "-1")


def test_the_grammar_model_declares_the_bitmask() -> None:
    assert _declared_outputs()[BITMASK_TENSOR] == ("TYPE_INT32", "-1, -1")
