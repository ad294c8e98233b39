"""The grammar model's logic without Triton: config parsing and request dispatch."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.bitmask import allowed_tokens
from grammar_backend.errors import (
    CompileError,
    ConfigError,
    ConstraintError,
    DuplicateSequence,
    GrammarError,
)
from grammar_backend.protocol import CloseState, MaskStep
from grammar_backend.spec import parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from tests.support import assets
from tests.unit.conftest import TINY_STOP, TINY_VOCAB_SIZE, tiny_encode
from triton_support.params import from_parameters, parameter_values
from triton_support.service import (
    GrammarModelConfig,
    GrammarReply,
    GrammarRequest,
    GrammarService,
)


@dataclass(frozen=True)
class Sample:
    path: str
    count: int = 3
    ratio: float = 0.5
    flag: bool = False
    maybe: str | None = "x"
    ids: tuple[int, ...] = ()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"path": "/m"}, Sample("/m")),
        ({"path": "/m", "count": "7", "ratio": "2", "flag": "true", "maybe": "", "ids": "1,2"},
         Sample("/m", 7, 2.0, True, None, (1, 2))),
        ({"path": "/m", "ids": "[3, 4]"}, Sample("/m", ids=(3, 4))),
    ],
)
def test_from_parameters(params: dict[str, str], expected: Sample) -> None:
    assert from_parameters(Sample, params, "m") == expected


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"path": "/m", "colour": "red"}, r"^m: unknown parameter 'colour'; known: count, flag, ids, maybe, path, ratio$"),
        ({"path": "${MODEL_DIR}"}, r"^m: parameter 'path' has an unfilled placeholder '\$\{MODEL_DIR\}'$"),
        ({}, r"^m: missing required parameter 'path'$"),
        ({"path": "/m", "count": "many"}, r"^m: parameter 'count': invalid literal for int"),
        ({"path": "/m", "flag": "yes"}, r"^m: parameter 'flag': expected true or false, got 'yes'$"),
    ],
)
def test_from_parameters_fails_loudly(params: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        from_parameters(Sample, params, "m")


def test_parameter_values_reads_triton_config() -> None:
    config = {"parameters": {"a": {"string_value": "1"}, "b": {"string_value": ""}}}
    assert parameter_values(config) == {"a": "1", "b": ""}
    assert parameter_values({}) == {}


def test_model_config_builds_engine_config() -> None:
    cfg = from_parameters(GrammarModelConfig, {"tokenizer": "/t", "max_batch": "16", "compile_timeout_s": "3",
                                               "store_dir": "", "compile_queue": "5", "compile_cpu_s": "7",
                                               "compile_memory_bytes": "1000000", "max_grammar_bytes": "2000"},
                          "grammar")
    engine_cfg = cfg.engine_config()
    assert (engine_cfg.max_batch, engine_cfg.cache.timeout_s, engine_cfg.cache.store_dir) == (16, 3.0, None)
    assert engine_cfg.cache.max_queued == 5
    assert (engine_cfg.workers.cpu_s, engine_cfg.workers.memory_bytes, engine_cfg.workers.max_grammar_bytes) == (
        7.0, 1_000_000, 2000)


@pytest.fixture()
def service(tiny_info: xgr.TokenizerInfo) -> Iterator[GrammarService]:
    svc = GrammarService(GrammarEngine(tiny_info, "fp", GrammarEngineConfig(max_batch=4), encode=tiny_encode))
    yield svc
    svc.engine.close()


def _start(svc: GrammarService, sid: int, kind: str, payload: str, options: str = "") -> int:
    reply = svc.handle(GrammarRequest("start", np.array([sid], np.uint64), grammar_type=kind,
                                      grammar=payload.encode(), grammar_options=options.encode()))
    return reply.active


def _answer(reply: GrammarReply) -> MaskStep:
    assert reply.step is not None and not reply.bitmask_in_buffer
    return reply.step


def test_start_step_end_cycle(service: GrammarService) -> None:
    assert _start(service, 5, "regex", "ab") == 1
    reply = service.handle(GrammarRequest("step", np.array([5, 6], np.uint64),
                                          np.array([tiny_encode("ab"), [0, 0]], np.int32), np.array([2, 0], np.int32)))
    answer = _answer(reply)
    assert answer.errors == (None, "sequence 6: not active (never started, ended or evicted)")
    assert answer.bitmask.shape == (2, 10) and answer.terminated.tolist() == [False, False]
    reply = service.handle(GrammarRequest("step", np.array([5], np.uint64), np.array([[TINY_STOP]], np.int32),
                                          np.array([1], np.int32)))
    assert _answer(reply).terminated.tolist() == [True]
    stats = json.loads(service.handle(GrammarRequest("stats", np.zeros(0, np.uint64))).stats or "")
    assert (stats["active"], stats["misses"], stats["compiles"]) == (1, 1, 1)
    assert service.handle(GrammarRequest("end", np.array([5], np.uint64))).active == 0


def test_a_budget_given_at_start_closes_the_output(service: GrammarService) -> None:
    """Tiny vocabulary (one token per byte): "[a-z]+!" with 4 tokens left after "abc" forces "!" then the stop."""
    service.handle(GrammarRequest("start", np.array([2], np.uint64), grammar_type="regex", grammar=b"[a-z]+!",
                                  budget=5))
    reply = service.handle(GrammarRequest("step", np.array([2], np.uint64), np.array([tiny_encode("abc")], np.int32),
                                          np.array([3], np.int32)))
    answer = _answer(reply)
    assert answer.closing is not None and answer.closing.tolist() == [CloseState.BUDGET]
    assert allowed_tokens(answer.bitmask[0], TINY_VOCAB_SIZE).tolist() == [ord("!")]
    reply = service.handle(GrammarRequest("step", np.array([2], np.uint64), np.array([[ord("!")]], np.int32),
                                          np.array([1], np.int32)))
    assert allowed_tokens(_answer(reply).bitmask[0], TINY_VOCAB_SIZE).tolist() == [TINY_STOP]


def test_jump_forward_reply(service: GrammarService) -> None:
    _start(service, 1, "choice", '["alpha"]')
    reply = service.handle(GrammarRequest("step", np.array([1], np.uint64), None, np.array([0], np.int32),
                                          jump_forward=True))
    # The last 'a' is kept: "ab" and "abc" extend it in the vocabulary, but the grammar ends after "alpha".
    answer = _answer(reply)
    assert answer.forced_counts is not None and answer.forced_counts.tolist() == [5]
    assert answer.forced_tokens is not None and bytes(answer.forced_tokens[0].tolist()) == b"alpha"


@pytest.mark.parametrize(
    ("request_", "error", "match"),
    [
        (GrammarRequest("fly", np.zeros(0, np.uint64)), ConstraintError, r"^OP: unknown op 'fly'; expected one of"),
        (GrammarRequest("start", np.array([1, 2], np.uint64), grammar_type="regex", grammar=b"a"),
         ConstraintError, r"^SEQUENCE_ID: start takes exactly one sequence, got 2$"),
        (GrammarRequest("start", np.array([1], np.uint64), grammar_type="json_schema", grammar=b"{"),
         ConstraintError, r"^grammar: invalid JSON at line 1 column 2"),
        (GrammarRequest("start", np.array([1], np.uint64), grammar_type="regex", grammar=b"(a"),
         CompileError, r"^grammar: xgrammar cannot compile this regex"),
        (GrammarRequest("start", np.array([7], np.uint64), grammar_type="regex", grammar=b"a"),
         DuplicateSequence, r"^sequence 7: already started$"),
        (GrammarRequest("start", np.array([1], np.uint64), grammar_type="regex", grammar=b"a", budget=-3),
         ConstraintError, r"^MAX_TOKENS: must be >= 0 \(0: no budget closing\), got -3$"),
    ],
)
def test_request_errors(service: GrammarService, request_: GrammarRequest, error: type[Exception],
                        match: str) -> None:
    _start(service, 7, "regex", "a")
    with pytest.raises(error, match=match):
        service.handle(request_)
    assert service.engine.active_count == 1
    if request_.op == "start":  # the asynchronous start reports the same error through its callback
        outcomes: list[GrammarReply | GrammarError] = []
        done = threading.Event()
        service.start_async(request_, _collect(outcomes, done))
        assert done.wait(60)
        assert len(outcomes) == 1 and isinstance(outcomes[0], error) and re.search(match, str(outcomes[0]))


def _collect(outcomes: list[GrammarReply | GrammarError], done: threading.Event
             ) -> Callable[[GrammarReply | GrammarError], None]:
    def on_done(outcome: GrammarReply | GrammarError) -> None:
        outcomes.append(outcome)
        done.set()
    return on_done


def test_start_async_replies_once_the_matcher_exists(service: GrammarService) -> None:
    outcomes: list[GrammarReply | GrammarError] = []
    done = threading.Event()
    service.start_async(GrammarRequest("start", np.array([3], np.uint64), grammar_type="regex", grammar=b"[0-9]+"),
                        _collect(outcomes, done))
    assert done.wait(60)
    assert outcomes == [GrammarReply(active=1, backend="xgrammar")]
    assert 3 in service.engine.table


def test_build_engine_from_a_real_model_folder() -> None:
    folder = assets.smollm2_dir()
    engine = GrammarModelConfig(tokenizer=str(folder)).build_engine()
    try:
        assert engine.vocab_size == 49152 and engine.bitmask.width == 1536
    finally:
        engine.close()


def test_a_validated_start_is_trusted(service: GrammarService, monkeypatch: pytest.MonkeyPatch) -> None:
    """`llm` forwards preprocessing's wire form with VALIDATED: no limit or meta-schema check runs again."""
    from grammar_backend import spec as spec_module

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a validated constraint was validated again")

    wire = spec_module.parse_constraint("json_schema", '{"type": "object", "properties": {"svc_v": {"type": "integer"}}}',
                                        '{"strict": true}').wire()
    monkeypatch.setattr(spec_module, "check_schema", never)
    monkeypatch.setattr(spec_module, "parse_options", never)
    request = GrammarRequest("start", np.array([7], np.uint64), grammar_type=wire["kind"],
                             grammar=wire["payload"].encode(), grammar_options=wire["options"].encode(), validated=True)
    assert service.handle(request).active == 1
    with pytest.raises(AssertionError, match="validated again"):
        service.handle(GrammarRequest("start", np.array([8], np.uint64), grammar_type="json_schema",
                                      grammar=b'{"type": "object", "properties": {"svc_w": {}}}'))


def test_a_tokenizer_llguidance_cannot_take_leaves_it_off(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    folder = assets.smollm2_dir()

    def slow_only(*args: object, **kwargs: object) -> None:
        raise ValueError("Only fast tokenizers are supported")

    monkeypatch.setattr("triton_support.service.LlgBackend", slow_only)
    engine = GrammarModelConfig(tokenizer=str(folder)).build_engine()
    try:
        assert engine.llg is None
        assert "the llguidance backend is off" in caplog.text and "Only fast tokenizers are supported" in caplog.text
        with pytest.raises(CompileError, match=r"^grammar_options\.backend: llguidance is not available on this server$"):
            engine.start(1, parse_constraint("regex", "a", {"backend": "llguidance"}))
    finally:
        engine.close()
