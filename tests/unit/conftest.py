"""Fixtures shared by the grammar-engine unit tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import xgrammar as xgr

from tests.support import assets

if TYPE_CHECKING:
    from standins.tiny_model import TinyModelInfo

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "fixtures" / "schemas"

#: Byte-level toy vocabulary: every single byte, a few multi-byte tokens (so
#: token boundaries differ from byte boundaries), then the stop token.
TINY_EXTRA = [b'{"', b'":', b'",', b"true", b"false", b"null", b"ab", b"abc"]
TINY_VOCAB: list[bytes] = [bytes([i]) for i in range(256)] + TINY_EXTRA + [b"</s>"]
TINY_STOP = len(TINY_VOCAB) - 1
TINY_VOCAB_SIZE = 320  # padded past len(TINY_VOCAB), like a model's logits width


def load_schema(name: str) -> dict[str, Any]:
    """A hand-written schema fixture by file stem."""
    return json.loads((SCHEMAS / f"{name}.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a loaded 2-core machine
    OpenMP's spinning threads slow the runtime tests 10x (measured 42-107 s vs 5 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModelInfo:
    """The tiny random Llama checkpoint (:func:`standins.tiny_model.build_tiny_llama`, seed 0), built once.

    Read-only: every test that loads it shares the folder.
    """
    # Imported here: torch and transformers cost seconds, and most unit tests need neither.
    from standins.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(TINY_VOCAB, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=[TINY_STOP])


def tiny_encode(text: str) -> list[int]:
    """Encode as one token per byte (alignment does not matter for the tiny vocabulary)."""
    return list(text.encode("utf-8"))


@pytest.fixture()
def channel_service(tiny_info: xgr.TokenizerInfo) -> Iterator[Any]:
    """A grammar service over the tiny vocabulary, listening on its grammar channel; no sequence may leak."""
    from grammar_service.engine import GrammarEngine, GrammarEngineConfig
    from triton_support.service import GrammarService

    svc = GrammarService(GrammarEngine(tiny_info, "fp", GrammarEngineConfig(max_batch=4), encode=tiny_encode))
    svc.open_channel()
    yield svc
    svc.close_channel()
    assert svc.engine.active_count == 0, "a sequence leaked"
    svc.engine.close()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    """The Qwen3 BPE tokenizer (151,669 tokens), from `make tokenizers`."""
    path = assets.qwen3_dir()
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


@pytest.fixture(scope="session")
def qwen_info(qwen_tokenizer: Any) -> xgr.TokenizerInfo:
    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return xgr.TokenizerInfo.from_huggingface(qwen_tokenizer, vocab_size=151936, stop_token_ids=[eos])
