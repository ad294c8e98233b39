"""tests.support.poll: the one polling loop of the tests."""

from __future__ import annotations

import itertools

import pytest

from tests.support.poll import HANG_S, poll, wait_for


def test_poll_returns_the_first_value_done_accepts() -> None:
    reads = itertools.count()
    assert poll(lambda: next(reads), lambda n: n == 3, HANG_S, interval_s=0.0) == 3
    assert next(reads) == 4  # nothing read after the accepted value


def test_poll_returns_the_value_read_at_the_deadline() -> None:
    reads = itertools.count()
    last = poll(lambda: next(reads), lambda n: False, 0.05, interval_s=0.01)
    # However few reads a loaded machine fits in the 0.05 s: the last one is returned, none comes after.
    assert next(reads) == last + 1


def test_wait_for_names_what_did_not_happen() -> None:
    with pytest.raises(TimeoutError, match=r"^the thing: not within 0 s$"):
        wait_for(lambda: False, 0.05, "the thing", interval_s=0.01)
    # A condition that already holds is not slept on: a sleep of the interval first would take HANG_S.
    assert 0 <= wait_for(lambda: True, HANG_S, "the thing", interval_s=HANG_S) < HANG_S
