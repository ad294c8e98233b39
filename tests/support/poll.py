"""Polling waits for tests: read until a condition holds, within a deadline that only bounds a hang.

A deadline here is generous (many times what the event takes on a loaded
2-core machine), so a slow machine never fails a test that a broken part
would.  The helpers that read a served ensemble (its counters, its freed
sequences) are in :mod:`tests.integration.served`, built on these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TypeVar

__all__ = ["HANG_S", "poll", "wait_for"]

T = TypeVar("T")

#: The deadline of a wait that only bounds a hang: what a test waits for (an
#: event, a count) takes seconds at most, even on a loaded 2-core machine, so
#: reaching this means something is stuck, never that the machine is slow.
HANG_S: Final = 120.0


def poll(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float, interval_s: float = 0.2) -> T:
    """Call ``read`` every ``interval_s`` until ``done`` holds for its value or ``timeout_s`` has passed.

    Returns
    -------
    T
        The last value read: the one ``done`` accepted, or the one read at
        the deadline (the caller asserts on it, so a failure shows it).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    """Poll ``condition`` until it holds; the seconds it took.

    Raises
    ------
    TimeoutError
        When it does not hold within ``timeout_s`` (the message names ``what``).
    """
    start = time.monotonic()
    if not poll(condition, bool, timeout_s, interval_s):
        raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
    return time.monotonic() - start
