"""A small thread-safe least-recently-used map: the one bounded cache of the package's lookups.

Used where a process keeps a bounded number of things it derived and may
derive again: schemas that passed the meta-schema check
(:mod:`grammar_backend.spec`), post-validators (:mod:`grammar_backend.fidelity`),
callers' mask buffers (:mod:`triton_support.maskbuf`) and jump-forward
spellings (:mod:`grammar_backend.jump`).  The compile cache
(:mod:`grammar_backend.cache`) is bounded by bytes and single-flight, a
different job.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["Lru"]

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """At most ``capacity`` entries; the least recently used one goes first.

    Parameters
    ----------
    capacity : int
        Most entries kept (positive).
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"Lru capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` for ``key`` unless another thread put one first; returns the kept value."""
        with self._lock:
            kept = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
            return kept
