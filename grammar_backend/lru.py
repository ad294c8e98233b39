"""A small bounded map of what was used recently, safe across threads without a lock.

The one bounded cache of the package's lookups, where a process keeps a
bounded number of things it derived and may derive again: schemas that passed
the meta-schema check (:mod:`grammar_backend.spec`), post-validators
(:mod:`grammar_backend.fidelity`), jump-forward spellings
(:mod:`grammar_backend.jump`), the closer's completions
(:mod:`grammar_backend.closing`), and above the core the callers' mask buffers
(:mod:`grammar_service.transport.maskbuf`).  The compile cache
(:mod:`grammar_service.cache`) is bounded by bytes and single-flight, a
different job.

Why no lock: the grammar service's threads (steps, starts, compiles) share
these maps, and several are read for every row of every step; a lookup that
never waits keeps the fill threads from queueing on each other, and it keeps
the core free of threading (the import test forbids it).
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Lru"]

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """At most ``capacity`` entries; an entry used among the last ``capacity // 2`` is kept.

    Two generations: an entry put or found goes to the young one; when the
    young one holds ``capacity // 2`` entries it becomes the old one and the
    old one is dropped whole.  An entry found in the old generation moves back
    to the young one.

    Every step is one dict operation (atomic under the GIL, and locked per
    dict on free-threaded builds) and the generations swap by rebinding, so
    threads share it without a lock.  Racing threads can at worst drop a
    generation early or derive a value twice, which a cache of derived values
    tolerates: no entry is ever wrong, and the bound holds up to one entry per
    thread inserting at the same moment.

    Parameters
    ----------
    capacity : int
        Most entries kept (at least 2).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"Lru capacity must be at least 2, got {capacity}")
        self.capacity = capacity
        self._half = capacity // 2
        self._young: dict[K, V] = {}
        self._old: dict[K, V] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now recently used), or None."""
        value = self._young.get(key)
        if value is None:
            value = self._old.pop(key, None)
            if value is not None:
                value = self._keep(key, value)
        return value

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` for ``key`` unless it has one (another thread may have put it first); returns the kept one."""
        kept = self._young.get(key)
        if kept is None:
            kept = self._old.pop(key, None)
        return self._keep(key, value if kept is None else kept)

    def set(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` in place of the one it has (a racing :meth:`put` may still win)."""
        self._old.pop(key, None)
        self._young.pop(key, None)
        self._keep(key, value)

    def _keep(self, key: K, value: V) -> V:
        young = self._young
        kept = young.setdefault(key, value)
        if len(young) >= self._half and young is self._young:
            self._old, self._young = young, {}
        return kept
