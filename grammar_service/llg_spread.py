"""Which template each new llguidance sequence copies, and the further templates built as sequences run side by side.

The policy is :class:`grammar_backend.llg.LlgCompiled`'s (why: copies of one
template take turns at its lexer); this module holds what the grammar core
may not: the lock its calls take, the finalizer that gives a copy back when
its matcher is collected, and the thread that builds further templates off
the start's path (a build is a compile, about 1 ms for a typical schema,
and a start may run on the step's thread).
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

from grammar_backend.llg import LlgBackend, LlgCompiled, LlgMatcher

__all__ = ["TemplateSpread"]

log = logging.getLogger(__name__)


class TemplateSpread:
    """New llguidance sequences spread over their grammar's templates (one per engine).

    Parameters
    ----------
    llg : LlgBackend
    """

    def __init__(self, llg: LlgBackend) -> None:
        self._llg = llg
        # Reentrant: a matcher's finalizer gives its copy back, and a collection may start it on a thread
        # that holds this lock.
        self._lock = threading.RLock()
        self._builds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llg-template")

    def matcher(self, compiled: LlgCompiled) -> LlgMatcher:
        """A new sequence's matcher: a copy of the template with the fewest live copies (its
        :attr:`~grammar_backend.llg.LlgMatcher.family`), given back when the matcher is collected; where every
        template has a live copy, one more is built (up to :attr:`LlgCompiled.most`)."""
        with self._lock:
            family, grow = compiled.take()
        try:
            matcher = self._llg.matcher(compiled, family)
        except BaseException:
            with self._lock:
                compiled.release(family)
                if grow:
                    compiled.built(None)
            raise
        weakref.finalize(matcher, self._release, compiled, family)
        if grow:
            self._builds.submit(self._build, compiled)
        return matcher

    def drain(self, timeout_s: float | None = None) -> None:
        """Return once every build asked for so far has ended (one build thread, first in first out).

        Raises
        ------
        TimeoutError
            They did not end within ``timeout_s``.
        """
        self._builds.submit(lambda: None).result(timeout_s)

    def close(self) -> None:
        """Drop the builds not begun (the one under way ends on its own)."""
        self._builds.shutdown(wait=False, cancel_futures=True)

    def _release(self, compiled: LlgCompiled, family: int) -> None:
        with self._lock:
            compiled.release(family)

    def _build(self, compiled: LlgCompiled) -> None:
        template = None
        try:
            template = self._llg.template(compiled)
        except Exception:  # it compiled once: only a resource failure; its sequences go on with the templates built
            log.exception("llguidance: a further template of a compiled grammar could not be built")
        finally:
            with self._lock:
                compiled.built(template)
