"""The TensorRT-LLM engine: what runs without the package, and the real thing where it is installed.

The ``trtllm`` tests need ``tensorrt_llm`` and a GPU (the NGC
``trtllm-python-py3`` image, see deploy/gpu/README.md); they skip cleanly
elsewhere.  The grammar logic they exercise is the shared processor, which
tests/unit/test_grammar_hook.py drives with the real torch model everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from grammar_backend.errors import ConfigError, InvalidArgument
from grammar_backend.params import from_parameters
from llm_runtime.mask import ConstraintRequest
from llm_runtime.model_config import ENGINE_GRAMMAR_MODES, LlmModelConfig
from llm_runtime.trtllm_engine import (
    TrtllmConfig,
    native_guided_kwargs,
    trtllm_sampling_kwargs,
)

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
        ({"trtllm_backend": "tensorrt"}, "apply to engine 'tensorrt_llm' only"),
        ({"engine_dir": "e"}, "apply to engine 'tensorrt_llm' only"),
        ({"kv_cache": "1"}, "unknown parameter 'kv_cache'"),
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
        ({"backend": "onnx"}, "trtllm_backend: must be one of pytorch, tensorrt, got 'onnx'"),
        ({"grammar_mode": "overlap"}, "grammar_mode: engine tensorrt_llm takes processor, native"),
        ({"max_batch": 0}, "max_batch: must be a positive integer"),
        ({"tensor_parallel_size": 2}, "1 GPU per replica, or use 'native'"),
        ({"kv_cache_free_fraction": 1.0}, r"kv_cache_free_fraction: must be in \(0, 1\)"),
        ({"backend": "tensorrt"}, "engine_dir: is required with trtllm_backend 'tensorrt' and only there"),
        ({"engine_dir": "/e"}, "engine_dir: is required with trtllm_backend 'tensorrt' and only there"),
    ],
)
def test_trtllm_config_refuses(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrtllmConfig(model_dir="m", **fields)  # type: ignore[arg-type]


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_tensorrt_llm_is_refused_with_the_reason_where_it_is_missing(tmp_path: Path) -> None:
    config = from_parameters(LlmModelConfig, {"model_dir": str(tmp_path), "engine": "tensorrt_llm"}, "llm")
    with pytest.raises(ConfigError, match=r"needs the tensorrt_llm package and a CUDA GPU .*use engine 'torch'"):
        config.build(None)  # type: ignore[arg-type]


SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}}}'


@pytest.mark.parametrize(
    ("kind", "payload", "options", "expected"),
    [
        ("json_schema", SCHEMA, "", {"json": SCHEMA}),
        ("json_object", "", "", {"json": "{\"type\":\"object\"}"}),
        ("regex", "[a-z]+", "", {"regex": "[a-z]+"}),
        ("ebnf", 'root ::= "x"', "", {"grammar": 'root ::= "x"'}),
        ("choice", '["a b", "c\\"d"]', "", {"grammar": 'root ::= "a b" | "c\\"d"'}),
        # Decoding policies are ours; native mode ignores them rather than refusing.
        ("regex", "x", '{"on_budget": "truncate"}', {"regex": "x"}),
    ],
)
def test_native_guided_kwargs(kind: str, payload: str, options: str, expected: dict[str, object]) -> None:
    assert native_guided_kwargs(ConstraintRequest(kind, payload, options)) == expected


def test_native_guided_structural_tag() -> None:
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    out = native_guided_kwargs(ConstraintRequest("structural_tag", json.dumps(tag), ""))
    assert json.loads(out["structural_tag"]) == tag


@pytest.mark.parametrize(
    ("kind", "payload", "options", "field"),
    [
        ("lark", 'start: "x"', "", "grammar_type"),
        ("json_schema", SCHEMA, '{"whitespace": "any"}', "options"),
        ("json_schema", SCHEMA, '{"strict": true}', "options"),
        ("json_object", "", '{"indent": 2}', "options"),
    ],
)
def test_native_refuses_what_it_cannot_express(kind: str, payload: str, options: str, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}: .*native grammar mode"):
        native_guided_kwargs(ConstraintRequest(kind, payload, options))


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


@pytest.mark.trtllm
@pytest.mark.gpu
def test_trtllm_engine_decodes_a_schema_through_the_processor() -> None:
    """The real TensorRT-LLM PyTorch backend, masks from the in-process grammar engine (needs TRTLLM_TEST_MODEL)."""
    model = os.environ.get("TRTLLM_TEST_MODEL", "")
    if not model:
        pytest.skip("set TRTLLM_TEST_MODEL to a local Hugging Face checkpoint folder")
    import threading

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from grammar_backend.engine import GrammarEngine, GrammarEngineConfig
    from llm_runtime.local_mask import LocalMaskProvider
    from llm_runtime.scheduler import FinishEvent, GenerationRequest, TokenEvent
    from llm_runtime.trtllm_engine import TrtllmGenerator

    hf = AutoTokenizer.from_pretrained(model, local_files_only=True)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    grammar = GrammarEngine(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), "t", GrammarEngineConfig())
    gen = TrtllmGenerator(TrtllmConfig(model_dir=model, max_batch=8, max_seq_len=1024), LocalMaskProvider(grammar))
    try:
        schema = '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}'
        done = threading.Event()
        events: list[TokenEvent | FinishEvent] = []

        def on_event(event: TokenEvent | FinishEvent) -> None:
            events.append(event)
            if isinstance(event, FinishEvent):
                done.set()

        ids = hf.encode("Give a JSON object with an integer n.")
        gen.submit(GenerationRequest(ids, constraint=ConstraintRequest("json_schema", schema, ""), max_tokens=32,
                                     temperature=0.0), on_event)
        assert done.wait(120)
        fin = events[-1]
        assert isinstance(fin, FinishEvent) and fin.finish_reason in ("stop", "length"), fin
        assert set(json.loads(fin.text)) == {"n"}
        stats = gen.processor_stats()
        assert stats is not None and stats.grammar_requests >= 1
    finally:
        gen.close()
        grammar.close()
