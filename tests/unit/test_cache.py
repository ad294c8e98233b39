"""Compile cache: single-flight, byte bound, timeouts, negative entries, on-disk store."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import xgrammar as xgr

from grammar_backend.cache import CacheConfig, CompileCache, GrammarStore
from grammar_backend.compile import compile_spec
from grammar_backend.errors import CompileError, CompileTimeout, ConfigError
from grammar_backend.spec import parse_constraint
from tests.unit.conftest import TINY_STOP, load_schema, tiny_encode


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
        if self.gate is not None:
            self.gate.wait(10)
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
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join()
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
    compiled = cache.get(_key(3), fn, timeout_s=10)
    assert fn.calls == 1 and isinstance(compiled, xgr.CompiledGrammar)
    assert cache.stats().timeouts == 2


def test_store_round_trip_skips_the_compile(tmp_path: Path, tiny_info: xgr.TokenizerInfo,
                                            compiler: xgr.GrammarCompiler) -> None:
    config = CacheConfig(store_dir=str(tmp_path / "store"))
    fn = Counter(compiler, "json_schema", json.dumps(load_schema("person")))
    CompileCache(config, tiny_info).get(_key(5), fn)
    second = CompileCache(config, tiny_info)
    compiled = second.get(_key(5), fn)
    assert fn.calls == 1 and second.stats().store_hits == 1 and second.stats().compiles == 0
    matcher = xgr.GrammarMatcher(compiled)
    for token in tiny_encode('{"name":"Ann","age":3}'):
        assert matcher.accept_token(token)
    assert matcher.accept_token(TINY_STOP) and matcher.is_terminated()


@pytest.mark.parametrize(
    "tamper",
    ["corrupt", "foreign", "version", "truncated"],
)
def test_store_rejects_files_it_did_not_write(
    tmp_path: Path, tiny_info: xgr.TokenizerInfo, compiler: xgr.GrammarCompiler, tamper: str
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
    path.write_text(json.dumps(doc) if tamper != "truncated" else path.read_text()[:50])
    cache = CompileCache(CacheConfig(store_dir=str(root)), tiny_info)
    assert isinstance(cache.get(_key(9), fn), xgr.CompiledGrammar)
    stats = cache.stats()
    assert (fn.calls, stats.store_rejects, stats.store_hits, stats.compiles) == (2, 1, 0, 1)
    # The recompiled grammar replaced the rejected file.
    assert GrammarStore(root, tiny_info).load(_key(9)) is not None


def test_store_secret_is_private(tmp_path: Path, tiny_info: xgr.TokenizerInfo) -> None:
    GrammarStore(tmp_path, tiny_info)
    assert (tmp_path / ".store-key").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "kwargs", [{"max_bytes": 0}, {"workers": 0}, {"timeout_s": 0}, {"negative_ttl_s": -1}, {"max_negative": 0}]
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
