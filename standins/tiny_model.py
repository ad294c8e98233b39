"""Build a tiny, random, but real Hugging Face Llama checkpoint on disk.

Tests and benchmarks of the decode side need a model folder that loads through
exactly the same path as a real checkpoint
(``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)``) but
runs in milliseconds.  :func:`build_tiny_llama` writes such a folder: a
byte-level BPE tokenizer trained in-process on a small corpus (so multi-byte
UTF-8 characters really are split across tokens), and a randomly initialised
``LlamaForCausalLM`` whose logits width is padded past the tokenizer's size
(as real checkpoints often are).  Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from grammar_service.engine import GrammarEngine

__all__ = ["CHATML", "DEFAULT_CORPUS", "TinyModelInfo", "build_tiny_llama", "tiny_grammar"]

# The corpus mixes ASCII, punctuation used by JSON, digits and multi-byte UTF-8
# (2-, 3- and 4-byte sequences) so that the learned vocabulary contains both
# merged words and bare bytes of partial characters.
DEFAULT_CORPUS: tuple[str, ...] = (
    "hello world, the quick brown fox jumps over the lazy dog",
    "yes no maybe true false null",
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    "0123456789 + - * / = ( ) [ ] { } < > : ; , .",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4",
    "emoji \U0001f600 \U0001f680 \U0001f9e0 done",
    "Stop here. STOP! The end.",
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A ChatML template over :data:`SPECIAL_TOKENS` (SmolLM2's form, without its system prompt).
CHATML: str = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelInfo:
    """What :func:`build_tiny_llama` wrote.

    Attributes
    ----------
    path : Path
        The checkpoint folder.
    tokenizer_size : int
        Number of tokens the tokenizer knows (ids ``0 .. tokenizer_size - 1``).
    vocab_size : int
        Width of the model's logits (``>= tokenizer_size``).
    eos_token_id : int
        Id of ``<|im_end|>``, the end token.
    """

    path: Path
    tokenizer_size: int
    vocab_size: int
    eos_token_id: int


def tiny_grammar(tiny: TinyModelInfo, max_batch: int = 8) -> GrammarEngine:
    """The real grammar engine over the tiny model's own tokenizer and logits width (close it after use)."""
    import xgrammar as xgr

    from grammar_service.engine import GrammarEngine, GrammarEngineConfig

    hf = AutoTokenizer.from_pretrained(str(tiny.path), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tiny.vocab_size, stop_token_ids=[tiny.eos_token_id])
    return GrammarEngine(info, "tiny", GrammarEngineConfig(max_batch=max_batch),
                         encode=lambda text: hf.encode(text, add_special_tokens=False))


def build_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    tokenizer_vocab: int = 400,
    padded_vocab: int = 448,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    init_std: float = 0.25,
    zero_eos_logit: bool = True,
    corpus: Sequence[str] = DEFAULT_CORPUS,
    chat_template: str | None = None,
) -> TinyModelInfo:
    """Write a tiny random Llama checkpoint with a trained byte-level BPE tokenizer.

    Parameters
    ----------
    path : str or Path
        Output folder (created).
    seed : int
        Seed of the weight initialisation.
    tokenizer_vocab : int
        Target vocabulary size of the BPE trainer (256 bytes + merges + specials).
    padded_vocab : int
        Logits width of the model; must be at least the tokenizer's size.
    hidden_size, num_layers, num_heads, num_kv_heads : int
        Model shape.  ``num_kv_heads < num_heads`` exercises grouped-query attention
        like SmolLM2 (9 query heads, 3 key/value heads).
    max_position_embeddings : int
        Longest sequence the model accepts.
    init_std : float
        Standard deviation of the weight initialisation.  The Hugging Face default
        (0.02) gives a random model nearly flat logits, where greedy decoding is
        decided by differences at the 1e-6 level; 0.25 makes the top logits differ
        by whole units so that exact-token comparisons test the code, not the
        rounding.
    zero_eos_logit : bool
        Zero the end token's row of the output projection, so its logit is exactly 0
        while the top logits of this model are around +5: unconstrained decoding then
        runs to ``max_tokens`` (deterministic lengths for batching tests), and the end
        token is produced only where a grammar forces it.
    corpus : sequence of str
        Training text for the tokenizer.
    chat_template : str or None
        A Jinja chat template saved with the tokenizer (:data:`CHATML` takes
        its special tokens); None: the checkpoint has none.

    Returns
    -------
    TinyModelInfo
        The folder and the token counts.

    Raises
    ------
    ValueError
        If ``padded_vocab`` is smaller than the trained tokenizer.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tokenizer_vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    tokenizer_size = tok.get_vocab_size()
    if padded_vocab < tokenizer_size:
        raise ValueError(f"padded_vocab: {padded_vocab} is smaller than the tokenizer size {tokenizer_size}")
    eos_id = tok.token_to_id("<|im_end|>")
    bos_id = tok.token_to_id("<|im_start|>")
    if eos_id is None or bos_id is None:
        raise RuntimeError("the trained tokenizer lost its special tokens")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue  # RMSNorm gains stay at 1
            param.copy_(torch.randn(param.shape, generator=gen) * init_std)
        if zero_eos_logit:
            model.lm_head.weight[eos_id].zero_()
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = bos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out)
    (out / "tiny_model.json").write_text(
        json.dumps({"seed": seed, "tokenizer_size": tokenizer_size, "vocab_size": padded_vocab}) + "\n"
    )
    return TinyModelInfo(path=out, tokenizer_size=tokenizer_size, vocab_size=padded_vocab, eos_token_id=eos_id)
