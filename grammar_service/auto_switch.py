"""``backend: auto``'s second look at a JSON constraint: the first output, replayed on both backends.

llguidance serves a JSON constraint first under ``backend: auto``: it compiles in
milliseconds where xgrammar's compile has a tail of seconds, and it passes more
of MaskBench (:func:`grammar_backend.backends.auto_order`).  Which backend fills
that constraint's masks more cheaply depends on the schema, by up to 15x either
way (docs/benchmarks.md, "backend auto's switch"): xgrammar is cheaper on most
schemas, llguidance on long strings with formats and on large open objects.  No
rule on the schema's text predicts it, so it is measured on what the constraint
really decodes: the first output that completes (its sequence ended terminated)
is replayed, off the step's path, on a fresh matcher of each backend, one token
at a time, timing each backend's mask fill at every position.  xgrammar serves
the constraint's later starts when

* its fidelity report leaves nothing unenforced that llguidance's enforces, and
  the schema uses no keyword where xgrammar was measured to differ
  (:func:`grammar_backend.backends.may_switch_to_xgrammar`);
* it compiled (in a worker process, as any xgrammar compile);
* its mask allows every token of the output llguidance produced, and its
  matcher ends where llguidance's did (an over-constraint of xgrammar's on this
  constraint's real outputs keeps llguidance);
* its fills along the output cost at most
  :data:`~grammar_backend.backends.SWITCH_FILL_RATIO` of llguidance's.

A constraint is replayed once (a later completed output of the same constraint
is not replayed again while the memo holds it); sequences already running keep
their backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Final

import numpy as np

from grammar_backend.backends import LLGUIDANCE, SWITCH_FILL_RATIO, XGRAMMAR, may_switch_to_xgrammar
from grammar_backend.bitmask import Matcher
from grammar_backend.errors import CompileQueueFull, GrammarError
from grammar_backend.lru import Lru
from grammar_backend.protocol import bitmask_width
from grammar_backend.spec import ConstraintSpec

log = logging.getLogger(__name__)

#: The outcomes of a replay, as counted (:meth:`AutoSwitch.counts`, metric ``grammar_auto_switches_total``).
OUTCOMES: Final = ("switched", "slower", "keywords", "refused", "compile_failed", "busy", "error")

#: Constraints remembered as replayed (or queued): at most one replay each while remembered.
_REMEMBERED: Final = 4096


class AutoSwitch:
    """One thread that replays first outputs and moves constraints to xgrammar where it is cheaper.

    Parameters
    ----------
    vocab_size : int
        The logits width (one mask row of it is filled per replayed position).
    compiled : callable
        ``(spec, backend) -> future of its compiled grammar``, from the engine's caches (xgrammar's compile runs
        in a worker process, as any; llguidance's is cached already).
    matcher : callable
        ``compiled grammar -> a new matcher`` of its backend.
    switch : callable
        Called with the spec when xgrammar is to serve it from now on.
    queue : int
        Most replays queued at once; more are counted ``busy`` and dropped (the constraint stays on llguidance
        and its next completed output is offered).
    compile_timeout_s : float
        How long a replay waits for xgrammar's compile.
    compiles_free : callable
        Whether xgrammar's compile workers have room: a replay's compile never queues behind, or in front of,
        the compiles requests wait for (none free: ``busy``, and the constraint's next completed output is
        offered again).
    """

    def __init__(self, vocab_size: int, compiled: Callable[[ConstraintSpec, str], Future[Any]],
                 matcher: Callable[[Any], Matcher], switch: Callable[[ConstraintSpec], None], queue: int,
                 compile_timeout_s: float, compiles_free: Callable[[], bool]) -> None:
        self._width = bitmask_width(vocab_size)
        self._compiled = compiled
        self._matcher = matcher
        self._switch = switch
        self._queue = queue
        self._timeout_s = compile_timeout_s
        self._compiles_free = compiles_free
        self._closed = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-auto-switch")
        self._lock = threading.Lock()
        self._pending = 0
        self._counts = dict.fromkeys(OUTCOMES, 0)
        #: Constraints offered: True once replayed or queued, False where a busy replay left it to the next output.
        self._offered: Lru[str, bool] = Lru(_REMEMBERED)

    def wants(self, key: str) -> bool:
        """Whether a sequence of the constraint ``key`` should record its output for a replay."""
        return self._offered.get(key) is not True

    def offer(self, key: str, spec: ConstraintSpec, path: Sequence[int]) -> None:
        """Queue the replay of ``path``, a completed output of ``spec`` that llguidance served (once per ``key``)."""
        with self._lock:
            if self._offered.get(key) is True:
                return
            if self._pending >= self._queue:
                self._counts["busy"] += 1
                return
            self._offered.set(key, True)
            self._pending += 1
        try:
            self._pool.submit(self._replay, key, spec, list(path))
        except RuntimeError:  # shut down: the engine is closing
            with self._lock:
                self._pending -= 1

    def counts(self) -> dict[str, int]:
        """Replays by outcome (:data:`OUTCOMES`)."""
        with self._lock:
            return dict(self._counts)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every replay queued so far has finished (benchmarks and tests); False on timeout."""
        try:
            self._pool.submit(lambda: None).result(timeout=timeout_s)
        except FutureTimeout:
            return False
        return True

    def close(self) -> None:
        """Drop queued replays; a running one ends without a verdict."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _replay(self, key: str, spec: ConstraintSpec, path: list[int]) -> None:
        try:
            outcome = self._decide(spec, path)
        except Exception:
            if self._closed:  # the engine's caches closed under it
                outcome = "busy"
            else:
                log.exception("grammar: backend auto: replaying an output on xgrammar failed; llguidance serves it")
                outcome = "error"
        with self._lock:
            self._counts[outcome] += 1
            self._pending -= 1
            if outcome == "busy":
                self._offered.set(key, False)  # the next completed output is offered again
        if outcome == "switched":
            self._switch(spec)

    def _decide(self, spec: ConstraintSpec, path: list[int]) -> str:
        if not may_switch_to_xgrammar(spec):
            return "keywords"
        if self._closed or not self._compiles_free():
            return "busy"
        try:
            grammars = [self._compiled(spec, backend).result(timeout=self._timeout_s)
                        for backend in (XGRAMMAR, LLGUIDANCE)]
        except CompileQueueFull:
            return "busy"
        except (GrammarError, FutureTimeout):
            return "compile_failed"  # the compile's own error is the cache's and the log's
        xgrammar, llguidance = (self._matcher(g) for g in grammars)
        spent = replay(xgrammar, llguidance, path, np.zeros((1, self._width), np.int32))
        if spent is None:
            return "refused"
        xgrammar_s, llguidance_s = spent
        log.info("grammar: backend auto: %d tokens replayed, fill %.2f ms on xgrammar, %.2f ms on llguidance",
                 len(path), xgrammar_s * 1e3, llguidance_s * 1e3)
        return "switched" if xgrammar_s <= SWITCH_FILL_RATIO * llguidance_s else "slower"


def replay(xgrammar: Matcher, llguidance: Matcher, path: Sequence[int], row: np.ndarray) -> tuple[float, float] | None:
    """Both matchers along ``path``: the seconds each spent filling its masks, or None where xgrammar's mask
    refuses a token of it (or does not end with it).

    The two fill the same position one after the other, so a load on the host weighs on both alike.
    """
    clock = time.perf_counter
    spent = [0.0, 0.0]
    for token in path:
        for i, matcher in enumerate((xgrammar, llguidance)):
            t0 = clock()
            matcher.fill_next_token_bitmask(row, 0)
            spent[i] += clock() - t0
            if i == 0 and not row[0, token >> 5] >> (token & 31) & 1:
                return None
            if not matcher.accept_token(token):
                return None
    if not xgrammar.is_terminated():
        return None
    return spent[0], spent[1]
