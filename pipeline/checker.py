"""The heavy lane's child process: checks large constraints at nice 19 (``python -m pipeline.checker``).

Why a process: a large schema's checks are Python (the meta-schema check of
a 1.9 MB schema takes about 4 s of CPU) and hold the GIL.  On a thread of
the ``preprocessing`` stub they would take the CPU from decoding at the same
priority, and a thread at nice 19 would hold the GIL while the scheduler
starves it, stalling the stub's own thread (priority inversion).  A child
has its own GIL and runs at nice 19, so it takes the CPU decoding leaves
(:mod:`grammar_service.child`), and its CPU time is bounded (``RLIMIT_CPU``):
past ``cpu_s`` the check is refused by name, as a compile is.

The child only checks; its verdict warms the parent's caches
(:func:`pipeline.preprocess.record_check`), so the parent then completes
the request from them without checking again.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import threading
from typing import Final

from contract.errors import DEADLINE_EXCEEDED, ServingError
from grammar_service.child import (
    Child,
    ChildDied,
    ChildStartError,
    child_stdio,
    describe_exit,
    limit_cpu,
    read_frame,
    worker_python,
    write_frame,
)
from pipeline.preprocess import RequestConstraint, check_reply, record_check

__all__ = ["CheckFailed", "CheckTimeout", "Checker", "main"]

log = logging.getLogger(__name__)

#: How long the child may take to start (it imports jsonschema and the spec parser: about 0.2 s alone).
_START_TIMEOUT_S: Final = 60.0
#: A check is killed past this many times its CPU limit in wall time (a child starved of CPU, or stuck).
_WALL_FACTOR: Final = 10


class CheckFailed(ServingError):
    """The child died on a check (a bug, or it could not start): INTERNAL."""


class CheckTimeout(ServingError):
    """A check ran past its wall time, starved of CPU by decoding: DEADLINE_EXCEEDED, retry later.

    Nothing is remembered: the constraint may be fine, and the host only busy
    (the child runs at nice 19).
    """

    status = DEADLINE_EXCEEDED


class Checker:
    """One child process that checks constraints, one at a time, started on first use and after a death.

    Parameters
    ----------
    cpu_s : float
        CPU seconds one check may use; past it the constraint is refused
        (INVALID_ARGUMENT naming the limit, remembered like any refusal).
    python : str, optional
        The child's interpreter (default :func:`grammar_service.child.worker_python`).
    """

    def __init__(self, cpu_s: float, python: str | None = None) -> None:
        self.cpu_s = cpu_s
        self._python = python
        self._child: Child | None = None
        self._lock = threading.Lock()

    def check(self, constraint: RequestConstraint) -> None:
        """Check ``constraint`` in the child and record the verdict (:func:`pipeline.preprocess.record_check`).

        Raises
        ------
        CheckTimeout
            The check ran past ``10 * cpu_s`` of wall time (a busy host): retriable, not remembered.
        CheckFailed
            The child could not start, or died on this check for another reason than its limits.
        """
        with self._lock:
            child = self._started()
            try:
                reply = child.run((constraint, self.cpu_s), wall_s=_WALL_FACTOR * self.cpu_s)
            except ChildDied as died:
                self._child = None
                if child.returncode == -signal.SIGXCPU:
                    record_check(constraint, ("refused", "grammar", self.limit_reason, ""))
                    return
                if died.timed_out:
                    raise CheckTimeout(f"preprocessing: checking this constraint took more than "
                                       f"{_WALL_FACTOR * self.cpu_s:g} s (the server is busy); retry later") from None
                log.error("preprocessing: the constraint checker died (%s)", describe_exit(child.returncode))
                raise CheckFailed(f"preprocessing: the constraint check failed "
                                  f"({describe_exit(child.returncode)})") from None
        record_check(constraint, reply)

    @property
    def limit_reason(self) -> str:
        """The refusal of a constraint whose checks outran the limit."""
        return f"checking this constraint used more than {self.cpu_s:g} s of CPU (the check limit); it is refused"

    def close(self) -> None:
        """Stop the child (a running check is killed: its caller gets :class:`CheckFailed`)."""
        child = self._child  # not under the lock: a running check holds it
        if child is not None:
            child.stop()

    def _started(self) -> Child:
        if self._child is None or not self._child.alive:
            try:
                self._child = Child(self._python or worker_python(), "pipeline.checker", pickle.dumps(None),
                                    _START_TIMEOUT_S)
            except ChildStartError as err:
                raise CheckFailed(f"preprocessing: the constraint checker failed to start ({err})") from err
        return self._child


def main() -> int:
    """Child entry point: answer checks on stdin/stdout until stdin closes."""
    inp, out = child_stdio()
    if read_frame(inp) is None:  # the init frame: nothing to set up
        return 0
    write_frame(out, pickle.dumps(("ready",)))
    while (frame := read_frame(inp)) is not None:
        constraint, cpu_s = pickle.loads(frame)
        limit_cpu(cpu_s)  # past it: SIGXCPU, which the parent reads as the limit
        write_frame(out, pickle.dumps(check_reply(constraint)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
