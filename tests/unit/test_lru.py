"""grammar_backend.lru.Lru: the bounded cache behind the meta-schema check, validators, mask buffers, jumps."""

from __future__ import annotations

import random
import threading

import pytest

from grammar_backend.lru import Lru


def test_what_was_used_recently_stays() -> None:
    lru: Lru[str, int] = Lru(4)  # generations of 2
    assert lru.put("a", 1) == 1 and lru.put("b", 2) == 2  # the young generation is full: it becomes the old one
    assert lru.get("a") == 1  # "a" moves back to the young generation
    lru.put("c", 3)  # full again: the old generation ("b") goes
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (1, None, 3, 2)


@pytest.mark.parametrize("capacity", [2, 3, 8, 64])
def test_the_bound_and_the_recent_entries(capacity: int) -> None:
    lru: Lru[int, int] = Lru(capacity)
    rng = random.Random(capacity)
    used: list[int] = []
    for _ in range(2000):
        key = rng.randrange(3 * capacity)
        if rng.random() < 0.5:
            assert lru.put(key, key * 7) == key * 7
        else:
            assert lru.get(key) in (None, key * 7)
            if lru.get(key) is None:
                continue
        used.append(key)
        assert len(lru) <= capacity
        recent = list(dict.fromkeys(reversed(used)))[: capacity // 2]
        # every entry among the last capacity // 2 distinct ones used is kept (looked at without using it)
        assert [k for k in recent if k not in lru._young and k not in lru._old] == []


def test_put_keeps_the_first_value_of_a_key() -> None:
    lru: Lru[str, object] = Lru(4)
    first, second = object(), object()
    assert lru.put("k", first) is first
    assert lru.put("k", second) is first
    lru.put("x", object())  # "k" is now in the old generation
    assert lru.put("k", second) is first


@pytest.mark.parametrize("aged", [False, True])
def test_set_replaces_the_value_of_a_key(aged: bool) -> None:
    lru: Lru[str, str] = Lru(4)
    lru.put("k", "first")
    if aged:
        lru.put("x", "x")  # "k" is now in the old generation
    lru.set("k", "second")
    assert lru.get("k") == "second" and lru.put("k", "third") == "second"
    assert len(lru) == (2 if aged else 1)


def test_falsy_values_are_values() -> None:
    lru: Lru[str, object] = Lru(4)
    assert lru.put("zero", 0) == 0 and lru.put("zero", 1) == 0
    assert lru.put("empty", ()) == () and lru.get("empty") == ()


def test_concurrent_puts_agree_on_one_value() -> None:
    lru: Lru[int, object] = Lru(8)
    kept: list[object] = []
    barrier = threading.Barrier(8)

    def racer() -> None:
        barrier.wait()
        kept.append(lru.put(1, object()))

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(k) for k in kept}) == 1


def test_threads_never_read_a_wrong_value_and_the_bound_holds() -> None:
    """No lock: racing gets and puts may lose entries, never mix them up, and stay within one entry per thread."""
    lru: Lru[int, int] = Lru(16)
    threads_n, wrong, over = 8, [], []
    barrier = threading.Barrier(threads_n)

    def racer(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(20_000):
            key = rng.randrange(64)
            got = lru.get(key) if rng.random() < 0.5 else lru.put(key, key + 1000)
            if got is not None and got != key + 1000:
                wrong.append((key, got))
            if len(lru) > lru.capacity + threads_n:
                over.append(len(lru))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (wrong, over) == ([], [])


def test_capacity_must_be_at_least_two() -> None:
    with pytest.raises(ValueError, match=r"^Lru capacity must be at least 2, got 1$"):
        Lru(1)
