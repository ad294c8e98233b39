"""Compile cache: bounded in bytes, single-flight, bounded queue, off-thread with a timeout.

Shared by every sequence of a grammar model instance.  A compile runs on one
of ``workers`` compile threads, each of which hands it to its own worker
process (:mod:`grammar_service.workers`), so the decoding process keeps
running and a compile that breaks a limit is killed there.  N concurrent
requests for one key wait on one future.  At most ``workers + max_queued``
distinct keys are compiling or waiting; one more is refused at once with
:class:`CompileQueueFull` (RESOURCE_EXHAUSTED), so a storm of slow schemas
cannot queue up unbounded work.  A caller that waits past its timeout gets
:class:`CompileTimeout` while the compile goes on (up to the workers' own
limit): a retry joins it, and its result is cached when it finishes.

Failures (:class:`CompileError`, including compiles stopped by a worker
limit) are cached as negative entries for a short TTL, so a client retrying
a bad schema costs a dictionary lookup, not a compile.

With ``store_dir`` set, misses go to :class:`GrammarStore` first, an
on-disk store bounded in bytes (least recently used files evicted) whose
failures are counted and logged, never a failed request.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import xgrammar as xgr

from grammar_backend.compile import XGRAMMAR_VERSION
from grammar_backend.errors import (
    CompileError,
    CompileQueueFull,
    CompileTimeout,
    ConfigError,
)

log = logging.getLogger(__name__)

CompileFn = Callable[[], xgr.CompiledGrammar]

_STORE_FORMAT: Final = "grammar-store/1"
_KEY_FILE: Final = ".store-key"
#: Prefix of the store's temporary files (grammars being written, the secret being created).
_TMP_PREFIX: Final = ".tmp-"
_SECRET_BYTES: Final = 32

#: Default bound of the on-disk store in bytes (``store_max_bytes``, ``GRAMMAR_STORE_MAX_BYTES``): 2 GiB.
#: With the Qwen3 vocabulary a stored grammar is 12 KB (a small object schema)
#: to 1.7 MB (tests/fixtures/schemas/person.json), 0.2 MB for a short regex:
#: 2 GiB holds thousands.  deploy/k8s's claim is 5Gi, and the bound must stay
#: well under it: each replica sees the others' writes only at its rescans
#: (:data:`STORE_RESCAN_S`), so a shared folder can exceed the bound by what
#: they wrote in between; files are counted by length, not allocated blocks;
#: and the filesystem keeps its own overhead (ext4 reserves 5 %).
STORE_MAX_BYTES: Final = 2 * 1024**3
#: An eviction removes the least recently used files until the store is at this
#: fraction of its bound, so the next one is a tenth of the bound's writes away.
STORE_EVICT_TO: Final = 0.9
#: How often (seconds) a writing replica re-reads the folder's total instead of
#: trusting its running one (other replicas write and evict too).  A scan is a
#: ``scandir`` and a ``stat`` per file (7 ms for 1,000 files on local ext4, timed
#: alone: docs/benchmarks.md), and a network volume costs a round trip per
#: ``stat``: the running total keeps scans off nearly every write.
STORE_RESCAN_S: Final = 60.0
#: A temporary file older than this (seconds) is a dead writer's (a write takes
#: well under a second); scans remove it.  An hour tolerates clock skew between
#: a network volume's server and its clients.
STORE_TMP_GRACE_S: Final = 3600.0
#: A failing store operation logs one warning per (operation, reason) per this many seconds.
STORE_WARN_INTERVAL_S: Final = 60.0


def check_store_max_bytes(value: int) -> int:
    """The store bound ``value``, checked (positive); the one home of its range.

    Raises
    ------
    ConfigError
        ``value`` is not positive.
    """
    if value <= 0:
        raise ConfigError(f"cache: store_max_bytes must be positive, got {value}")
    return value


@dataclass(frozen=True)
class CacheConfig:
    """Compile-cache settings.

    Parameters
    ----------
    max_bytes : int
        Bound on the summed ``CompiledGrammar.memory_size_bytes`` of cached entries.
    workers : int
        Compile threads (each drives one worker process).
    max_queued : int
        Most distinct compiles waiting for a free worker.
    timeout_s : float
        How long a caller waits for a compile.
    negative_ttl_s : float
        How long a compile failure is remembered.
    max_negative : int
        Bound on remembered failures.
    store_dir : str or None
        Folder of the on-disk store of serialized compiled grammars (None: no store).
    store_max_bytes : int
        Bound on the bytes of the store's files (:class:`GrammarStore`; default
        :data:`STORE_MAX_BYTES`, range :func:`check_store_max_bytes`).
    """

    max_bytes: int = 512 * 1024 * 1024
    workers: int = 2
    max_queued: int = 8
    timeout_s: float = 20.0
    negative_ttl_s: float = 30.0
    max_negative: int = 1024
    store_dir: str | None = None
    store_max_bytes: int = STORE_MAX_BYTES

    def __post_init__(self) -> None:
        check_store_max_bytes(self.store_max_bytes)
        if self.max_bytes <= 0 or self.workers <= 0 or self.max_negative <= 0 or self.max_queued < 0:
            raise ConfigError("cache: max_bytes, workers and max_negative must be positive, max_queued >= 0")
        if self.timeout_s <= 0 or self.negative_ttl_s < 0:
            raise ConfigError("cache: timeout_s must be positive and negative_ttl_s non-negative")


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache counters."""

    hits: int
    misses: int
    negative_hits: int
    compiles: int
    compile_failures: int
    timeouts: int
    refused: int
    compile_seconds: float
    evictions: int
    entries: int
    bytes_in_use: int
    in_flight: int
    store: StoreStats  # all zeros without a store


class CompileCache:
    """Bytes-bounded LRU of compiled grammars with single-flight compiles.

    Parameters
    ----------
    config : CacheConfig
    tokenizer_info : xgrammar.TokenizerInfo
        Needed to deserialize grammars from the on-disk store.
    clock : callable
        Monotonic clock, injectable for tests of the negative TTL.
    """

    def __init__(
        self,
        config: CacheConfig,
        tokenizer_info: xgr.TokenizerInfo,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._negative: OrderedDict[str, tuple[float, CompileError]] = OrderedDict()
        self._in_flight: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="grammar-compile")
        # Compiles wait here, not in the pool's queue, so a small one can pass large ones
        # (:meth:`_dispatch_locked`); running counts what the pool's threads hold.
        self._waiting: deque[tuple[str, CompileFn, Future[xgr.CompiledGrammar], bool]] = deque()
        self._running = 0
        self._running_heavy = 0
        self._store = (GrammarStore(Path(config.store_dir), tokenizer_info, config.store_max_bytes, clock=clock)
                       if config.store_dir else None)
        self._counts = dict.fromkeys(
            ("hits", "misses", "negative_hits", "compiles", "compile_failures", "timeouts", "refused", "evictions"), 0
        )
        self._compile_seconds = 0.0

    # ------------------------------------------------------------------ API
    def get(self, key: str, compile_fn: CompileFn, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """Return the compiled grammar for ``key``, compiling it once if needed.

        Parameters
        ----------
        key : str
            The canonical cache key (:meth:`ConstraintSpec.cache_key`).
        compile_fn : callable
            Compiles the grammar; raises :class:`CompileError` on bad input.
        timeout_s : float, optional
            Overrides the configured timeout for this call.

        Raises
        ------
        CompileError
            The compile failed now or within the negative TTL.
        CompileTimeout
            The compile did not finish in time (it continues in the background).
        CompileQueueFull
            ``key`` is not compiling and the queue is full.
        """
        future = self.get_future(key, compile_fn)
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=limit)
        except FutureTimeout as err:
            raise self.timed_out(limit) from err

    def timed_out(self, limit_s: float) -> CompileTimeout:
        """Count a caller that stopped waiting after ``limit_s``, and return its error."""
        with self._lock:
            self._counts["timeouts"] += 1
        return CompileTimeout(f"grammar: compile did not finish within {limit_s:g} s (it goes on; retry later)")

    def get_future(self, key: str, compile_fn: CompileFn, heavy: bool = False) -> Future[xgr.CompiledGrammar]:
        """Non-blocking form of :meth:`get`: a future of the compiled grammar.

        ``heavy``: the constraint is large (over :data:`contract.HEAVY_CONSTRAINT_BYTES`,
        so its compile may take seconds or minutes).  Heavy compiles hold at
        most :attr:`heavy_workers` compile threads: with two or more, one is
        always left to small constraints, which pass the heavy ones waiting.

        Raises
        ------
        CompileQueueFull
            ``key`` is not compiling and the queue is full.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._counts["hits"] += 1
                return _done(entry)
            failed = self._negative.get(key)
            if failed is not None:
                if failed[0] > self._clock():
                    self._counts["negative_hits"] += 1
                    return _failed(failed[1])
                del self._negative[key]
            future = self._in_flight.get(key)
            if future is not None:
                self._counts["hits"] += 1
                return future
            if len(self._in_flight) >= self.config.workers + self.config.max_queued:
                self._counts["refused"] += 1
                raise CompileQueueFull(
                    f"grammar: {len(self._in_flight)} compiles are running or queued "
                    f"({self.config.workers} workers, queue of {self.config.max_queued}); retry later"
                )
            self._counts["misses"] += 1
            future = Future()
            self._in_flight[key] = future
            self._waiting.append((key, compile_fn, future, heavy))
            self._dispatch_locked()
        return future

    @property
    def heavy_workers(self) -> int:
        """Most compile threads heavy compiles may hold at once: all but one, at least one."""
        return max(1, self.config.workers - 1)

    def _dispatch_locked(self) -> None:
        """Start waiting compiles while threads are free, oldest first, each heavy one only within its share."""
        while self._waiting and self._running < self.config.workers:
            heavy_ok = self._running_heavy < self.heavy_workers
            job = next((j for j in self._waiting if heavy_ok or not j[3]), None)
            if job is None:
                return  # only heavy ones wait, and they hold their share: the free thread stays for a small one
            self._waiting.remove(job)
            self._running += 1
            self._running_heavy += job[3]
            self._pool.submit(self._run, *job)

    def _run(self, key: str, compile_fn: CompileFn, future: Future[xgr.CompiledGrammar], heavy: bool) -> None:
        try:
            self._produce(key, compile_fn, future)
        finally:
            with self._lock:
                self._running -= 1
                self._running_heavy -= heavy
                self._dispatch_locked()

    def in_flight(self) -> int:
        """Compiles running or queued now."""
        with self._lock:
            return len(self._in_flight)

    def stats(self) -> CacheStats:
        """Current counters."""
        with self._lock:
            return CacheStats(
                **self._counts,
                store=self._store.stats() if self._store else StoreStats(),
                compile_seconds=self._compile_seconds,
                entries=len(self._entries),
                bytes_in_use=self._bytes,
                in_flight=len(self._in_flight),
            )

    def on_each_thread(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once on each compile thread and wait (starting their worker processes).

        Each call blocks its thread until all have started, so every call gets a
        thread of its own.
        """
        barrier = threading.Barrier(self.config.workers)

        def run() -> None:
            try:
                fn()
            except BaseException:
                barrier.abort()  # the others stop waiting (BrokenBarrierError); this error is raised below
                raise
            barrier.wait()

        for future in [self._pool.submit(run) for _ in range(self.config.workers)]:
            future.result()

    def close(self) -> None:
        """Stop accepting compiles; running ones finish in the background, waiting ones never start."""
        with self._lock:
            self._waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ internals
    def _produce(self, key: str, compile_fn: CompileFn, future: Future[xgr.CompiledGrammar]) -> None:
        # The store's load and save never raise for I/O (GrammarStore counts and
        # logs their failures): a full or read-only volume costs a compile, never
        # a request whose compile succeeded.  The save runs after this try: what
        # it could raise is no compile failure.
        fresh = False
        try:
            compiled = self._store.load(key) if self._store else None
            if compiled is None:
                fresh = True
                start = time.perf_counter()
                try:
                    compiled = compile_fn()
                finally:
                    elapsed = time.perf_counter() - start
                    with self._lock:
                        self._compile_seconds += elapsed
                        self._counts["compiles"] += 1
        except CompileError as err:
            with self._lock:
                self._counts["compile_failures"] += 1
                del self._in_flight[key]
                self._negative[key] = (self._clock() + self.config.negative_ttl_s, err)
                while len(self._negative) > self.config.max_negative:
                    self._negative.popitem(last=False)
            future.set_exception(err)
            return
        except Exception as err:  # noqa: BLE001 - not cached, but must reach every waiter
            with self._lock:
                self._counts["compile_failures"] += 1
                del self._in_flight[key]
            future.set_exception(err)
            return
        if fresh and self._store:
            self._store.save(key, compiled)
        with self._lock:
            del self._in_flight[key]
            self._insert(key, compiled)
        future.set_result(compiled)

    def _insert(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.config.max_bytes:
            # Bigger than the whole budget: served to its waiters, never cached.
            self._counts["evictions"] += 1
            return
        self._entries[key] = compiled
        self._sizes[key] = size
        self._bytes += size
        while self._bytes > self.config.max_bytes:
            old, _ = self._entries.popitem(last=False)
            self._bytes -= self._sizes.pop(old)
            self._counts["evictions"] += 1


def _done(value: xgr.CompiledGrammar) -> Future[xgr.CompiledGrammar]:
    future: Future[xgr.CompiledGrammar] = Future()
    future.set_result(value)
    return future


def _failed(err: BaseException) -> Future[xgr.CompiledGrammar]:
    future: Future[xgr.CompiledGrammar] = Future()
    future.set_exception(err)
    return future


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the on-disk store's counters.

    Attributes
    ----------
    hits : int
        Loads that returned a grammar.
    rejects : int
        Files discarded because they failed a check (``read_failures`` ``corrupt`` and ``stale``).
    bytes : int
        Bytes of grammar files in the folder, as this replica last counted them.
    files : int
        Grammar files in the folder, likewise.
    evictions : int
        Files this replica removed to keep the store within its bound.
    write_failures : dict
        ``{operation: {reason: count}}``: operations ``save``, ``touch`` (marking a
        hit as recently used), ``remove`` (eviction, discarding a rejected file, a
        dead writer's temporary); reasons are errno names (``ENOSPC``, ``EROFS``,
        ``EACCES``, ...) or an exception's type name.
    read_failures : dict
        ``{reason: count}``: ``corrupt`` (not parseable, bad MAC), ``stale``
        (another store format or xgrammar serialization), or an errno name.
    """

    hits: int = 0
    rejects: int = 0
    bytes: int = 0
    files: int = 0
    evictions: int = 0
    write_failures: dict[str, dict[str, int]] = field(default_factory=dict)
    read_failures: dict[str, int] = field(default_factory=dict)


def _reason(err: BaseException) -> str:
    """A bounded label for ``err``: its errno name (``ENOSPC``), else its type's name."""
    if isinstance(err, OSError) and err.errno is not None:
        return errno.errorcode.get(err.errno, type(err).__name__)
    return type(err).__name__


class _Throttle:
    """Logs one warning per key per ``interval_s``, saying how many it held back since the last.

    A full or read-only volume fails every write: one line a minute per kind of
    failure, not one per request.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def warning(self, key: tuple[str, str], msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval_s`` ago."""
        with self._lock:
            now = self._clock()
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._held[key] = self._held.get(key, 0) + 1
                return
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            msg += " (%d more since the last such warning)"
            args = (*args, held)
        log.warning(msg, *args, exc_info=exc_info)


#: A grammar file's name: the key (a hex sha256 digest) and ``.json``.
_GRAMMAR_FILE: Final = re.compile(r"[0-9a-f]{64}\.json")


class GrammarStore:
    """On-disk store of serialized compiled grammars, keyed by the canonical key, bounded in bytes.

    Each file is ``<key>.json``: a header (format, key, xgrammar and
    serialization versions) and the ``CompiledGrammar.serialize_json`` text,
    authenticated with an HMAC-SHA256 under a random secret that the store
    creates once (mode 0600) in its folder.  Files are written atomically
    (temporary file, fsync, rename).  A file that fails any check, from a
    different xgrammar, corrupted or not written by this store, is removed
    and the grammar recompiled: loading never crashes the server.

    The store never fails a request: a write that fails (full or read-only
    volume, permissions, a vanished folder) and a read that fails are logged
    (once per kind a minute) and counted (:meth:`stats`), and the caller
    serves the grammar it compiled or compiles it.

    Bound: after a write that takes the folder past ``max_bytes``, the least
    recently used files go until it is at :data:`STORE_EVICT_TO` of it.  Use
    is the file's mtime: set by the write and by every load that returns the
    grammar (atime is no use: ``relatime`` updates it at most daily).  A
    running total avoids a folder scan per write; it is re-read at start, on
    eviction and at most every ``rescan_s`` on writes and hits.  Replicas may
    share the folder: all evict by the same mtime order, a file another
    replica removed is a miss when loaded and already freed when evicted, and
    two replicas evicting at once free a little more than needed.  Grammars
    served from the in-memory cache do not touch their file, so the store's
    order is that of loads and writes.

    Parameters
    ----------
    root : Path
        The store folder (created if missing).
    tokenizer_info : xgrammar.TokenizerInfo
        Deserialization checks the tokenizer metadata against it.
    max_bytes : int
        Bound on the bytes of grammar files (:func:`check_store_max_bytes`).
    rescan_s : float
        Longest time between re-reads of the folder's total while writing.
    clock : callable
        Monotonic clock (rescans and warning rate limits).

    Raises
    ------
    ConfigError
        The folder cannot be created or its secret read or created (at start,
        never per request), or ``max_bytes`` is not positive.
    """

    def __init__(self, root: Path, tokenizer_info: xgr.TokenizerInfo, max_bytes: int = STORE_MAX_BYTES, *,
                 rescan_s: float = STORE_RESCAN_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.max_bytes = check_store_max_bytes(max_bytes)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._secret = self._load_secret()
        except OSError as err:
            raise ConfigError(f"grammar store: cannot open {root}: {err}") from err
        self._info = tokenizer_info
        self._serialization = xgr.get_serialization_version()
        self._rescan_s = rescan_s
        self._clock = clock
        self._warn = _Throttle(STORE_WARN_INTERVAL_S, clock)
        self._lock = threading.Lock()  # the counters and the running total
        self._maintaining = threading.Lock()  # one rescan or eviction at a time
        self._hits = self._rejects = self._evictions = 0
        self._write_failures: dict[tuple[str, str], int] = {}
        self._read_failures: dict[str, int] = {}
        self._bytes = self._files = 0
        self._scanned_at = -math.inf
        self._maintain()

    def _load_secret(self) -> bytes:
        # Replicas may share the folder (a ReadWriteMany volume): the secret is
        # written whole to a temporary file and hard-linked into place, which
        # fails if another replica won the race, so no replica ever reads a
        # half-written secret (with O_CREAT|O_EXCL a reader could read it empty,
        # sign with b"" and delete every file the others wrote).
        path = self.root / _KEY_FILE
        if not path.exists():
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f"{_TMP_PREFIX}key-")  # mode 0600
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(secrets.token_bytes(_SECRET_BYTES))
                    fh.flush()
                    os.fsync(fh.fileno())
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass
            finally:
                os.unlink(tmp)
        secret = path.read_bytes()
        if len(secret) != _SECRET_BYTES:
            raise ConfigError(f"grammar store: {path} holds {len(secret)} bytes, not a {_SECRET_BYTES}-byte secret; "
                              "remove the folder's files to start a new store")
        return secret

    def _path(self, key: str) -> Path:
        name = f"{key}.json"
        if not _GRAMMAR_FILE.fullmatch(name):
            raise ValueError(f"store keys are hex sha256 digests, got {key!r}")
        return self.root / name

    def _mac(self, header: str, body: str) -> str:
        return hmac.new(self._secret, f"{header}\n{body}".encode(), hashlib.sha256).hexdigest()

    def _header(self, key: str) -> dict[str, str]:
        return {"format": _STORE_FORMAT, "key": key, "xgrammar": XGRAMMAR_VERSION, "serialization": self._serialization}

    # ------------------------------------------------------------------ API
    def stats(self) -> StoreStats:
        """Current counters."""
        with self._lock:
            failures: dict[str, dict[str, int]] = {}
            for (op, reason), n in self._write_failures.items():
                failures.setdefault(op, {})[reason] = n
            return StoreStats(hits=self._hits, rejects=self._rejects, bytes=self._bytes, files=self._files,
                              evictions=self._evictions, write_failures=failures,
                              read_failures=dict(self._read_failures))

    def save(self, key: str, compiled: xgr.CompiledGrammar) -> bool:
        """Write ``compiled`` under ``key`` atomically, then keep the store within its bound.

        Never raises: a failed write is logged (rate-limited) and counted in
        ``write_failures["save"]``; the caller serves ``compiled`` from memory.

        Returns
        -------
        bool
            Whether the file was written.
        """
        path = self._path(key)
        tmp: str | None = None
        try:
            # The temporary file first: a read-only, vanished or foreign-owned
            # folder fails here, before the grammar is serialized.
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=_TMP_PREFIX)
            with os.fdopen(fd, "wb") as fh:
                body = compiled.serialize_json()
                header = json.dumps(self._header(key), sort_keys=True)
                data = json.dumps({"header": header, "mac": self._mac(header, body), "body": body}).encode()
                if len(data) > self.max_bytes:
                    raise _TooBig(len(data))
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            tmp = None
        except _TooBig as err:
            # Bigger than the whole bound: never stored (as the in-memory cache never keeps one).
            with self._lock:
                self._write_failures[("save", "too_big")] = self._write_failures.get(("save", "too_big"), 0) + 1
            self._warn.warning(("save", "too_big"), "grammar store: not storing %s: %d bytes exceed the store's "
                               "bound of %d", path.name, err.size, self.max_bytes)
            return False
        except Exception as err:  # noqa: BLE001 - a store write never fails a request: logged and counted
            self._write_failed("save", path.name, err)
            return False
        finally:
            if tmp is not None:
                self._remove(Path(tmp).name)
        with self._lock:
            self._bytes += len(data)
            self._files += 1
        self._maybe_maintain()
        return True

    def load(self, key: str) -> xgr.CompiledGrammar | None:
        """The stored grammar for ``key``, or None when absent, unreadable or rejected.

        Never raises: a read that fails is a miss, logged (rate-limited) and
        counted in ``read_failures``; a rejected file is removed.
        """
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:  # never written, or removed by an eviction (here or on another replica)
            return None
        except OSError as err:  # e.g. ESTALE on a shared network volume: a miss, compiled again
            reason = _reason(err)
            self._count_read_failure(reason)
            self._warn.warning(("read", reason), "grammar store: cannot read %s: %s", path.name, err)
            return None
        reason, detail, compiled = "", "", None
        try:
            doc = json.loads(raw.decode("utf-8"))
            header, mac, body = doc["header"], doc["mac"], doc["body"]
            meta = json.loads(header)
            if not hmac.compare_digest(str(mac), self._mac(header, body)):
                reason, detail = "corrupt", "bad MAC (corrupted or not written by this store)"
            elif meta != self._header(key):
                reason, detail = "stale", f"header mismatch {meta}"
            else:
                compiled = xgr.CompiledGrammar.deserialize_json(body, self._info)
        except (ValueError, KeyError, TypeError, RuntimeError,
                xgr.DeserializeFormatError, xgr.DeserializeVersionError, xgr.InvalidJSONError) as err:
            reason, detail = "corrupt", f"{type(err).__name__}: {err}"
        if compiled is None:
            with self._lock:
                self._rejects += 1
            self._count_read_failure(reason)
            self._warn.warning(("read", reason), "grammar store: discarding %s: %s", path.name, detail)
            if self._remove(path.name):
                with self._lock:
                    self._bytes = max(0, self._bytes - len(raw))
                    self._files = max(0, self._files - 1)
            return None
        with self._lock:
            self._hits += 1
        try:
            os.utime(path)  # recently used: the last file an eviction removes
        except FileNotFoundError:
            pass  # evicted since it was read (another replica): served anyway, the next load is a miss
        except OSError as err:
            self._write_failed("touch", path.name, err)
        self._maybe_maintain()
        return compiled

    # ------------------------------------------------------------ internals
    def _count_read_failure(self, reason: str) -> None:
        with self._lock:
            self._read_failures[reason] = self._read_failures.get(reason, 0) + 1

    def _write_failed(self, op: str, name: str, err: BaseException) -> None:
        reason = _reason(err)
        with self._lock:
            self._write_failures[(op, reason)] = self._write_failures.get((op, reason), 0) + 1
        # An OSError is the volume's state (the message says it all); anything else is a bug: its traceback.
        self._warn.warning((op, reason), "grammar store: %s %s failed: %s", op, name, err,
                           exc_info=None if isinstance(err, OSError) else err)

    def _remove(self, name: str) -> bool:
        """Unlink ``name`` from the folder; False when it was already gone or the unlink failed (counted)."""
        try:
            (self.root / name).unlink()
        except FileNotFoundError:
            return False  # another replica removed it first
        except OSError as err:
            self._write_failed("remove", name, err)
            return False
        return True

    def _maybe_maintain(self) -> None:
        with self._lock:
            due = self._bytes > self.max_bytes or self._clock() - self._scanned_at >= self._rescan_s
        if due:
            self._maintain()

    def _scan(self) -> list[tuple[int, str, int]] | None:
        """The grammar files as ``(mtime_ns, name, size)``; removes dead writers' temporaries.

        None when the folder cannot be listed (counted as a read failure).
        """
        files: list[tuple[int, str, int]] = []
        stale_before = time.time_ns() - int(STORE_TMP_GRACE_S * 1e9)
        try:
            with os.scandir(self.root) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed since it was listed (renamed, evicted by another replica)
                    if _GRAMMAR_FILE.fullmatch(entry.name):
                        files.append((st.st_mtime_ns, entry.name, st.st_size))
                    elif entry.name.startswith(_TMP_PREFIX) and st.st_mtime_ns < stale_before:
                        self._remove(entry.name)
        except OSError as err:
            reason = _reason(err)
            self._count_read_failure(reason)
            self._warn.warning(("scan", reason), "grammar store: cannot list %s: %s", self.root, err)
            return None
        return files

    def _maintain(self) -> None:
        """Re-read the folder's total; over the bound, remove the least recently used files."""
        if not self._maintaining.acquire(blocking=False):
            return  # another thread is at it
        try:
            files = self._scan()
            if files is None:
                with self._lock:
                    self._scanned_at = self._clock()  # not again at every write while the folder is unreadable
                return
            total = sum(size for _, _, size in files)
            count = len(files)
            evicted = 0
            if total > self.max_bytes:
                target = int(self.max_bytes * STORE_EVICT_TO)
                files.sort()  # oldest use first; ties (coarse mtimes) by name, the same order on every replica
                for _, name, size in files:
                    if total <= target:
                        break
                    if self._remove(name):
                        evicted += 1
                    elif (self.root / name).exists():
                        break  # it cannot be removed (counted): the others will not be either
                    total -= size
                    count -= 1
            with self._lock:
                self._bytes, self._files = total, count
                self._evictions += evicted
                self._scanned_at = self._clock()
        finally:
            self._maintaining.release()


class _TooBig(Exception):
    """A serialized grammar larger than the store's whole bound (internal to :meth:`GrammarStore.save`)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size
