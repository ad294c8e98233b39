"""The heavy lane: arrival order, its bound, its close, and an item that raises."""

from __future__ import annotations

import threading

import pytest

from contract.errors import RESOURCE_EXHAUSTED, UNAVAILABLE, status_of
from pipeline.lane import HeavyLane, LaneClosed, LaneFull
from tests.support.poll import HANG_S, wait_for


class Gate:
    """Items block until released, so the test sees the queue as it is."""

    def __init__(self) -> None:
        self.done: list[int] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.finished = threading.Semaphore(0)

    def run(self, item: int) -> None:
        self.started.release()
        self.release.wait(HANG_S)
        self.done.append(item)
        self.finished.release()


def _take(sem: threading.Semaphore, count: int) -> None:
    for _ in range(count):
        assert sem.acquire(timeout=HANG_S), "the lane did not get there"


def test_items_run_one_at_a_time_in_arrival_order() -> None:
    gate = Gate()
    lane = HeavyLane("test", 8, gate.run)
    for item in range(5):
        lane.submit(item)
    _take(gate.started, 1)
    assert lane.waiting == 4  # the first is running (it started), the rest wait
    gate.release.set()
    _take(gate.finished, 5)
    assert gate.done == [0, 1, 2, 3, 4]
    assert lane.close(HANG_S) == []


def test_past_its_depth_a_submit_is_refused_with_resource_exhausted() -> None:
    gate = Gate()
    lane = HeavyLane("preprocessing", 2, gate.run)
    lane.submit(0)
    _take(gate.started, 1)  # running: not counted against the depth
    lane.submit(1)
    lane.submit(2)
    with pytest.raises(LaneFull, match=r"^preprocessing: 2 large constraints already wait to be checked on this "
                                       r"instance; retry later$") as err:
        lane.submit(3)
    assert status_of(err.value) == RESOURCE_EXHAUSTED
    gate.release.set()
    _take(gate.finished, 3)
    assert gate.done == [0, 1, 2]
    lane.close(HANG_S)


def test_close_returns_the_items_never_started_and_refuses_new_ones() -> None:
    gate = Gate()
    lane = HeavyLane("preprocessing", 4, gate.run)
    for item in range(3):
        lane.submit(item)
    _take(gate.started, 1)
    left: list[int] = []
    closer = threading.Thread(target=lambda: left.extend(lane.close(HANG_S)))
    closer.start()
    wait_for(lambda: lane.waiting == 0, HANG_S, "the lane closed")  # close() took the waiting items
    with pytest.raises(LaneClosed, match=r"^preprocessing: the server is shutting down; retry$") as err:
        lane.submit(9)
    assert status_of(err.value) == UNAVAILABLE
    gate.release.set()
    closer.join(HANG_S)
    assert (gate.done, left) == ([0], [1, 2])  # the running item finishes; the rest go back to be answered


def test_an_item_that_raises_is_logged_and_the_lane_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    done: list[int] = []
    finished = threading.Semaphore(0)

    def run(item: int) -> None:
        if item == 0:
            raise RuntimeError("a bug in one answer")
        done.append(item)
        finished.release()

    lane = HeavyLane("test", 4, run)
    lane.submit(0)
    lane.submit(1)
    _take(finished, 1)
    assert done == [1]
    assert "test: the heavy lane's work item failed" in caplog.text
    assert "RuntimeError: a bug in one answer" in caplog.text
    lane.close(HANG_S)


@pytest.mark.parametrize("depth", [0, -1])
def test_a_depth_below_one_is_refused(depth: int) -> None:
    with pytest.raises(ValueError, match=rf"^test: the heavy lane's depth must be at least 1, got {depth}$"):
        HeavyLane("test", depth, lambda item: None)
