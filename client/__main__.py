"""Command-line client: ``python -m client [options] PROMPT``.

Streams the generated text to stdout as it arrives; with a thinking section
(``--reasoning-end``, or a server whose model reasons), the thinking goes to
stderr and the answer alone to stdout.

Exit codes
----------
0  success
1  any other failure (generation error, deadline, malformed response)
2  invalid request or constraint (locally, or the server's INVALID_ARGUMENT)
3  output incomplete: truncated at ``--max-tokens``, or cut by a ``--stop``
   string under a constraint
5  output closed early by the server (``--on-budget``/``--on-repeat close``):
   it matches the constraint, but values may be cut short
4  server unavailable
130  interrupted (Ctrl-C); the request is cancelled on the server
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import contract
from client.constraints import BACKEND, ON_BUDGET, ON_REPEAT, Constraint, Whitespace
from client.errors import (
    ClientError,
    ClosedEarly,
    GenerationError,
    InvalidConstraint,
    InvalidRequest,
    ServerUnavailable,
    TruncatedOutput,
)
from client.sdk import (
    API_KEY_ENV,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    REQUEST_FIELDS,
    Client,
    GenerateRequest,
    Reasoning,
    Result,
)

__all__ = ["EXIT_CLOSED", "EXIT_INVALID", "EXIT_OK", "EXIT_OTHER", "EXIT_TRUNCATED", "EXIT_UNAVAILABLE", "FLAG_FIELDS",
           "build_parser", "constraint_from_args", "main", "request_from_args"]

EXIT_OK: Final = 0
EXIT_OTHER: Final = 1
EXIT_INVALID: Final = 2
EXIT_TRUNCATED: Final = 3
EXIT_UNAVAILABLE: Final = 4
EXIT_CLOSED: Final = 5
EXIT_INTERRUPTED: Final = 130
#: Request fields the CLI does not take as a same-named flag: the prompt
#: (PROMPT, --messages), the constraint (its own flags) and require_complete
#: (--allow-incomplete).  Every other GenerateRequest field is the flag's dest
#: (--max-tokens -> max_tokens), read by name in :func:`request_from_args`.
_DERIVED_FIELDS: Final = frozenset({"prompt", "messages", "constraint", "reasoning", "require_complete"})
#: The request fields read straight from the parsed flags of the same name.
FLAG_FIELDS: Final = tuple(name for name in REQUEST_FIELDS if name not in _DERIVED_FIELDS)


def _whitespace(text: str) -> Whitespace:
    if text == "compact":
        return "compact"
    if text == "any":
        return "any"
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f'must be "compact", "any" or an integer, got {text!r}') from err
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of ``python -m client``.

    Returns
    -------
    argparse.ArgumentParser
    """
    parser = argparse.ArgumentParser(
        prog="python -m client",
        description="Grammar-constrained generation on a Triton server; streams text to stdout.",
        epilog="exit codes: 0 ok, 1 other error, 2 invalid constraint/request, 3 incomplete (truncated or cut "
               "by a stop string), 4 server unavailable, 5 closed early (valid, values may be cut short)",
    )
    parser.add_argument("prompt", nargs="?", help="user prompt ('-' reads stdin); or use --messages")
    parser.add_argument("--messages", metavar="FILE", help="JSON file with a [{role, content}, ...] chat history")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"Triton gRPC endpoint (default {DEFAULT_URL})")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"ensemble name (default {DEFAULT_MODEL})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"deadline of the whole call (default {DEFAULT_TIMEOUT_S:g})")
    secure = parser.add_argument_group("TLS and API key (a gateway that serves TLS or asks for keys)")
    secure.add_argument("--tls", action="store_true", help="connect with TLS, verified by the system's roots")
    secure.add_argument("--ca-file", metavar="FILE", help="PEM CA that signed the server's certificate (implies --tls)")
    secure.add_argument("--cert-file", metavar="FILE", help="client certificate for mutual TLS (with --key-file)")
    secure.add_argument("--key-file", metavar="FILE", help="client private key for mutual TLS")
    secure.add_argument("--api-key", metavar="KEY",
                        help=f"sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the "
                             "variable: a flag is visible in the process list)")

    kinds = parser.add_argument_group("constraint (at most one)").add_mutually_exclusive_group()
    kinds.add_argument("--schema", metavar="FILE|JSON", help="JSON Schema: a .json file or inline JSON text")
    kinds.add_argument("--json-object", action="store_true", help="any JSON object")
    kinds.add_argument("--regex", metavar="PATTERN", help="regular expression the whole output matches")
    kinds.add_argument("--ebnf", metavar="FILE", help="EBNF/GBNF grammar file (start rule: root)")
    kinds.add_argument("--lark", metavar="FILE", help="Lark grammar file")
    kinds.add_argument("--choice", action="append", metavar="TEXT", help="one allowed output; repeat the flag")
    kinds.add_argument("--tool-call", metavar="FILE",
                       help='structural tag JSON file: {"triggers": [...], "tags": [{"begin", "schema", "end"}]} '
                            'or xgrammar\'s {"type": "structural_tag", "format": {...}}')

    options = parser.add_argument_group("JSON options (--schema, --json-object)")
    options.add_argument("--strict", action="store_true", default=None, help="close every object in the schema")
    options.add_argument("--whitespace", type=_whitespace, metavar="compact|any|N",
                         help="whitespace between JSON tokens")
    options.add_argument("--indent", type=int, metavar="N", help="pretty-print indentation")
    options.add_argument("--any-order", action="store_true", default=None, help="allow properties in any order")

    policies = parser.add_argument_group("decoding policies (any constraint)")
    policies.add_argument("--on-budget", choices=ON_BUDGET,
                          help="close: end with the shortest valid completion when --max-tokens runs out "
                               "(server default); truncate: cut the output there")
    policies.add_argument("--on-repeat", choices=ON_REPEAT,
                          help="close: end an output that keeps repeating itself the same way (server default)")
    policies.add_argument("--backend", choices=BACKEND,
                          help="grammar engine: auto (server default: llguidance for JSON, xgrammar for the rest, "
                               "each falling back to the other), xgrammar or llguidance")
    policies.add_argument("--value-retries", type=int, metavar="N",
                          help="JSON: times a completed value that breaks the schema may be dropped and generated "
                               f"again (server default {contract.VALUE_RETRIES}; 0: off)")
    policies.add_argument("--no-jump-forward", dest="jump_forward", action="store_false", default=None,
                          help="sample every token, also where the constraint forces the text (the server "
                               "appends forced text without sampling by default)")

    thinking = parser.add_argument_group("reasoning (the model thinks first; the constraint applies after the end "
                                         "marker; the thinking goes to stderr)")
    thinking.add_argument("--reasoning-end", metavar="MARKER", help="the marker that ends the thinking, e.g. '</think>'")
    thinking.add_argument("--reasoning-start", metavar="MARKER",
                          help="the marker the thinking may begin with, e.g. '<think>' (with --reasoning-end)")
    thinking.add_argument("--max-reasoning-tokens", type=int, metavar="N",
                          help="the server forces the end marker after N thinking tokens (marker included)")
    thinking.add_argument("--no-reasoning", dest="no_reasoning", action="store_true",
                          help="no thinking section, where the server's model reasons by default")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                          help=f"generation budget (default {DEFAULT_MAX_TOKENS})")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    sampling.add_argument("--top-p", type=float, metavar="P")
    sampling.add_argument("--top-k", type=int, metavar="K")
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--stop", action="append", metavar="TEXT", help="stop string; repeat the flag")
    sampling.add_argument("--repetition-penalty", type=float, metavar="R",
                          help=f"in (0, {contract.MAX_REPETITION_PENALTY:g}]: divides the logits of tokens already in "
                               "the prompt or output (1: off)")
    sampling.add_argument("--frequency-penalty", type=float, metavar="F",
                          help=f"in -{contract.MAX_PENALTY:g}..{contract.MAX_PENALTY:g}: subtracted per occurrence "
                               "in the output (0: off)")
    sampling.add_argument("--presence-penalty", type=float, metavar="P",
                          help=f"in -{contract.MAX_PENALTY:g}..{contract.MAX_PENALTY:g}: subtracted once a token "
                               "occurs in the output (0: off)")
    sampling.add_argument("--min-p", type=float, metavar="M",
                          help="in 0..1: sample only tokens at least M times as likely as the most likely (0: off)")
    sampling.add_argument("--logprobs", type=int, metavar="K",
                          help=f"in 0..{contract.MAX_TOP_LOGPROBS}: report each token's log probability and its K "
                               "most likely alternatives (printed by --print-result, as RESULT's logprobs)")
    sampling.add_argument("--draft-tokens", type=int, metavar="D",
                          help=f"in 0..{contract.MAX_DRAFT_TOKENS}: prompt-lookup speculation, at most D tokens copied "
                               "from the prompt and output verified per forward (0: off; default: the server's)")

    output = parser.add_argument_group("output")
    output.add_argument("--print-result", action="store_true", help="print the final RESULT JSON after the text")
    output.add_argument("--allow-incomplete", action="store_true",
                        help="exit 0 on incomplete output instead of 3 (or 5: closed early)")
    return parser


def _read_file(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise InvalidConstraint(flag, f"no such file: {path!r}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidConstraint(flag, f"cannot read {path!r}: {err}") from err


def _load_json_file(path: str, flag: str) -> Any:
    text = _read_file(path, flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidConstraint(flag, f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from err


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """Build the :class:`Constraint` selected by parsed arguments, with its decoding policies.

    Parameters
    ----------
    args : argparse.Namespace
        The result of :func:`build_parser` ``.parse_args``.

    Returns
    -------
    Constraint or None
        ``None`` when no constraint flag is given.

    Raises
    ------
    InvalidConstraint
        As :func:`_constraint_kind`, or a policy flag without a constraint.
    """
    constraint = _constraint_kind(args)
    given = {"--on-budget": args.on_budget, "--on-repeat": args.on_repeat, "--no-jump-forward": args.jump_forward,
             "--backend": args.backend, "--value-retries": args.value_retries}
    flags = [flag for flag, value in given.items() if value is not None]
    if not flags:
        return constraint
    if constraint is None:
        raise InvalidConstraint(flags[0], "applies only with a constraint")
    return constraint.with_policies(on_budget=args.on_budget, on_repeat=args.on_repeat, jump_forward=args.jump_forward,
                                    backend=args.backend, value_retries=args.value_retries)


def _constraint_kind(args: argparse.Namespace) -> Constraint | None:
    """The constraint flag's :class:`Constraint` (None without one).

    Raises
    ------
    InvalidConstraint
        A file is unreadable or invalid, a JSON option is given for a non-JSON
        constraint, or the constraint fails its checks.
    """
    json_opts: dict[str, Any] = {
        "strict": args.strict,
        "whitespace": args.whitespace,
        "indent": args.indent,
        "any_order": args.any_order,
    }
    given = [name for name, value in json_opts.items() if value is not None]
    if args.schema is not None:
        return Constraint.json_schema(args.schema, **json_opts)
    if args.json_object:
        if args.strict is not None or args.any_order is not None:
            flag = "--strict" if args.strict is not None else "--any-order"
            raise InvalidConstraint(flag, "does not apply to --json-object")
        return Constraint.json_object(whitespace=args.whitespace, indent=args.indent)
    if given and args.tool_call is not None:
        # The server refuses JSON options on structural tags (contract.JSON_OPTION_KINDS).
        raise InvalidConstraint(f"--{given[0].replace('_', '-')}",
                                "does not apply to --tool-call (a structural tag; set options inside xgrammar's form)")
    if args.tool_call is not None:
        spec = _load_json_file(args.tool_call, "--tool-call")
        if not isinstance(spec, dict):
            raise InvalidConstraint("--tool-call", f"must hold a JSON object, got {type(spec).__name__}")
        if "type" in spec:
            return Constraint.structural_tag_raw(spec)
        unknown = sorted(set(spec) - {"triggers", "tags"})
        if unknown:
            raise InvalidConstraint(f"--tool-call.{unknown[0]}", "unknown key; expected triggers, tags")
        if "triggers" not in spec or "tags" not in spec:
            raise InvalidConstraint("--tool-call", "needs 'triggers' and 'tags' (or xgrammar's 'type' + 'format')")
        return Constraint.structural_tag(spec["triggers"], spec["tags"])
    if given:
        raise InvalidConstraint(f"--{given[0].replace('_', '-')}", "applies only to --schema and --json-object")
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.ebnf is not None:
        return Constraint.ebnf(_read_file(args.ebnf, "--ebnf"))
    if args.lark is not None:
        return Constraint.lark(_read_file(args.lark, "--lark"))
    if args.choice is not None:
        return Constraint.choice(args.choice)
    return None


def request_from_args(args: argparse.Namespace, stdin: TextIO) -> GenerateRequest:
    """Build the :class:`GenerateRequest` of parsed arguments.

    Parameters
    ----------
    args : argparse.Namespace
        The result of :func:`build_parser` ``.parse_args``.
    stdin : TextIO
        Read for the prompt ``-``.

    Returns
    -------
    GenerateRequest

    Raises
    ------
    InvalidRequest
        A field is rejected (:class:`InvalidConstraint` for the constraint flags).
    """
    constraint = constraint_from_args(args)
    prompt = stdin.read() if args.prompt == "-" else args.prompt
    messages = None if args.messages is None else _load_json_file(args.messages, "--messages")
    flags = {name: getattr(args, name) for name in FLAG_FIELDS}
    return GenerateRequest(prompt=prompt, messages=messages, constraint=constraint, reasoning=reasoning_from_args(args),
                           require_complete=not args.allow_incomplete, **flags)


def reasoning_from_args(args: argparse.Namespace) -> Reasoning | bool | dict[str, Any] | None:
    """The request's ``reasoning`` field from the reasoning flags (None: the server's default).

    Raises
    ------
    InvalidRequest
        ``--no-reasoning`` with another reasoning flag, or ``--reasoning-start`` without ``--reasoning-end``.
    """
    given = [flag for flag, value in (("--reasoning-end", args.reasoning_end), ("--reasoning-start", args.reasoning_start),
                                      ("--max-reasoning-tokens", args.max_reasoning_tokens)) if value is not None]
    if args.no_reasoning:
        if given:
            raise InvalidRequest("reasoning", f"--no-reasoning and {given[0]} contradict each other")
        return False
    if args.reasoning_start is not None and args.reasoning_end is None:
        raise InvalidRequest("reasoning.end", "--reasoning-start needs --reasoning-end")
    if args.reasoning_end is not None:
        return Reasoning(end=args.reasoning_end, start=args.reasoning_start or "",
                         max_reasoning_tokens=args.max_reasoning_tokens)
    if args.max_reasoning_tokens is not None:
        return {"max_reasoning_tokens": args.max_reasoning_tokens}  # the server's markers
    return None


def _print_result(result: Result | None, out: TextIO) -> None:
    if result is not None:
        doc = dict(result.raw)
        if result.logprobs is not None:  # streamed with the text, not in RESULT: shown with it here
            doc["logprobs"] = [entry.to_openai() for entry in result.logprobs]
        out.write(json.dumps(doc, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Run the CLI.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).
    stdin, stdout, stderr : TextIO, optional
        Streams (default the process's).

    Returns
    -------
    int
        The exit code (see the module docstring).
    """
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.messages is None):
        parser.error("give exactly one of PROMPT and --messages")

    text_ended_with_newline = True
    result: Result | None = None
    try:
        request = request_from_args(args, stdin)
        with Client(args.url, args.model, timeout_s=args.timeout, tls=args.tls, ca_file=args.ca_file,
                    cert_file=args.cert_file, key_file=args.key_file, api_key=args.api_key) as llm:
            chunks = llm.stream(request)
            for chunk in chunks:
                if chunk.reasoning:
                    stderr.write(chunk.reasoning)
                    stderr.flush()
                if chunk.text:
                    stdout.write(chunk.text)
                    stdout.flush()
                    text_ended_with_newline = chunk.text.endswith("\n")
                if chunk.result is not None:
                    result = chunk.result
                    # Close the text line before the RESULT line, or the shell prompt.
                    if not text_ended_with_newline:
                        stdout.write("\n")
                    if args.print_result:
                        _print_result(result, stdout)
                    stdout.flush()
    except KeyboardInterrupt:
        stderr.write("\ninterrupted\n")
        return EXIT_INTERRUPTED
    except ClosedEarly as err:
        stderr.write(f"note: {err}\n")
        return EXIT_CLOSED
    except TruncatedOutput as err:
        stderr.write(f"error: {err}\n")
        return EXIT_TRUNCATED
    except InvalidRequest as err:  # InvalidConstraint included
        stderr.write(f"error: {err}\n")
        return EXIT_INVALID
    except ServerUnavailable as err:
        stderr.write(f"error: {err}\n")
        return EXIT_UNAVAILABLE
    except GenerationError as err:
        if err.result is not None and result is None and args.print_result:
            _print_result(err.result, stdout)
        stderr.write(f"error: {err}\n")
        return EXIT_OTHER
    except ClientError as err:
        stderr.write(f"error: {err}\n")
        return EXIT_OTHER
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
