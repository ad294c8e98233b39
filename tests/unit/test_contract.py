"""The request contract: the client's builders and the server's validation accept exactly the same requests.

Every option of every constraint kind and every sampling field, at its bounds
and just past them, goes through the client (``Constraint``, ``build_inputs``)
and through the server (``parse_constraint``, preprocessing's
``parse_params``): both accept, or both refuse naming the same field.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

import contract
from client import Constraint
from client.errors import InvalidConstraint, InvalidRequest
from client.sdk import build_inputs
from grammar_backend import closing, spec
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

OPTION_CASES: list[tuple[str, Any]] = [
    ("strict", True), ("strict", False), ("strict", "yes"), ("strict", 1),
    ("any_order", True), ("any_order", None),
    ("whitespace", "compact"), ("whitespace", "any"), ("whitespace", "tabs"), ("whitespace", 0),
    ("whitespace", contract.MAX_WHITESPACE_RUN), ("whitespace", contract.MAX_WHITESPACE_RUN + 1),
    ("whitespace", -1), ("whitespace", True),
    ("indent", None), ("indent", 0), ("indent", contract.MAX_INDENT), ("indent", contract.MAX_INDENT + 1),
    ("indent", -1), ("indent", 1.5),
    ("on_budget", "close"), ("on_budget", "truncate"), ("on_budget", "stop"),
    ("on_repeat", "close"), ("on_repeat", "continue"), ("on_repeat", None),
    ("jump_forward", True), ("jump_forward", False), ("jump_forward", "on"), ("jump_forward", 0),
    ("backend", "auto"), ("backend", "xgrammar"), ("backend", "llguidance"), ("backend", "outlines"),
    ("value_retries", 0), ("value_retries", contract.MAX_VALUE_RETRIES), ("value_retries", contract.MAX_VALUE_RETRIES + 1),
    ("value_retries", -1), ("value_retries", True), ("value_retries", 2.0),
    ("colour", "red"),
]


def _field_or_ok(call: Any, errors: tuple[type[Exception], ...]) -> str:
    try:
        call()
    except errors as err:
        return str(err).split(":", 1)[0]
    return "ok"


@pytest.mark.parametrize("kind", contract.CONSTRAINT_KINDS)
@pytest.mark.parametrize(("name", "value"), OPTION_CASES)
def test_client_and_server_agree_on_every_option(kind: str, name: str, value: Any) -> None:
    options = {name: value}
    client = _field_or_ok(lambda: Constraint(kind, PAYLOADS[kind], options), (InvalidConstraint,))
    server = _field_or_ok(lambda: spec.parse_constraint(kind, PAYLOADS[kind], options), (ConstraintError,))
    assert client == server, (kind, options)


def test_the_option_table_covers_every_option() -> None:
    assert {name for name, _ in OPTION_CASES} == {*contract.OPTION_NAMES, "colour"}


def test_json_options_apply_to_the_json_kinds_only() -> None:
    for kind in contract.CONSTRAINT_KINDS:
        outcome = _field_or_ok(lambda k=kind: spec.parse_constraint(k, PAYLOADS[k], {"strict": True}), (ConstraintError,))
        assert (outcome == "ok") == (kind in contract.JSON_OPTION_KINDS), kind


SAMPLING_CASES: list[dict[str, Any]] = [
    {"temperature": 0.0}, {"temperature": contract.MAX_TEMPERATURE}, {"temperature": contract.MAX_TEMPERATURE + 0.5},
    {"temperature": -0.1}, {"temperature": float("nan")},
    {"top_p": 1.0}, {"top_p": 0.01}, {"top_p": 0.0}, {"top_p": 1.01},
    {"top_k": 0}, {"top_k": 1}, {"top_k": contract.MAX_TOP_K}, {"top_k": -1},
    {"seed": 0}, {"seed": contract.SEED_LIMIT - 1},
    {"stop": ["a"] * contract.MAX_STOP_STRINGS}, {"stop": ["a"] * (contract.MAX_STOP_STRINGS + 1)},
    {"stop": ["x" * contract.MAX_STOP_CHARS]}, {"stop": ["x" * (contract.MAX_STOP_CHARS + 1)]}, {"stop": [""]},
]


@pytest.mark.parametrize("fields", SAMPLING_CASES, ids=lambda f: ",".join(f"{k}={str(v)[:12]}" for k, v in f.items()))
def test_client_and_server_agree_on_sampling(fields: dict[str, Any]) -> None:
    client = _field_or_ok(lambda: build_inputs("hi", **fields), (InvalidRequest,))
    raw = RawRequest(prompt=b"hi", temperature=fields.get("temperature"), top_p=fields.get("top_p"),
                     top_k=fields.get("top_k"), seed=fields.get("seed"),
                     stop=tuple(s.encode() for s in fields.get("stop", ())),
                     **{name: fields.get(name) for name in contract.PENALTY_FIELDS})
    server = _field_or_ok(lambda: parse_params(raw, PreprocessConfig(tokenizer="unused")), (InvalidArgument,))
    assert client == server, fields


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
SAMPLING_CASES.extend(fields for fields, _ in PENALTY_CASES)


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


def test_every_layer_reads_the_contract() -> None:
    """One home: the server modules hold the contract's own objects, not copies."""
    from client import constraints, sdk

    assert spec.OPTION_NAMES is contract.OPTION_NAMES
    assert spec.ON_BUDGET is contract.POLICIES["on_budget"] is constraints.ON_BUDGET
    assert spec.SpecLimits().max_payload_bytes == contract.MAX_CONSTRAINT_BYTES == constraints.MAX_CONSTRAINT_BYTES
    assert tuple(closing.CLOSE_REASONS.values()) == contract.CLOSE_REASONS
    assert set(sdk.CLOSE_REASONS) == set(contract.CLOSE_REASONS)
    assert postprocess.FINISH_REASONS is contract.FINISH_REASONS
    assert set(sdk.FINISH_REASONS) == set(contract.FINISH_REASONS)
    assert constraints.KINDS == set(contract.CONSTRAINT_KINDS) == {k.value for k in spec.ConstraintKind}
    assert dataclasses.asdict(spec.ConstraintOptions()) == contract.check_options("json_schema", {})


def test_every_layer_takes_the_contract_payload_limits() -> None:
    from client import constraints
    from triton_support.service import GrammarModelConfig

    pre = PreprocessConfig(tokenizer="unused")
    gram = GrammarModelConfig(tokenizer="unused")
    limits = spec.SpecLimits()
    assert (pre.max_payload_bytes, gram.max_payload_bytes, limits.max_payload_bytes,
            constraints.MAX_CONSTRAINT_BYTES) == (contract.MAX_CONSTRAINT_BYTES,) * 4
    assert (pre.max_depth, gram.max_depth, limits.max_depth) == (contract.MAX_CONSTRAINT_DEPTH,) * 3
