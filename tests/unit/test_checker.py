"""The heavy lane's child process: its verdicts reach the parent's caches, its CPU limit, its death."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest

import contract
from grammar_backend.errors import ConstraintError
from grammar_backend.spec import SpecLimits
from pipeline.checker import Checker, CheckFailed, CheckTimeout
from pipeline.preprocess import RequestConstraint, check_constraint
from tests.support.poll import HANG_S, wait_for

LIMITS = SpecLimits(max_payload_bytes=contract.MAX_CONSTRAINT_BYTES, max_depth=contract.MAX_CONSTRAINT_DEPTH)


def _constraint(schema: object) -> RequestConstraint:
    return RequestConstraint("json_schema", json.dumps(schema).encode(), None, LIMITS)


@pytest.fixture()
def checker() -> Iterator[Checker]:
    ch = Checker(cpu_s=30.0)
    yield ch
    ch.close()


def test_an_accepted_constraint_completes_from_the_cache_without_a_check(checker: Checker) -> None:
    constraint = _constraint({"type": "object", "description": "accepted in the child"})
    assert not constraint.seen
    checker.check(constraint)
    assert constraint.seen
    spec = check_constraint(constraint)
    assert (spec.kind.value, spec.payload) == ("json_schema", '{"type":"object","description":"accepted in the child"}')


def test_a_refusal_in_the_child_is_the_parents_refusal(checker: Checker) -> None:
    constraint = _constraint({"type": 1, "description": "refused in the child"})
    checker.check(constraint)
    assert constraint.seen
    with pytest.raises(ConstraintError, match=r"^grammar#/type: not a valid JSON Schema: 1 is not valid under any "):
        check_constraint(constraint)


def test_a_check_past_its_cpu_limit_is_refused_by_name_and_the_next_one_gets_a_new_child() -> None:
    # 3,000 anyOf branches of 12 properties: seconds of meta-schema check, far past 0.5 s of CPU.
    variants = [{"type": "object", "properties": {f"v{i}_{j}": {"type": "integer"} for j in range(12)}}
                for i in range(3_000)]
    slow = _constraint({"anyOf": variants})
    checker = Checker(cpu_s=0.5)
    try:
        checker.check(slow)
        with pytest.raises(ConstraintError, match=r"^grammar: checking this constraint used more than 0.5 s of CPU "
                                                  r"\(the check limit\); it is refused$"):
            check_constraint(slow)
        small = _constraint({"type": "string", "description": "after the limit"})
        checker.check(small)
        assert check_constraint(small).kind.value == "json_schema"
    finally:
        checker.close()


def test_a_child_that_dies_fails_that_check_only(checker: Checker) -> None:
    checker.check(_constraint({"type": "integer", "description": "starts the child"}))
    child = checker._child
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)
    wait_for(lambda: not child.alive, HANG_S, "the child died")
    constraint = _constraint({"type": "integer", "description": "after the death"})
    checker.check(constraint)  # a new child
    assert check_constraint(constraint).kind.value == "json_schema"


def test_a_check_starved_past_its_wall_time_is_retriable_and_not_remembered() -> None:
    """A child that makes no progress (stopped here; starved of CPU on a busy host) is no verdict on the constraint."""
    checker = Checker(cpu_s=0.2)  # wall time: 2 s
    try:
        checker.check(_constraint({"type": "integer", "description": "starts the starved child"}))
        child = checker._child
        assert child is not None
        os.kill(child.pid, signal.SIGSTOP)
        constraint = _constraint({"type": "integer", "description": "checked by a stopped child"})
        with pytest.raises(CheckTimeout, match=r"^preprocessing: checking this constraint took more than 2 s \(the "
                                               r"server is busy\); retry later$") as err:
            checker.check(constraint)
        assert err.value.status == "DEADLINE_EXCEEDED"
        assert not constraint.seen
        checker.check(constraint)  # a new child
        assert check_constraint(constraint).kind.value == "json_schema"
    finally:
        checker.close()


def test_a_child_that_cannot_start_fails_with_its_reason() -> None:
    checker = Checker(cpu_s=30.0, python="/bin/false")
    with pytest.raises(CheckFailed, match=r"^preprocessing: the constraint checker failed to start \(exit status 1\)$"):
        checker.check(_constraint({"type": "integer", "description": "never checked"}))
