"""Compile worker processes: results, limits, crashes, restarts, and no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import xgrammar as xgr

from grammar_backend.errors import CompileError, ConfigError, GrammarError
from grammar_backend.spec import ConstraintSpec, SpecLimits, parse_constraint
from grammar_service.child import worker_python
from grammar_service.workers import (
    CompileWorkers,
    WorkerConfig,
    WorkerStats,
)
from tests.support.poll import HANG_S, poll
from tests.support.procs import alive
from tests.unit.conftest import (
    REPO,
    TINY_STOP,
    TINY_VOCAB,
    TINY_VOCAB_SIZE,
    tiny_encode,
)

MIB = 1024 * 1024


def _enum(n: int) -> ConstraintSpec:
    # With xgrammar's compiler cache on (as in the workers), a 10k-item enum
    # takes about 5.5 s with the tiny vocabulary; 2k items compile to 0.44 MB.
    return parse_constraint("json_schema", json.dumps({"enum": [f"value-{i}" for i in range(n)]}))


def _huge_key() -> ConstraintSpec:
    # A 1 MB property name overflows xgrammar's recursive trie builder: the
    # input that killed the grammar stub before compiles moved to workers.
    key = "k" * 1_000_000
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    return parse_constraint(
        "json_schema", json.dumps(schema), limits=SpecLimits(max_key_chars=2_000_000, max_string_chars=2_000_000)
    )


def _stats(**counts: int) -> WorkerStats:
    return WorkerStats(**{**dict.fromkeys(WorkerStats.__dataclass_fields__, 0), **counts})


@pytest.fixture
def make_workers(tiny_info: xgr.TokenizerInfo) -> Iterator[Callable[..., CompileWorkers]]:
    made: list[CompileWorkers] = []

    def make(**config: object) -> CompileWorkers:
        workers = CompileWorkers(tiny_info, WorkerConfig(**config))  # type: ignore[arg-type]
        made.append(workers)
        return workers

    yield make  # type: ignore[misc]
    for workers in made:
        workers.close()


def test_a_compiled_grammar_comes_back_usable(make_workers: Callable[..., CompileWorkers]) -> None:
    workers = make_workers()
    spec = parse_constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}))
    compiled = workers.compile(spec)
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in tiny_encode('{"a":12}'))
    assert matcher.accept_token(TINY_STOP)
    assert matcher.is_terminated()
    assert not xgr.GrammarMatcher(compiled).accept_token(tiny_encode("[")[0])
    assert workers.stats() == _stats(started=1)


@pytest.mark.parametrize(
    ("spec", "config", "message", "counter"),
    [
        (parse_constraint("regex", "a("), {}, r"^grammar: xgrammar cannot compile this regex: Regex parsing error", None),
        # On a loaded machine (nice 19) the wall limit, twice the CPU limit, may come first.
        (_enum(10_000), {"cpu_s": 1.0},
         (r"^grammar: compiling this json_schema (used more than 1 s of CPU \(the compile limit\)|ran past 2 s "
         r"\(the compile time limit\)) and was stopped$"),
         "cpu_kills"),
        (_enum(10_000), {"memory_bytes": 32 * MIB},
         r"^grammar: compiling this json_schema needed more than 32 MiB \(the compile memory limit\)$",
         "memory_refusals"),
        (_enum(2_000), {"max_grammar_bytes": MIB // 4},
         r"^grammar: this json_schema compiles to 0\.4 MiB, over the 0\.25 MiB limit on a compiled grammar$",
         "size_refusals"),
        (_huge_key(), {}, r"^grammar: the compiler crashed on this json_schema \(signal SIGSEGV\); it is refused$",
         "crashes"),
    ],
    ids=["rejected", "cpu-limit", "memory-limit", "size-limit", "crash"],
)
def test_refusals_name_the_limit_and_the_next_compile_works(
    make_workers: Callable[..., CompileWorkers], spec: ConstraintSpec, config: dict[str, object], message: str,
    counter: str | None,
) -> None:
    workers = make_workers(**config)
    with pytest.raises(CompileError, match=message) as caught:
        workers.compile(spec)
    assert caught.value.status == "INVALID_ARGUMENT"
    workers.compile(parse_constraint("regex", "[0-9]+"))
    killed = counter in ("cpu_kills", "memory_refusals", "crashes")
    expected = {"started": 2 if killed else 1}
    if counter is not None:
        expected[counter] = 1
    stats = workers.stats()
    if counter == "cpu_kills" and stats.wall_kills:
        expected = {"started": 2, "wall_kills": 1}
    assert stats == _stats(**expected)


def test_a_stalled_worker_is_killed_at_twice_the_cpu_limit(make_workers: Callable[..., CompileWorkers]) -> None:
    workers = make_workers(cpu_s=0.5)
    workers.compile(parse_constraint("regex", "x"))  # starts this thread's worker
    (pid,) = [w.pid for w in workers._live]
    # Stopped before the compile is sent (a request this small fits in its pipe): a stopped process uses no
    # CPU, so only the wall limit can end it, whenever the compile would have reached its CPU limit.
    os.kill(pid, signal.SIGSTOP)
    with pytest.raises(CompileError, match=r"^grammar: compiling this regex ran past 1 s \(the compile time limit\)"):
        workers.compile(parse_constraint("regex", "[0-9]{1,9}z"))
    workers.compile(parse_constraint("regex", "y"))
    assert workers.stats() == _stats(started=2, wall_kills=1)


def test_close_stops_the_workers_and_refuses_compiles(make_workers: Callable[..., CompileWorkers]) -> None:
    workers = make_workers()
    workers.compile(parse_constraint("regex", "x"))
    (worker,) = workers._live
    workers.close()
    assert worker.returncode is not None
    with pytest.raises(GrammarError, match=r"^grammar: the compile workers are closed$"):
        workers.compile(parse_constraint("regex", "y"))


_ORPHAN_CHILD = f"""
import sys, xgrammar as xgr
sys.path.insert(0, {str(REPO)!r})
from grammar_backend.spec import parse_constraint
from grammar_service.workers import CompileWorkers, WorkerConfig
info = xgr.TokenizerInfo({TINY_VOCAB!r}, vocab_size={TINY_VOCAB_SIZE}, stop_token_ids=[{TINY_STOP}])
workers = CompileWorkers(info, WorkerConfig())
workers.compile(parse_constraint("regex", "x"))
print([w.pid for w in workers._live][0], flush=True)
sys.stdin.read()
"""


def test_a_worker_dies_with_its_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)  # no cleanup runs in the parent, as when a stub is killed
    parent.wait(timeout=HANG_S)
    assert not poll(lambda: alive(pid), lambda running: not running, HANG_S, interval_s=0.05)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"cpu_s": 0}, r"^workers: cpu_s must be positive, got 0$"),
        ({"memory_bytes": 0}, r"^workers: memory_bytes, max_grammar_bytes, compile_threads and xgrammar_cache_bytes"),
        ({"max_grammar_bytes": -1}, r"^workers: memory_bytes, max_grammar_bytes"),
    ],
)
def test_config_is_checked(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig(**config)  # type: ignore[arg-type]


def test_the_worker_interpreter_is_this_python() -> None:
    assert worker_python() == sys.executable
