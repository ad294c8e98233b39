"""Unit tests of the CLI (python -m client): argument parsing into Constraints, exit codes without a server."""

from __future__ import annotations

import dataclasses
import io
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client import Constraint, GenerateRequest, InvalidConstraint
from client.__main__ import (
    EXIT_INVALID,
    EXIT_UNAVAILABLE,
    FLAG_FIELDS,
    build_parser,
    constraint_from_args,
    main,
    request_from_args,
)
from client.sdk import REQUEST_FIELDS

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SHORT_TAG: dict[str, Any] = {"triggers": ["<f="], "tags": [{"begin": "<f=add>", "schema": SCHEMA, "end": "</f>"}]}
RAW_TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    contents = {
        "schema.json": json.dumps(SCHEMA),
        "g.ebnf": 'root ::= "a" | "b"\n',
        "g.lark": 'start: "a"\n',
        "short.json": json.dumps(SHORT_TAG),
        "raw.json": json.dumps(RAW_TAG),
        "extra.json": json.dumps({**SHORT_TAG, "name": "x"}),
        "half.json": json.dumps({"triggers": ["<f="]}),
        "list.json": "[1]",
        "broken.json": "{",
        "messages.json": json.dumps([{"role": "user", "content": "hi"}]),
    }
    paths = {}
    for name, text in contents.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        paths[name] = str(tmp_path / name)
    paths["missing"] = str(tmp_path / "missing.ebnf")
    return paths


def parse(argv: list[str], files: dict[str, str]) -> Constraint | None:
    resolved = [files.get(arg[1:], arg) if arg.startswith("@") else arg for arg in argv]
    return constraint_from_args(build_parser().parse_args(resolved))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["p"], lambda f: None),
        (["--schema", json.dumps(SCHEMA), "p"], lambda f: Constraint.json_schema(SCHEMA)),
        (["--schema", "@schema.json", "p"], lambda f: Constraint.json_schema(SCHEMA)),
        (
            ["--schema", "@schema.json", "--strict", "--whitespace", "any", "--indent", "2", "--any-order", "p"],
            lambda f: Constraint.json_schema(SCHEMA, strict=True, whitespace="any", indent=2, any_order=True),
        ),
        (["--schema", "@schema.json", "--whitespace", "3", "p"], lambda f: Constraint.json_schema(SCHEMA, whitespace=3)),
        (["--json-object", "p"], lambda f: Constraint.json_object()),
        (["--json-object", "--indent", "4", "p"], lambda f: Constraint.json_object(indent=4)),
        (["--regex", r"\d+", "p"], lambda f: Constraint.regex(r"\d+")),
        (["--ebnf", "@g.ebnf", "p"], lambda f: Constraint.ebnf('root ::= "a" | "b"\n')),
        (["--lark", "@g.lark", "p"], lambda f: Constraint.lark('start: "a"\n')),
        (["--choice", "yes", "--choice", "no", "p"], lambda f: Constraint.choice(["yes", "no"])),
        (["--tool-call", "@short.json", "p"], lambda f: Constraint.structural_tag(SHORT_TAG["triggers"],
                                                                                  SHORT_TAG["tags"])),
        (["--tool-call", "@raw.json", "p"], lambda f: Constraint.structural_tag_raw(RAW_TAG)),
        (["--regex", "a+", "--on-budget", "truncate", "--on-repeat", "continue", "p"],
         lambda f: Constraint("regex", "a+", {"on_budget": "truncate", "on_repeat": "continue"})),
        (["--schema", "@schema.json", "--on-repeat", "close", "p"],
         lambda f: Constraint.json_schema(SCHEMA).with_policies(on_repeat="close")),
        (["--regex", "a+", "--no-jump-forward", "p"], lambda f: Constraint("regex", "a+", {"jump_forward": False})),
        (["--regex", "a+", "--backend", "llguidance", "p"], lambda f: Constraint("regex", "a+", {"backend": "llguidance"})),
        (["--json-object", "--value-retries", "3", "p"], lambda f: Constraint("json_object", "", {"value_retries": 3})),
    ],
)
def test_constraint_from_args(argv: list[str], expected: Any, files: dict[str, str]) -> None:
    constraint = parse(argv, files)
    assert constraint == expected(files)
    if constraint is not None:
        assert constraint.options_json == expected(files).options_json


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--regex", "a", "--strict", "p"], r"^--strict: applies only to --schema and --json-object$"),
        # The server refuses JSON options on structural tags (contract.JSON_OPTION_KINDS).
        (["--tool-call", "@short.json", "--strict", "p"], r"^--strict: does not apply to --tool-call"),
        (["--choice", "a", "--indent", "2", "p"], r"^--indent: applies only to --schema"),
        (["--json-object", "--strict", "p"], r"^--strict: does not apply to --json-object$"),
        (["--json-object", "--any-order", "p"], r"^--any-order: does not apply to --json-object$"),
        (["--tool-call", "@raw.json", "--whitespace", "any", "p"],
         r"^--whitespace: does not apply to --tool-call"),
        (["--tool-call", "@extra.json", "p"], r"^--tool-call\.name: unknown key; expected triggers, tags$"),
        (["--tool-call", "@half.json", "p"], r"^--tool-call: needs 'triggers' and 'tags'"),
        (["--tool-call", "@list.json", "p"], r"^--tool-call: must hold a JSON object, got list$"),
        (["--tool-call", "@broken.json", "p"], r"^--tool-call: .*broken\.json: invalid JSON at line 1 column 2"),
        (["--ebnf", "@missing", "p"], r"^--ebnf: no such file: '.*missing\.ebnf'$"),
        (["--schema", "@list.json", "p"], r"^schema: must be a JSON object, got list$"),
        (["--regex", "", "p"], r"^regex: must not be empty$"),
        (["--choice", "a", "--choice", "a", "p"], r"^choices\[1\]: duplicate of choices\[0\]$"),
        (["--on-budget", "truncate", "p"], r"^--on-budget: applies only with a constraint$"),
    ],
)
def test_constraint_from_args_rejects(argv: list[str], message: str, files: dict[str, str]) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        parse(argv, files)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--regex", "a", "--choice", "b", "p"], "not allowed with argument"),
        (["--whitespace", "tabs", "p"], "must be \"compact\", \"any\" or an integer, got 'tabs'"),
        (["--whitespace", "-1", "p"], "must be a non-negative integer, got -1"),
        (["--max-tokens", "many", "p"], "invalid int value: 'many'"),
        (["--regex", "a", "--on-budget", "stop", "p"], "argument --on-budget: invalid choice: 'stop'"),
    ],
)
def test_argparse_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_sampling_flags_parse() -> None:
    args = build_parser().parse_args(
        ["--max-tokens", "9", "--temperature", "0.5", "--top-p", "0.8", "--top-k", "5", "--seed", "7",
         "--stop", "\n", "--stop", "END", "--print-result", "--url", "h:1", "--model", "m", "--timeout", "3", "p"]
    )
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed, args.stop) == (
        9, 0.5, 0.8, 5, 7, ["\n", "END"])
    assert (args.print_result, args.url, args.model, args.timeout, args.prompt) == (True, "h:1", "m", 3.0, "p")


def test_cli_flags_are_the_request_fields() -> None:
    # One list: every GenerateRequest field is a flag of the same dest with the
    # dataclass's default, except the five the CLI derives (prompt sources,
    # the constraint flags, the reasoning flags, --allow-incomplete).
    dests = {action.dest: action.default for action in build_parser()._actions}
    defaults = {f.name: f.default for f in dataclasses.fields(GenerateRequest) if f.init}
    assert set(REQUEST_FIELDS) - set(FLAG_FIELDS) == {"prompt", "messages", "constraint", "reasoning",
                                                      "require_complete"}
    assert {name: dests[name] for name in FLAG_FIELDS} == {name: defaults[name] for name in FLAG_FIELDS}
    assert {"prompt", "messages", "allow_incomplete"} <= set(dests)


@pytest.mark.parametrize(
    ("argv", "stdin", "expected"),
    [
        (["p"], "", GenerateRequest("p")),
        (["-"], "from stdin", GenerateRequest("from stdin")),
        (["--messages", "@messages.json"], "", GenerateRequest(messages=[{"role": "user", "content": "hi"}])),
        (["--max-tokens", "9", "--temperature", "0.5", "--top-p", "0.8", "--top-k", "5", "--seed", "7", "--stop",
          "\n", "--stop", "END", "--repetition-penalty", "1.2", "--frequency-penalty", "0.5", "--presence-penalty",
          "-0.5", "--min-p", "0.1", "--allow-incomplete", "--regex", "[a-z]+", "p"], "",
         GenerateRequest("p", constraint=Constraint.regex("[a-z]+"), max_tokens=9, temperature=0.5, top_p=0.8,
                         top_k=5, seed=7, stop=["\n", "END"], repetition_penalty=1.2, frequency_penalty=0.5,
                         presence_penalty=-0.5, min_p=0.1, require_complete=False)),
    ],
)
def test_request_from_args(argv: list[str], stdin: str, expected: GenerateRequest, files: dict[str, str]) -> None:
    argv = [files.get(a[1:], a) if a.startswith("@") else a for a in argv]
    assert request_from_args(build_parser().parse_args(argv), io.StringIO(stdin)) == expected


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _main(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "code", "stderr"),
    [
        (["--regex", "", "p"], EXIT_INVALID, "error: regex: must not be empty\n"),
        (["--max-tokens", "0", "p"], EXIT_INVALID, "error: max_tokens: must be in [1, 2147483647], got 0\n"),
        (["--top-p", "2", "p"], EXIT_INVALID, "error: top_p: must be a number in (0, 1], got 2.0\n"),
        (["--messages", "@broken.json"], EXIT_INVALID, None),
    ],
)
def test_main_invalid_exits_2(argv: list[str], code: int, stderr: str | None, files: dict[str, str]) -> None:
    argv = ["--url", f"127.0.0.1:{_closed_port()}", *[files.get(a[1:], a) if a.startswith("@") else a for a in argv]]
    got_code, out, err = _main(argv)
    assert (got_code, out) == (code, "")
    if stderr is not None:
        assert err == stderr
    else:
        assert err.startswith("error: --messages: ")


def test_main_server_unavailable_exits_4(files: dict[str, str]) -> None:
    for argv in (["hi"], ["--messages", files["messages.json"]], ["-"]):
        code, out, err = _main(["--url", f"127.0.0.1:{_closed_port()}", "--timeout", "5", *argv], stdin="from stdin")
        assert (code, out) == (EXIT_UNAVAILABLE, "")
        assert err.startswith("error: server unavailable: ")


def test_main_requires_exactly_one_prompt_source(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["p", "--messages", files["messages.json"]]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "give exactly one of PROMPT and --messages" in capsys.readouterr().err


def test_module_entry_point_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "client", "--url", f"127.0.0.1:{_closed_port()}", "--choice", "a", "--choice", "a",
         "hi"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == EXIT_INVALID
    assert proc.stdout == ""
    assert proc.stderr == "error: choices[1]: duplicate of choices[0]\n"


@pytest.mark.parametrize(
    ("argv", "stderr"),
    [
        (["--ca-file", "/nonexistent/ca.pem", "p"], "error: ca_file: cannot read '/nonexistent/ca.pem'\n"),
        (["--cert-file", "c.pem", "p"], "error: key_file: mutual TLS needs both cert_file and key_file\n"),
        (["--api-key", "a\nb", "p"], "error: api_key: must be a non-empty single-line string\n"),
    ],
)
def test_main_security_flags_are_checked(argv: list[str], stderr: str) -> None:
    code, out, err = _main(["--url", f"127.0.0.1:{_closed_port()}", *argv])
    assert (code, out, err) == (EXIT_INVALID, "", stderr)


def test_security_flags_parse() -> None:
    args = build_parser().parse_args(["--ca-file", "ca.pem", "--cert-file", "c.pem", "--key-file", "k.pem",
                                      "--api-key", "k", "p"])
    assert (args.tls, args.ca_file, args.cert_file, args.key_file, args.api_key) == (
        False, "ca.pem", "c.pem", "k.pem", "k")
    defaults = build_parser().parse_args(["p"])
    assert (defaults.tls, defaults.ca_file, defaults.api_key) == (False, None, None)
