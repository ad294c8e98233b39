"""Compile cache: single-flight, byte bound, timeouts, negative entries; the on-disk store, its bound and failures.

The store's failure tests break real filesystems: a folder replaced by a file
or removed, a non-empty folder where a grammar file goes (these fail for root
too), and, where this process may mount (root with CAP_SYS_ADMIN, as in the
dev container), a tmpfs that is full or remounted read-only; elsewhere those
cases skip.  ``chmod`` cannot stop root, so the permission case skips as root.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xgrammar as xgr

from grammar_backend.compile import compile_spec
from grammar_backend.errors import CompileError, CompileTimeout, ConfigError
from grammar_backend.spec import parse_constraint
from grammar_service.cache import (
    STORE_MAX_BYTES,
    STORE_TMP_GRACE_S,
    CacheConfig,
    CompileCache,
    GrammarStore,
    StoreStats,
)
from tests.support.poll import HANG_S, wait_for
from tests.unit.conftest import TINY_STOP, load_schema, tiny_encode
from triton_support.params import from_parameters
from triton_support.service import GrammarModelConfig


@pytest.fixture()
def compiler(tiny_info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(tiny_info, cache_enabled=False)


def _key(n: int) -> str:
    return f"{n:064x}"


class Counter:
    """Counts real compiles of one spec; optionally blocks until released."""

    def __init__(self, compiler: xgr.GrammarCompiler, kind: str, payload: str, gate: threading.Event | None = None):
        self.spec = parse_constraint(kind, payload)
        self.compiler = compiler
        self.calls = 0
        self.gate = gate

    def __call__(self) -> xgr.CompiledGrammar:
        self.calls += 1
        if self.gate is not None and not self.gate.wait(HANG_S):
            raise TimeoutError("the compile's gate never opened")
        return compile_spec(self.compiler, self.spec)


def test_concurrent_requests_for_one_key_compile_once(tiny_info: xgr.TokenizerInfo,
                                                      compiler: xgr.GrammarCompiler) -> None:
    cache = CompileCache(CacheConfig(workers=2), tiny_info)
    gate = threading.Event()
    fn = Counter(compiler, "json_schema", json.dumps(load_schema("order")), gate)
    results: list[xgr.CompiledGrammar] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(_key(1), fn))) for _ in range(16)]
    for t in threads:
        t.start()
    # Every request has asked while the one compile is held: the first missed, the others joined it.
    wait_for(lambda: (cache.stats().misses, cache.stats().hits, cache.stats().in_flight) == (1, 15, 1), HANG_S,
             "all 16 requests joined the held compile", interval_s=0.01)
    gate.set()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads)
    assert fn.calls == 1
    assert len(results) == 16 and all(r is results[0] for r in results)
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.compiles, stats.entries, stats.in_flight) == (1, 15, 1, 1, 0)
    assert stats.bytes_in_use == results[0].memory_size_bytes > 0


def test_lru_is_bounded_in_bytes(tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler) -> None:
    one = compile_spec(compiler, parse_constraint("regex", "a{1,40}b"))
    size = one.memory_size_bytes
    cache = CompileCache(CacheConfig(max_bytes=int(size * 2.5)), tiny_info)
    fns = [Counter(compiler, "regex", "a{1,40}b") for _ in range(3)]
    for i, fn in enumerate(fns):
        cache.get(_key(i), fn)
    cache.get(_key(1), fns[1])  # key 1 becomes most recent; key 0 was evicted by key 2
    stats = cache.stats()
    assert (stats.entries, stats.evictions, stats.bytes_in_use) == (2, 1, 2 * size)
    cache.get(_key(0), fns[0])
    assert fns[0].calls == 2 and fns[1].calls == 1


def test_failures_are_cached_until_the_ttl(tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler) -> None:
    now = [100.0]
    cache = CompileCache(CacheConfig(negative_ttl_s=30), tiny_info, clock=lambda: now[0])
    fn = Counter(compiler, "regex", "a(")
    for _ in range(3):
        with pytest.raises(CompileError, match=r"^grammar: xgrammar cannot compile this regex: Regex parsing error"):
            cache.get(_key(7), fn)
    assert fn.calls == 1 and cache.stats().negative_hits == 2
    now[0] += 31
    with pytest.raises(CompileError):
        cache.get(_key(7), fn)
    assert fn.calls == 2


@pytest.mark.parametrize(("workers", "heavy_share"), [(1, 1), (2, 1), (3, 2)])
def test_heavy_compiles_leave_a_thread_to_small_ones(tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler,
                                                     workers: int, heavy_share: int) -> None:
    """Heavy compiles hold at most all but one thread; a small compile passes the heavy ones waiting."""
    cache = CompileCache(CacheConfig(workers=workers, max_queued=8), tiny_info)
    assert cache.heavy_workers == heavy_share
    gate = threading.Event()
    heavy = [Counter(compiler, "regex", f"h{n}[0-9]+", gate) for n in range(workers + 1)]
    futures = [cache.get_future(_key(100 + n), fn, heavy=True) for n, fn in enumerate(heavy)]
    wait_for(lambda: sum(fn.calls for fn in heavy) == heavy_share, HANG_S, "the heavy share started", interval_s=0.01)
    small = Counter(compiler, "regex", "[a-z]+")
    if workers == 1:  # nothing to leave: the small one waits its turn
        done = cache.get_future(_key(99), small)
        assert small.calls == 0
        gate.set()
        assert isinstance(done.result(HANG_S), xgr.CompiledGrammar)
    else:
        assert isinstance(cache.get_future(_key(99), small).result(HANG_S), xgr.CompiledGrammar)
        assert sum(fn.calls for fn in heavy) == heavy_share  # still held: the small one did not wait for them
        gate.set()
    for future in futures:
        assert isinstance(future.result(HANG_S), xgr.CompiledGrammar)
    assert [fn.calls for fn in heavy] == [1] * (workers + 1)
    assert cache.stats().in_flight == 0


def test_a_small_compile_does_not_wait_behind_heavy_ones_queued_first(tiny_info: xgr.TokenizerInfo,
                                                                      compiler: xgr.GrammarCompiler) -> None:
    """Small compiles queued behind heavy ones start as threads free up, oldest first among what may run."""
    cache = CompileCache(CacheConfig(workers=2, max_queued=8), tiny_info)
    gates = [threading.Event() for _ in range(3)]
    heavy = [Counter(compiler, "regex", f"q{n}[0-9]+", gates[n]) for n in range(3)]
    futures = [cache.get_future(_key(200 + n), fn, heavy=True) for n, fn in enumerate(heavy)]
    small_gate = threading.Event()
    first = Counter(compiler, "regex", "s1[a-z]+", small_gate)
    small = cache.get_future(_key(210), first)  # takes the free thread
    wait_for(lambda: first.calls == 1, HANG_S, "the small compile started", interval_s=0.01)
    second = Counter(compiler, "regex", "s2[a-z]+")
    late = cache.get_future(_key(211), second)  # queued behind two heavy ones
    small_gate.set()
    assert isinstance(late.result(HANG_S), xgr.CompiledGrammar)  # the freed thread went to it, not to a heavy one
    assert [fn.calls for fn in heavy] == [1, 0, 0]
    for gate in gates:
        gate.set()
    for future in (small, *futures):
        assert isinstance(future.result(HANG_S), xgr.CompiledGrammar)


def test_timeout_keeps_the_compile_in_flight_and_retries_join_it(
    tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler
) -> None:
    cache = CompileCache(CacheConfig(timeout_s=0.05), tiny_info)
    gate = threading.Event()
    fn = Counter(compiler, "regex", "[0-9]+", gate)
    with pytest.raises(CompileTimeout, match=r"^grammar: compile did not finish within 0.05 s \(it goes on; retry later\)$"):
        cache.get(_key(3), fn)
    with pytest.raises(CompileTimeout):
        cache.get(_key(3), fn)
    gate.set()
    compiled = cache.get(_key(3), fn, timeout_s=HANG_S)
    assert fn.calls == 1 and isinstance(compiled, xgr.CompiledGrammar)
    assert cache.stats().timeouts == 2


def test_store_round_trip_skips_the_compile(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                            compiler: xgr.GrammarCompiler) -> None:
    config = CacheConfig(store_dir=str(tmp_path / "store"))
    fn = Counter(compiler, "json_schema", json.dumps(load_schema("person")))
    CompileCache(config, tiny_info).get(_key(5), fn)
    second = CompileCache(config, tiny_info)
    compiled = second.get(_key(5), fn)
    assert fn.calls == 1 and second.stats().store.hits == 1 and second.stats().compiles == 0
    matcher = xgr.GrammarMatcher(compiled)
    for token in tiny_encode('{"name":"Ann","age":3}'):
        assert matcher.accept_token(token)
    assert matcher.accept_token(TINY_STOP) and matcher.is_terminated()


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [("corrupt", "corrupt"), ("foreign", "corrupt"), ("version", "stale"), ("truncated", "corrupt"),
     ("not_utf8", "corrupt")],
)
def test_store_rejects_files_it_did_not_write(
    tmp_path: Path, tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler, tamper: str, reason: str
) -> None:
    root = tmp_path / "store"
    fn = Counter(compiler, "regex", "x+")
    CompileCache(CacheConfig(store_dir=str(root)), tiny_info).get(_key(9), fn)
    path = root / f"{_key(9)}.json"
    doc = json.loads(path.read_text())
    if tamper == "corrupt":
        doc["body"] = doc["body"].replace("x", "y", 1)
    elif tamper == "foreign":
        doc = {"header": doc["header"], "mac": "0" * 64, "body": doc["body"]}
    elif tamper == "version":
        header = json.loads(doc["header"])
        header["xgrammar"] = "0.0.1"
        doc["header"] = json.dumps(header, sort_keys=True)
        # Signed with the store's secret: written by this store under another xgrammar.
        secret = (root / ".store-key").read_bytes()
        doc["mac"] = hmac.new(secret, f"{doc['header']}\n{doc['body']}".encode(), hashlib.sha256).hexdigest()
    if tamper == "not_utf8":
        path.write_bytes(b"\xff\xfe" + path.read_bytes())
    else:
        path.write_text(json.dumps(doc) if tamper != "truncated" else path.read_text()[:50])
    cache = CompileCache(CacheConfig(store_dir=str(root)), tiny_info)
    assert isinstance(cache.get(_key(9), fn), xgr.CompiledGrammar)
    stats = cache.stats()
    assert (fn.calls, stats.store.rejects, stats.store.hits, stats.compiles, stats.compile_failures) == (2, 1, 0, 1, 0)
    assert (stats.store.read_failures, stats.store.write_failures) == ({reason: 1}, {})
    # The recompiled grammar replaced the rejected file.
    assert GrammarStore(root, tiny_info).load(_key(9)) is not None


def test_store_secret_is_private(tmp_path: Path, tiny_info: xgr.TokenizerInfo) -> None:
    GrammarStore(tmp_path, tiny_info)
    assert (tmp_path / ".store-key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "kwargs", [{"max_bytes": 0}, {"workers": 0}, {"timeout_s": 0}, {"negative_ttl_s": -1}, {"max_negative": 0},
               {"store_max_bytes": 0}, {"store_max_bytes": -1}]
)
def test_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=r"^cache: "):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_on_each_thread_runs_once_per_thread_and_a_failure_does_not_hang(tiny_info: xgr.TokenizerInfo) -> None:
    cache = CompileCache(CacheConfig(workers=3), tiny_info)
    try:
        names: list[str] = []
        cache.on_each_thread(lambda: names.append(threading.current_thread().name))
        assert len(set(names)) == 3

        def fail() -> None:
            raise RuntimeError("worker did not start")

        with pytest.raises(RuntimeError, match=r"^worker did not start$"):
            cache.on_each_thread(fail)
    finally:
        cache.close()


def test_replicas_sharing_a_store_agree_on_its_secret(tmp_path: Path, tiny_info: xgr.TokenizerInfo) -> None:
    """Stores opened at once on one folder (replicas on a shared volume) read each other's grammars."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        stores = list(pool.map(lambda _: GrammarStore(tmp_path, tiny_info), range(8)))
    compiled = xgr.GrammarCompiler(tiny_info, max_threads=1).compile_regex("ab+")
    stores[0].save(_key(3), compiled)
    assert all(s.load(_key(3)) is not None for s in stores)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".store-key", f"{_key(3)}.json"]


def test_a_torn_store_secret_fails_loudly(tmp_path: Path, tiny_info: xgr.TokenizerInfo) -> None:
    (tmp_path / ".store-key").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"holds 0 bytes, not a 32-byte secret"):
        GrammarStore(tmp_path, tiny_info)


# ---------------------------------------------------------------- the store's failures
@pytest.fixture()
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mounts a tmpfs of ``size`` bytes (skips where this process may not mount); unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                             capture_output=True, text=True, check=False)
        if run.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {run.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def _read_only(point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)


def _fill(point: Path) -> None:
    """Write whole pages until the filesystem is full (ENOSPC)."""
    fd = os.open(point / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def _break_store(case: str, tmp_path: Path, tmpfs: Callable[[int], Path]) -> tuple[Path, Callable[[], None], str]:
    """A store folder, how to break it once a store is open on it, and the errno name a write then fails with."""
    if case == "folder_is_a_file":
        root = tmp_path / "store"

        def replace_with_a_file() -> None:
            shutil.rmtree(root)
            root.write_text("")

        return root, replace_with_a_file, "ENOTDIR"
    if case == "folder_removed":
        root = tmp_path / "store"
        return root, lambda: shutil.rmtree(root), "ENOENT"
    if case == "read_only_fs":
        point = tmpfs(1 << 20)
        return point, lambda: _read_only(point), "EROFS"
    if case == "full_fs":
        point = tmpfs(64 * 1024)
        return point, lambda: _fill(point), "ENOSPC"
    assert case == "no_permission"
    if os.geteuid() == 0:
        pytest.skip("root writes into a 0o555 folder (the other cases fail for root too)")
    root = tmp_path / "store"
    return root, lambda: root.chmod(0o555), "EACCES"


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in tiny_encode(text)) and matcher.accept_token(TINY_STOP)


@pytest.mark.parametrize("case", ["folder_is_a_file", "folder_removed", "read_only_fs", "full_fs", "no_permission"])
def test_a_failed_store_write_serves_the_compiled_grammar(
    tmp_path: Path, tmpfs: Callable[[int], Path], tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler,
    case: str,
) -> None:
    """The compile succeeded: the request gets its grammar, the failure is counted (and no temporary is left)."""
    root, breaks, reason = _break_store(case, tmp_path, tmpfs)
    cache = CompileCache(CacheConfig(store_dir=str(root)), tiny_info)
    before = sorted(p.name for p in root.iterdir())
    breaks()
    try:
        fn = Counter(compiler, "regex", "x+")
        compiled = cache.get(_key(1), fn)
        assert _accepts(compiled, "xxx")
        stats = cache.stats()
        assert (fn.calls, stats.compiles, stats.compile_failures, stats.entries) == (1, 1, 0, 1)
        # A file where the folder was fails the read too (a miss); a missing folder is a plain miss.
        reads = {"ENOTDIR": 1} if case == "folder_is_a_file" else {}
        assert stats.store == StoreStats(write_failures={"save": {reason: 1}}, read_failures=reads)
        assert cache.get(_key(1), fn) is compiled and cache.stats().hits == 1  # served from memory
        if root.is_dir():
            assert sorted(p.name for p in root.iterdir()) == sorted([*before, *(["filler"] if case == "full_fs" else [])])
    finally:
        if case == "no_permission":
            root.chmod(0o755)
        cache.close()


def test_a_read_only_store_still_serves_its_grammars(tmp_path: Path, tmpfs: Callable[[int], Path],
                                                     tiny_info: xgr.TokenizerInfo,
                                                     compiler: xgr.GrammarCompiler) -> None:
    """Hits load (marking them used fails, counted); a corrupt file cannot be removed (counted); both are served."""
    point = tmpfs(1 << 20)
    good, bad = Counter(compiler, "regex", "x+"), Counter(compiler, "regex", "y+")
    writer = CompileCache(CacheConfig(store_dir=str(point)), tiny_info)
    writer.get(_key(1), good)
    writer.get(_key(2), bad)
    (point / f"{_key(2)}.json").write_text("{}")
    _read_only(point)
    cache = CompileCache(CacheConfig(store_dir=str(point)), tiny_info)
    assert _accepts(cache.get(_key(1), good), "xx") and _accepts(cache.get(_key(2), bad), "yy")
    stats = cache.stats()
    assert (good.calls, bad.calls, stats.compiles, stats.compile_failures) == (1, 2, 1, 0)
    assert stats.store.hits == 1 and stats.store.rejects == 1
    assert stats.store.read_failures == {"corrupt": 1}
    assert stats.store.write_failures == {"touch": {"EROFS": 1}, "remove": {"EROFS": 1}, "save": {"EROFS": 1}}


def test_an_unreadable_store_file_is_a_miss(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                            compiler: xgr.GrammarCompiler) -> None:
    """A folder where the grammar file goes (fails for root too): the read and the write fail, the request does not."""
    root = tmp_path / "store"
    cache = CompileCache(CacheConfig(store_dir=str(root)), tiny_info)
    (root / f"{_key(4)}.json").mkdir()
    (root / f"{_key(4)}.json" / "x").write_text("")
    fn = Counter(compiler, "regex", "x+")
    assert _accepts(cache.get(_key(4), fn), "x")
    store = cache.stats().store
    assert (store.read_failures, store.write_failures) == ({"EISDIR": 1}, {"save": {"EISDIR": 1}})
    assert sorted(p.name for p in root.iterdir()) == [".store-key", f"{_key(4)}.json"]


def test_store_failures_log_once_a_minute_per_kind(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                                   compiler: xgr.GrammarCompiler,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    root = tmp_path / "store"
    cache = CompileCache(CacheConfig(store_dir=str(root)), tiny_info, clock=lambda: now[0])
    shutil.rmtree(root)
    root.write_text("")
    with caplog.at_level(logging.WARNING, logger="grammar_service.cache"):
        for i in range(5):
            cache.get(_key(i), Counter(compiler, "regex", f"a{{{i + 1}}}"))
        now[0] += 61
        cache.get(_key(5), Counter(compiler, "regex", "b+"))
    # Each kind (the read, the save) once, then once more after the minute with the count it held back.
    lines = [r.getMessage() for r in caplog.records]
    assert [(line.split(":")[1].split()[0], line.endswith(" (4 more since the last such warning)"))
            for line in lines] == [("cannot", False), ("save", False), ("cannot", True), ("save", True)], lines
    assert lines[0].startswith(f"grammar store: cannot read {_key(0)}.json: [Errno 20] Not a directory")
    assert lines[1].startswith(f"grammar store: save {_key(0)}.json failed: [Errno 20] Not a directory")
    assert lines[3].startswith(f"grammar store: save {_key(5)}.json failed: [Errno 20] Not a directory")
    store = cache.stats().store
    assert (store.write_failures, store.read_failures) == ({"save": {"ENOTDIR": 6}}, {"ENOTDIR": 6})


def test_a_store_that_cannot_open_fails_at_start_naming_the_folder(tmp_path: Path,
                                                                   tiny_info: xgr.TokenizerInfo) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^grammar store: cannot open .*/file/store: \[Errno 20\] Not a directory"):
        GrammarStore(tmp_path / "file" / "store", tiny_info)


# ---------------------------------------------------------------- the store's bound
@pytest.fixture()
def grammar(compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
    return compile_spec(compiler, parse_constraint("regex", "a{1,40}b"))


def _file_size(tmp_path: Path, info: xgr.TokenizerInfo, grammar: xgr.CompiledGrammar) -> int:
    """The length of one stored file of ``grammar`` (the same under every key: the header holds a fixed-size key)."""
    probe = GrammarStore(tmp_path / "probe", info)
    probe.save(_key(0), grammar)
    return (tmp_path / "probe" / f"{_key(0)}.json").stat().st_size


def _aged(root: Path, keys: list[int]) -> None:
    """Give the files of ``keys`` distinct mtimes long ago, in that order (oldest first)."""
    t0 = time.time() - 10_000
    for i, k in enumerate(keys):
        os.utime(root / f"{_key(k)}.json", (t0 + i, t0 + i))


def _stored(root: Path) -> list[int]:
    return sorted(int(p.stem, 16) for p in root.glob("*.json"))


def test_store_evicts_the_least_recently_used_to_nine_tenths(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                                             grammar: xgr.CompiledGrammar) -> None:
    size = _file_size(tmp_path, tiny_info, grammar)
    root = tmp_path / "store"
    store = GrammarStore(root, tiny_info, max_bytes=4 * size + size // 2)  # room for 4; evicts down to 4.05
    for k in range(4):
        assert store.save(_key(k), grammar)
    _aged(root, [0, 1, 2, 3])
    assert store.load(_key(0)) is not None  # a hit: now the most recently used
    assert store.save(_key(4), grammar)
    assert _stored(root) == [0, 2, 3, 4]
    assert store.stats() == StoreStats(hits=1, bytes=4 * size, files=4, evictions=1)
    assert store.save(_key(5), grammar)
    assert _stored(root) == [0, 3, 4, 5]
    assert store.load(_key(1)) is None  # evicted: a miss, not a failure
    assert store.stats() == StoreStats(hits=1, bytes=4 * size, files=4, evictions=2)


def test_an_eviction_frees_down_to_nine_tenths_of_the_bound(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                                            grammar: xgr.CompiledGrammar) -> None:
    size = _file_size(tmp_path, tiny_info, grammar)
    root = tmp_path / "store"
    store = GrammarStore(root, tiny_info, max_bytes=20 * size + size // 2)  # 90 %: 18.45 files
    for k in range(20):
        store.save(_key(k), grammar)
    _aged(root, list(range(20)))
    assert store.stats() == StoreStats(bytes=20 * size, files=20)
    store.save(_key(20), grammar)  # 21 files: the three oldest go
    assert _stored(root) == list(range(3, 21))
    assert store.stats() == StoreStats(bytes=18 * size, files=18, evictions=3)


def test_a_grammar_bigger_than_the_store_is_served_not_stored(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                                              grammar: xgr.CompiledGrammar) -> None:
    size = _file_size(tmp_path, tiny_info, grammar)
    root = tmp_path / "store"
    store = GrammarStore(root, tiny_info, max_bytes=size - 1)
    assert store.save(_key(1), grammar) is False
    assert store.stats() == StoreStats(write_failures={"save": {"too_big": 1}})
    assert sorted(p.name for p in root.iterdir()) == [".store-key"]


def test_replicas_sharing_a_bounded_store(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                          grammar: xgr.CompiledGrammar) -> None:
    """What another replica evicted is a miss; a replica's total follows the folder at its next rescan."""
    size = _file_size(tmp_path, tiny_info, grammar)
    root = tmp_path / "store"
    now = [0.0]
    a = GrammarStore(root, tiny_info, max_bytes=4 * size + size // 2, rescan_s=60, clock=lambda: now[0])
    for k in range(4):
        a.save(_key(k), grammar)
    _aged(root, [0, 1, 2, 3])
    b = GrammarStore(root, tiny_info, max_bytes=4 * size + size // 2, rescan_s=60, clock=lambda: now[0])
    assert b.stats().bytes == 4 * size  # counted at start
    b.save(_key(4), grammar)  # B evicts A's oldest
    assert _stored(root) == [1, 2, 3, 4]
    assert a.load(_key(0)) is None
    assert a.stats() == StoreStats(bytes=4 * size, files=4)  # A has not rescanned yet: it does not know
    now[0] += 60
    assert a.load(_key(1)) is not None  # a hit past the rescan interval re-reads the folder
    assert a.stats() == StoreStats(hits=1, bytes=4 * size, files=4)
    assert (a.stats().read_failures, b.stats().write_failures) == ({}, {})


def test_a_scan_removes_dead_writers_temporaries(tmp_path: Path, tiny_info: xgr.TokenizerInfo) -> None:
    tmp_path.joinpath(".tmp-dead").write_text("x" * 100)
    tmp_path.joinpath(".tmp-writing").write_text("x" * 100)
    old = time.time() - STORE_TMP_GRACE_S - 10
    os.utime(tmp_path / ".tmp-dead", (old, old))
    store = GrammarStore(tmp_path, tiny_info)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".store-key", ".tmp-writing"]
    assert store.stats() == StoreStats()


@pytest.mark.parametrize(("value", "expected"), [("", STORE_MAX_BYTES), ("1000000", 1_000_000)])
def test_store_max_bytes_parameter(value: str, expected: int) -> None:
    cfg = from_parameters(GrammarModelConfig, {"tokenizer": "/t", "store_max_bytes": value}, "grammar")
    assert cfg.engine_config().cache.store_max_bytes == expected


def test_store_max_bytes_parameter_range() -> None:
    cfg = from_parameters(GrammarModelConfig, {"tokenizer": "/t", "store_max_bytes": "0"}, "grammar")
    with pytest.raises(ConfigError, match=r"^cache: store_max_bytes must be positive, got 0$"):
        cfg.engine_config()
