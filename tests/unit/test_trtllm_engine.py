"""The TensorRT-LLM engine: what runs without the package, and the real thing where it is installed.

The engine over TensorRT-LLM's executor as emulated is
tests/unit/test_trtllm_generator.py; the real package, on a GPU, in the image,
is tests/gpu (``make test-gpu``, deploy/gpu/README.md).  The grammar rows are
tests/unit/test_grammar_hook.py's, with the real torch model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import json
import pickle
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from grammar_backend.errors import ConfigError, InvalidArgument
from llm_runtime.errors import EngineStalled, RequestError
from llm_runtime.grammar_hook import GrammarRows
from llm_runtime.mask import ConstraintRequest
from llm_runtime.model_config import ENGINE_GRAMMAR_MODES, LlmModelConfig
from llm_runtime.sampler import SamplingParams
from llm_runtime.trtllm_api import TRTLLM_GUIDED_API, TRTLLM_VERSION, check_trtllm_api
from llm_runtime.trtllm_engine import (
    TrtllmConfig,
    native_guided_kwargs,
    next_output,
    occupancy,
    trtllm_sampling_kwargs,
)
from triton_support.params import from_parameters

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


@pytest.mark.parametrize(
    ("params", "mode"),
    [
        ({"model_dir": "m"}, "overlap"),
        ({"model_dir": "m", "grammar_mode": "processor"}, "processor"),
        ({"model_dir": "m", "engine": "tensorrt_llm"}, "processor"),
        ({"model_dir": "m", "engine": "tensorrt_llm", "grammar_mode": "native"}, "native"),
    ],
)
def test_grammar_mode_defaults_per_engine(params: dict[str, str], mode: str) -> None:
    assert from_parameters(LlmModelConfig, params, "llm").mode == mode


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"engine": "vllm"}, "engine must be one of torch, tensorrt_llm, got 'vllm'"),
        ({"grammar_mode": "native"}, "engine 'torch' takes grammar_mode overlap, processor, got 'native'"),
        ({"engine": "tensorrt_llm", "grammar_mode": "overlap"},
         "engine 'tensorrt_llm' takes grammar_mode processor, native, got 'overlap'"),
        ({"trtllm_backend": "tensorrt"}, "unknown parameter 'trtllm_backend'"),
        ({"kv_cache_free_fraction": "0.5"}, "kv_cache_free_fraction applies to engine 'tensorrt_llm' only"),
        ({"kv_cache": "1"}, "unknown parameter 'kv_cache'"),
        ({"trtllm_sampler": "TRTLLMSampler"}, "trtllm_sampler applies to engine 'tensorrt_llm' only"),
        ({"engine": "tensorrt_llm", "max_prefill_tokens": "4096"}, "max_prefill_tokens applies to engine 'torch' only"),
        ({"max_prefill_tokens": "1k"}, "parameter 'max_prefill_tokens': invalid literal"),
        ({"draft_tokens": "17"}, r"draft_tokens must be in 0\.\.16, got 17"),
        ({"engine": "tensorrt_llm", "draft_tokens": "4"},
         ("draft_tokens \\(prompt-lookup speculation\\) applies to engine 'torch' only; TensorRT-LLM speculates "
          "as trtllm_speculative_config sets it")),
        ({"engine": "tensorrt_llm", "trtllm_sampler": "auto"},
         "trtllm_sampler must be one of TorchSampler, TRTLLMSampler or empty, got 'auto'"),
    ],
)
def test_llm_config_refuses(params: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_parameters(LlmModelConfig, {"model_dir": "m", **params}, "llm")


def test_engine_grammar_modes_are_the_engines_own() -> None:
    from llm_runtime.scheduler import SCHEDULER_GRAMMAR_MODES
    from llm_runtime.trtllm_engine import TRTLLM_GRAMMAR_MODES

    assert ENGINE_GRAMMAR_MODES == {"torch": SCHEDULER_GRAMMAR_MODES, "tensorrt_llm": TRTLLM_GRAMMAR_MODES}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"grammar_mode": "overlap"}, "grammar_mode: engine tensorrt_llm takes processor, native"),
        ({"max_batch": 0}, "max_batch: must be a positive integer"),
        ({"tensor_parallel_size": 2}, "1 GPU per replica, or use 'native'"),
        ({"kv_cache_free_fraction": 1.0}, r"kv_cache_free_fraction: must be in \(0, 1\)"),
        ({"stall_timeout_s": 0}, r"stall_timeout_s: must be in \(0, 3600\]"),
    ],
)
def test_trtllm_config_refuses(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrtllmConfig(**{"model_dir": "m", "max_batch": 8, "max_seq_len": 1024, **fields})  # type: ignore[arg-type]


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_tensorrt_llm_is_refused_with_the_reason_where_it_is_missing(tmp_path: Path) -> None:
    config = from_parameters(LlmModelConfig, {"model_dir": str(tmp_path), "engine": "tensorrt_llm"}, "llm")
    with pytest.raises(ConfigError, match=r"needs the tensorrt_llm package and a CUDA GPU .*use engine 'torch'"):
        config.build(None)  # type: ignore[arg-type]


SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}}}'
#: Native mode cuts the output at max_tokens: what every on_budget does there.
TRUNCATE = '{"on_budget": "truncate"}'


@pytest.mark.parametrize(
    ("kind", "payload", "options", "expected"),
    [
        ("json_schema", SCHEMA, TRUNCATE, {"json": SCHEMA}),
        ("json_object", "", TRUNCATE, {"json": "{\"type\":\"object\"}"}),
        ("regex", "[a-z]+", TRUNCATE, {"regex": "[a-z]+"}),
        # TensorRT-LLM's xgrammar gets the pattern with ECMA-262's meaning written out (regex_dialect).
        ("regex", "\\d.", TRUNCATE, {"regex": "[0-9][^\\n\\r\u2028\u2029]"}),
        ("ebnf", 'root ::= "x"', TRUNCATE, {"grammar": 'root ::= "x"'}),
        ("choice", '["a b", "c\\"d"]', TRUNCATE, {"grammar": 'root ::= "a b" | "c\\"d"'}),
        # The other decoding policies are ours; native mode does not refuse them.
        ("regex", "x", '{"on_budget": "truncate", "on_repeat": "continue"}', {"regex": "x"}),
    ],
)
def test_native_guided_kwargs(kind: str, payload: str, options: str, expected: dict[str, object]) -> None:
    assert native_guided_kwargs(ConstraintRequest(kind, payload, options)) == expected


def test_native_guided_structural_tag() -> None:
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    out = native_guided_kwargs(ConstraintRequest("structural_tag", json.dumps(tag), TRUNCATE))
    assert json.loads(out["structural_tag"]) == tag


@pytest.mark.parametrize(
    ("kind", "payload", "options", "field"),
    [
        ("lark", 'start: "x"', TRUNCATE, "grammar_type"),
        ("json_schema", SCHEMA, '{"whitespace": "any"}', "options"),
        ("json_schema", SCHEMA, '{"strict": true}', "options"),
        ("json_object", "", '{"indent": 2}', "options"),
    ],
)
def test_native_refuses_what_it_cannot_express(kind: str, payload: str, options: str, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}: .*native grammar mode"):
        native_guided_kwargs(ConstraintRequest(kind, payload, options))


@pytest.mark.parametrize("options", ["", '{"on_budget": "close"}', TRUNCATE])
def test_native_serves_every_on_budget_as_truncate(options: str) -> None:
    """TensorRT-LLM's decoder cannot close before max_tokens: the default ``close`` is served (as truncate), as documented."""
    assert native_guided_kwargs(ConstraintRequest("regex", "x", options)) == {"regex": "x"}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((16, 0.0, 0, 1.0, None, {7, 3}),
         {"max_tokens": 16, "end_id": 3, "pad_id": 3, "stop_token_ids": [7], "detokenize": False, "n": 1,
          "top_k": 1}),
        ((8, 0.7, 40, 0.9, 5, {2}),
         {"max_tokens": 8, "end_id": 2, "pad_id": 2, "stop_token_ids": None, "detokenize": False, "n": 1,
          "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 5}),
        ((8, 1.0, 0, 1.0, None, {2}),
         {"max_tokens": 8, "end_id": 2, "pad_id": 2, "stop_token_ids": None, "detokenize": False, "n": 1,
          "temperature": 1.0, "top_k": None, "top_p": 1.0}),
    ],
)
def test_sampling_mapping(args: tuple[object, ...], expected: dict[str, object]) -> None:
    assert trtllm_sampling_kwargs(*args) == expected  # type: ignore[arg-type]


_BASE = {"max_tokens": 8, "end_id": 2, "pad_id": 2, "stop_token_ids": None, "detokenize": False, "n": 1}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param(SamplingParams(temperature=0.0), {"top_k": 1}, id="neutral-adds-nothing"),
        pytest.param(SamplingParams(temperature=0.0, repetition_penalty=1.2, min_p=0.1),
                     {"top_k": 1, "repetition_penalty": 1.2}, id="greedy-drops-min-p"),
        pytest.param(SamplingParams(temperature=0.5, frequency_penalty=0.5, min_p=0.1),
                     {"temperature": 0.5, "top_k": None, "top_p": 1.0, "frequency_penalty": 0.5, "min_p": 0.1,
                      "prompt_ignore_length": 11}, id="frequency-skips-the-prompt"),
        pytest.param(SamplingParams(temperature=0.0, presence_penalty=-1.0),
                     {"top_k": 1, "presence_penalty": -1.0, "prompt_ignore_length": 11}, id="presence"),
    ],
)
def test_penalty_mapping_under_trtllm_sampler(params: SamplingParams, expected: dict[str, object]) -> None:
    got = trtllm_sampling_kwargs(8, params.temperature, 0, 1.0, None, {2}, penalties=params, prompt_len=11,
                                 sampler_type="TRTLLMSampler")
    assert got == {**_BASE, **expected}


@pytest.mark.parametrize("field", ["repetition_penalty", "frequency_penalty", "presence_penalty", "min_p"])
def test_torch_sampler_refuses_penalties_by_name(field: str) -> None:
    params = dataclasses.replace(SamplingParams(temperature=0.7), **{field: 0.5})  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=f"^{field}: is not applied by TensorRT-LLM 1.2.1's TorchSampler; "):
        trtllm_sampling_kwargs(8, 0.7, 0, 1.0, None, {2}, penalties=params, prompt_len=3)
    assert "top_k" in trtllm_sampling_kwargs(8, 0.7, 0, 1.0, None, {2}, penalties=SamplingParams(temperature=0.7))


def test_sampler_type_checked() -> None:
    with pytest.raises(ConfigError, match="sampler_type"):
        TrtllmConfig(model_dir="m", max_batch=8, max_seq_len=1024, sampler_type="auto")


@pytest.mark.parametrize(
    ("live", "compiling", "max_batch", "expected"),
    [
        (0, 0, 64, (0, 0)),
        (5, 2, 64, (3, 2)),     # two compile here, three decode
        (70, 0, 64, (64, 6)),   # six queue inside TensorRT-LLM
        (70, 4, 64, (64, 6)),   # four compile, two queue there
        (3, 3, 64, (0, 3)),
    ],
)
def test_gpu_occupancy_gauges(live: int, compiling: int, max_batch: int, expected: tuple[int, int]) -> None:
    assert occupancy(live, compiling, max_batch) == expected


@pytest.mark.parametrize(
    ("kwargs", "guided"),
    [
        (trtllm_sampling_kwargs(16, 0.0, 0, 1.0, None, {7, 3}), {"regex": GrammarRows.guide(2**64 - 1)}),
        (trtllm_sampling_kwargs(8, 0.7, 40, 0.9, 5, {2}), native_guided_kwargs(ConstraintRequest("json_schema", SCHEMA, TRUNCATE))),
    ],
    ids=["processor", "native"],
)
def test_pickle_round_trip_of_what_tensorrt_llm_carries(kwargs: dict[str, object], guided: dict[str, str]) -> None:
    """TensorRT-LLM 1.2 pickles every new request (sampling params and guided params), even at world size 1:
    the engine hands it plain values only, so the round trip is exact (no processor object rides along)."""
    carried = {**kwargs, "guided_decoding": guided}
    assert pickle.loads(pickle.dumps(carried, protocol=pickle.HIGHEST_PROTOCOL)) == carried
    assert {type(v) for v in carried.values()} <= {int, float, bool, str, list, dict, type(None)}


def test_pickle_guide_names_its_sequence() -> None:
    assert GrammarRows.guide(42) == "constrained-llm-sequence-42"


def method_with(params: tuple[str, ...]) -> object:
    """A function whose signature has exactly these parameter names."""
    def method(*args: object) -> None:
        del args

    method.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])
    return method


def trtllm_like(drop: tuple[str, str] | None = None, params: tuple[str, str, tuple[str, ...]] | None = None,
                ) -> tuple[types.ModuleType, types.ModuleType]:
    """Modules shaped as TRTLLM_GUIDED_API says (built from that table), with one member dropped or changed."""
    guided = types.ModuleType("guided_decoder")
    for cls_name, members in TRTLLM_GUIDED_API.items():
        body: dict[str, object] = {}
        for name, args in members.items():
            if drop == (cls_name, name):
                continue
            if params is not None and params[:2] == (cls_name, name):
                args = params[2]
            body[name] = method_with(args) if args is not None else object()
        setattr(guided, cls_name, type(cls_name, (), body))
    creator = types.ModuleType("py_executor_creator")
    creator.GuidedDecoder = guided.GuidedDecoder  # type: ignore[attr-defined]
    return guided, creator


def test_trtllm_api_check_accepts_the_api_it_was_written_for() -> None:
    check_trtllm_api(*trtllm_like())


@pytest.mark.parametrize(
    ("drop", "params", "message"),
    [
        (("GuidedDecoder", "_build"), None, "GuidedDecoder._build is missing"),
        (None, ("GuidedDecoder", "_build", ("self", "requests", "runtime_draft_len")),
         r"GuidedDecoder._build takes \(self, requests, runtime_draft_len\), expected \(self, requests\)"),
        (("GuidedRequests", "valid_requests_with_offsets"), None,
         "GuidedRequests.valid_requests_with_offsets is missing"),
        (("GuidedRequest", "new_token"), None, "GuidedRequest.new_token is missing"),
    ],
)
def test_trtllm_api_check_names_what_differs(drop: tuple[str, str] | None,
                                             params: tuple[str, str, tuple[str, ...]] | None, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"not the {TRTLLM_VERSION} API this engine hooks: .*{message}"):
        check_trtllm_api(*trtllm_like(drop, params))


def test_trtllm_api_check_needs_the_creator_to_build_it_by_name() -> None:
    guided, creator = trtllm_like()
    creator.GuidedDecoder = type("Other", (), {})  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="py_executor_creator does not build GuidedDecoder by that name"):
        check_trtllm_api(guided, creator)


def test_trtllm_api_check_reads_dataclass_fields() -> None:
    """GuidedRequest is a slotted dataclass in TensorRT-LLM: its fields count even without class attributes."""
    guided, creator = trtllm_like()
    fields = [n for n, a in TRTLLM_GUIDED_API["GuidedRequest"].items() if a is None]
    methods = {n: getattr(guided.GuidedRequest, n) for n, a in TRTLLM_GUIDED_API["GuidedRequest"].items() if a}
    guided.GuidedRequest = dataclass(slots=True)(type("GuidedRequest", (), {  # type: ignore[attr-defined]
        "__annotations__": dict.fromkeys(fields, "object"), **methods}))
    check_trtllm_api(guided, creator)


async def _outputs(delays: list[float]) -> AsyncIterator[int]:
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield i


@pytest.mark.parametrize(("delays", "expected"), [([0, 0], [0, 1]), ([0, 5.0], EngineStalled)])
def test_waits_on_tensorrt_llm_are_bounded(delays: list[float], expected: object) -> None:
    async def collect() -> list[int]:
        it, got = _outputs(delays), []
        while True:
            try:
                got.append(await next_output(it, 0.2))
            except StopAsyncIteration:
                return got

    if expected is EngineStalled:
        with pytest.raises(EngineStalled, match="TensorRT-LLM sent no output for 0.2 s"):
            asyncio.run(collect())
    else:
        assert asyncio.run(collect()) == expected
