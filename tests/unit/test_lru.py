"""grammar_backend.lru.Lru: the bounded cache behind the meta-schema check, validators, mask buffers, jumps."""

from __future__ import annotations

import threading

import pytest

from grammar_backend.lru import Lru


def test_least_recently_used_goes_first() -> None:
    lru: Lru[str, int] = Lru(2)
    assert lru.put("a", 1) == 1 and lru.put("b", 2) == 2
    assert lru.get("a") == 1  # "a" is now the most recent
    lru.put("c", 3)
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (1, None, 3, 2)


def test_put_keeps_the_first_value_of_a_key() -> None:
    lru: Lru[str, object] = Lru(4)
    first, second = object(), object()
    assert lru.put("k", first) is first
    assert lru.put("k", second) is first


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


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^Lru capacity must be positive, got 0$"):
        Lru(0)
