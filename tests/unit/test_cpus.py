"""grammar_service.cpus: the CPUs the grammar model may use, and GRAMMAR_FILL_THREADS=0's choice from them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grammar_service.cpus import MAX_AUTO_FILL_THREADS, auto_fill_threads, usable_cpus
from grammar_service.engine import GrammarEngineConfig
from triton_support.service import GrammarModelConfig

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        (None, AFFINITY),  # no cgroup v2 file: the affinity mask
        ("max 100000\n", AFFINITY),  # no quota
        ("100000 100000\n", 1),
        ("150000 100000\n", min(AFFINITY, 2)),  # 1.5 CPUs of quota: two threads can run, throttled
        ("50000 100000\n", 1),  # under one CPU: still one thread
        ("6400000 100000\n", AFFINITY),  # a quota above the affinity mask: the mask bounds
        ("garbage\n", AFFINITY),
    ],
)
def test_usable_cpus(tmp_path: Path, cpu_max: str | None, expected: int) -> None:
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert usable_cpus(path, tmp_path / "no-v1") == expected


@pytest.mark.parametrize(
    ("quota", "period", "expected"),
    [
        ("-1", "100000", AFFINITY),  # cgroup v1 without a quota
        ("100000", "100000", 1),
        ("250000", "100000", min(AFFINITY, 3)),
        ("6400000", "100000", AFFINITY),
    ],
)
def test_usable_cpus_on_cgroup_v1(tmp_path: Path, quota: str, period: str, expected: int) -> None:
    """A node still on cgroup v1 (no cpu.max): the CFS quota over its period."""
    (tmp_path / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu.cfs_period_us").write_text(period + "\n")
    assert usable_cpus(tmp_path / "absent-cpu.max", tmp_path) == expected


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (16, 8), (64, 8)])
def test_auto_fill_threads_takes_half_the_cpus_up_to_the_cap(cpus: int, threads: int) -> None:
    assert auto_fill_threads(cpus) == threads
    assert 1 <= threads <= MAX_AUTO_FILL_THREADS


@pytest.mark.parametrize(("fill_threads", "expected"), [(0, auto_fill_threads(usable_cpus())), (1, 1), (3, 3)])
def test_the_grammar_models_fill_threads(fill_threads: int, expected: int) -> None:
    config = GrammarModelConfig(tokenizer="unused", fill_threads=fill_threads)
    assert config.engine_config().fill_threads == expected


@pytest.mark.parametrize("fill_threads", [1, 2, 8])
@pytest.mark.parametrize("cpus", [1, 2, 16])
def test_the_fill_is_pipelined_only_beside_a_free_cpu(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                     fill_threads: int) -> None:
    monkeypatch.setattr("triton_support.service.usable_cpus", lambda: cpus)
    config = GrammarModelConfig(tokenizer="unused", fill_threads=fill_threads).engine_config()
    assert config.pipeline_rows == (GrammarEngineConfig.pipeline_rows if fill_threads < cpus else 0)
    assert GrammarEngineConfig.pipeline_rows > 0
