"""Compile worker processes: every xgrammar compile runs outside the decoding process.

Why a process and not a thread: xgrammar cannot interrupt a compile, some
inputs take minutes or gigabytes, and some crash the compiler outright (and
with it every sequence's matcher): ``bench/compile_storm.py`` sends such
constraints; what they did to the ``grammar`` stub before this module is in
docs/benchmarks.md.  A worker process can be limited and killed:

* CPU time: ``RLIMIT_CPU`` is set before each compile to what the worker
  has used so far plus ``cpu_s``; past it the kernel stops the worker with
  SIGXCPU.  The parent also kills a compile after ``2 * cpu_s`` of wall
  time (a worker starved of CPU, or stuck).
* Memory: ``RLIMIT_AS`` is the worker's address space after start-up plus
  ``memory_bytes``; an allocation past it fails (``MemoryError`` or the
  worker aborts).
* Size: a compiled grammar larger than ``max_grammar_bytes`` is refused in
  the worker, before it is serialized and shipped.
* Priority: workers run at nice 19, so compiles take the CPU that decoding
  leaves.

Every such refusal is a :class:`~grammar_backend.errors.CompileError` that
names the limit (INVALID_ARGUMENT: retrying the same constraint cannot
help, and the compile cache remembers it for its negative TTL).  A killed
or crashed worker is replaced before the next compile.

Each worker is a :class:`grammar_service.child.Child` (its wire: length-prefixed
pickles over a pipe pair, between this project's modules only).  A compiled grammar comes back as
``CompiledGrammar.serialize_json`` text; serializing and deserializing can
cost more than the compile (docs/benchmarks.md), paid once per schema (the
cache keeps the result).  A worker imports xgrammar, which imports torch
(hundreds of MB resident, mostly shared library pages, and seconds to start:
:meth:`grammar_service.engine.GrammarEngine.warm_up`), so workers are
started once and reused.

Workers run ``python -m grammar_service.compile_worker``, started only by :class:`CompileWorkers`.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import resource
import signal
import threading
from dataclasses import dataclass
from typing import IO, Any, Final

import xgrammar as xgr

from grammar_backend.compile import compile_spec
from grammar_backend.errors import CompileError, ConfigError, GrammarError
from grammar_backend.spec import ConstraintSpec
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

log = logging.getLogger(__name__)

_MIB: Final = 1024 * 1024
#: How long a new worker may take to import xgrammar and load the vocabulary.
_START_TIMEOUT_S: Final = 120.0
#: Exit status of a worker whose allocation failed under RLIMIT_AS.
_EXIT_MEMORY: Final = 3


@dataclass(frozen=True)
class WorkerConfig:
    """Limits of the compile worker processes.

    Parameters
    ----------
    cpu_s : float
        CPU seconds one compile may use (``RLIMIT_CPU``); it is also stopped
        after twice that in wall-clock time.
    memory_bytes : int
        Address space a worker may add to what it holds after start-up.
    max_grammar_bytes : int
        Largest accepted ``CompiledGrammar.memory_size_bytes``.
    compile_threads : int
        Threads of xgrammar's compiler inside a worker.
    xgrammar_cache_bytes : int
        Bound of each worker's xgrammar compiler cache (shared sub-structures
        across schemas; see :class:`grammar_service.engine.GrammarEngine`).
    python : str
        Interpreter of the workers; empty: :func:`worker_python`.
    """

    cpu_s: float = 30.0
    memory_bytes: int = 1024 * _MIB
    max_grammar_bytes: int = 64 * _MIB
    compile_threads: int = 1
    xgrammar_cache_bytes: int = 64 * _MIB
    python: str = ""

    def __post_init__(self) -> None:
        if self.cpu_s <= 0:
            raise ConfigError(f"workers: cpu_s must be positive, got {self.cpu_s!r}")
        if min(self.memory_bytes, self.max_grammar_bytes, self.compile_threads, self.xgrammar_cache_bytes) <= 0:
            raise ConfigError(
                "workers: memory_bytes, max_grammar_bytes, compile_threads and xgrammar_cache_bytes must be positive"
            )


@dataclass(frozen=True)
class WorkerStats:
    """Counters of the compile workers."""

    started: int
    cpu_kills: int
    wall_kills: int
    memory_refusals: int
    size_refusals: int
    crashes: int


class CompileWorkers:
    """Runs compiles in worker processes, one process per calling thread.

    The compile cache calls :meth:`compile` from its fixed pool of compile
    threads; each thread lazily starts, and keeps, its own worker, so there
    are never more workers than compile threads and no compile waits for a
    worker.

    Parameters
    ----------
    tokenizer_info : xgrammar.TokenizerInfo
        Shipped to each worker (serialized) and used to deserialize results.
    config : WorkerConfig
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, config: WorkerConfig) -> None:
        self.config = config
        self._info = tokenizer_info
        self._python = config.python or worker_python()
        self._init: bytes | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._live: set[Child] = set()
        self._closed = False
        self._counts = dict.fromkeys(WorkerStats.__dataclass_fields__, 0)

    def compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        """Compile ``spec`` in this thread's worker (blocking).

        Raises
        ------
        CompileError
            xgrammar rejects the constraint, or compiling it broke a limit or
            the worker (the message names which).
        GrammarError
            The pool is closed, or a worker cannot start.
        """
        worker = self._worker()
        try:
            reply = worker.run(spec, wall_s=2 * self.config.cpu_s)
        except ChildDied as died:
            self._discard(worker)
            with self._lock:
                closed = self._closed
            if closed:  # killed by close(), not by the constraint
                raise GrammarError("grammar: the compile workers are closed") from None
            raise self._death_error(spec, worker, died) from None
        status = reply[0]
        if status == "ok":
            return xgr.CompiledGrammar.deserialize_json(reply[1], self._info)
        if status == "memory":
            self._discard(worker)
            self._count("memory_refusals")
            raise CompileError("grammar", self._memory_reason(spec))
        if status == "size":
            self._count("size_refusals")
        raise CompileError(reply[1], reply[2])

    def ensure_started(self) -> None:
        """Start this thread's worker now (compile threads call it at warm-up)."""
        self._worker()

    def stats(self) -> WorkerStats:
        """Current counters."""
        with self._lock:
            return WorkerStats(**self._counts)

    def close(self) -> None:
        """Stop every worker (a running compile is killed)."""
        with self._lock:
            self._closed = True
            live, self._live = self._live, set()
        for worker in live:
            worker.stop()

    # ------------------------------------------------------------ internals
    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _worker(self) -> Child:
        worker: Child | None = getattr(self._local, "worker", None)
        if worker is not None and worker.alive:
            return worker
        if self._init is None:
            # Built once, on the first compile thread that needs it (the
            # vocabulary's JSON, megabytes).
            self._init = pickle.dumps({
                "tokenizer_info": self._info.serialize_json(),
                "compile_threads": self.config.compile_threads,
                "xgrammar_cache_bytes": self.config.xgrammar_cache_bytes,
                "cpu_s": self.config.cpu_s,
                "memory_bytes": self.config.memory_bytes,
                "max_grammar_bytes": self.config.max_grammar_bytes,
            })
        with self._lock:
            if self._closed:
                raise GrammarError("grammar: the compile workers are closed")
        worker = _start_worker(self._python, self._init)
        with self._lock:
            self._live.add(worker)
            self._counts["started"] += 1
            closed = self._closed
        if closed:
            self._discard(worker)
            raise GrammarError("grammar: the compile workers are closed")
        self._local.worker = worker
        return worker

    def _discard(self, worker: Child) -> None:
        worker.stop()
        with self._lock:
            self._live.discard(worker)

    def _death_error(self, spec: ConstraintSpec, worker: Child, died: ChildDied) -> CompileError:
        code = worker.returncode
        kind = spec.kind.value
        if died.timed_out:
            self._count("wall_kills")
            reason = f"compiling this {kind} ran past {2 * self.config.cpu_s:g} s (the compile time limit) and was stopped"
        elif code == -signal.SIGXCPU:
            self._count("cpu_kills")
            reason = f"compiling this {kind} used more than {self.config.cpu_s:g} s of CPU (the compile limit) and was stopped"
        elif code == _EXIT_MEMORY or code == -signal.SIGABRT:
            # An allocation past RLIMIT_AS surfaces as MemoryError (exit 3) or,
            # inside C++ code that does not translate bad_alloc, as an abort.
            self._count("memory_refusals")
            reason = self._memory_reason(spec)
        else:
            self._count("crashes")
            reason = f"the compiler crashed on this {kind} ({describe_exit(code)}); it is refused"
        log.warning("grammar: compile worker %d stopped: %s", worker.pid, reason)
        return CompileError("grammar", reason)

    def _memory_reason(self, spec: ConstraintSpec) -> str:
        return (
            f"compiling this {spec.kind.value} needed more than {self.config.memory_bytes / _MIB:g} MiB "
            "(the compile memory limit)"
        )


def _start_worker(python: str, init: bytes) -> Child:
    try:
        return Child(python, "grammar_service.compile_worker", init, _START_TIMEOUT_S)
    except ChildStartError as err:
        raise GrammarError(f"grammar: a compile worker failed to start ({err})") from err


def _address_space() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _serve(inp: IO[bytes], out: IO[bytes]) -> int:
    init_frame = read_frame(inp)
    if init_frame is None:
        return 0
    init = pickle.loads(init_frame)
    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgr.GrammarCompiler(
        info,
        max_threads=init["compile_threads"],
        cache_enabled=True,
        cache_limit_bytes=init["xgrammar_cache_bytes"],
    )
    max_bytes = init["max_grammar_bytes"]
    cpu_s = init["cpu_s"]
    limit = _address_space() + init["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_frame(out, pickle.dumps(("ready",)))
    while (frame := read_frame(inp)) is not None:
        limit_cpu(cpu_s)
        try:
            reply = _compile_one(compiler, pickle.loads(frame), max_bytes)
        except MemoryError:
            with contextlib.suppress(OSError):
                write_frame(out, pickle.dumps(("memory",)))
            return _EXIT_MEMORY
        write_frame(out, pickle.dumps(reply))
    return 0


def _compile_one(compiler: xgr.GrammarCompiler, spec: ConstraintSpec, max_bytes: int) -> tuple[Any, ...]:
    try:
        compiled = compile_spec(compiler, spec)
    except CompileError as err:
        if "bad_alloc" in err.reason:
            # xgrammar reports a failed allocation as a RuntimeError; what its
            # caches hold after one is unknown, so this worker ends.
            raise MemoryError from err
        return ("refused", err.field, err.reason)
    size = int(compiled.memory_size_bytes)
    if size > max_bytes:
        reason = (
            f"this {spec.kind.value} compiles to {size / _MIB:.1f} MiB, over the "
            f"{max_bytes / _MIB:g} MiB limit on a compiled grammar"
        )
        return ("size", "grammar", reason)
    try:
        return ("ok", compiled.serialize_json())
    except RuntimeError as err:
        # The JSON of an open-object grammar is many times its size (337 MB for a
        # 21 MB grammar, docs/benchmarks.md): serializing is what runs past the memory limit.
        if "bad_alloc" in str(err):
            raise MemoryError from err
        raise


def main() -> int:
    """Worker entry point: serve compiles on stdin/stdout until stdin closes (at nice 19, no core files)."""
    return _serve(*child_stdio())

