"""The pipelined fill (grammar_service.fill_pipeline): a step's first rows filled on a thread of their own while the
step thread plans the rest answers exactly as the step that plans, then fills."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.bitmask import ALL_ALLOWED, BitmaskBuffer
from grammar_backend.errors import ConfigError, GrammarError
from grammar_backend.llg import LlgBackend
from grammar_backend.spec import parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig, StepResult
from grammar_service.fill_pipeline import FillPipeline
from tests.unit.test_drafts import BOUNDED, COLOURS, PERSON, Target, V, allowed

ROWS = 16
#: (constraint, options, budget, value checks) of row r: case r % 5.  Closing (calm and forced rows), value
#: checks that drop and ban, jump-forward and a regex, in the head and in the tail of every split.
ROW_CASES: list[tuple[str, str, dict[str, Any], int, bool]] = [
    ("json_schema", json.dumps(PERSON), {"jump_forward": True}, 30, False),
    ("json_schema", json.dumps(BOUNDED), {}, 0, True),
    ("json_schema", json.dumps(COLOURS), {"jump_forward": True}, 24, True),
    ("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 6}), {}, 16, False),
    ("regex", r"[a-z]{2,8}(-[0-9]{1,3}){1,3}", {}, 12, False),
]
#: Not started: an unknown sequence's row is an error row (here in the head of every split).
UNKNOWN = 999


def _engine(qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any, pipeline_rows: int, threads: int) -> GrammarEngine:
    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = GrammarEngineConfig(max_batch=ROWS, fill_threads=threads, pipeline_rows=pipeline_rows)
    return GrammarEngine(qwen_info, "qwen3", config,
                         encode=lambda text: qwen_tokenizer.encode(text, add_special_tokens=False),
                         llg=LlgBackend(qwen_tokenizer, V, (eos,)))


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def engines(request: pytest.FixtureRequest, qwen_info: xgr.TokenizerInfo,
            qwen_tokenizer: Any) -> Iterator[tuple[GrammarEngine, GrammarEngine]]:
    """Two engines on ``request.param`` fill threads: one plans then fills, the other pipelines every step."""
    serial = _engine(qwen_info, qwen_tokenizer, 0, request.param)
    piped = _engine(qwen_info, qwen_tokenizer, 1, request.param)
    yield serial, piped
    for eng in (serial, piped):
        assert eng.active_count == 0, "a sequence leaked"
        eng.close()


def _answer(res: StepResult) -> tuple[Any, ...]:
    drafted = None if res.draft_bitmask is None or res.draft_valid is None or res.draft_closing is None else (
        res.draft_bitmask.tobytes(), res.draft_valid.tolist(), res.draft_closing.tolist())
    return (res.bitmask.tobytes(), res.terminated.tolist(), [None if e is None else str(e) for e in res.errors],
            res.forced, res.closing.tolist(), res.dropped.tolist(), res.hold.tolist(), res.forced_safe.tolist(),
            drafted)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_pipelined_step_answers_as_the_serial_one(engines: tuple[GrammarEngine, GrammarEngine],
                                                    qwen_info: xgr.TokenizerInfo, backend: str, seed: int) -> None:
    serial, piped = engines
    ids = [UNKNOWN if r == 1 else 100 + r for r in range(ROWS)]
    for eng in engines:
        for r, seq_id in enumerate(ids):
            if seq_id == UNKNOWN:
                continue
            kind, payload, options, budget, checks = ROW_CASES[r % len(ROW_CASES)]
            eng.start(seq_id, parse_constraint(kind, payload, {"backend": backend, **options}), budget=budget,
                      value_checks=checks)
    target = Target(seed, [int(t) for t in qwen_info.stop_token_ids])
    outputs: list[list[int]] = [[] for _ in ids]
    pending: list[list[int]] = [[] for _ in ids]
    splits: list[int] = []
    record = piped._record_split

    def recorded(rows: int, plan_s: float, fill_s: float) -> None:
        splits.append(piped._split(rows))  # where this step's rows were split (before the averages move)
        record(rows, plan_s, fill_s)

    try:
        piped._record_split = recorded  # type: ignore[method-assign]
        for n in range(60):
            tokens = np.zeros((ROWS, 1), np.int32)
            for r, p in enumerate(pending):
                tokens[r, : len(p)] = p
            counts = np.array([len(p) for p in pending], np.int32)
            seq_ids = np.array(ids, np.uint64)
            # Every other step carries two drafts a row (its last token again): the draft positions are
            # planned and filled after the pipelined fill, on forks of the rows it filled.
            drafts: dict[str, np.ndarray] = {}
            if n % 2:
                drafts = {"drafts": np.repeat(tokens, 2, axis=1), "draft_counts": 2 * counts}
            want = serial.step(seq_ids, tokens, counts, jump_forward=True, **drafts)
            # The pipelined one writes the caller's mask buffer, as the grammar model's shared memory.
            out = np.zeros((ROWS, serial.bitmask.width), np.int32)
            got = piped.step(seq_ids, tokens, counts, jump_forward=True, out=out, **drafts)
            assert got.bitmask is out or got.bitmask.base is out
            assert (want.draft_bitmask is not None) == bool(n % 2)
            assert _answer(got) == _answer(want)
            if all(want.terminated[r] or want.errors[r] is not None for r in range(ROWS)):
                break
            for r in range(ROWS):
                pending[r] = []
                if want.terminated[r] or want.errors[r] is not None:
                    continue
                if want.dropped[r]:
                    del outputs[r][len(outputs[r]) - int(want.dropped[r]):]
                    continue  # fed again from before the dropped tokens: this mask is not sampled
                token = target.pick(want.bitmask[r], len(outputs[r]))
                outputs[r].append(token)
                pending[r] = [token]
        else:
            raise AssertionError("no end in 60 steps")
    finally:
        piped._record_split = record  # type: ignore[method-assign]
        for eng in engines:
            eng.end([s for s in ids if s != UNKNOWN])
    assert len(splits) > 10 and all(2 <= s <= ROWS // 2 for s in splits)  # every step was pipelined
    assert sum(map(len, outputs)) > 5 * ROWS


def test_a_fill_error_on_the_fill_thread_fails_its_step_only(engines: tuple[GrammarEngine, GrammarEngine],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    piped = engines[1]
    fill_rows = piped.bitmask.fill_rows

    def broken(matchers: Any, start: int, *, one_call: bool = False) -> None:
        if one_call:  # the fill thread's call
            raise RuntimeError("fill failed")
        fill_rows(matchers, start, one_call=one_call)

    ids, tokens, counts = np.array([1, 2], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32)
    for seq_id in (1, 2):
        piped.start(seq_id, parse_constraint("json_schema", json.dumps(COLOURS), {}))
    try:
        monkeypatch.setattr(piped.bitmask, "fill_rows", broken)
        with pytest.raises(RuntimeError, match="^fill failed$"):
            piped.step(ids, tokens, counts)
        monkeypatch.undo()
        res = piped.step(ids, tokens, counts)
        assert res.errors == (None, None) and allowed(res.bitmask[0]).sum() == allowed(res.bitmask[1]).sum() > 0
    finally:
        piped.end([1, 2])


def test_a_row_naming_a_sequence_again_is_an_error_row(engines: tuple[GrammarEngine, GrammarEngine],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    piped = engines[1]
    assert piped._pipeline is not None
    submitted: list[int] = []
    submit = piped._pipeline.submit

    def counted(matchers: Any, start: int) -> None:
        submitted.append(len(matchers))
        submit(matchers, start)

    monkeypatch.setattr(piped._pipeline, "submit", counted)
    ids = np.array([1, 2] * (ROWS // 2), np.uint64)
    tokens, counts = np.zeros((ROWS, 1), np.int32), np.zeros(ROWS, np.int32)
    for eng in engines:
        for seq_id in (1, 2):
            eng.start(seq_id, parse_constraint("json_schema", json.dumps(COLOURS), {}))
    try:
        # One matcher cannot be two rows (on two fill threads, llguidance's executor refused the whole fill).
        for eng in engines:
            res = eng.step(ids, tokens, counts)
            assert [None if e is None else str(e) for e in res.errors] == [
                None, None, *(f"sequence {s}: named by more than one row of this step" for s in ids[2:].tolist())]
            assert allowed(res.bitmask[0]).sum() == allowed(res.bitmask[1]).sum() > 0
        assert len(submitted) == 1  # pipelined all the same
    finally:
        for eng in engines:
            eng.end([1, 2])


def test_a_step_after_close_plans_then_fills(qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any) -> None:
    eng = _engine(qwen_info, qwen_tokenizer, 1, 1)
    pipeline = eng._pipeline
    assert pipeline is not None
    for seq_id in (1, 2):
        eng.start(seq_id, parse_constraint("json_schema", json.dumps(COLOURS), {}))
    eng.close()
    res = eng.step(np.array([1, 2], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32))
    assert res.errors == (None, None) and allowed(res.bitmask[0]).sum() == allowed(res.bitmask[1]).sum() > 0
    with pytest.raises(GrammarError, match="^fill pipeline: closed$"):
        pipeline.submit([None], 0)
    eng.end([1, 2])


def test_no_fill_thread_where_no_step_can_be_pipelined(qwen_info: xgr.TokenizerInfo, qwen_tokenizer: Any) -> None:
    eng = _engine(qwen_info, qwen_tokenizer, ROWS + 1, 1)
    try:
        assert eng._pipeline is None
    finally:
        eng.close()


class _Broken:
    """A matcher whose fill fails (a backend's bug): the step thread must see it, and the pipeline go on."""

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0) -> None:
        raise ValueError("broken")


def test_the_fill_threads_error_is_raised_on_the_step_thread() -> None:
    buffer = BitmaskBuffer(2, 64)
    buffer.prepare(2)
    buffer.buffer.fill(0)
    pipeline = FillPipeline(buffer)
    try:
        pipeline.submit([_Broken()], 0)  # type: ignore[list-item]
        with pytest.raises(ValueError, match="^broken$"):
            pipeline.wait()
        pipeline.submit([None], 1)
        assert pipeline.wait() >= 0.0
        assert (buffer.buffer[1] == ALL_ALLOWED).all()
        assert pipeline.wait() == 0.0  # nothing submitted: at once
    finally:
        pipeline.close()


def test_pipeline_rows_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"^engine: pipeline_rows must be 0 \(never\) or positive, got -1$"):
        GrammarEngineConfig(pipeline_rows=-1)
