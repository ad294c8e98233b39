"""Sequence table: precise per-sequence errors, eviction, and no leaks under random operations."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_backend.compile import compile_spec
from grammar_backend.errors import (
    CapacityExceeded,
    DuplicateSequence,
    SequenceError,
    TokenRejected,
    UnknownSequence,
)
from grammar_backend.spec import ConstraintSpec, parse_constraint
from grammar_service.table import SequenceTable, TableConfig
from tests.unit.conftest import TINY_STOP, tiny_encode

SPEC = parse_constraint("regex", "ab(c|d)+")


@pytest.fixture(scope="module")
def compiled(tiny_info: xgr.TokenizerInfo) -> xgr.CompiledGrammar:
    return compile_spec(xgr.GrammarCompiler(tiny_info, cache_enabled=False), SPEC)


def _table(capacity: int = 8, ttl: float = 0.0, now: list[float] | None = None) -> SequenceTable:
    clock = now if now is not None else [0.0]
    return SequenceTable(TableConfig(capacity=capacity, idle_ttl_s=ttl), clock=lambda: clock[0])


def test_lifecycle(compiled: xgr.CompiledGrammar) -> None:
    table = _table()
    table.start(1, SPEC, xgr.GrammarMatcher(compiled))
    assert table.accept(1, tiny_encode("abc")) is False
    assert table.accept(1, [TINY_STOP]) is True
    assert table.get(1).tokens_accepted == 4
    assert table.end(1) is True and table.end(1) is False and len(table) == 0


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [
        (lambda t, c: t.start(1, SPEC, c), DuplicateSequence, r"^sequence 1: already started$"),
        (lambda t, c: t.get(2), UnknownSequence, r"^sequence 2: not active \(never started, ended or evicted\)$"),
        (lambda t, c: t.accept(1, tiny_encode("abz")), TokenRejected,
         r"^sequence 1: token 122 at position 2 is rejected by the grammar$"),
        (lambda t, c: t.rollback(1, 1), SequenceError, r"^sequence 1: cannot roll back 1 tokens \(at most 0\)$"),
    ],
)
def test_errors_are_precise_and_local(
    compiled: xgr.CompiledGrammar, action: object, error: type[Exception], match: str
) -> None:
    table = _table()
    table.start(1, SPEC, xgr.GrammarMatcher(compiled))
    table.start(3, SPEC, xgr.GrammarMatcher(compiled))
    with pytest.raises(error, match=match):
        action(table, compiled)  # type: ignore[operator]
    # The failed operation left sequence 1 at its start and sequence 3 untouched.
    assert table.get(1).tokens_accepted == 0
    assert table.accept(3, tiny_encode("abd")) is False


def test_rejected_multi_token_accept_is_atomic(compiled: xgr.CompiledGrammar) -> None:
    table = _table()
    table.start(1, SPEC, xgr.GrammarMatcher(compiled))
    with pytest.raises(TokenRejected):
        table.accept(1, tiny_encode("abcz"))
    # "ab" was rolled back: the sequence accepts "abd" from its start.
    assert table.accept(1, tiny_encode("abd")) is False and table.get(1).tokens_accepted == 3


def test_rollback_restores_the_matcher(compiled: xgr.CompiledGrammar) -> None:
    table = _table()
    table.start(1, SPEC, xgr.GrammarMatcher(compiled))
    table.accept(1, tiny_encode("abcc"))
    table.rollback(1, 3)
    assert table.get(1).tokens_accepted == 1
    assert table.accept(1, tiny_encode("bd")) is False


def test_capacity_and_idle_eviction(compiled: xgr.CompiledGrammar) -> None:
    now = [0.0]
    table = _table(capacity=2, ttl=10, now=now)
    table.start(1, SPEC, xgr.GrammarMatcher(compiled))
    now[0] = 5
    table.start(2, SPEC, xgr.GrammarMatcher(compiled))
    with pytest.raises(CapacityExceeded, match=r"^sequence 3: 2 sequences are active$"):
        table.start(3, SPEC, xgr.GrammarMatcher(compiled))
    now[0] = 12  # sequence 1 idle for 12 s, sequence 2 for 7 s
    table.start(3, SPEC, xgr.GrammarMatcher(compiled))
    assert 1 not in table and 2 in table and table.evicted == 1
    now[0] = 30
    assert table.evict_idle() == [2, 3] and len(table) == 0


def test_a_step_looks_its_rows_up_at_once(compiled: xgr.CompiledGrammar) -> None:
    now = [0.0]
    table = _table(capacity=3, ttl=10, now=now)
    for seq_id in (1, 2, 3):
        table.start(seq_id, SPEC, xgr.GrammarMatcher(compiled))
    now[0] = 8
    rows = table.get_rows([3, 9, 1])
    assert [r.seq_id for r in rows] == [3, 9, 1]
    assert isinstance(rows[1], UnknownSequence)
    assert str(rows[1]) == "sequence 9: not active (never started, ended or evicted)"
    # A sequence an earlier row named: that row's error, the first row keeps it.
    again = table.get_rows([1, 3, 1])
    assert again[:2] == [table.get(1), table.get(3)]
    assert str(again[2]) == "sequence 1: named by more than one row of this step"
    now[0] = 12  # 1 and 3 were used at 8; 2 has been idle since 0
    table.start(4, SPEC, xgr.GrammarMatcher(compiled))
    assert 2 not in table and 1 in table and 3 in table


OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "accept", "bad", "rollback", "end", "tick"]),
        st.integers(0, 5),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_operations_never_leak(compiled: xgr.CompiledGrammar, ops: list[tuple[str, int, int]]) -> None:
    """A model of which ids are active must always equal the table's."""
    now = [0.0]
    table = _table(capacity=4, ttl=50, now=now)
    model: dict[int, tuple[int, float]] = {}  # id -> (tokens accepted, last use)
    tokens = tiny_encode("abcdcdcdcdcd")

    def expire() -> None:
        for sid in [s for s, (_, used) in model.items() if now[0] - used >= 50]:
            del model[sid]

    for op, sid, n in ops:
        if op == "tick":
            now[0] += 20 * n
            continue
        if op == "start":
            if sid in model:
                with pytest.raises(DuplicateSequence):
                    table.start(sid, SPEC, xgr.GrammarMatcher(compiled))
                continue
            expire()
            if len(model) >= 4:
                with pytest.raises(CapacityExceeded):
                    table.start(sid, SPEC, xgr.GrammarMatcher(compiled))
            else:
                table.start(sid, SPEC, xgr.GrammarMatcher(compiled))
                model[sid] = (0, now[0])
        elif op == "end":
            assert table.end(sid) is (sid in model)
            model.pop(sid, None)
        elif sid not in model:
            with pytest.raises(UnknownSequence):
                table.accept(sid, [])
        elif op == "accept":
            done, _ = model[sid]
            table.accept(sid, tokens[done : done + n])
            model[sid] = (done + len(tokens[done : done + n]), now[0])
        elif op == "bad":
            with pytest.raises(TokenRejected):
                table.accept(sid, [ord("z")])
            model[sid] = (model[sid][0], now[0])
        else:
            done, _ = model[sid]
            if n <= done:
                table.rollback(sid, n)
                model[sid] = (done - n, now[0])
            else:
                with pytest.raises(SequenceError):
                    table.rollback(sid, n)
                model[sid] = (done, now[0])
        assert sorted(s for s in range(6) if s in table) == sorted(model)
        for s, (done, _) in model.items():
            assert table.get(s).tokens_accepted == done
            model[s] = (done, now[0])
    for s in list(model):
        assert table.end(s)
    table.evict_idle()
    assert len(table) == 0


def test_spec_is_kept_on_the_sequence(compiled: xgr.CompiledGrammar) -> None:
    table = _table()
    seq = table.start(9, SPEC, xgr.GrammarMatcher(compiled))
    assert isinstance(seq.spec, ConstraintSpec) and seq.spec.payload == "ab(c|d)+"
