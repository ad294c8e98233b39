"""The request contract: the client's builders and the server's validation accept exactly the same requests.

Every option of every constraint kind and every sampling field, at its bounds
and just past them, goes through the client (``Constraint``, ``build_inputs``)
and through the server (``parse_constraint``, preprocessing's
``parse_params``) and gets the table's verdict from each: accepted, or
refused with the exact message (the same field on both sides), so a check
that stops refusing fails here, not only one that the two sides disagree on.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest

import contract
from client import Constraint
from client.errors import InvalidConstraint, InvalidRequest
from client.sdk import build_inputs
from grammar_backend import protocol, spec
from grammar_backend.errors import ConstraintError, InvalidArgument
from pipeline import postprocess
from pipeline.preprocess import PreprocessConfig, RawRequest, parse_params

REPO = Path(__file__).resolve().parents[2]

PAYLOADS = {
    "json_schema": '{"type":"object"}',
    "json_object": "",
    "regex": "[a-z]+",
    "ebnf": 'root ::= "a"',
    "lark": 'start: "a"',
    "choice": '["a","b"]',
    "structural_tag": '{"triggers":["<f"],"tags":[{"begin":"<f>","schema":{"type":"object"},"end":"</f>"}]}',
}

#: Accepted by the JSON kinds; any other kind refuses it as ``"grammar_options.<name>: only applies to
#: json_schema and json_object, not <kind>"`` (a JSON option at a value other than its default).
JSON_ONLY = "json only"
_WS = 'grammar_options.whitespace: must be "compact", "any" or an integer 0..64, got '
_UNKNOWN = ("grammar_options.colour: unknown option; expected one of strict, whitespace, indent, any_order, "
            "on_budget, on_repeat, backend, jump_forward, value_retries")

# (option, value, verdict): None = every kind accepts it, JSON_ONLY, or the exact message every kind refuses it with.
OPTION_CASES: list[tuple[str, Any, str | None]] = [
    ("strict", True, JSON_ONLY), ("strict", False, None),
    ("strict", "yes", "grammar_options.strict: must be a boolean, got 'yes'"),
    ("strict", 1, "grammar_options.strict: must be a boolean, got 1"),
    ("any_order", True, JSON_ONLY), ("any_order", None, "grammar_options.any_order: must be a boolean, got None"),
    ("whitespace", "compact", None), ("whitespace", "any", JSON_ONLY), ("whitespace", "tabs", _WS + "'tabs'"),
    ("whitespace", 0, JSON_ONLY), ("whitespace", contract.MAX_WHITESPACE_RUN, JSON_ONLY),
    ("whitespace", contract.MAX_WHITESPACE_RUN + 1, _WS + "65"), ("whitespace", -1, _WS + "-1"),
    ("whitespace", True, _WS + "True"),
    ("indent", None, None), ("indent", 0, JSON_ONLY), ("indent", contract.MAX_INDENT, JSON_ONLY),
    ("indent", contract.MAX_INDENT + 1, "grammar_options.indent: must be null or an integer 0..16, got 17"),
    ("indent", -1, "grammar_options.indent: must be null or an integer 0..16, got -1"),
    ("indent", 1.5, "grammar_options.indent: must be null or an integer 0..16, got 1.5"),
    ("on_budget", "close", None), ("on_budget", "truncate", None),
    ("on_budget", "stop", "grammar_options.on_budget: must be one of 'close', 'truncate', got 'stop'"),
    ("on_repeat", "close", None), ("on_repeat", "continue", None),
    ("on_repeat", None, "grammar_options.on_repeat: must be one of 'close', 'continue', got None"),
    ("jump_forward", True, None), ("jump_forward", False, None),
    ("jump_forward", "on", "grammar_options.jump_forward: must be a boolean, got 'on'"),
    ("jump_forward", 0, "grammar_options.jump_forward: must be a boolean, got 0"),
    ("backend", "auto", None), ("backend", "xgrammar", None), ("backend", "llguidance", None),
    ("backend", "outlines",
     "grammar_options.backend: must be one of 'auto', 'xgrammar', 'llguidance', got 'outlines'"),
    ("value_retries", 0, JSON_ONLY), ("value_retries", contract.MAX_VALUE_RETRIES, JSON_ONLY),
    ("value_retries", contract.MAX_VALUE_RETRIES + 1, "grammar_options.value_retries: must be an integer 0..64, got 65"),
    ("value_retries", -1, "grammar_options.value_retries: must be an integer 0..64, got -1"),
    ("value_retries", True, "grammar_options.value_retries: must be an integer 0..64, got True"),
    ("value_retries", 2.0, "grammar_options.value_retries: must be an integer 0..64, got 2.0"),
    ("colour", "red", _UNKNOWN),
]


def _message_or_none(call: Any, errors: tuple[type[Exception], ...]) -> str | None:
    """The message of the error ``call`` raises (one of ``errors``), or ``None`` when it accepts."""
    try:
        call()
    except errors as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind", contract.CONSTRAINT_KINDS)
@pytest.mark.parametrize(("name", "value", "verdict"), OPTION_CASES,
                         ids=[f"{name}={value!r}" for name, value, _ in OPTION_CASES])
def test_client_and_server_give_every_option_its_verdict(kind: str, name: str, value: Any, verdict: str | None) -> None:
    options = {name: value}
    expected = verdict
    if verdict is JSON_ONLY:
        expected = None if kind in contract.JSON_OPTION_KINDS else (
            f"grammar_options.{name}: only applies to json_schema and json_object, not {kind}")
    client = _message_or_none(lambda: Constraint(kind, PAYLOADS[kind], options), (InvalidConstraint,))
    server = _message_or_none(lambda: spec.parse_constraint(kind, PAYLOADS[kind], options), (ConstraintError,))
    assert (client, server) == (expected, expected), (kind, options)


def test_the_option_table_covers_every_option() -> None:
    assert {name for name, _, _ in OPTION_CASES} == {*contract.OPTION_NAMES, "colour"}


def test_json_options_apply_to_the_json_kinds_only() -> None:
    for kind in contract.CONSTRAINT_KINDS:
        outcome = _message_or_none(lambda k=kind: spec.parse_constraint(k, PAYLOADS[k], {"strict": True}),
                                   (ConstraintError,))
        assert (outcome is None) == (kind in contract.JSON_OPTION_KINDS), kind


def _same(fields: dict[str, Any], message: str) -> tuple[dict[str, Any], str | None, str | None]:
    """A sampling case both sides refuse with the same message."""
    return fields, message, message


# (fields, the server's verdict, the client's): None = accepted, else the exact message.  The two differ in
# reason, never in field, where the SDK checks first on its own (finite, an integer in range, non-empty).
SAMPLING_CASES: list[tuple[dict[str, Any], str | None, str | None]] = [
    ({"temperature": 0.0}, None, None), ({"temperature": contract.MAX_TEMPERATURE}, None, None),
    _same({"temperature": contract.MAX_TEMPERATURE + 0.5}, "temperature: must be a number in 0..2, got 2.5"),
    _same({"temperature": -0.1}, "temperature: must be a number in 0..2, got -0.1"),
    ({"temperature": float("nan")}, "temperature: must be a number in 0..2, got nan", "temperature: must be finite, got nan"),
    ({"top_p": 1.0}, None, None), ({"top_p": 0.01}, None, None),
    _same({"top_p": 0.0}, "top_p: must be a number in (0, 1], got 0.0"),
    _same({"top_p": 1.01}, "top_p: must be a number in (0, 1], got 1.01"),
    ({"top_k": 0}, None, None), ({"top_k": 1}, None, None), ({"top_k": contract.MAX_TOP_K}, None, None),
    ({"top_k": -1}, "top_k: must be an integer in 0..2147483647 (0 = off), got -1",
     "top_k: must be in [0, 2147483647], got -1"),
    ({"seed": 0}, None, None), ({"seed": contract.SEED_LIMIT - 1}, None, None),
    ({"stop": ["a"] * contract.MAX_STOP_STRINGS}, None, None),
    _same({"stop": ["a"] * (contract.MAX_STOP_STRINGS + 1)}, "stop: at most 8 stop strings, got 9"),
    ({"stop": ["x" * contract.MAX_STOP_CHARS]}, None, None),
    _same({"stop": ["x" * (contract.MAX_STOP_CHARS + 1)]}, "stop[0]: is 257 characters; at most 256"),
    ({"stop": [""]}, "stop[0]: must be a non-empty string", "stop[0]: must not be empty"),
]


def _sampling_id(value: dict[str, Any] | str | None) -> str:
    """A sampling case's id: its fields, then each verdict as ``ok`` or ``refused`` (not the whole message)."""
    if isinstance(value, dict):
        return ",".join(f"{k}={str(v)[:12]}" for k, v in value.items())
    return "ok" if value is None else "refused"


@pytest.mark.parametrize(("fields", "server_verdict", "client_verdict"), SAMPLING_CASES,
                         ids=_sampling_id)
def test_client_and_server_give_every_sampling_field_its_verdict(
        fields: dict[str, Any], server_verdict: str | None, client_verdict: str | None) -> None:
    client = _message_or_none(lambda: build_inputs("hi", **fields), (InvalidRequest,))
    raw = RawRequest(prompt=b"hi", temperature=fields.get("temperature"), top_p=fields.get("top_p"),
                     top_k=fields.get("top_k"), seed=fields.get("seed"),
                     stop=tuple(s.encode() for s in fields.get("stop", ())),
                     **{name: fields.get(name) for name in contract.PENALTY_FIELDS})
    server = _message_or_none(lambda: parse_params(raw, PreprocessConfig(tokenizer="unused")), (InvalidArgument,))
    assert (client, server) == (client_verdict, server_verdict), fields


# Each penalty field at its edges: (fields, the contract's verdict: None = accepted, else the exact message).
PENALTY_CASES: list[tuple[dict[str, Any], str | None]] = [
    ({"repetition_penalty": 1.0}, None),
    ({"repetition_penalty": contract.MAX_REPETITION_PENALTY}, None),
    ({"repetition_penalty": 0.01}, None),
    ({"repetition_penalty": 0.0}, "repetition_penalty: must be a number in (0, 2] (1 = off), got 0.0"),
    ({"repetition_penalty": 2.5}, "repetition_penalty: must be a number in (0, 2] (1 = off), got 2.5"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty: must be a number in (0, 2] (1 = off), got inf"),
    ({"frequency_penalty": -contract.MAX_PENALTY}, None),
    ({"frequency_penalty": contract.MAX_PENALTY}, None),
    ({"frequency_penalty": 2.5}, "frequency_penalty: must be a number in -2..2 (0 = off), got 2.5"),
    ({"presence_penalty": -2.5}, "presence_penalty: must be a number in -2..2 (0 = off), got -2.5"),
    ({"presence_penalty": float("nan")}, "presence_penalty: must be a number in -2..2 (0 = off), got nan"),
    ({"min_p": 0.0}, None),
    ({"min_p": 1.0}, None),
    ({"min_p": -0.1}, "min_p: must be a number in 0..1 (0 = off), got -0.1"),
    ({"min_p": 1.5}, "min_p: must be a number in 0..1 (0 = off), got 1.5"),
]


def _sdk_verdict(fields: dict[str, Any], message: str | None) -> str | None:
    """The SDK's verdict on one penalty field: it refuses inf and nan itself, before the contract's range check."""
    ((name, value),) = fields.items()
    return f"{name}: must be finite, got {value}" if message is not None and not math.isfinite(value) else message


SAMPLING_CASES.extend((fields, message, _sdk_verdict(fields, message)) for fields, message in PENALTY_CASES)


@pytest.mark.parametrize(("fields", "message"), PENALTY_CASES, ids=[str(f) for f, _ in PENALTY_CASES])
def test_penalty_fields_verdicts(fields: dict[str, Any], message: str | None) -> None:
    def check() -> None:
        contract.check_sampling(temperature=0.7, top_p=1.0, top_k=0, seed=None, stop=(), **fields)

    if message is None:
        check()
    else:
        with pytest.raises(contract.ContractError, match=f"^{re.escape(message)}$"):
            check()
        with pytest.raises(InvalidRequest) as caught:  # the SDK says "must be finite" for inf and nan first
            build_inputs("hi", **fields)
        assert caught.value.field == next(iter(fields))


def test_penalty_tensors_are_the_fields_in_capitals() -> None:
    """The SDK sends each penalty as its field's name in capitals, FP32, and the ensemble declares each."""
    inputs = build_inputs("hi", repetition_penalty=1.5, frequency_penalty=-0.5, presence_penalty=0.25, min_p=0.125)
    got = {i.name(): i.datatype() for i in inputs}
    ensemble = (REPO / "model_repository/constrained_llm/config.pbtxt.in").read_text()
    pre = (REPO / "model_repository/preprocessing/config.pbtxt.in").read_text()
    for name in contract.PENALTY_FIELDS:
        line = f'{{ name: "{name.upper()}", data_type: TYPE_FP32, dims: [ 1 ], optional: true }}'
        assert line in ensemble and line in pre, name
        assert f'input_map {{ key: "{name.upper()}" value: "{name.upper()}" }}' in ensemble, name
        assert got[name.upper()] == "FP32"


_LOGPROBS_REFUSAL = "logprobs: must be null (off) or an integer in 0..20 (alternatives per token), got {!r}"
# (value, verdict): None = accepted, else the exact message, the same from the contract, the SDK and preprocessing.
LOGPROBS_CASES: list[tuple[Any, str | None]] = [
    (None, None), (0, None), (1, None), (contract.MAX_TOP_LOGPROBS, None),
    (-1, _LOGPROBS_REFUSAL.format(-1)), (contract.MAX_TOP_LOGPROBS + 1, _LOGPROBS_REFUSAL.format(21)),
    (True, _LOGPROBS_REFUSAL.format(True)), (2.0, _LOGPROBS_REFUSAL.format(2.0)), ("3", _LOGPROBS_REFUSAL.format("3")),
]


@pytest.mark.parametrize(("value", "verdict"), LOGPROBS_CASES, ids=[repr(v) for v, _ in LOGPROBS_CASES])
def test_client_and_server_give_logprobs_its_verdict(value: Any, verdict: str | None) -> None:
    contract_says = _message_or_none(lambda: contract.check_logprobs(value), (contract.ContractError,))
    client = _message_or_none(lambda: build_inputs("hi", logprobs=value), (InvalidRequest,))
    server = _message_or_none(lambda: parse_params(RawRequest(prompt=b"hi", logprobs=value),
                                                   PreprocessConfig(tokenizer="unused")), (InvalidArgument,))
    assert (contract_says, client, server) == (verdict, verdict, verdict)
    if verdict is None:
        assert contract.check_logprobs(value) == value


def test_logprobs_tensors_are_declared_end_to_end() -> None:
    """LOGPROBS: an INT32 request input (SDK -> ensemble -> preprocessing); TOKEN_LOGPROBS: BYTES, llm ->
    postprocessing -> client."""
    (tensor,) = [i for i in build_inputs("hi", logprobs=3) if i.name() == "LOGPROBS"]
    assert tensor.datatype() == "INT32"
    assert "LOGPROBS" not in {i.name() for i in build_inputs("hi")}  # absent: off, the request as before
    repo = REPO / "model_repository"
    line = '{ name: "LOGPROBS", data_type: TYPE_INT32, dims: [ 1 ], optional: true }'
    assert line in (repo / "constrained_llm/config.pbtxt.in").read_text()
    assert line in (repo / "preprocessing/config.pbtxt.in").read_text()
    # The entries come back as TOKEN_LOGPROBS (an ensemble's tensors share one namespace, so not LOGPROBS).
    out = '{ name: "TOKEN_LOGPROBS", data_type: TYPE_STRING, dims: [ 1 ] }'
    for model in ("constrained_llm", "llm", "postprocessing"):
        assert out in (repo / f"{model}/config.pbtxt.in").read_text(), model
    ensemble = (repo / "constrained_llm/config.pbtxt.in").read_text()
    for mapping in ('input_map { key: "LOGPROBS" value: "LOGPROBS" }',
                    'output_map { key: "TOKEN_LOGPROBS" value: "_TOKEN_LOGPROBS" }',
                    'input_map { key: "TOKEN_LOGPROBS" value: "_TOKEN_LOGPROBS" }',
                    'output_map { key: "TOKEN_LOGPROBS" value: "TOKEN_LOGPROBS" }'):
        assert mapping in ensemble, mapping


def test_every_layer_reads_the_contract() -> None:
    """One home: the server modules hold the contract's own objects, not copies."""
    from client import constraints, sdk

    assert spec.OPTION_NAMES is contract.OPTION_NAMES
    assert spec.ON_BUDGET is contract.POLICIES["on_budget"] is constraints.ON_BUDGET
    assert spec.SpecLimits().max_payload_bytes == contract.MAX_CONSTRAINT_BYTES == constraints.MAX_CONSTRAINT_BYTES
    assert tuple(protocol.CLOSE_STATE_REASONS.values()) == contract.CLOSE_REASONS
    assert set(sdk.CLOSE_REASONS) == set(contract.CLOSE_REASONS)
    assert postprocess.FINISH_REASONS is contract.FINISH_REASONS
    assert set(sdk.FINISH_REASONS) == set(contract.FINISH_REASONS)
    assert constraints.KINDS == set(contract.CONSTRAINT_KINDS) == {k.value for k in spec.ConstraintKind}
    # reasoning rides in the options but is the REASONING field's (contract.reasoning), not a grammar option
    assert dataclasses.asdict(spec.ConstraintOptions()) == {**contract.check_options("json_schema", {}),
                                                            "reasoning": None}
    assert "reasoning" not in contract.OPTION_NAMES


def test_every_layer_takes_the_contract_payload_limits() -> None:
    from client import constraints
    from triton_support.service import GrammarModelConfig

    pre = PreprocessConfig(tokenizer="unused")
    gram = GrammarModelConfig(tokenizer="unused")
    limits = spec.SpecLimits()
    assert (pre.max_payload_bytes, gram.max_payload_bytes, limits.max_payload_bytes,
            constraints.MAX_CONSTRAINT_BYTES) == (contract.MAX_CONSTRAINT_BYTES,) * 4
    assert (pre.max_depth, gram.max_depth, limits.max_depth) == (contract.MAX_CONSTRAINT_DEPTH,) * 3
