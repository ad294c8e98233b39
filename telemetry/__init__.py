"""What the engines count and time, before anything publishes it: snapshots and latency windows.

The decode loop (:mod:`llm_runtime`), the grammar service
(:mod:`triton_support.service`) and the ``postprocessing`` model keep their
counters, gauges and latency windows here, in-process and allocation-free per
step; :mod:`triton_support.metrics` turns a :class:`Snapshot` into Triton
metrics at most every :data:`PUBLISH_MIN_GAP_S`.  Standard library and NumPy
only, so a layer below Triton can fill a snapshot without importing it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Final

import numpy as np

__all__ = ["PUBLISH_MIN_GAP_S", "QUANTILES", "Labels", "LatencyWindow", "Snapshot"]

Labels = tuple[tuple[str, str], ...]

#: Quantiles of the latency summaries.
QUANTILES: Final = ("0.5", "0.99")
#: Least time between two publications of one model: a gauge's change reaches the endpoint within
#: about this (Prometheus scrapes every 15-30 s), and a burst of changes costs one publication.
PUBLISH_MIN_GAP_S: Final = 0.25


@dataclass
class Snapshot:
    """Values of one publication: cumulative counters and present gauges, by name and labels."""

    values: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def put(self, name: str, value: float, **labels: str) -> None:
        """Set the value of one series."""
        self.values[(name, tuple(sorted(labels.items())))] = float(value)

    def add(self, name: str, delta: float = 1.0, **labels: str) -> None:
        """Add to one series (a counter kept in the snapshot itself)."""
        key = (name, tuple(sorted(labels.items())))
        self.values[key] = self.values.get(key, 0.0) + delta

    def put_latency(self, name: str, window: LatencyWindow) -> None:
        """The window's quantiles (when it saw values) and its cumulative sum and count."""
        qs = window.quantiles()
        if qs is not None:
            for q, v in zip(QUANTILES, qs, strict=True):
                self.put(name, v, quantile=q)
        self.put(f"{name}_sum", window.total_s)
        self.put(f"{name}_count", window.count)


class LatencyWindow:
    """Durations since the last publication in a preallocated ring, plus cumulative sum and count.

    ``add`` is O(1) and allocation-free (called per step); ``quantiles``
    reads and clears the window (called per publication).  Thread-safe.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._ring = np.zeros(capacity)
        self._n = 0
        self._lock = threading.Lock()
        self.total_s = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        """Record one duration (NaN and infinities are ignored)."""
        if not math.isfinite(seconds):
            return
        with self._lock:
            self._ring[self._n % self._ring.shape[0]] = seconds
            self._n += 1
            self.total_s += seconds
            self.count += 1

    def quantiles(self) -> tuple[float, ...] | None:
        """p50 and p99 of the window (``None`` when empty), and start a new window."""
        with self._lock:
            n = min(self._n, self._ring.shape[0])
            if n == 0:
                return None
            out = tuple(float(v) for v in np.quantile(self._ring[:n], [float(q) for q in QUANTILES]))
            self._n = 0
            return out
