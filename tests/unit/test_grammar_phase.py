"""GrammarPhase: one decode step's grammar request, beside the forward (overlap) or after it (processor)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.spec import parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from llm_runtime.grammar_phase import GrammarPhase
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ROW_DROP, ROW_ERROR, ROW_MASK, ROW_STOP, MaskStep
from tests.unit.conftest import TINY_STOP, TINY_VOCAB_SIZE, tiny_encode

WIDTH = (TINY_VOCAB_SIZE + 31) // 32


@dataclass
class Row:
    seq_id: int
    jump: tuple[int, ...] = ()
    in_engine: bool = True
    refeed: bool = False
    last_token: int = -1
    accepted: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()


class Recording(LocalMaskProvider):
    """The in-process provider over the real engine, recording what each step asked and on which thread."""

    def __init__(self, engine: GrammarEngine) -> None:
        super().__init__(engine)
        self.calls: list[tuple[list[int], list[list[int]], bool, str]] = []
        self.fail: Exception | None = None
        self.answer: MaskStep | None = None

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        self.calls.append(([int(s) for s in seq_ids], [list(map(int, tokens[i, : counts[i]]))
                                                        for i in range(len(seq_ids))],
                           jump_forward, threading.current_thread().name))
        if self.fail is not None:
            raise self.fail
        out = super().step(seq_ids, tokens, counts, jump_forward)
        return self.answer if self.answer is not None else out


@pytest.fixture()
def provider(tiny_info: xgr.TokenizerInfo) -> Iterator[Recording]:
    engine = GrammarEngine(tiny_info, "fp", GrammarEngineConfig(max_batch=4), encode=tiny_encode)
    spec = parse_constraint("regex", "ab+c")
    for s in (1, 2, 3):
        engine.start(s, spec)
    yield Recording(engine)
    engine.end([1, 2, 3])
    engine.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "processor"])
def test_the_request_and_when_it_runs(provider: Recording, overlap: bool) -> None:
    phase = GrammarPhase(provider, max_rows=4, max_jump_tokens=8, overlap=overlap)
    try:
        # All join now (nothing to accept); then a sampled token, a jump of two, a row fed again.
        phase.launch([Row(1, in_engine=False), Row(2, in_engine=False), Row(3, in_engine=False)])
        phase.collect(WIDTH)
        assert phase.error is None and phase.step is not None
        phase.launch([Row(1, last_token=ord("a")), Row(2, jump=(ord("a"), ord("b"))), Row(3, refeed=True)])
        if not overlap:
            assert len(provider.calls) == 1  # processor: nothing runs before the forward
        phase.collect(WIDTH)
        step = phase.step
        assert step is not None and phase.requests == 2
        first, second = provider.calls
        assert first[:3] == ([1, 2, 3], [[], [], []], True)
        assert second[:3] == ([1, 2, 3], [[ord("a")], [ord("a"), ord("b")], []], True)
        assert {first[3], second[3]} == ({"llm-grammar-step_0"} if overlap else {threading.current_thread().name})
        assert [step.row_kind(j) for j in range(3)] == [ROW_MASK] * 3
        assert phase.call_s > 0 and phase.wait_s >= 0 and phase.grammar_s > 0
        if not overlap:
            assert phase.wait_s >= phase.call_s  # the whole call is waited for
        # The loop's own grammar time: the launch and the collect (its wait included), then what it charges.
        assert phase.loop_s > phase.wait_s
        before = phase.loop_s
        phase.charge(0.25)
        assert phase.loop_s == before + 0.25
        t0 = time.perf_counter()
        phase.launch([Row(1, last_token=ord("b"))])
        launched_s = time.perf_counter() - t0
        # A new step starts from its own launch: at most the launch's time, not the 0.25 s charged before.
        assert 0 < phase.loop_s <= launched_s
        phase.collect(WIDTH)
    finally:
        phase.close()


def test_row_kinds_read_one_answer(provider: Recording) -> None:
    phase = GrammarPhase(provider, max_rows=4, max_jump_tokens=0, overlap=True)
    try:
        phase.launch([Row(1, in_engine=False), Row(2, in_engine=False)])
        phase.collect(WIDTH)
        # Row 1 writes "abc" and its stop token; row 2 a token the grammar refuses.
        for token in (ord("a"), ord("b"), ord("c"), TINY_STOP):
            phase.launch([Row(1, last_token=token), Row(2, last_token=ord("z") if token == ord("a") else 0,
                                                         refeed=token != ord("a"))])
            phase.collect(WIDTH)
            if token == ord("a"):
                step = phase.step
                assert step is not None and step.row_kind(1) == ROW_ERROR
                assert step.errors[1] == f"sequence 2: token {ord('z')} at position 0 is rejected by the grammar"
        step = phase.step
        assert step is not None and step.row_kind(0) == ROW_STOP
        assert provider.calls[1][2] is False  # max_jump_tokens 0: no forced tokens asked for
    finally:
        phase.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "processor"])
def test_a_failed_or_malformed_answer_is_the_steps_error(provider: Recording, overlap: bool,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    phase = GrammarPhase(provider, max_rows=4, max_jump_tokens=8, overlap=overlap)
    try:
        provider.fail = ConnectionError("grammar model unreachable")
        phase.launch([Row(1, in_engine=False)])
        phase.collect(WIDTH)
        assert phase.step is None and isinstance(phase.error, ConnectionError)
        assert "MaskProvider.step failed" in caplog.text
        provider.fail = None
        provider.answer = MaskStep(np.zeros((2, WIDTH), np.int32), np.zeros(2, bool), (None, None))
        phase.launch([Row(1, in_engine=False)])
        phase.collect(WIDTH)
        error: object = phase.error
        assert phase.step is None and error == "bitmask must be int32 [1, 10], got int32 (2, 10)"
    finally:
        phase.close()


def _i32(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


@pytest.mark.parametrize(
    "step",
    [
        MaskStep(np.zeros((3, WIDTH), np.int32), np.array([False, True, False]), (None, None, "bad row")),
        MaskStep(np.zeros((4, WIDTH), np.int32), np.array([True, False, False, False]), (None,) * 4,
                 closing=np.array([1, 0, 2, 0], np.int8), dropped=_i32(3, 2, 0, 0), hold=_i32(0, 1, 4, 0),
                 forced_tokens=np.array([[5, 6, 7], [8, 0, 0], [0, 0, 0], [9, 10, 0]], np.int32),
                 forced_counts=_i32(3, 1, 0, 2), forced_safe=_i32(2, 0, 0, 1)),
        MaskStep(np.zeros((0, WIDTH), np.int32), np.zeros(0, bool), ()),
    ],
    ids=["errors-and-stops", "every-column", "empty"],
)
def test_rows_read_what_the_row_methods_read(step: MaskStep) -> None:
    """The decode loop reads a step's rows at once (MaskStep.read); each entry is the per-row reading."""
    n = len(step.errors)
    rows = step.read(n, WIDTH)
    assert not isinstance(rows, str)
    assert rows.kind == [step.row_kind(j) for j in range(n)]
    assert rows.close == [step.close_state(j) for j in range(n)]
    assert rows.held == [step.held(j) for j in range(n)]
    assert rows.forced_safe == [step.forced_safe_of(j) for j in range(n)]
    assert [step.forced(j, 16, rows.forced[j]) for j in range(n)] == [step.forced(j, 16) for j in range(n)]
    if n == 4:
        assert rows.kind == [ROW_STOP, ROW_DROP, ROW_MASK, ROW_MASK]
        assert [step.forced(j, 2) for j in range(n)] == [(5, 6), (), (), (9, 10)]


def _answer(**fields: object) -> MaskStep:
    base: dict[str, object] = {"bitmask": np.zeros((2, WIDTH), np.int32), "terminated": np.zeros(2, bool),
                               "errors": (None, None)}
    return MaskStep(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "why"),
    [
        (_answer(), None),
        (_answer(forced_tokens=np.zeros((2, 3), np.int32), forced_counts=_i32(3, 0)), None),
        (_answer(bitmask=np.zeros((2, WIDTH), np.int64)), f"bitmask must be int32 [2, {WIDTH}], got int64 (2, {WIDTH})"),
        (_answer(terminated=np.zeros(3, bool)), "terminated must be bool [2]"),
        (_answer(errors=(None,)), "errors must have 2 entries, got 1"),
        (_answer(hold=_i32(1)), "hold must be int32 [2] or None"),
        (_answer(forced_tokens=np.zeros((2, 3), np.int32)), "forced_tokens and forced_counts come together"),
        (_answer(forced_tokens=np.zeros((2, 3), np.int32), forced_counts=_i32(4, 0)),
         "forced counts must be int32 in 0..3"),
        (_answer(forced_tokens=np.zeros((2, 3), np.int32), forced_counts=_i32(1, -1)),
         "forced counts must be int32 in 0..3"),
        (_answer(forced_tokens=np.zeros((2, 3), np.int32), forced_counts=np.array([1, 1], np.int64)),
         "forced counts must be int32 in 0..3"),
    ],
    ids=["fits", "fits-forced", "bitmask-dtype", "terminated-shape", "errors-count", "hold-shape", "forced-alone",
         "count-past-width", "count-negative", "count-int64"],
)
def test_an_answer_that_does_not_fit_the_step_says_why(step: MaskStep, why: str | None) -> None:
    read = step.read(2, WIDTH)
    assert (read if isinstance(read, str) else None) == why
