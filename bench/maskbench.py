"""MaskBench conformance runner: spec check, compile and token-by-token forcing of every test instance.

Usage (from the repository root)::

    .venv/bin/python bench/maskbench.py ../shared/data/maskbench-dev --workers 2 --timeout 30 \
        --json build/maskbench.json

For every MaskBench-format file (``{"schema": ..., "tests": [{"valid": bool, "data": ...}]}``)
in DIR, a child process:

1. validates the schema with :func:`grammar_backend.spec.parse_constraint`
   (``spec_rejected`` and the reason when it fails);
2. compiles it as a start does (:meth:`grammar_service.engine.GrammarEngine.start`,
   grammar option ``backend`` from ``--backend``: ``auto`` tries llguidance
   first for JSON, then xgrammar, whose compile is stopped at
   ``--auto-timeout`` CPU seconds; the record says which backend served), ``compile_error`` with the last backend's
   reason; ``timeout`` or ``crash`` are decided by this parent, which kills
   a worker that runs past ``--timeout`` and notices a worker that died,
   e.g. on a segfault;
3. forces each test instance through the engine: the instance's compact JSON
   (``json.dumps(data, separators=(",", ":"), ensure_ascii=False)``) is
   tokenized with the Hugging Face tokenizer, each token is accepted with one
   ``engine.step`` (which also fills the next mask, as in decoding), then the
   stop token; under ``auto``, each instance's end lets the engine replay the
   schema's first complete output on xgrammar (:mod:`grammar_service.auto_switch`),
   waited for, so later instances are served as a server's later requests would
   be (the record's ``served_by``).  A token whose mask bit is clear rejects the instance there
   (decoding could not produce it, MaskBench's rule); a token the mask allows
   but the matcher refuses is a disagreement between the two
   (``mask_mismatches``; expected 0).  With ``--value-checks`` (the served
   default, :mod:`grammar_backend.values`) a completed value that breaks
   its subschema where the grammar cannot express it also rejects the
   instance, at that value's end: decoding would drop it and generate it
   again.

A valid instance rejected is an over-constraint; an invalid instance accepted
is an under-constraint, and the post-validator
(:func:`grammar_backend.fidelity.validate_output`) is asked whether it catches
it.  A schema passes when it compiled, every valid instance was accepted and
every invalid one rejected (a compiled schema without tests passes).

Like JSONSchemaBench's own harness, the work runs in child processes: a schema
that hangs or crashes the compiler costs one worker (respawned, ~3 s to load
the tokenizer again), never the run.  The per-schema time limit applies to each
phase (spec, compile, force) separately.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Final, Self

# Before the project's packages: it puts the repository root on sys.path (spawned workers inherit sys.path).
import harness
import numpy as np
from harness import QWEN_DIR, QWEN_VOCAB, REPO

#: The default tokenizer: the large byte-level BPE closest in size to the
#: Llama-3.1 vocabulary that MaskBench's published figures used.
DEFAULT_TOKENIZER: Final = QWEN_DIR
#: Qwen3's logits width (the tokenizer itself has 151,669 tokens).
DEFAULT_VOCAB_SIZE: Final = QWEN_VOCAB

#: Published results on the full MaskBench (11,305 schemas, Llama-3.1
#: tokenizer), Geng et al. 2025, arXiv 2501.10868.
ANCHOR_PASSES: Final = (("LLGuidance", 8909), ("XGrammar", 8122), ("Outlines", 7050), ("llama.cpp", 6505))
ANCHOR_TOTAL: Final = 11_305

#: xgrammar's log prefix "[hh:mm:ss] /project/cpp/file.cc:123: ".
_CPP_PREFIX: Final = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_SUBSET: Final = re.compile(r"^(.*?)(?:---.*|_\d+)\.json$")

STATUSES: Final = ("spec_rejected", "compile_error", "timeout", "crash", "error", "bad_file", "compiled")


def subset_of(name: str) -> str:
    """The MaskBench subset of a file name: the prefix before ``---`` or ``_<n>``."""
    match = _SUBSET.match(name)
    return match.group(1) if match else Path(name).stem


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile (nearest-rank, so it is always an observed value); NaN when empty.

    Infinite entries (censored samples such as timeouts) are ordered last.
    """
    arr = np.sort(np.asarray(values, dtype=np.float64))
    if arr.size == 0:
        return float("nan")
    rank = max(1, int(np.ceil(q / 100.0 * arr.size)))
    return float(arr[rank - 1])


def compact_json(data: Any) -> str:
    """The instance text that is forced: compact separators, no ASCII escaping."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def clean_log_line(line: str) -> str:
    """An xgrammar log line without its time stamp and C++ source path."""
    return _CPP_PREFIX.sub("", line.strip())


def first_line(err: BaseException) -> str:
    """``Type: first line of the message`` (C++ prefixes removed)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {clean_log_line(text.splitlines()[0]) if text else ''}".rstrip(": ")


# ---------------------------------------------------------------------------
# Worker pool: one task at a time per child process, per-phase deadline,
# kill on timeout, "crash" on a dead worker.
# ---------------------------------------------------------------------------


class WorkerContext:
    """Handed to a task function inside a worker: phase reports and the worker's stderr.

    Parameters
    ----------
    conn : Connection
        The worker's end of its pipe to the parent.
    stderr_path : str
        The file the worker's fd 2 is redirected to (xgrammar logs there).
    """

    def __init__(self, conn: Connection, stderr_path: str) -> None:
        self._conn = conn
        self._stderr_path = stderr_path
        self._offset = os.path.getsize(stderr_path)

    def phase(self, name: str, **info: Any) -> None:
        """Start phase ``name``: the parent restarts the deadline and keeps ``info`` for a failure record."""
        self._conn.send(("phase", name, info))

    def new_stderr(self) -> str:
        """What the worker wrote to stderr since the previous call (xgrammar warnings)."""
        sys.stderr.flush()
        with open(self._stderr_path, encoding="utf-8", errors="replace") as fh:
            fh.seek(self._offset)
            text = fh.read()
            self._offset = fh.tell()
        return text


InitFn = Callable[..., Any]
TaskFn = Callable[[Any, Any, WorkerContext], dict[str, Any]]


def _worker_main(
    conn: Connection, init_fn: InitFn, init_args: tuple[Any, ...], task_fn: TaskFn, stderr_path: str
) -> None:
    """Body of a worker process: init once, then run tasks until a None task."""
    # Ctrl-C is the parent's to handle (it kills its workers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        state = init_fn(*init_args)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which aborts the run
        conn.send(("init_error", f"{first_line(err)}\n{traceback.format_exc()}", {}))
        return
    ctx = WorkerContext(conn, stderr_path)
    conn.send(("ready", "", {}))
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            record = task_fn(state, task, ctx)
        except Exception as err:  # noqa: BLE001 - an unexpected exception is a result ("error"), not a dead worker
            conn.send(("error", f"{first_line(err)}\n{traceback.format_exc()}", {}))
            continue
        conn.send(("done", "", record))


@dataclass(frozen=True)
class Outcome:
    """What became of one task.

    Attributes
    ----------
    task : Any
    kind : str
        ``done`` (record is the task's result), ``error`` (the task raised;
        detail is the traceback), ``timeout`` (a phase ran past the limit;
        the worker was killed) or ``crash`` (the worker died; detail has the
        exit status and the tail of its stderr).
    phase : str
        The last phase the task reported.
    record : dict
        The result, or for a failure the info of the phases reported so far.
    elapsed_s : float
        Wall time from assignment to outcome.
    detail : str
    """

    task: Any
    kind: str
    phase: str
    record: dict[str, Any]
    elapsed_s: float
    detail: str = ""


class WorkerInitError(RuntimeError):
    """A worker could not initialize (tokenizer missing, import error): the run cannot proceed."""


@dataclass
class _Worker:
    proc: BaseProcess
    conn: Connection
    stderr_path: str
    ready: bool = False
    task: Any = None
    has_task: bool = False
    phase: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    assigned: float = 0.0
    deadline: float = 0.0


class WorkerPool:
    """Child processes that each run one task at a time under a per-phase deadline.

    Parameters
    ----------
    workers : int
        Number of child processes.
    init_fn, init_args
        Called once in each child; its result is the ``state`` passed to ``task_fn``.
        Must be a module-level function (pickled by reference under ``spawn``).
    task_fn : callable
        ``task_fn(state, task, ctx) -> dict``, module-level.
    timeout_s : float
        Limit of each phase of a task (a task reports phases with ``ctx.phase``).
    init_timeout_s : float
        Limit of a worker's initialization.
    """

    def __init__(
        self,
        workers: int,
        init_fn: InitFn,
        init_args: tuple[Any, ...],
        task_fn: TaskFn,
        timeout_s: float,
        init_timeout_s: float = 600.0,
    ) -> None:
        if workers <= 0 or timeout_s <= 0:
            raise ValueError("WorkerPool: workers and timeout_s must be positive")
        # spawn, not fork: the parent may hold tokenizer/xgrammar threads, and a
        # fresh interpreter per worker keeps a crashed compile's state out of the next one.
        self._ctx = multiprocessing.get_context("spawn")
        self._n = workers
        self._init = (init_fn, init_args)
        self._task_fn = task_fn
        self.timeout_s = timeout_s
        self.init_timeout_s = init_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="maskbench-workers-")
        self._serial = 0
        self._workers: list[_Worker] = []
        self.respawns = 0

    def __enter__(self) -> Self:
        for _ in range(self._n):
            self._workers.append(self._spawn())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self) -> _Worker:
        self._serial += 1
        stderr_path = os.path.join(self._tmp.name, f"worker-{self._serial}.stderr")
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._init[0], self._init[1], self._task_fn, stderr_path),
            name=f"maskbench-worker-{self._serial}",
            daemon=True,
        )
        proc.start()
        # Closing our copy of the child's end makes the pipe report EOF when the child dies.
        child_conn.close()
        return _Worker(proc, parent_conn, stderr_path, deadline=time.monotonic() + self.init_timeout_s)

    def _stderr_tail(self, worker: _Worker, limit: int = 1500) -> str:
        try:
            with open(worker.stderr_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - limit))
                return fh.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def _kill(self, worker: _Worker) -> None:
        # Our own child, by its Process handle (its pid).
        if worker.proc.is_alive():
            worker.proc.kill()
        worker.proc.join(timeout=10)
        worker.conn.close()

    def _retire(self, worker: _Worker, respawn: bool) -> None:
        """Kill a timed-out or crashed worker; start a new one only if tasks are left (~3 s of tokenizer load)."""
        self._kill(worker)
        if respawn:
            self._workers[self._workers.index(worker)] = self._spawn()
            self.respawns += 1
        else:
            self._workers.remove(worker)

    def run(self, tasks: Iterable[Any], keep_going: Callable[[], bool] | None = None) -> Iterator[Outcome]:
        """Run ``tasks``, yielding one :class:`Outcome` per task in completion order.

        Parameters
        ----------
        tasks : iterable
            Picklable task descriptions.
        keep_going : callable, optional
            Checked before each assignment; once it returns False no new task
            starts (the ones in flight finish) and the rest are not run.

        Raises
        ------
        WorkerInitError
            A worker failed to initialize or died during initialization.
        """
        pending = deque(tasks)
        stopped = False
        while len(self._workers) < self._n:  # workers retired by an earlier run
            self._workers.append(self._spawn())
        while True:
            now = time.monotonic()
            for worker in self._workers:
                if worker.ready and not worker.has_task and pending and not stopped:
                    if keep_going is not None and not keep_going():
                        stopped = True
                        break
                    worker.task = pending.popleft()
                    worker.has_task, worker.phase, worker.info = True, "start", {}
                    worker.assigned, worker.deadline = now, now + self.timeout_s
                    worker.conn.send(worker.task)
            if not any(w.has_task for w in self._workers) and (not pending or stopped):
                return
            waiting = [w for w in self._workers if w.has_task or not w.ready]
            timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            ready_conns = wait([w.conn for w in waiting], timeout=timeout)
            for worker in [w for w in waiting if w.conn in ready_conns]:
                outcome = self._receive(worker, bool(pending) and not stopped)
                if outcome is not None:
                    yield outcome
            now = time.monotonic()
            for worker in list(self._workers):
                if (worker.deadline <= now and (worker.has_task or not worker.ready) and worker.proc.is_alive()
                        and not worker.conn.poll()):  # a message that arrived in time is read first
                    if not worker.ready:
                        self._kill(worker)
                        raise WorkerInitError(f"worker did not initialize within {self.init_timeout_s:g} s")
                    outcome = Outcome(
                        worker.task, "timeout", worker.phase, dict(worker.info), now - worker.assigned,
                        f"{worker.phase} did not finish within {self.timeout_s:g} s",
                    )
                    self._retire(worker, bool(pending) and not stopped)
                    yield outcome

    def _receive(self, worker: _Worker, respawn: bool) -> Outcome | None:
        try:
            kind, detail, payload = worker.conn.recv()
        except (EOFError, OSError):
            worker.proc.join(timeout=10)
            code = worker.proc.exitcode
            if code is not None and code < 0:
                try:
                    how = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    how = f"killed by signal {-code}"
            else:
                how = f"exited with status {code}"
            tail = self._stderr_tail(worker)
            if not worker.ready:
                self._kill(worker)
                raise WorkerInitError(f"worker died during initialization ({how}):\n{tail}") from None
            outcome = Outcome(
                worker.task, "crash", worker.phase, dict(worker.info),
                time.monotonic() - worker.assigned, f"{how}; stderr tail: {tail[-600:]}",
            )
            self._retire(worker, respawn)
            return outcome
        if kind == "init_error":
            self._kill(worker)
            raise WorkerInitError(f"worker initialization failed: {detail}")
        if kind == "ready":
            worker.ready = True
            return None
        if kind == "phase":
            worker.phase = detail
            worker.info.update(payload)
            worker.deadline = time.monotonic() + self.timeout_s
            return None
        outcome = Outcome(
            worker.task, kind, worker.phase, payload if kind == "done" else dict(worker.info),
            time.monotonic() - worker.assigned, detail,
        )
        worker.task, worker.has_task = None, False
        return outcome

    def close(self) -> None:
        """Stop every worker (an idle one politely, a busy or initializing one by kill); remove the stderr files."""
        for worker in self._workers:
            if worker.proc.is_alive() and worker.ready and not worker.has_task:
                try:
                    worker.conn.send(None)
                    worker.proc.join(timeout=5)
                except OSError:
                    pass
            self._kill(worker)
        self._workers.clear()
        self._tmp.cleanup()


# ---------------------------------------------------------------------------
# The MaskBench task (runs inside a worker)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """What every worker needs to know (picklable)."""

    tokenizer: str
    vocab_size: int | None
    options: dict[str, Any]
    timeout_s: float
    auto_timeout_s: float
    value_checks: bool = True


@dataclass
class _State:
    engine: Any
    bundle: Any
    vocab_bytes: list[bytes]
    options: dict[str, Any]
    stop: int
    value_checks: bool = True
    next_seq: int = 1


def _init_worker(config: RunConfig) -> _State:
    from grammar_backend.llg import LlgBackend
    from grammar_backend.tokenizer import load_tokenizer
    from grammar_service.cache import CacheConfig
    from grammar_service.engine import GrammarEngine, GrammarEngineConfig
    from grammar_service.workers import WorkerConfig

    bundle = load_tokenizer(config.tokenizer, vocab_size=config.vocab_size)
    auto = config.options["backend"] == "auto"
    engine = GrammarEngine(
        bundle.info,
        bundle.fingerprint,
        GrammarEngineConfig(
            max_batch=1,
            # The parent's kill is the time limit; the in-process one is a backstop
            # that must never fire first (it would leave the compile thread running).
            cache=CacheConfig(
                max_bytes=256 * 1024 * 1024, workers=1, timeout_s=4 * config.timeout_s + 60, negative_ttl_s=0
            ),
            # auto: xgrammar's compile worker is stopped at its CPU limit, so the
            # fallback to llguidance happens inside the phase and the worker is
            # free for the next schema (a compile left running would hold it).
            workers=WorkerConfig(cpu_s=config.auto_timeout_s if auto else 4 * config.timeout_s + 60),
            auto_timeout_s=2 * config.auto_timeout_s + 5,
        ),
        llg=LlgBackend(bundle.hf, bundle.vocab_size, bundle.stop_token_ids),
    )
    # The compile worker process starts here, outside every timed phase (1-4 s).
    engine.warm_up()
    # The bytes xgrammar sees for each token: used to check that the HF
    # tokenization reproduces the instance byte for byte (Qwen's NFC normalizer
    # may not).  0.4 s once per worker for 151,936 tokens.
    vocab_bytes = list(bundle.info.decoded_vocab)
    return _State(engine, bundle, vocab_bytes, dict(config.options), int(bundle.stop_token_ids[0]),
                  config.value_checks)


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@dataclass
class _Forced:
    accepted: bool
    position: int | None  # token index where it was rejected (len(tokens) = the stop token)
    mismatches: int
    text_accepted: bool = False  # rejected by the mask only: the matcher takes every token (a tokenization rule)
    by_value_check: bool = False  # rejected where a completed value broke the schema (grammar_backend.values)
    backend: str = ""  # the backend that served it


def _compile(state: _State, spec: Any) -> str:
    """Compile ``spec`` as a start does (``backend: auto`` falls over to llguidance); returns the backend."""
    seq_id = state.next_seq
    state.next_seq += 1
    state.engine.start(seq_id, spec)
    backend: str = state.engine.table.get(seq_id).backend
    state.engine.end([seq_id])
    return backend


def _force(state: _State, spec: Any, tokens: list[int], step_ns: list[int]) -> _Forced:
    """Accept ``tokens`` then the stop token one ``engine.step`` at a time, timing each step."""
    engine = state.engine
    seq_id = state.next_seq
    state.next_seq += 1
    # A cache hit: the grammar was compiled just before (auto remembers the backend).
    engine.start(seq_id, spec, value_checks=state.value_checks)
    backend = engine.table.get(seq_id).backend
    ids = np.array([seq_id], dtype=np.uint64)
    tok = np.zeros((1, 1), dtype=np.int32)
    none, one = np.zeros(1, dtype=np.int32), np.ones(1, dtype=np.int32)
    mismatches = 0
    masked_at: int | None = None
    clock = time.perf_counter_ns
    try:
        t0 = clock()
        res = engine.step(ids, tok, none)
        step_ns.append(clock() - t0)
        for pos, token in enumerate([*tokens, state.stop]):
            allowed = _allowed(res.bitmask[0], token)
            if not allowed and masked_at is None:
                # Decoding cannot produce it: the mask decides, as in MaskBench.  The
                # matcher goes on, to tell a tokenization rule from a rejected text:
                # llguidance's mask keeps forced text to its own tokenization (`":"`
                # as one token where its parser also takes `":` then `"`).
                masked_at = pos
            tok[0, 0] = token
            t0 = clock()
            res = engine.step(ids, tok, one)
            elapsed = clock() - t0
            if res.errors[0] is not None:
                if masked_at is not None:
                    return _Forced(False, masked_at, mismatches, backend=backend)
                return _Forced(False, pos, mismatches + 1, backend=backend)  # the mask allowed what the matcher refuses
            if res.dropped[0] and masked_at is None:
                return _Forced(False, pos, mismatches, by_value_check=True, backend=backend)
            if pos < len(tokens) and masked_at is None:  # the stop token's step fills no mask
                step_ns.append(elapsed)
        if not bool(res.terminated[0]):
            raise RuntimeError(f"sequence {seq_id}: stop token accepted but the matcher is not terminated")
        if masked_at is not None:
            return _Forced(False, masked_at, mismatches, text_accepted=True, backend=backend)
        return _Forced(True, None, mismatches, backend=backend)
    finally:
        engine.end([seq_id])


def _context_at(state: _State, tokens: list[int], position: int) -> str:
    """Text just before the rejected token, and the token, for the report."""
    before = b"".join(state.vocab_bytes[t] for t in tokens[max(0, position - 12):position])
    token = state.vocab_bytes[tokens[position]] if position < len(tokens) else b"<stop>"
    return f"...{before.decode('utf-8', 'replace')[-40:]!s} | {token.decode('utf-8', 'replace')!r}"


def _warnings(text: str) -> list[str]:
    seen: list[str] = []
    for line in text.splitlines():
        line = clean_log_line(line)
        line = line.removeprefix("Warning: ")
        if line and line not in seen:
            seen.append(line)
    return seen[:5]


def run_schema(state: _State, path: str, ctx: WorkerContext) -> dict[str, Any]:
    """Run one MaskBench file: spec check, compile, force every test instance.

    Returns
    -------
    dict
        The per-schema record (see the module docstring); ``step_ns`` holds the
        per-token step times (popped by the parent).
    """
    from grammar_backend.errors import CompileError, CompileTimeout, ConstraintError
    from grammar_backend.fidelity import validate_output
    from grammar_backend.spec import parse_constraint

    name = os.path.basename(path)
    rec: dict[str, Any] = {"file": name, "subset": subset_of(name)}
    ctx.phase("load")
    try:
        case = json.loads(Path(path).read_text(encoding="utf-8"))
        schema = case["schema"]
        tests = case.get("tests") or []
        if not isinstance(tests, list) or not all(isinstance(t, dict) and isinstance(t.get("valid"), bool)
                                                  and "data" in t for t in tests):
            raise ValueError("tests must be a list of {valid: bool, data: ...}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        rec.update(status="bad_file", reason=first_line(err))
        return rec
    rec["n_valid"] = sum(1 for t in tests if t["valid"])
    rec["n_invalid"] = len(tests) - rec["n_valid"]

    ctx.phase("spec")
    try:
        spec = parse_constraint("json_schema", json.dumps(schema, ensure_ascii=False), state.options)
    except ConstraintError as err:
        rec.update(status="spec_rejected", reason=str(err))
        return rec

    ctx.phase("compile")
    ctx.new_stderr()
    t0 = time.perf_counter()
    try:
        rec["backend"] = _compile(state, spec)
    except (CompileError, CompileTimeout) as err:
        rec.update(status="compile_error", reason=str(err), compile_s=time.perf_counter() - t0)
        return rec
    rec["compile_s"] = time.perf_counter() - t0
    warnings = _warnings(ctx.new_stderr())
    if warnings:
        rec["warnings"] = warnings

    ctx.phase("force", compile_s=rec["compile_s"])
    step_ns: list[int] = []
    over: list[dict[str, Any]] = []
    under: list[dict[str, Any]] = []
    untokenizable: list[int] = []
    checked: list[int] = []  # invalid instances a value check rejected
    served: set[str] = set()  # the backends that served the instances
    mismatches = 0
    for index, test in enumerate(tests):
        text = compact_json(test["data"])
        tokens = state.bundle.hf.encode(text, add_special_tokens=False)
        if b"".join(state.vocab_bytes[t] for t in tokens) != text.encode("utf-8"):
            untokenizable.append(index)
            continue
        forced = _force(state, spec, tokens, step_ns)
        served.add(forced.backend)
        # backend auto replays the first complete output on xgrammar (grammar_service.auto_switch): waited
        # for here, so the next instance is served as a server's next request would be.
        state.engine.auto_switch.drain(600.0)  # the parent's phase limit ends it sooner
        mismatches += forced.mismatches
        if test["valid"] and not forced.accepted:
            position = len(tokens) if forced.position is None else forced.position
            over.append({"test": index, "token": position, "of": len(tokens),
                         "at": _context_at(state, tokens, position), "tokenization_only": forced.text_accepted,
                         "value_check": forced.by_value_check})
        elif not test["valid"] and forced.by_value_check:
            checked.append(index)
        elif not test["valid"] and forced.accepted:
            try:
                report = validate_output(schema, text)
            except ConstraintError as err:
                # The post-validator refuses this schema (e.g. a $ref it cannot
                # resolve where xgrammar could): recorded, and not "caught".
                under.append({"test": index, "caught": False, "violation": None, "validator_error": str(err)})
                continue
            under.append({"test": index, "caught": report.valid is False,
                          "violation": report.violations[0].message if report.violations else None})
    rec.update(
        status="compiled",
        valid_rejected=over,
        invalid_accepted=under,
        untokenizable=untokenizable,
        value_checked=checked,
        mask_mismatches=mismatches,
        tokens=len(step_ns),
        served_by=sorted(served),
        # The schema's own step cost (one row: accept + fill), what the backends' fill costs compare on.
        step_mean_us=round(float(np.mean(step_ns)) / 1e3, 2) if step_ns else None,
        step_ns=np.asarray(step_ns, dtype=np.int64),
    )
    rec["passed"] = not over and not under and not untokenizable and mismatches == 0
    rec["passed_or_caught"] = not over and not untokenizable and mismatches == 0 and all(u["caught"] for u in under)
    return rec


# ---------------------------------------------------------------------------
# Parent: run, aggregate, print, write JSON
# ---------------------------------------------------------------------------


def outcome_record(outcome: Outcome) -> dict[str, Any]:
    """The per-schema record of an outcome (failures become timeout / crash / error records)."""
    if outcome.kind == "done":
        rec = dict(outcome.record)
    else:
        name = os.path.basename(str(outcome.task))
        rec = {"file": name, "subset": subset_of(name), "status": outcome.kind, "phase": outcome.phase,
               "reason": outcome.detail}
        if "compile_s" in outcome.record:
            rec["compile_s"] = outcome.record["compile_s"]
    rec.setdefault("passed", False)
    rec["elapsed_s"] = round(outcome.elapsed_s, 4)
    return rec


_COLUMNS: Final = ("schemas", "spec_rejected", "compile_error", "timeout", "crash", "error", "bad_file",
                   "compiled", "passed", "over_schemas", "valid_rejected", "valid_total", "under_schemas",
                   "invalid_accepted", "caught", "validator_errors", "invalid_total", "untokenizable",
                   "mask_mismatches", "valid_rejected_tokenization", "valid_rejected_value_check", "value_checked",
                   "value_checked_schemas", "passed_or_caught")


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Counts per subset and in total (key ``TOTAL``)."""
    table: dict[str, dict[str, int]] = {}
    for rec in records:
        for key in (rec["subset"], "TOTAL"):
            row = table.setdefault(key, dict.fromkeys(_COLUMNS, 0))
            row["schemas"] += 1
            row[rec["status"]] += 1
            row["passed"] += int(bool(rec["passed"]))
            row["passed_or_caught"] += int(bool(rec.get("passed_or_caught")))
            row["valid_total"] += rec.get("n_valid", 0)
            row["invalid_total"] += rec.get("n_invalid", 0)
            over, under = rec.get("valid_rejected", []), rec.get("invalid_accepted", [])
            row["over_schemas"] += int(bool(over))
            row["valid_rejected"] += len(over)
            row["valid_rejected_tokenization"] += sum(1 for o in over if o.get("tokenization_only"))
            row["valid_rejected_value_check"] += sum(1 for o in over if o.get("value_check"))
            row["value_checked"] += len(rec.get("value_checked", []))
            row["value_checked_schemas"] += int(bool(rec.get("value_checked")))
            row["under_schemas"] += int(bool(under))
            row["invalid_accepted"] += len(under)
            row["caught"] += sum(1 for u in under if u["caught"])
            row["validator_errors"] += sum(1 for u in under if "validator_error" in u)
            row["untokenizable"] += len(rec.get("untokenizable", []))
            row["mask_mismatches"] += rec.get("mask_mismatches", 0)
    total = table.pop("TOTAL", dict.fromkeys(_COLUMNS, 0))
    ordered = dict(sorted(table.items()))
    ordered["TOTAL"] = total
    return ordered


def format_table(table: dict[str, dict[str, int]]) -> str:
    """The per-subset table as fixed-width text."""
    head = ("subset", "n", "spec-rej", "cerr", "tmo", "crash", "err", "pass", "pass%",
            "over(sch/inst/valid)", "under(sch/inst/caught/invalid)")
    rows = [head]
    for name, r in table.items():
        rows.append((
            name, str(r["schemas"]), str(r["spec_rejected"]), str(r["compile_error"]), str(r["timeout"]),
            str(r["crash"]), str(r["error"] + r["bad_file"]), str(r["passed"]),
            f"{100.0 * r['passed'] / r['schemas']:.1f}" if r["schemas"] else "-",
            f"{r['over_schemas']}/{r['valid_rejected']}/{r['valid_total']}",
            f"{r['under_schemas']}/{r['invalid_accepted']}/{r['caught']}/{r['invalid_total']}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)


def finite(value: float) -> float | None:
    """``value``, or None when it is NaN (JSON has no NaN)."""
    return None if math.isnan(value) else value


def fmt(value: float | None, spec: str = ".3f") -> str:
    """Format a figure; ``-`` for a missing one, ``>limit`` is the caller's business."""
    return "-" if value is None or math.isnan(value) else format(value, spec)


def timing_summary(records: Sequence[dict[str, Any]], step_ns: Mapping[str, np.ndarray], wall_s: float
                   ) -> dict[str, Any]:
    """Compile-time and per-token step-time percentiles, in all and per serving backend (None: no sample)."""

    def figures(recs: Sequence[dict[str, Any]], steps: np.ndarray) -> dict[str, Any]:
        compiles = [r["compile_s"] for r in recs if r["status"] == "compiled"]
        return {
            "compile_s": {"count": len(compiles), "p50": finite(percentile(compiles, 50)),
                          "p90": finite(percentile(compiles, 90)), "p99": finite(percentile(compiles, 99)),
                          "max": max(compiles, default=None), "sum": sum(compiles)},
            "step_us": {"tokens": int(steps.size), "p50": finite(percentile(steps, 50) / 1e3),
                        "p99": finite(percentile(steps, 99) / 1e3),
                        "max": float(steps.max()) / 1e3 if steps.size else None},
        }

    every = np.concatenate(list(step_ns.values())) if step_ns else np.zeros(0, dtype=np.int64)
    by_backend = {}
    for backend in sorted({r["backend"] for r in records if "backend" in r}):
        served = [r for r in records if r.get("backend") == backend]
        by_backend[backend] = {"schemas": len(served), "passed": sum(bool(r["passed"]) for r in served),
                               **figures(served, step_ns.get(backend, np.zeros(0, dtype=np.int64)))}
    return {"wall_s": round(wall_s, 1), **figures(records, every), "by_backend": by_backend}


def select_files(directory: Path, limit: int | None, seed: int) -> list[Path]:
    """The ``*.json`` files of ``directory``, sorted; a seeded sample of ``limit`` of them if given.

    Raises
    ------
    FileNotFoundError, ValueError
        No such folder, no JSON file in it, or a non-positive limit.
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"DIR {directory}: not a directory")
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ValueError(f"DIR {directory}: no *.json files")
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"--limit must be positive, got {limit}")
        if limit < len(files):
            files = sorted(random.Random(seed).sample(files, limit))
    return files


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def install_interrupt_handlers() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so a run stops its workers and keeps its partial results.

    SIGINT is re-armed explicitly: a shell starts background jobs with it ignored.
    """
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser, metavar="DIR")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                        help=f"local tokenizer folder or .gguf (default {DEFAULT_TOKENIZER.relative_to(REPO)})")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"model logits width (default: {DEFAULT_VOCAB_SIZE} for the default tokenizer, "
                             "else from the model config)")
    harness.add_phase_timeout(parser, 30.0)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--limit", type=int, default=None, help="a seeded random sample of N files")
    harness.add_seed(parser, 0, "--limit sample")
    harness.add_json(parser, "the full results")
    parser.add_argument("--strict", action=argparse.BooleanOptionalAction, default=False,
                        help="grammar option strict: close objects the schema leaves open (default: no)")
    parser.add_argument("--any-order", action=argparse.BooleanOptionalAction, default=False,
                        help="grammar option any_order: object keys in any order (default: no)")
    harness.add_backend(parser, "auto", "grammar option backend (auto: llguidance, xgrammar where llguidance "
                                        "refuses the schema)")
    parser.add_argument("--auto-timeout", type=float, default=10.0,
                        help="CPU seconds xgrammar gets per compile under auto, where it is the fallback "
                             "(default 10)")
    parser.add_argument("--value-checks", action=argparse.BooleanOptionalAction, default=True,
                        help="check each completed value against what the grammar leaves unenforced, as "
                             "decoding does (grammar_backend.values; default: yes)")
    harness.add_quiet(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 when a schema raised an unexpected exception (status ``error``)."""
    args = build_parser().parse_args(argv)
    if args.workers <= 0 or args.timeout <= 0:
        raise SystemExit("--workers and --timeout must be positive")
    vocab_size = args.vocab_size
    if vocab_size is None and args.tokenizer.resolve() == DEFAULT_TOKENIZER.resolve():
        vocab_size = DEFAULT_VOCAB_SIZE
    files = select_files(args.data, args.limit, args.seed)
    install_interrupt_handlers()
    options = {"strict": args.strict, "any_order": args.any_order, "whitespace": "compact", "backend": args.backend}
    config = RunConfig(str(args.tokenizer), vocab_size, options, args.timeout, args.auto_timeout, args.value_checks)

    print(f"maskbench: {len(files)} files from {args.data}, tokenizer {args.tokenizer} (vocab {vocab_size or 'auto'}), "
          f"options {options}, {args.workers} workers, {args.timeout:g} s per phase", flush=True)
    records: list[dict[str, Any]] = []
    steps: dict[str, list[np.ndarray]] = {}
    start = time.monotonic()
    interrupted = False
    with WorkerPool(args.workers, _init_worker, (config,), run_schema, args.timeout) as pool:
        try:
            for outcome in pool.run([str(f) for f in files]):
                rec = outcome_record(outcome)
                step_ns = rec.pop("step_ns", None)
                if step_ns is not None:
                    steps.setdefault(rec["backend"], []).append(step_ns)
                records.append(rec)
                if not args.quiet and (len(records) % 50 == 0 or outcome.kind in ("timeout", "crash", "error")):
                    elapsed = time.monotonic() - start
                    note = f" [{rec['file']}: {outcome.kind} in {outcome.phase}]" if outcome.kind != "done" else ""
                    print(f"  {len(records)}/{len(files)} in {elapsed:.0f} s, passed "
                          f"{sum(r['passed'] for r in records)}{note}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            interrupted = True
        respawns = pool.respawns
    wall = time.monotonic() - start
    records.sort(key=lambda r: r["file"])
    table = summarize(records)
    timings = timing_summary(records, {b: np.concatenate(s) for b, s in steps.items()}, wall)

    print()
    print(format_table(table))
    print("columns: cerr = compile error, tmo = timeout, err = harness error or bad file; over = valid instances "
          "rejected (schemas/instances/valid instances); under = invalid instances accepted "
          "(schemas/instances/caught by validate_output/invalid instances)")
    total = table["TOTAL"]
    c, s = timings["compile_s"], timings["step_us"]
    print(f"\ntotals: {total['passed']}/{total['schemas']} passed; compiled {total['compiled']}, spec rejected "
          f"{total['spec_rejected']}, compile errors {total['compile_error']}, timeouts {total['timeout']}, "
          f"crashes {total['crash']}, harness errors {total['error']}, untokenizable instances "
          f"{total['untokenizable']}, mask/accept mismatches {total['mask_mismatches']}, post-validator "
          f"refusals {total['validator_errors']}")
    print(f"valid instances rejected: {total['valid_rejected']} in {total['over_schemas']} schemas, of which "
          f"{total['valid_rejected_tokenization']} by the mask only (the matcher takes the text: a tokenization "
          f"rule), {total['valid_rejected_value_check']} by a value check")
    print(f"passed when post-validation counts (every valid instance accepted, every invalid one rejected while "
          f"decoding or flagged by post-validation): {total['passed_or_caught']}/{total['schemas']} "
          f"({100 * total['passed_or_caught'] / max(1, total['schemas']):.1f}%)")
    print(f"value checks {'on' if args.value_checks else 'off'}: {total['value_checked']} invalid instances "
          f"rejected at a value's end in {total['value_checked_schemas']} schemas")
    print(f"compile s ({c['count']} compiled schemas): p50 {fmt(c['p50'])}  p90 {fmt(c['p90'])}  "
          f"p99 {fmt(c['p99'])}  max {fmt(c['max'])}  sum {c['sum']:.0f}")
    print(f"per-token engine.step (accept + fill, one sequence) us over {s['tokens']} tokens: "
          f"p50 {fmt(s['p50'], '.1f')}  p99 {fmt(s['p99'], '.1f')}  max {fmt(s['max'], '.0f')}  "
          f"(with {args.workers} workers sharing the cores)")
    for backend, b in timings["by_backend"].items():
        bc, bs = b["compile_s"], b["step_us"]
        print(f"served by {backend}: {b['schemas']} schemas, {b['passed']} passed; compile s p50 {fmt(bc['p50'])} "
              f"p99 {fmt(bc['p99'])}; step us p50 {fmt(bs['p50'], '.1f')} p99 {fmt(bs['p99'], '.1f')}")
    switched = [r for r in records if len(r.get("served_by", ())) > 1]
    if switched:
        print(f"backend auto switched {len(switched)} schemas to xgrammar after their first complete output "
              f"(grammar_service.auto_switch), {sum(bool(r['passed']) for r in switched)} of them passed")
    print(f"wall {wall:.0f} s, worker respawns {respawns}{', INTERRUPTED' if interrupted else ''}")
    print(f"\nanchors (full MaskBench, {ANCHOR_TOTAL} schemas, Llama-3.1 tokenizer; this run is "
          f"{len(files)} of its files): " + ", ".join(f"{n} {p} ({100 * p / ANCHOR_TOTAL:.1f}%)"
                                                               for n, p in ANCHOR_PASSES))
    if args.json is not None:
        doc = {
            "config": {"dir": str(args.data), "files": len(files), "tokenizer": str(args.tokenizer),
                       "vocab_size": vocab_size, "options": options, "workers": args.workers,
                       "timeout_s": args.timeout, "auto_timeout_s": args.auto_timeout, "limit": args.limit,
                       "value_checks": args.value_checks,
                       "seed": args.seed},
            "interrupted": interrupted,
            "respawns": respawns,
            "anchors": {"total_schemas": ANCHOR_TOTAL, "passes": dict(ANCHOR_PASSES)},
            "totals": table["TOTAL"],
            "subsets": {k: v for k, v in table.items() if k != "TOTAL"},
            "timings": timings,
            "schemas": records,
        }
        harness.write_json(args.json, doc, allow_nan=False)
        print(f"wrote {args.json}")
    return 1 if total["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
