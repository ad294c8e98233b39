"""A checkpoint with a real model's shape and tokenizer but random weights: for timing only.

A forward costs the same whatever the weights hold, so a benchmark of step
times (``processor_bench.py``) can run a model's real shape where its weights
cannot travel (the device machine takes 64 MiB; SmolLM2-135M's weights are
517 MB, a 1.7B model's 3.4 GB).  The outputs are noise: greedy decoding over
random logits, so a constrained output fills its strings with arbitrary
allowed tokens until budget closing ends it.  Never use such a checkpoint to
judge output quality.

Usage::

    python bench/random_checkpoint.py SHAPE TOKENIZER_DIR OUT_DIR [--device cuda]

``SHAPE`` is one of :data:`SHAPES` or a ``config.json`` path.  ``TOKENIZER_DIR``
holds ``tokenizer.json`` (and ``tokenizer_config.json``); the shape's vocabulary
must cover it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import harness
import torch
from transformers import AutoConfig, AutoModelForCausalLM

#: What Qwen3's published ``config.json`` files share (Qwen/Qwen3-1.7B, Qwen/Qwen3-8B).
_QWEN3: Final[Mapping[str, Any]] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False, "num_key_value_heads": 8,
}
#: Published configurations (their ``config.json`` fields that set the shape).
SHAPES: Final[Mapping[str, Mapping[str, Any]]] = {
    # Qwen/Qwen3-1.7B: 28 layers, GQA 16/8 heads of 128, vocabulary 151,936.
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    # Qwen/Qwen3-8B: 36 layers, GQA 32/8 heads of 128.
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
}

_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def write_random_checkpoint(shape: Mapping[str, Any], tokenizer_dir: Path, out: Path, *,
                            device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write ``out`` as a Hugging Face folder: ``shape``'s model with random weights and ``tokenizer_dir``'s tokenizer.

    Parameters
    ----------
    shape : mapping
        ``config.json`` fields (``model_type`` required).
    tokenizer_dir : Path
        Folder with ``tokenizer.json``; its tokenizer files are copied.
    out : Path
        Created (or overwritten).
    device : str
        Where the weights are initialised (``cuda`` is much faster for billions of them).
    dtype : torch.dtype
        Weight dtype written.
    seed : int
        ``torch.manual_seed`` value.

    Returns
    -------
    Path
        ``out``.
    """
    fields = dict(shape)
    model_type = fields.pop("model_type")
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    top = max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens", []))])
    if top >= int(fields["vocab_size"]):
        raise ValueError(f"tokenizer {tokenizer_dir} has token id {top}, past the shape's vocab_size {fields['vocab_size']}")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__)
    parser.add_argument("shape", help=f"one of {sorted(SHAPES)} or a config.json path")
    parser.add_argument("tokenizer_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape] if args.shape in SHAPES else json.loads(Path(args.shape).read_text())
    write_random_checkpoint(shape, args.tokenizer_dir, args.out, device=args.device, dtype=getattr(torch, args.dtype))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
