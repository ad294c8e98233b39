"""A checkpoint without a chat template, served: refused at load by default, or served as a base model.

A real tritonserver over the tiny stand-in (``build_tiny_llama`` without a
template, as a base checkpoint's tokenizer), rendered with ``PROMPT_FORMAT``:
``chat`` (the default) never becomes ready and says why in its log, instead
of failing every request with INTERNAL; ``plain`` serves PROMPT as text and
refuses MESSAGES by name, for that request only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from client import Client, Constraint, InvalidConstraint
from deploy.server import ServerStartError
from standins.tiny_model import build_tiny_llama
from tests.integration.served import start_ensemble

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2,048 positions: the rendered llm model's max_seq_len.
    return build_tiny_llama(tmp_path_factory.mktemp("base") / "model", max_position_embeddings=2048).path


def test_chat_format_without_a_template_fails_at_load_with_what_to_add(tmp_path: Path, base_model: Path) -> None:
    with pytest.raises(ServerStartError) as caught:
        start_ensemble(tmp_path, {"MODEL_DIR": str(base_model), "TORCH_THREADS": "1"}, ready_timeout_s=120)
    assert "model load failed: ConfigError: preprocessing: the tokenizer of " in str(caught.value)
    assert "has no chat template. Add one" in str(caught.value)
    assert "PROMPT_FORMAT=plain" in str(caught.value)


def test_plain_format_serves_prompts_and_refuses_messages(tmp_path: Path, base_model: Path) -> None:
    server = start_ensemble(tmp_path, {"MODEL_DIR": str(base_model), "PROMPT_FORMAT": "plain", "TORCH_THREADS": "1"})
    try:
        with Client(server.grpc_url) as client:
            result = client.generate("Digits:", constraint=Constraint.regex("[0-9]{6}"), max_tokens=16)
            assert result.complete and len(result.text) == 6 and result.text.isdigit(), result
            with pytest.raises(InvalidConstraint, match=r"^messages: this model has no chat template \(prompt "
                                                        r"format plain\): send PROMPT"):
                client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert client.generate("Again:", max_tokens=4, require_complete=False).usage.completion_tokens >= 1
    finally:
        server.stop()
