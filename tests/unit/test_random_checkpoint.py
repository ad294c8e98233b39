"""``bench/random_checkpoint.py``: a model's shape with random weights loads through the real engine.

The device run of ``deploy/gpu/torch_gpu_check.sh`` times shapes whose weights
cannot travel; the checkpoint must load exactly as a real one does
(:class:`llm_runtime.engine.TorchEngine`) with the logits width of its shape.
Uses the tiny model's tokenizer (the ``tiny`` fixture); ~3 s on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from standins.tiny_model import TinyModelInfo

REPO = Path(__file__).resolve().parents[2]

#: A two-layer Qwen3 (the device run's family) small enough for the CPU.
SMALL_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 640, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False,
}


@pytest.fixture
def random_checkpoint(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import random_checkpoint

    return random_checkpoint


def test_shape_loads_through_the_engine(tmp_path: Path, tiny: TinyModelInfo, random_checkpoint: Any) -> None:
    from llm_runtime.engine import TorchEngine, TorchEngineConfig

    eos = json.loads((tiny.path / "config.json").read_text())["eos_token_id"]
    out = random_checkpoint.write_random_checkpoint({**SMALL_QWEN3, "eos_token_id": eos}, tiny.path, tmp_path / "ckpt")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    engine = TorchEngine(out, TorchEngineConfig(max_batch_size=2, max_seq_len=64))
    assert engine.vocab_size == 640
    assert engine.eos_token_ids == {eos}
    assert engine.tokenizer.get_vocab_size(with_added_tokens=True) == tiny.tokenizer_size


def test_shape_too_narrow_for_the_tokenizer(tmp_path: Path, tiny: TinyModelInfo, random_checkpoint: Any) -> None:
    narrow = {**SMALL_QWEN3, "vocab_size": tiny.tokenizer_size - 1}
    with pytest.raises(ValueError, match=rf"has token id {tiny.tokenizer_size - 1}, past the shape's vocab_size "
                                         rf"{tiny.tokenizer_size - 1}"):
        random_checkpoint.write_random_checkpoint(narrow, tiny.path, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["qwen3-1.7b", "qwen3-8b"])
def test_published_shapes_cover_qwen3(random_checkpoint: Any, name: str) -> None:
    shape = random_checkpoint.SHAPES[name]
    assert (shape["model_type"], shape["vocab_size"], shape["eos_token_id"]) == ("qwen3", 151936, 151645)
