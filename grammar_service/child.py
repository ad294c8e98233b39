"""A Python child process that serves pickled frames on its stdin and stdout, one request at a time.

Work that may take seconds or minutes of CPU, or crash, runs in such a
child rather than in a serving process: the compile workers
(:mod:`grammar_service.workers`) and preprocessing's heavy lane
(:mod:`pipeline.lane`).  The parent can bound a request's wall time (it kills
the child past it) and the child runs at nice 19, so it takes the CPU that
decoding leaves.

The wire is length-prefixed pickles both ways: both ends are this project's
modules, started by this module, so nothing untrusted is ever unpickled.
This module imports nothing heavy: a child that needs only the standard
library and :mod:`pipeline` starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Final

from contract.errors import ConfigError

__all__ = ["Child", "ChildDied", "ChildStartError", "child_stdio", "describe_exit", "die_with_parent", "limit_cpu",
           "read_frame", "worker_python", "write_frame"]

HEADER: Final = 8


def worker_python() -> str:
    """The interpreter that runs children.

    ``sys.executable`` when it is a Python interpreter.  Inside Triton's
    Python-backend stub it is not (the stub embeds libpython); there the
    ``python3`` first on ``PATH`` is the one, which ``deploy.server`` makes
    the project's virtualenv, the same rule the stub itself follows.

    Raises
    ------
    ConfigError
        Neither is available.
    """
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise ConfigError(
            f"workers: sys.executable is {sys.executable!r} and no python3 is on PATH; set the workers' python"
        )
    return found


class ChildDied(Exception):
    """The child exited (end of its output) or, with ``timed_out``, did not answer in time."""

    def __init__(self, timed_out: bool) -> None:
        super().__init__("worker died" if not timed_out else "worker timed out")
        self.timed_out = timed_out


class ChildStartError(Exception):
    """The child did not start and answer its init frame with ``("ready",)``; the message says how it ended."""


class Child:
    """One child process (``python -m module``) and its pipes, used by one thread at a time.

    Parameters
    ----------
    python : str
        The interpreter (:func:`worker_python`).
    module : str
        The child's module; it reads the init frame, answers ``("ready",)``,
        then one reply per request frame until its stdin closes.
    init : bytes
        The init frame (a pickle the module expects).
    start_timeout_s : float
        How long it may take to answer the init frame.

    Raises
    ------
    ChildStartError
        It exited or answered anything but ready.
    """

    def __init__(self, python: str, module: str, init: bytes, start_timeout_s: float) -> None:
        env = dict(os.environ)
        # The child imports the project's packages from the same place as the parent.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([python, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, close_fds=True)
        self.pid = self.proc.pid
        self._stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        self._stdout_fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        try:
            write_frame(self._stdin, init)
            ready = self._read(time.monotonic() + start_timeout_s)
        except (ChildDied, OSError) as err:
            self.stop()
            raise ChildStartError(describe_exit(self.proc.returncode)) from err
        if ready != ("ready",):
            self.stop()
            raise ChildStartError(f"answered {ready!r} instead of ready")

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Its exit status once it exited (negative: the signal)."""
        return self.proc.returncode

    def run(self, request: object, wall_s: float) -> Any:
        """Send one request and wait for its reply, killing the child past ``wall_s``.

        Raises
        ------
        ChildDied
            It exited, or ``timed_out``: it did not answer in time (it is killed).
        """
        try:
            write_frame(self._stdin, pickle.dumps(request))
        except OSError:
            self.stop()
            raise ChildDied(timed_out=False) from None
        try:
            return self._read(time.monotonic() + wall_s)
        except ChildDied as died:
            if not died.timed_out:
                # End of file: the child is exiting.  Killing it now would hide why
                # (its exit status read as SIGKILL: out-of-memory exits were reported
                # as crashes, docs/benchmarks.md, MaskBench conformance).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5)
            self.stop()
            raise ChildDied(died.timed_out) from None

    def _read(self, deadline: float) -> Any:
        size = int.from_bytes(self._read_exact(HEADER, deadline), "big")
        return pickle.loads(self._read_exact(size, deadline))

    def _read_exact(self, size: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._stdout_fd], [], [], remaining)[0]:
                raise ChildDied(timed_out=True)
            chunk = os.read(self._stdout_fd, min(size - len(buf), 1 << 20))
            if not chunk:
                raise ChildDied(timed_out=False)
            buf += chunk
        return bytes(buf)

    def stop(self) -> None:
        """Kill the process and reap it (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def describe_exit(code: int | None) -> str:
    """``exit status N``, ``signal NAME`` or ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def write_frame(out: IO[bytes], payload: bytes) -> None:
    """One frame: its length, then the bytes."""
    out.write(len(payload).to_bytes(HEADER, "big"))
    out.write(payload)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes | None:
    """The next frame's bytes; None at the end of the input."""
    header = inp.read(HEADER)
    if len(header) < HEADER:
        return None
    size = int.from_bytes(header, "big")
    payload = inp.read(size)
    if len(payload) < size:
        return None
    return payload


# ------------------------------------------------------------------ child side
def limit_cpu(cpu_s: float) -> None:
    """Let this process use ``cpu_s`` more CPU seconds from now; past them the kernel sends SIGXCPU (it dies)."""
    import resource  # here: the parent never needs it

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + cpu_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this child when its parent dies (a killed stub leaves no orphans)."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def child_stdio() -> tuple[IO[bytes], IO[bytes]]:
    """The child's frame streams; anything else written to stdout goes to stderr.

    Call first in the child's ``main``.  It also runs the child at nice 19 and without core files.
    """
    die_with_parent()
    # Background work, decoding is not: on the 2-core machine, nice 19 took other
    # streams' inter-token p50 during a compile storm (bench/compile_storm.py --quick)
    # from 929 ms to 506 ms.
    os.nice(19)
    import resource  # here: the parent never needs it

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return sys.stdin.buffer, out
