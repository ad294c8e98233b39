"""Unit tests of deploy.render (model repository templating)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.render import (
    RenderError,
    load_values,
    main,
    parse_assignments,
    pbtxt_escape,
    render_repository,
    render_template,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def tree(root: Path) -> dict[str, str]:
    """Every file under root (relative posix path -> text)."""
    return {
        p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    write(
        root / "llm" / "config.pbtxt.in",
        'name: "llm"\nparameters { key: "model_dir" value { string_value: "${MODEL_DIR}" } }\n'
        'parameters { key: "engine" value { string_value: "${ENGINE}" } }\n',
    )
    write(root / "llm" / "1" / "model.py", "# llm adapter\n")
    write(root / "grammar" / "config.pbtxt", 'name: "grammar"\nmax_batch_size: 0\n')
    write(root / "grammar" / "1" / "model.py", "# grammar adapter\n")
    (root / "ensemble" / "1").mkdir(parents=True)
    write(root / "ensemble" / "config.pbtxt.in", 'name: "ensemble"  # cost: $$0\n')
    write(root / "llm" / "1" / "__pycache__" / "model.cpython-311.pyc", "debris")
    return root


# ------------------------------------------------------------ render_template
@pytest.mark.parametrize(
    ("template", "values", "expected", "used"),
    [
        ("a ${X} b", {"X": "1"}, "a 1 b", {"X"}),
        ("${X}${X}${Y_2}", {"X": "a", "Y_2": "b"}, "aab", {"X", "Y_2"}),
        ("price $$5 ${X}", {"X": "x"}, "price $5 x", {"X"}),
        ("$${X}", {}, "${X}", set()),
        ("no placeholders", {}, "no placeholders", set()),
        ("${X}", {"X": ""}, "", {"X"}),
        ("${X}", {"X": "${Y}"}, "${Y}", {"X"}),  # values are not re-expanded
    ],
)
def test_render_template_substitutes(template: str, values: dict[str, str], expected: str, used: set[str]) -> None:
    assert render_template(template, values, origin="t") == (expected, frozenset(used))


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("a ${X} ${Y} ${X}", r"^m/config\.pbtxt\.in: unfilled placeholder\(s\) \$\{X\}, \$\{Y\}$"),
        ("line1\nvalue: $X", r"^m/config\.pbtxt\.in:2: stray '\$' in '\$X'"),
        ("${1X}", r"^m/config\.pbtxt\.in:1: stray '\$'"),
        ("${X", r"^m/config\.pbtxt\.in:1: stray '\$' in '\$\{X'"),
        ("end $", r"^m/config\.pbtxt\.in:1: stray '\$' in '\$'"),
    ],
)
def test_render_template_rejects(template: str, match: str) -> None:
    with pytest.raises(RenderError, match=match):
        render_template(template, {}, origin="m/config.pbtxt.in")


@pytest.mark.parametrize(
    ("value", "escaped"),
    [
        ("/models/qwen3-8b", "/models/qwen3-8b"),
        ('{"decoding_type": "NGram"}', '{\\"decoding_type\\": \\"NGram\\"}'),
        ("C:\\models\\a'b", "C:\\\\models\\\\a\\'b"),
        ("line\nnext\ttab\x7f", "line\\012next\\011tab\\177"),
        ("<think>é", "<think>é"),
    ],
)
def test_pbtxt_escape_table(value: str, escaped: str) -> None:
    assert pbtxt_escape(value) == escaped


@pytest.mark.parametrize("value", ['{"decoding_type": "Eagle", "speculative_model_dir": "/m/eagle3", "max_draft_len": 3}',
                                   "a\\b\\\"c'd", "two\nlines\r\x00end", "plain", "", "ünïcode ✓"])
def test_rendered_string_parses_back_to_the_value(value: str) -> None:
    """Triton's own ModelConfig proto, parsed by protobuf's TextFormat as tritonserver does, holds the value as given."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text, _ = render_template('name: "m"\nparameters { key: "p" value: { string_value: "${V}" } }\n', {"V": value},
                              origin="t")
    parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert parsed.parameters["p"].string_value == value


# ------------------------------------------------------------ values parsing
def test_parse_assignments_keeps_equals_and_empty_values() -> None:
    assert parse_assignments(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["A"], r"^--set 'A': expected KEY=VALUE$"),
        (["1A=x"], r"^--set '1A=x': invalid key '1A'"),
        (["A-B=x"], r"invalid key 'A-B'"),
        (["=x"], r"invalid key ''"),
        (["A=1", "A=2"], r"^--set A: given more than once$"),
    ],
)
def test_parse_assignments_rejects(items: list[str], match: str) -> None:
    with pytest.raises(RenderError, match=match):
        parse_assignments(items)


def test_load_values_converts_scalars(tmp_path: Path) -> None:
    path = write(tmp_path / "v.json", json.dumps({"S": "s", "I": 8, "T": True, "F": False}))
    assert load_values(path) == {"S": "s", "I": "8", "T": "true", "F": "false"}


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("[1]", r"values file must hold a JSON object, got list"),
        ('{"A": 1.5}', r"A: value must be a string, integer or boolean, got float"),
        ('{"A": null}', r"A: value must be a string, integer or boolean, got NoneType"),
        ('{"A": {"b": 1}}', r"got dict"),
        ('{"bad key": "x"}', r"invalid key 'bad key'"),
        ('{"A": ', r"invalid JSON at line 1 column 7"),
    ],
)
def test_load_values_rejects(tmp_path: Path, content: str, match: str) -> None:
    path = write(tmp_path / "v.json", content)
    with pytest.raises(RenderError, match=match):
        load_values(path)


def test_load_values_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RenderError, match=r"cannot read values file: No such file or directory"):
        load_values(tmp_path / "absent.json")


# ------------------------------------------------------------ render_repository
def test_render_repository_exact_output(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out" / "repo"
    result = render_repository(src, dst, {"MODEL_DIR": "/m/smollm2", "ENGINE": "torch"})
    assert tree(dst) == {
        "ensemble/config.pbtxt": 'name: "ensemble"  # cost: $0\n',
        "grammar/1/model.py": "# grammar adapter\n",
        "grammar/config.pbtxt": 'name: "grammar"\nmax_batch_size: 0\n',
        "llm/1/model.py": "# llm adapter\n",
        "llm/config.pbtxt": 'name: "llm"\nparameters { key: "model_dir" value { string_value: "/m/smollm2" } }\n'
        'parameters { key: "engine" value { string_value: "torch" } }\n',
    }
    assert (dst / "ensemble" / "1").is_dir()  # empty version dirs are kept: Triton needs them
    assert result.dst == dst.absolute()
    assert result.configs == ("ensemble/config.pbtxt", "grammar/config.pbtxt", "llm/config.pbtxt")
    assert result.copied == ("grammar/1/model.py", "llm/1/model.py")
    assert result.used_keys == frozenset({"MODEL_DIR", "ENGINE"})
    # No staging directories are left beside dst.
    assert sorted(p.name for p in dst.parent.iterdir()) == ["repo"]


def test_render_repository_keeps_file_modes(src: Path, tmp_path: Path) -> None:
    script = write(src / "llm" / "1" / "helper.sh", "#!/bin/sh\n")
    script.chmod(0o755)
    dst = tmp_path / "dst"
    render_repository(src, dst, {"MODEL_DIR": "m", "ENGINE": "e"})
    assert stat.S_IMODE((dst / "llm" / "1" / "helper.sh").stat().st_mode) == 0o755


def test_render_repository_replaces_previous_dst(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    write(dst / "stale_model" / "config.pbtxt", "old")
    render_repository(src, dst, {"MODEL_DIR": "m", "ENGINE": "e"})
    assert sorted(tree(dst)) == [
        "ensemble/config.pbtxt",
        "grammar/1/model.py",
        "grammar/config.pbtxt",
        "llm/1/model.py",
        "llm/config.pbtxt",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"MODEL_DIR": "m"}, r"^llm/config\.pbtxt\.in: unfilled placeholder\(s\) \$\{ENGINE\}$"),
        ({}, r"^llm/config\.pbtxt\.in: unfilled placeholder\(s\) \$\{MODEL_DIR\}, \$\{ENGINE\}$"),
        (
            {"MODEL_DIR": "m", "ENGINE": "e", "MODLE_DIR": "typo", "A": "1"},
            r"^value\(s\) A, MODLE_DIR not used by any template under ",
        ),
        ({"MODEL_DIR": "m", "ENGINE": "e", "bad-key": "x"}, r"^values: invalid key 'bad-key'"),
    ],
)
def test_render_repository_failure_leaves_dst_untouched(
    src: Path, tmp_path: Path, values: dict[str, str], match: str
) -> None:
    dst = tmp_path / "dst"
    write(dst / "previous" / "config.pbtxt", "kept")
    with pytest.raises(RenderError, match=match):
        render_repository(src, dst, values)
    assert tree(dst) == {"previous/config.pbtxt": "kept"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_render_repository_rejects_template_and_config_side_by_side(src: Path, tmp_path: Path) -> None:
    write(src / "llm" / "config.pbtxt", "rendered by hand")
    with pytest.raises(RenderError, match=r"^llm/config\.pbtxt\.in: both config\.pbtxt and config\.pbtxt\.in exist"):
        render_repository(src, tmp_path / "dst", {"MODEL_DIR": "m", "ENGINE": "e"})


def test_render_repository_rejects_non_utf8_template(src: Path, tmp_path: Path) -> None:
    (src / "grammar" / "config.pbtxt").write_bytes(b'name: "\xff"\n')
    with pytest.raises(RenderError, match=r"^grammar/config\.pbtxt: not UTF-8 text: invalid start byte at byte 7$"):
        render_repository(src, tmp_path / "dst", {"MODEL_DIR": "m", "ENGINE": "e"})


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ("missing", r"^--src .*/nowhere: not a directory$"),
        ("empty", r"^--src .*/empty: no config\.pbtxt\.in or config\.pbtxt found$"),
        ("dst_inside_src", r"^--dst .*: must not overlap --src "),
        ("dst_is_src", r"^--dst .*: must not overlap --src "),
    ],
)
def test_render_repository_rejects_bad_layout(tmp_path: Path, src: Path, layout: str, match: str) -> None:
    if layout == "missing":
        args = (tmp_path / "nowhere", tmp_path / "dst")
    elif layout == "empty":
        (tmp_path / "empty").mkdir()
        args = (tmp_path / "empty", tmp_path / "dst")
    elif layout == "dst_inside_src":
        args = (src, src / "build")
    else:
        args = (src, src)
    with pytest.raises(RenderError, match=match):
        render_repository(*args, {})


# ------------------------------------------------------------ command line
def test_main_merges_values_file_and_set(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = write(tmp_path / "values.json", json.dumps({"MODEL_DIR": "/from/file", "ENGINE": "torch"}))
    dst = tmp_path / "dst"
    code = main(["--src", str(src), "--dst", str(dst), "--values", str(values), "--set", "ENGINE=tensorrt_llm"])
    assert code == 0
    assert '"/from/file"' in (dst / "llm" / "config.pbtxt").read_text()
    assert '"tensorrt_llm"' in (dst / "llm" / "config.pbtxt").read_text()
    assert capsys.readouterr().out == f"render: wrote 3 config(s), copied 2 file(s) into {dst}\n"


def test_main_reports_error_and_exit_status(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--src", str(src), "--dst", str(tmp_path / "dst"), "--set", "MODEL_DIR=m"])
    assert code == 2
    assert capsys.readouterr().err == "render: error: llm/config.pbtxt.in: unfilled placeholder(s) ${ENGINE}\n"
    assert not (tmp_path / "dst").exists()


def test_module_entry_point_exits_non_zero(src: Path, tmp_path: Path) -> None:
    """`python -m deploy.render` (what the Makefile runs) fails with a message."""
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.render", "--src", str(src), "--dst", str(tmp_path / "d"), "--set", "NOPE=1"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("render: error: llm/config.pbtxt.in: unfilled placeholder(s) ${MODEL_DIR}, ${ENGINE}")


_PARAMETER = re.compile(r'^parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}$', re.MULTILINE)


def _rendered_parameters(repo: Path, model: str) -> dict[str, str]:
    return dict(_PARAMETER.findall((repo / model / "config.pbtxt").read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped model repository, rendered with deploy/values.json."""
    values = {**load_values(REPO_ROOT / "deploy" / "values.json"), "MODEL_DIR": "/models/m"}
    return render_repository(REPO_ROOT / "model_repository", tmp_path_factory.mktemp("shipped") / "repo", values).dst


def test_one_max_tokens_bound_across_the_served_path(shipped: Path) -> None:
    """The rendered bound == what preprocessing refuses above == what the engine's checks accept."""
    from contract.errors import InvalidArgument
    from llm_runtime.model_config import LlmModelConfig
    from llm_runtime.scheduler import GenerationRequest, SchedulerConfig, check_request
    from pipeline.preprocess import DEFAULT_MAX_TOKENS_LIMIT, PreprocessConfig, RawRequest, parse_params
    from triton_support.params import from_parameters

    pre = from_parameters(PreprocessConfig, _rendered_parameters(shipped, "preprocessing"), "preprocessing")
    llm = from_parameters(LlmModelConfig, _rendered_parameters(shipped, "llm"), "llm")
    limit = pre.max_tokens_limit
    assert limit == int(load_values(REPO_ROOT / "deploy" / "values.json")["MAX_TOKENS_LIMIT"]) == DEFAULT_MAX_TOKENS_LIMIT
    assert parse_params(RawRequest(prompt=b"x", max_tokens=limit), pre)[0].max_tokens == limit
    with pytest.raises(InvalidArgument, match=rf"^max_tokens: must be in 1\.\.{limit}, got {limit + 1}$"):
        parse_params(RawRequest(prompt=b"x", max_tokens=limit + 1), pre)
    # llm has no cap of its own: a one-token prompt with the bound fits its context (torch and TensorRT-LLM alike).
    checked = check_request(GenerationRequest([0], max_tokens=limit), lambda _: None, SchedulerConfig(),
                            vocab_size=1, context_len=llm.max_seq_len)
    assert checked.prompt.tolist() == [0]


def test_engine_sizes_render_from_one_value(shipped: Path) -> None:
    """MAX_BATCH reaches grammar and llm alike; llm's max_seq_len is its config's one default."""
    from llm_runtime.model_config import LlmModelConfig
    from triton_support.params import from_parameters

    values = load_values(REPO_ROOT / "deploy" / "values.json")
    llm = from_parameters(LlmModelConfig, _rendered_parameters(shipped, "llm"), "llm")
    grammar = _rendered_parameters(shipped, "grammar")
    assert (llm.max_batch, int(grammar["max_batch"])) == (int(values["MAX_BATCH"]),) * 2
    assert "max_seq_len" not in _rendered_parameters(shipped, "llm")
    assert llm.max_seq_len == LlmModelConfig.max_seq_len
