"""Compile cache: bounded in bytes, single-flight, bounded queue, off-thread with a timeout.

Shared by every sequence of a grammar model instance.  A compile runs on one
of ``workers`` compile threads, each of which hands it to its own worker
process (:mod:`grammar_backend.workers`), so the decoding process keeps
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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
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
    """

    max_bytes: int = 512 * 1024 * 1024
    workers: int = 2
    max_queued: int = 8
    timeout_s: float = 20.0
    negative_ttl_s: float = 30.0
    max_negative: int = 1024
    store_dir: str | None = None

    def __post_init__(self) -> None:
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
    store_hits: int
    store_rejects: int
    compiles: int
    compile_failures: int
    timeouts: int
    refused: int
    compile_seconds: float
    evictions: int
    entries: int
    bytes_in_use: int
    in_flight: int


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
        self._store = GrammarStore(Path(config.store_dir), tokenizer_info) if config.store_dir else None
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

    def get_future(self, key: str, compile_fn: CompileFn) -> Future[xgr.CompiledGrammar]:
        """Non-blocking form of :meth:`get`: a future of the compiled grammar.

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
        self._pool.submit(self._produce, key, compile_fn, future)
        return future

    def stats(self) -> CacheStats:
        """Current counters."""
        with self._lock:
            return CacheStats(
                **self._counts,
                store_hits=self._store.hits if self._store else 0,
                store_rejects=self._store.rejects if self._store else 0,
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
        """Stop accepting compiles; running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ internals
    def _produce(self, key: str, compile_fn: CompileFn, future: Future[xgr.CompiledGrammar]) -> None:
        try:
            compiled = self._store.load(key) if self._store else None
            if compiled is None:
                start = time.perf_counter()
                try:
                    compiled = compile_fn()
                finally:
                    elapsed = time.perf_counter() - start
                    with self._lock:
                        self._compile_seconds += elapsed
                        self._counts["compiles"] += 1
                if self._store:
                    self._store.save(key, compiled)
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


_STORE_FORMAT: Final = "grammar-store/1"
_KEY_FILE: Final = ".store-key"
_SECRET_BYTES: Final = 32


class GrammarStore:
    """On-disk store of serialized compiled grammars, keyed by the canonical key.

    Each file is ``<key>.json``: a header (format, key, xgrammar and
    serialization versions) and the ``CompiledGrammar.serialize_json`` text,
    authenticated with an HMAC-SHA256 under a random secret that the store
    creates once (mode 0600) in its folder.  Files are written atomically
    (temporary file, fsync, rename).  A file that fails any check, from a
    different xgrammar, corrupted or not written by this store, is removed
    and the grammar recompiled: loading never crashes the server.

    Parameters
    ----------
    root : Path
        The store folder (created if missing).
    tokenizer_info : xgrammar.TokenizerInfo
        Deserialization checks the tokenizer metadata against it.
    """

    def __init__(self, root: Path, tokenizer_info: xgr.TokenizerInfo) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._info = tokenizer_info
        self._secret = self._load_secret()
        self._serialization = xgr.get_serialization_version()
        self.hits = 0
        self.rejects = 0

    def _load_secret(self) -> bytes:
        # Replicas may share the folder (a ReadWriteMany volume): the secret is
        # written whole to a temporary file and hard-linked into place, which
        # fails if another replica won the race, so no replica ever reads a
        # half-written secret (with O_CREAT|O_EXCL a reader could read it empty,
        # sign with b"" and delete every file the others wrote).
        path = self.root / _KEY_FILE
        if not path.exists():
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-key-")  # mode 0600
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
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"store keys are hex sha256 digests, got {key!r}")
        return self.root / f"{key}.json"

    def _mac(self, header: str, body: str) -> str:
        return hmac.new(self._secret, f"{header}\n{body}".encode(), hashlib.sha256).hexdigest()

    def save(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        """Write ``compiled`` under ``key`` atomically."""
        body = compiled.serialize_json()
        header = json.dumps(
            {"format": _STORE_FORMAT, "key": key, "xgrammar": XGRAMMAR_VERSION,
             "serialization": self._serialization},
            sort_keys=True,
        )
        text = json.dumps({"header": header, "mac": self._mac(header, body), "body": body})
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, key: str) -> xgr.CompiledGrammar | None:
        """The stored grammar for ``key``, or None when absent or rejected."""
        path = self._path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as err:  # e.g. ESTALE on a shared network volume: a miss, compiled again
            log.warning("grammar store: cannot read %s: %s", path.name, err)
            return None
        reason = None
        compiled = None
        try:
            doc = json.loads(text)
            header, mac, body = doc["header"], doc["mac"], doc["body"]
            meta = json.loads(header)
            if not hmac.compare_digest(str(mac), self._mac(header, body)):
                reason = "bad MAC (corrupted or not written by this store)"
            elif meta != {"format": _STORE_FORMAT, "key": key, "xgrammar": XGRAMMAR_VERSION,
                          "serialization": self._serialization}:
                reason = f"header mismatch {meta}"
            else:
                compiled = xgr.CompiledGrammar.deserialize_json(body, self._info)
        except (ValueError, KeyError, TypeError, RuntimeError,
                xgr.DeserializeFormatError, xgr.DeserializeVersionError, xgr.InvalidJSONError) as err:
            reason = f"{type(err).__name__}: {err}"
        if compiled is None:
            self.rejects += 1
            log.warning("grammar store: discarding %s: %s", path.name, reason)
            path.unlink(missing_ok=True)
            return None
        self.hits += 1
        return compiled
