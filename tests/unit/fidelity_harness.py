"""Shared by the fidelity tests: a byte-level xgrammar compiler, compiled as the engine does, and schemas."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from grammar_backend.compile import compile_json
from grammar_backend.spec import ConstraintOptions

STOP = 256


def byte_compiler() -> xgr.GrammarCompiler:
    """A compiler over 256 single-byte tokens plus a stop token (byte-exact decoding)."""
    vocab = [bytes([i]) for i in range(256)] + [b"<|stop|>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[STOP])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_schema(compiler: xgr.GrammarCompiler, schema: Any, strict: bool) -> xgr.CompiledGrammar:
    """Compile through the engine's own call (:func:`grammar_backend.compile.compile_json`), default options but ``strict``.

    The defaults are what the engine serves: compact JSON, the schema's key order.
    """
    return compile_json(compiler, json.dumps(schema), ConstraintOptions(strict=strict))


def decodes(compiled: xgr.CompiledGrammar, text: str) -> bool:
    """Whether decoding can emit ``text`` then stop: one byte-token at a time, like a model."""
    matcher = xgr.GrammarMatcher(compiled)
    for byte in text.encode("utf-8"):
        if not matcher.accept_token(byte):
            return False
    return matcher.accept_token(STOP) and matcher.is_terminated()


INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}
OBJ_A = {"type": "object", "properties": {"a": INT}}
LINKED = {
    "$defs": {
        "n": {
            "type": "object",
            "properties": {"v": INT, "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
            "required": ["v", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/n",
}
