"""xgrammar's JSON strings stay valid JSON (:mod:`grammar_backend.json_strings`): bounded strings, patterns, tags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from grammar_backend.bitmask import allowed_tokens
from grammar_backend.compile import compile_spec, json_format_kwargs
from grammar_backend.errors import CompileError
from grammar_backend.json_strings import raw_escape_in_pattern
from grammar_backend.spec import ConstraintOptions, parse_constraint
from tests.unit.fidelity_harness import byte_compiler, compile_schema, decodes


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return byte_compiler()


DEFAULTS = ConstraintOptions()


def xgrammar_alone(compiler: xgr.GrammarCompiler, schema: str, options: ConstraintOptions = DEFAULTS
                   ) -> xgr.CompiledGrammar:
    """xgrammar's own compile of ``schema``, with the engine's formatting arguments and no mending."""
    return compiler.compile_json_schema(schema, **json_format_kwargs(options))  # type: ignore[arg-type]


BOUNDED = {"type": "string", "maxLength": 5}
#: (id, schema, text, accepted): what the served grammar admits, byte by byte.
STRINGS = [
    ("max_raw_bel", BOUNDED, '"a\x07b"', False),
    ("max_raw_tab", BOUNDED, '"a\tb"', False),
    ("max_raw_nul", BOUNDED, '"a\x00b"', False),
    ("max_raw_unit_separator", BOUNDED, '"a\x1fb"', False),
    ("max_raw_newline", BOUNDED, '"a\nb"', False),
    ("max_raw_quote", BOUNDED, '"a"b"', False),
    ("max_plain", BOUNDED, '"ab de"', True),
    ("max_above", BOUNDED, '"abcdef"', False),
    ("max_delete_is_plain", BOUNDED, '"a\x7fb"', True),
    ("max_code_points", {"type": "string", "maxLength": 3}, '"\u00e9\u00e9\u00e9"', True),
    ("max_code_points_above", {"type": "string", "maxLength": 3}, '"\u00e9\u00e9\u00e9\u00e9"', False),
    ("min_raw", {"type": "string", "minLength": 2}, '"\x01\x02"', False),
    ("min_below", {"type": "string", "minLength": 2}, '"a"', False),
    ("min_plain", {"type": "string", "minLength": 2}, '"ab"', True),
    ("property_names_raw", {"type": "object", "propertyNames": {"maxLength": 3}}, '{"a\x07":1}', False),
    ("property_names_plain", {"type": "object", "propertyNames": {"maxLength": 3}}, '{"abc":1}', True),
    ("in_object", {"type": "object", "properties": {"n": BOUNDED}, "required": ["n"]}, '{"n":"a\x07"}', False),
    ("in_object_plain", {"type": "object", "properties": {"n": BOUNDED}, "required": ["n"]}, '{"n":"ab"}', True),
    ("unbounded_escape_kept", {"type": "string"}, '"a\\nb"', True),
    ("unbounded_raw", {"type": "string"}, '"a\x07b"', False),
]


@pytest.mark.parametrize(("schema", "text", "accepted"), [c[1:] for c in STRINGS], ids=[c[0] for c in STRINGS])
def test_served_strings(compiler: xgr.GrammarCompiler, schema: Any, text: str, accepted: bool) -> None:
    assert decodes(compile_schema(compiler, schema, False), text) is accepted


@pytest.mark.parametrize(("text", "accepted"), [
    ('{"a":"cr\u00e8me br\u00fbl\u00e9e","b":"\u00e9\u00e9\u00e9"}', True),
    ('{"a":"cr\u00e8me br\u00fbl\u0e9e","b":"x"}', False),
    ('{"a":"cr\u00e8me br\u00fbl\u00e9e","b":"\x07"}', False),
])
def test_narrowed_grammar_keeps_its_code_points_through_the_cache(text: str, accepted: bool) -> None:
    """A compiler with its cache on compiles a narrowed grammar from EBNF text; xgrammar prints U+00E9
    before ``e`` as ``\\xe9e``, which its parser read as U+0E9E: the text written keeps them apart."""
    vocab = [bytes([i]) for i in range(256)] + [b"<|stop|>"]
    cached = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[256]), max_threads=1,
                                 cache_enabled=True)
    schema = {"type": "object", "properties": {"a": {"const": "cr\u00e8me br\u00fbl\u00e9e"},
                                               "b": {"type": "string", "maxLength": 3}}, "required": ["a", "b"]}
    assert decodes(compile_schema(cached, schema, False), text) is accepted


def test_xgrammar_alone_still_admits_raw_control_characters(compiler: xgr.GrammarCompiler) -> None:
    """The defect the module mends, on the pinned xgrammar: if this fails after an upgrade,
    xgrammar#800 is fixed there and :func:`grammar_backend.json_strings.json_grammar`'s rewrite may go."""
    raw = xgrammar_alone(compiler, json.dumps(BOUNDED))
    assert decodes(raw, '"a\x07b"')
    assert not decodes(raw, '"a\\nb"')  # and no escape: the served grammar keeps that narrowing


PATTERNS = [
    # (pattern, the character xgrammar writes raw, or None)
    ('^a"b?$', 0x22),
    ("^a\\tb$", 0x09),
    ("^a[\\n]b?$", 0x0A),
    ("^a\\u0000b?$", 0x00),
    ("^a\\u0007$", 0x07),
    ("^C:\\\\", 0x5C),
    ("\\w+[\\\\](\\w+\\.)*\\w+\\.dll", 0x5C),  # JsonSchemaStore BizTalkServerApplicationSchema
    ("^ab$", None),
    ("^[a-z]+$", None),
    (".*", None),
    ("^[^x]{0,5}$", None),
    ("^[\\x00-\\x7f]+$", None),  # a class that spans them is lowered as a JSON-string regex
    ("^a\\sb?$", None),
    ("^(a)\\1$", None),  # refused by xgrammar itself: not this module's to report
]


@pytest.mark.parametrize(("pattern", "found"), PATTERNS, ids=[repr(p) for p, _ in PATTERNS])
def test_raw_escape_in_pattern(pattern: str, found: int | None) -> None:
    assert raw_escape_in_pattern(pattern) == found


@pytest.mark.parametrize(("pattern", "text"), [('^a"b?$', '"a"b"'), ("^a\\tb$", '"a\tb"'), ("^C:\\\\", '"C:\\"')])
def test_xgrammar_alone_writes_pattern_literals_raw(compiler: xgr.GrammarCompiler, pattern: str, text: str) -> None:
    """Why such patterns are refused: xgrammar's grammar takes the invalid JSON."""
    raw = xgrammar_alone(compiler, json.dumps({"type": "string", "pattern": pattern}))
    assert decodes(raw, text)


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "pattern": '^a"b?$'},
     (r"""^grammar: xgrammar cannot compile this json_schema: the pattern '\^a"b\?\$' names the character """
      r"""U\+0022 \('"'\), which xgrammar writes into the JSON string unescaped \(invalid JSON\); choose """
      r"""backend llguidance for it$""")),
    ({"type": "object", "patternProperties": {"^x\\ty$": {"type": "integer"}}},
     r"the pattern '\^x\\\\ty\$' names the character U\+0009 \('\\t'\)"),
    ({"type": "object", "properties": {"a": {"type": "object", "propertyNames": {"pattern": "^\\\\$"}}}},
     r"the pattern '\^\\\\\\\\\$' names the character U\+005C"),
])
def test_compile_refuses_a_raw_pattern_literal(compiler: xgr.GrammarCompiler, schema: Any, message: str) -> None:
    with pytest.raises(CompileError, match=message):
        compile_spec(compiler, parse_constraint("json_schema", json.dumps(schema)))


def _tag(schema: Any) -> str:
    return json.dumps({"triggers": ["<f>"], "tags": [{"begin": "<f>", "schema": schema, "end": "</f>"}]})


@pytest.mark.parametrize(("text", "accepted"), [
    ('<f>{"x":"a\x07"}</f>', False),
    ('<f>{"x":"ab"}</f>', True),
    ('<f>{"x":"abcde"}</f>', False),
])
def test_structural_tag_arguments(compiler: xgr.GrammarCompiler, text: str, accepted: bool) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 4}}, "required": ["x"]}
    compiled = compile_spec(compiler, parse_constraint("structural_tag", _tag(schema)))
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(b) for b in text.encode()) is accepted


def test_structural_tag_refuses_a_raw_pattern_literal(compiler: xgr.GrammarCompiler) -> None:
    spec = parse_constraint("structural_tag", _tag({"type": "string", "pattern": '^"$'}))
    with pytest.raises(CompileError, match=r"xgrammar cannot compile this structural_tag: the pattern '\^\"\$'"):
        compile_spec(compiler, spec)


def test_no_control_token_inside_a_bounded_string_real_vocabulary(qwen_info: xgr.TokenizerInfo,
                                                                   qwen_tokenizer: Any) -> None:
    """With the Qwen3 BPE vocabulary, mid-string under ``maxLength``: the mask admits no token holding a
    control character (xgrammar's own grammar admits hundreds)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}}, "required": ["name"]}
    spec = parse_constraint("json_schema", json.dumps(schema))
    xgr_compiler = xgr.GrammarCompiler(qwen_info, max_threads=1, cache_enabled=False)
    decoded = qwen_info.decoded_vocab
    control = {i for i, b in enumerate(decoded) if any(c < 0x20 for c in b)}

    def allowed(compiled: xgr.CompiledGrammar) -> set[int]:
        matcher = xgr.GrammarMatcher(compiled)
        for token in qwen_tokenizer.encode('{"name":"Br', add_special_tokens=False):
            assert matcher.accept_token(token)
        mask = xgr.allocate_token_bitmask(1, qwen_info.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        return set(allowed_tokens(mask.numpy()[0], qwen_info.vocab_size).tolist())

    served = allowed(compile_spec(xgr_compiler, spec))
    raw = allowed(xgrammar_alone(xgr_compiler, spec.payload, spec.options))
    assert len(served) > 1000
    assert served & control == set()
    assert len(raw & control) > 100
    assert raw - served == raw & control  # exactly the control tokens went


#: Schemas whose strings a random walk fills: bounded, patterned, keyed, inside a tool-call-like object.
FUZZ_SCHEMAS = [
    ("bounded_items", {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}),
    ("person", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                 "city": {"type": "string", "minLength": 1, "maxLength": 30},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "city", "tags"], "additionalProperties": False}),
    ("keys", {"type": "object", "propertyNames": {"maxLength": 8}, "additionalProperties": {"type": "string"}}),
    ("pattern", {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+-[0-9]{2,}$"}},
                 "required": ["id"]}),
]


def test_random_walks_close_as_json(monkeypatch: pytest.MonkeyPatch, tiny: Any) -> None:
    """``bench/json_fuzz.py`` on a few schemas over the tiny stand-in's byte-level BPE: every closed output
    of both served backends parses; xgrammar's own grammar, walked the same way, does not (the walk can fail)."""
    from grammar_backend.tokenizer import load_tokenizer

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is not a package
    import json_fuzz

    tallies = json_fuzz.fuzz(FUZZ_SCHEMAS, load_tokenizer(tiny.path), walks=12, max_steps=60, seed=0)
    served, llg, raw = (tallies[g] for g in json_fuzz.GRAMMARS)
    assert (served.schemas, llg.schemas, raw.schemas) == (4, 4, 4)
    assert served.closed >= 36 and llg.closed >= 36  # of 48 walks: the closer finds most completions
    assert (served.failed, llg.failed) == (0, 0), (served.examples, llg.examples)
    assert raw.failed > 0
    assert all("Invalid control character" in err for _, _, err in raw.examples)
